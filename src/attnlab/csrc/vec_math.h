// Small vector-friendly math shared by attnlab's own CPU kernels (gelu.cpp, short_attention.cpp). (torch's
// extension build runs ninja in every new process, and ninja's dependency files rebuild a kernel whose header
// changed.)
#pragma once

#include <cstdint>
#include <cstring>

namespace attnlab_vec {

// exp(r) for r = y − n·ln 2 (ln 2 in two parts), |r| <= ln 2 / 2: Cephes' expf polynomial, on a float or lane by
// lane on a GCC vector of floats
template <class F>
inline F exp_of_remainder(F y, F n) {
  F r = y - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  F p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp(y) for y <= 0: Cephes' expf (round to y·log2(e), a degree-6 polynomial, the power of two in the
// exponent bits), and 0 below -87 (exp < 2^-125), for -inf and for NaN. As int32, the bit patterns of negative
// floats grow with their magnitude: the range test and the clamp that keeps the polynomial finite are integer
// compares, which vectorise where a float compare-and-select would not (-ftrapping-math). +0.0 is outside the
// range (its bits are 0): callers pass -0.0, e.g. -|s - m| for a maximum m.
inline float exp_nonpositive(float y) {
  int32_t bits;
  std::memcpy(&bits, &y, 4);
  const int32_t minus_87 = static_cast<int32_t>(0xC2AE0000u);
  const uint32_t in_range = 0U - static_cast<uint32_t>(bits <= minus_87);  // all ones where -87 <= y <= -0
  bits = bits < minus_87 ? bits : minus_87;
  std::memcpy(&y, &bits, 4);
  const float n = (y * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // y·log2(e) to the nearest integer
  const float p = exp_of_remainder(y, n);
  const int32_t scale_bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &scale_bits, 4);
  float e = p * scale;
  uint32_t e_bits;
  std::memcpy(&e_bits, &e, 4);
  e_bits &= in_range;
  std::memcpy(&e, &e_bits, 4);
  return e;
}

// The same on a GCC vector of floats F (I: the int32 vector of as many lanes), lane by lane, for the loops the
// compiler does not vectorise itself: those that also sum (a softmax's denominator), whose order of additions
// it must keep without -ffast-math.
template <class F, class I>
inline F exp_nonpositive(F y) {
  I bits = (I)y;  // (a cast between vectors of one size keeps the bits)
  const I minus_87 = I{} + static_cast<int32_t>(0xC2AE0000u);
  const I in_range = bits <= minus_87;  // (a vector compare gives all ones where true)
  bits = bits < minus_87 ? bits : minus_87;
  y = (F)bits;
  const F n = (y * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const F p = exp_of_remainder(y, n);
  const I scale_bits = (__builtin_convertvector(n, I) + 127) << 23;  // 2^n
  return (F)((I)(p * (F)scale_bits) & in_range);
}

}  // namespace attnlab_vec
