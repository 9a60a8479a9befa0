// Dropout on CPU in one pass: out[i] = keep(i) ? x[i] * scale : 0, for fp32, bf16 and fp16 tensors.
//
// keep(i) = (hash(seed, i) >> 16) >= dropped: 16 random bits per element from a counter-based hash of the
// element's index and a 64-bit seed (attnlab.model.layers.Dropout draws the seed from torch's generator, one
// draw per call). Why: PyTorch's CPU dropout draws every element from one Mersenne Twister, serially (3-6 ns
// each), and attnlab's torch-only path still needs one 64-bit draw per 4 elements, a comparison, a bool mask
// kept for the backward and a multiply. Here the mask is a function of (seed, i): any thread computes any
// element, the result does not depend on the number of threads, and the backward is this same function of the
// gradient with the same seed, so no mask is stored.
//
// The hash is Chris Wellons' "lowbias32" (xor-shift-multiply, measured among the best 32-bit integer mixers):
// the seed's two halves are mixed into two keys first (so seeds a few bits apart give unrelated masks, not
// shifted copies of one another), then hash(i) = lowbias32(lowbias32(lo32(i) ^ key0) + (key1 ^ hi32(i))).
// tests/test_pitfalls.py recomputes it with torch's integer operations and compares every element. NaN and inf
// in dropped positions become 0, as in attnlab's torch path (nn.Dropout's NaN·0 keeps NaN). Built on first use
// by torch.utils.cpp_extension (attnlab.accel.build_torch_ops).
// Lean headers (Tensor's methods and only the operators called), not <ATen/ATen.h>: the build on first use
// takes seconds less.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/promote_types.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <algorithm>

namespace {

inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// The random lanes of elements i0 … i0 + len - 1 (a block that does not cross a multiple of 2^32) into h: a
// loop of 32-bit integer operations only, which the compiler vectorises.
inline void lanes(int64_t i0, int64_t len, uint32_t k0, uint32_t k1, uint32_t* h) {
  const uint32_t base = static_cast<uint32_t>(i0), k = k1 ^ static_cast<uint32_t>(i0 >> 32);
  for (int64_t t = 0; t < len; ++t) h[t] = lowbias32(lowbias32((base + static_cast<uint32_t>(t)) ^ k0) + k) >> 16;
}

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as c10::BFloat16; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7FFFU + ((u >> 16) & 1U)) >> 16;
  return (u & 0x7FFFFFFFU) > 0x7F800000U ? static_cast<uint16_t>((u >> 16) | 0x40U) : static_cast<uint16_t>(rounded);
}

// One block: out = keep ? x · scale : 0. The select is a bit mask (0 or all ones): a conditional expression
// over floats is a branch the compiler does not vectorise without -fno-trapping-math.
inline uint32_t all_ones_if(bool b) { return 0U - static_cast<uint32_t>(b); }

void apply_block(const float* __restrict x, float* __restrict out, const uint32_t* __restrict lane, int64_t len,
                 float scale, uint32_t dropped) {
  for (int64_t t = 0; t < len; ++t) {
    float v = x[t] * scale;
    uint32_t u;
    std::memcpy(&u, &v, 4);
    u &= all_ones_if(lane[t] >= dropped);
    std::memcpy(out + t, &u, 4);
  }
}

void apply_block(const at::BFloat16* __restrict x, at::BFloat16* __restrict out, const uint32_t* __restrict lane,
                 int64_t len, float scale, uint32_t dropped) {
  const uint16_t* __restrict in = reinterpret_cast<const uint16_t*>(x);
  uint16_t* __restrict o = reinterpret_cast<uint16_t*>(out);
  for (int64_t t = 0; t < len; ++t)
    o[t] = float_to_bf16(bf16_to_float(in[t]) * scale) & static_cast<uint16_t>(all_ones_if(lane[t] >= dropped));
}

void apply_block(const at::Half* __restrict x, at::Half* __restrict out, const uint32_t* __restrict lane, int64_t len,
                 float scale, uint32_t dropped) {  // (c10's conversions: not vectorised; fp16 training on CPU is rare)
  for (int64_t t = 0; t < len; ++t)
    out[t] = lane[t] >= dropped ? static_cast<at::Half>(static_cast<float>(x[t]) * scale) : static_cast<at::Half>(0.0f);
}

// dropout_add: out = residual + dropout(x), in the residual's dtype; the dropped x · scale rounded to x's dtype
// first, so the sum is the one of dropout(x) then a cast and an add (the three passes it replaces), bit for bit.
// (The select between the multiply and the add is a bit mask: no fused multiply-add can join them. fp16 goes
// through c10's scalar conversions, not vectorised, as in apply_block.)
inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return bf16_to_float(v.x); }
inline float to_float(at::Half v) { return static_cast<float>(v); }
inline float rounded_as(float v, const float*) { return v; }
inline float rounded_as(float v, const at::BFloat16*) { return bf16_to_float(float_to_bf16(v)); }
inline float rounded_as(float v, const at::Half*) { return static_cast<float>(static_cast<at::Half>(v)); }
inline void store(float v, float* o) { *o = v; }
inline void store(float v, at::BFloat16* o) { o->x = float_to_bf16(v); }
inline void store(float v, at::Half* o) { *o = static_cast<at::Half>(v); }

template <typename T, typename R>
void add_block(const T* __restrict x, const R* __restrict r, R* __restrict out, const uint32_t* __restrict lane,
               int64_t len, float scale, uint32_t dropped) {
  for (int64_t t = 0; t < len; ++t) {
    float v = rounded_as(to_float(x[t]) * scale, x);
    uint32_t u;
    std::memcpy(&u, &v, 4);
    u &= all_ones_if(lane[t] >= dropped);
    std::memcpy(&v, &u, 4);
    store(to_float(r[t]) + v, out + t);
  }
}

constexpr int64_t kBlock = 512;    // elements per block of lanes (2 KB on the stack)
constexpr int64_t kGrain = 32768;  // elements per task at least

struct Mask {  // keep(i) = (hash(i) >> 16) >= dropped, the hash keyed by the seed's two halves mixed into k0, k1
  uint32_t k0, k1, dropped;
  float scale;
};

Mask make_mask(const char* op, const at::Tensor& x, int64_t seed, int64_t dropped, double scale) {
  TORCH_CHECK(x.device().is_cpu(), op, ": a CPU tensor is expected");
  TORCH_CHECK(dropped >= 0 && dropped < 65536, op, ": dropped must be in [0, 65536), got ", dropped);
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint32_t k0 = lowbias32(static_cast<uint32_t>(s) + 0x9E3779B9U);
  return {k0, lowbias32(static_cast<uint32_t>(s >> 32) ^ k0), static_cast<uint32_t>(dropped), static_cast<float>(scale)};
}

// n elements in blocks of kBlock (aligned: none crosses a multiple of 2^32), in parallel: each block's lanes,
// then block(i0, len, lanes) applies them.
template <typename Block>
void for_each_block(int64_t n, const Mask& m, Block block) {
  at::parallel_for(0, (n + kBlock - 1) / kBlock, kGrain / kBlock, [&](int64_t b, int64_t e) {
    uint32_t lane[kBlock];
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t i0 = blk * kBlock, len = std::min(kBlock, n - i0);
      lanes(i0, len, m.k0, m.k1, lane);
      block(i0, len, lane);
    }
  });
}

// f(T{}) for the float type T of t (fp32, bf16, fp16).
template <typename F>
void with_float_type(const char* op, at::ScalarType t, F f) {
  switch (t) {
    case at::kFloat:
      return f(float{});
    case at::kBFloat16:
      return f(at::BFloat16{});
    case at::kHalf:
      return f(at::Half{});
    default:
      TORCH_CHECK(false, op, ": float32, bfloat16 or float16 expected, got ", t);
  }
}

at::Tensor dropout(const at::Tensor& x, int64_t seed, int64_t dropped, double scale) {
  const Mask m = make_mask("attnlab::dropout", x, seed, dropped, scale);
  at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  with_float_type("attnlab::dropout", xc.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = xc.data_ptr<T>();
    T* op = out.data_ptr<T>();
    for_each_block(xc.numel(), m, [&](int64_t i0, int64_t len, const uint32_t* lane) {
      apply_block(xp + i0, op + i0, lane, len, m.scale, m.dropped);
    });
  });
  return out;
}

at::Tensor dropout_add(const at::Tensor& x, const at::Tensor& residual, int64_t seed, int64_t dropped, double scale) {
  const Mask m = make_mask("attnlab::dropout_add", x, seed, dropped, scale);
  TORCH_CHECK(residual.device().is_cpu() && residual.sizes() == x.sizes(),
              "attnlab::dropout_add: a CPU residual of x's shape is expected");
  TORCH_CHECK(at::promote_types(x.scalar_type(), residual.scalar_type()) == residual.scalar_type(),
              "attnlab::dropout_add: the residual's dtype must be the wider, got ", x.scalar_type(), " and ",
              residual.scalar_type());
  at::Tensor xc = x.contiguous(), rc = residual.contiguous();
  at::Tensor out = at::empty_like(rc);
  with_float_type("attnlab::dropout_add", xc.scalar_type(), [&](auto x_tag) {
    with_float_type("attnlab::dropout_add", rc.scalar_type(), [&](auto r_tag) {
      using T = decltype(x_tag);
      using R = decltype(r_tag);
      const T* xp = xc.data_ptr<T>();
      const R* rp = rc.data_ptr<R>();
      R* op = out.data_ptr<R>();
      for_each_block(xc.numel(), m, [&](int64_t i0, int64_t len, const uint32_t* lane) {
        add_block(xp + i0, rp + i0, op + i0, lane, len, m.scale, m.dropped);
      });
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("dropout(Tensor x, int seed, int dropped, float scale) -> Tensor");
  m.def("dropout_add(Tensor x, Tensor residual, int seed, int dropped, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("dropout", &dropout);
  m.impl("dropout_add", &dropout_add);
}
