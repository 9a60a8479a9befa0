// The products of weight-only quantised decoding on CPUs with AVX2 + FMA (+ F16C), for a few rows of fp32
// activations x (M, K):
//   attnlab::int8_matvec  y = (x · Wᵀ) ⊙ scales, int8 weights W (N, K), one fp32 scale per output channel
//                         (attnlab.quant.Int8Linear);
//   attnlab::int4_matvec  4-bit weights, a scale and a minimum per group of inputs (attnlab.quant.Int4Linear,
//                         llama.cpp's Q4_1), in the layout described above int4_matvec below.
//
// Why a kernel of our own: decoding one token reads every weight once, so the product should run at
// the memory's speed. PyTorch's _weight_int8pack_mm and inductor's GEMM template are built around
// bf16 activations and AVX-512; capped at AVX2 they read SmolLM2's int8 weights at ~7 and ~20 GB/s.
// Here each weight row is read once, 64 int8 at a time, widened to int16 and multiplied against the row
// of activations rounded to int16 (one scale per row, finer than bf16's rounding for all but tiny
// elements), summed exactly in int32, the rows split over PyTorch's own threads. The int4 kernel rounds the
// activations to int8 per 16 inputs instead (see above int4_matvec). Built on first use by
// torch.utils.cpp_extension (attnlab.quant._build_own_kernels).
// Lean headers (Tensor's methods and only the operators called), not <ATen/ATen.h>: the build on first use
// takes seconds less.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 int8 weights at p, widened to fp32
inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

float dot(const float* x, const int8_t* w, int64_t K) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {  // four independent accumulators hide the FMA latency
    a0 = _mm256_fmadd_ps(widen8(w + k), _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(widen8(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    a2 = _mm256_fmadd_ps(widen8(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
    a3 = _mm256_fmadd_ps(widen8(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(widen8(w + k), _mm256_loadu_ps(x + k), a0);
  float s = horizontal_sum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; k < K; ++k) s += x[k] * static_cast<float>(w[k]);
  return s;
}

// The same dot product with the activations as int16 (q = round(x / xscale)): 16 weights at a time widened
// to int16 and multiplied-and-paired into int32 by one instruction (vpmaddwd), half the work per weight of
// the float form above, which is what limits one core here. Each int32 lane gains at most 2·127·32767 per
// 16 inputs, so the four accumulators together hold 256 such steps (K = 4096) without overflow (2,130,641,408;
// with weights of −128, which Int8Linear never makes, 2,147,418,112, still below 2^31); longer rows are summed
// in blocks of that length, in int64.
constexpr int64_t kInt16Block = 4096;
// rows of W ahead of the one being multiplied whose bytes are asked for in advance
constexpr int64_t kAheadRows = 8;
// Rows of x beyond which the weight is dequantised to fp32 once and multiplied densely (at::mm): these
// kernels redo each weight's widening for every row of x (int8: every 4 rows), right for decoding (a few rows,
// limited by the memory) and slower past some tens of rows (limited by arithmetic). In the compiled step the rows
// are batch × beams (its prompt runs eager). Measured on SmolLM2's shapes (AVX-512 CPU, 2 threads, at::mm
// uncapped): at 64 rows these kernels still win (int8 576 × 1536: 0.84 vs 0.86 ms; int4: 1.19 vs 1.71;
// the 49,152-row head: 26 vs 73 ms int8, 35 vs 101 int4), at 9 rows by 3-20x.
constexpr int64_t kMaxMatvecRows = 64;

inline __m256i widen16(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i load16(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

int64_t dot_int16(const int16_t* x, const int8_t* w, int64_t K) {
  int64_t total = 0;
  for (int64_t k0 = 0; k0 < K; k0 += kInt16Block) {
    const int64_t k1 = std::min(K, k0 + kInt16Block);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = k0;
    for (; k + 64 <= k1; k += 64) {
      a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(widen16(w + k), load16(x + k)));
      a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(widen16(w + k + 16), load16(x + k + 16)));
      a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(widen16(w + k + 32), load16(x + k + 32)));
      a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(widen16(w + k + 48), load16(x + k + 48)));
    }
    for (; k + 16 <= k1; k += 16) a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(widen16(w + k), load16(x + k)));
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)));
    for (int i = 0; i < 8; ++i) total += lanes[i];
    for (; k < k1; ++k) total += static_cast<int32_t>(x[k]) * w[k];
  }
  return total;
}

// The same for R rows of activations (row stride K) against one weight row, into total[0, R): each 16 weights are
// widened once for all R rows, where R calls of dot_int16 widen them R times (the widening is most of the work;
// SmolLM2's products for a prompt's 4 rows took 1.8-2.6x the time of one row that way). Exact int32 sums as above: each of a row's two
// accumulators takes half of a block's 256 steps. The sums, exact, equal dot_int16's. (One row stays with dot_int16,
// whose four accumulators over 64 inputs ran SmolLM2's batch-1 products 1.055x faster than dot_int16_rows<1> in two
// A/Bs of three, 0.98x in the third: native AVX2 EPYC, 2 threads, thirty-seventh #13 session.)
template <int R>
void dot_int16_rows(const int16_t* x, const int8_t* w, int64_t K, int64_t* total) {
  for (int r = 0; r < R; ++r) total[r] = 0;
  for (int64_t k0 = 0; k0 < K; k0 += kInt16Block) {
    const int64_t k1 = std::min(K, k0 + kInt16Block);
    __m256i a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_si256();
    int64_t k = k0;
    for (; k + 32 <= k1; k += 32) {
      const __m256i w0 = widen16(w + k), w1 = widen16(w + k + 16);
      for (int r = 0; r < R; ++r) {
        a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(w0, load16(x + r * K + k)));
        a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(w1, load16(x + r * K + k + 16)));
      }
    }
    for (; k + 16 <= k1; k += 16) {
      const __m256i w0 = widen16(w + k);
      for (int r = 0; r < R; ++r) a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(w0, load16(x + r * K + k)));
    }
    for (int r = 0; r < R; ++r) {
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi32(a[r][0], a[r][1]));
      for (int i = 0; i < 8; ++i) total[r] += lanes[i];
      for (int64_t j = k; j < k1; ++j) total[r] += static_cast<int32_t>(x[r * K + j]) * w[j];
    }
  }
}

at::Tensor int8_matvec(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && scales.dim() == 1, "int8_matvec: x (M, K), w (N, K), scales (N,)");
  TORCH_CHECK(x.size(1) == w.size(1) && scales.size(0) == w.size(0), "int8_matvec: x ", x.sizes(), ", w ", w.sizes(),
              ", scales ", scales.sizes(), " do not fit");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat,
              "int8_matvec: expects fp32 x, int8 w, fp32 scales");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && scales.device().is_cpu(), "int8_matvec: CPU tensors only");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = scales.contiguous();
  const int64_t M = xc.size(0), N = wc.size(0), K = wc.size(1);
  if (M > kMaxMatvecRows) return at::mm(xc, wc.to(at::kFloat).t()).mul_(sc);  // many rows: see kMaxMatvecRows
  at::Tensor y = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* wp = wc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Each row of x as int16 with its own scale: max|x| ↦ 32767. Rounding moves an element by at most
  // max|x| / 65534, less than bf16's rounding (2^-9 of itself) for every element within 128x of its row's
  // largest. A row that is not finite takes the float dot product, so NaN and inf come out as they would.
  std::vector<int16_t> xq(M * K);
  std::vector<float> xscale(M, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xp + m * K;
    float big = 0.f;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) {
      big = std::max(big, std::fabs(xr[k]));
      finite = finite && std::isfinite(xr[k]);
    }
    if (!finite) { xscale[m] = NAN; continue; }
    xscale[m] = big > 0.f ? big / 32767.f : 1.f;
    const float inv = 1.f / xscale[m];
    for (int64_t k = 0; k < K; ++k) xq[m * K + k] = static_cast<int16_t>(std::nearbyint(xr[k] * inv));
  }
  // rows of W per task: enough work per thread that starting it costs little (~32 KB of weights)
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* wr = wp + n * K;
      if (n + kAheadRows < n1)  // the memory's own prefetcher alone leaves it waiting (measured)
        for (int64_t off = 0; off < K; off += 64) _mm_prefetch(reinterpret_cast<const char*>(wr + kAheadRows * K + off), _MM_HINT_T0);
      for (int64_t m = 0; m < M;) {  // a few rows, up to 4 at a time: the weight row is widened once for them
        if (std::isnan(xscale[m])) {
          yp[m * N + n] = dot(xp + m * K, wr, K) * sp[n];
          ++m;
          continue;
        }
        int64_t R = 1, total[4];
        while (R < 4 && m + R < M && !std::isnan(xscale[m + R])) ++R;
        const int16_t* xr = xq.data() + m * K;
        switch (R) {
          case 4: dot_int16_rows<4>(xr, wr, K, total); break;
          case 3: dot_int16_rows<3>(xr, wr, K, total); break;
          case 2: dot_int16_rows<2>(xr, wr, K, total); break;
          default: total[0] = dot_int16(xr, wr, K);
        }
        for (int64_t r = 0; r < R; ++r)
          yp[(m + r) * N + n] = static_cast<float>(static_cast<double>(total[r]) * xscale[m + r]) * sp[n];
        m += R;
      }
    }
  });
  return y;
}

// -- int4 ------------------------------------------------------------------------------------------------
//
// Layout (made by attnlab.quant.Int4Linear._own_tensors from the portable one), chosen so that one mask gives
// 32 of the 4-bit values as bytes in order, and a shift and the mask the next 32:
//   w (N, Kp/2) uint8, Kp = K rounded up to 64: per 64 inputs 32 bytes, byte i holding input i in its low
//     nibble and input 32 + i in its high one;
//   scales, mins (N, Kp/32) fp16, one per 32 inputs: W[n, k] = q · scale + min with q in 0…15 (a group of
//     64 or 128 inputs repeats its scale and min; the padding has q = scale = min = 0).
// fp16 scales (as in llama.cpp's Q4_1 blocks) make 32 weights 20 bytes: 0.625 bytes per weight, against
// int8's 1.
//
// Per row: Σ_k W x = Σ_b scale_b · Σ_{k∈b} q_k x_k + Σ_b min_b · Σ_{k∈b} x_k over the 32-input blocks b, on the
// activations rounded to int8 with a scale per 16 inputs (max |x| ↦ 127: as llama.cpp's Q8_1, which its Q4_1
// products meet, with half its block), because vpmaddubsw multiplies 32 unsigned bytes by 32 signed ones at
// once: twice the products per instruction of int16's vpmaddwd. With int16 activations (the int8 kernel's) this
// kernel was arithmetic-bound at ~14-15 GB/s of SmolLM2's weights on a 2-core AVX2 EPYC; on bytes it reads
// them at 18-19 GB/s, near the memory's speed (1.23-1.30x; docs/results.md, thirty-sixth session). The price: the rounding moves each
// activation by at most max|x| / 254 of its 16, ~0.6% error on SmolLM2's products (0.8% with 32 inputs per
// scale, as Q8_1; 0.01% with int16). Each half block's products are summed exactly (int16 pairs ≤ 2 · 15 · 127,
// then 4 of them, ≤ 15,240, then int32) and scaled in fp32 by scale_b · xscale; the sums per 32 are of the
// rounded activations (see int4_matvec).
constexpr int64_t kInt4Block = 64;

// 64 inputs' products: 32 bytes of w against 64 int8 activations, as two vectors of 16 int16 pair sums
// (the first 32 inputs', the last 32's)
inline void products64(const uint8_t* w, const int8_t* x, __m256i& first, __m256i& last) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  first = _mm256_maddubs_epi16(_mm256_and_si256(v, mask), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  last = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), mask),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32)));
}

// Four 64-input blocks' sums from block b: two pairwise additions in int16 (hadd) and one of pairs into int32 leave
// lanes [b b+1 b+2 b+3 | b b+1 b+2 b+3], each block's first 16 inputs in the low half, its last 16 in the high one
inline __m256i quad_sums(const uint8_t* w, const int8_t* xq, int64_t b) {
  __m256i p0, p1, p2, p3;  // (four products' vectors live at a time: eight spill registers, measured slower)
  products64(w + 16 * b, xq + 32 * b, p0, p1);
  products64(w + 16 * (b + 2), xq + 32 * (b + 2), p2, p3);
  return _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_hadd_epi16(p0, p1), _mm256_hadd_epi16(p2, p3)), _mm256_set1_epi16(1));
}

// One row: Σ_b scale_b · Σ_{h∈b} xscale_h · Σ_{k∈h} q_k xq_k + Σ_b min_b · xsum_b over its G 32-input blocks b
// (G even) and their halves h, the activations' scales as 8 for the first halves of 8 blocks, then 8 for their
// last halves. Eight blocks at a time: their scales times the activations' in two vectors, each four blocks' sums
// in one vector (quad_sums), so that one conversion and one multiply-add serve four blocks.
float dot_int4(const int8_t* xq, const float* xscale, const float* xsum, const uint8_t* w, const at::Half* scales,
               const at::Half* mins, int64_t G) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc_min = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= G; b += 8) {
    const __m256 sw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b)));
    const __m256 first = _mm256_mul_ps(sw, _mm256_loadu_ps(xscale + 2 * b)), last = _mm256_mul_ps(sw, _mm256_loadu_ps(xscale + 2 * b + 8));
    acc_min = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + b))),
                              _mm256_loadu_ps(xsum + b), acc_min);
    // blocks b…b+3 meet the scales' low halves (first and last 16s), b+4…b+7 their high ones
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(quad_sums(w, xq, b)), _mm256_permute2f128_ps(first, last, 0x20), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(quad_sums(w, xq, b + 4)), _mm256_permute2f128_ps(first, last, 0x31), acc1);
  }
  float tail = 0.f;
  for (; b < G; b += 2) {  // two blocks at a time (the scales as 2 first halves, 2 last): lanes [b b b+1 b+1 | …]
    __m256i p0, p1;
    products64(w + 16 * b, xq + 32 * b, p0, p1);
    const float s0 = static_cast<float>(scales[b]), s1 = static_cast<float>(scales[b + 1]);
    const float* h = xscale + 2 * b;
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_hadd_epi16(p0, p1), _mm256_set1_epi16(1))),
                           _mm256_setr_ps(s0 * h[0], s0 * h[0], s1 * h[1], s1 * h[1], s0 * h[2], s0 * h[2], s1 * h[3], s1 * h[3]),
                           acc0);
    tail += static_cast<float>(mins[b]) * xsum[b] + static_cast<float>(mins[b + 1]) * xsum[b + 1];
  }
  return horizontal_sum(_mm256_add_ps(_mm256_add_ps(acc0, acc1), acc_min)) + tail;
}

// input k's 4-bit value in a row of the layout
inline int nibble(const uint8_t* row, int64_t k) {
  const uint8_t byte = row[k / kInt4Block * 32 + k % 32];
  return k % kInt4Block < 32 ? byte & 15 : byte >> 4;
}

// The (N, Kp) fp32 weight of the layout, for many rows of x
at::Tensor dequantize_int4(const uint8_t* w, const at::Half* scales, const at::Half* mins, int64_t N, int64_t Kp) {
  at::Tensor out = at::empty({N, Kp}, at::TensorOptions().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const int64_t G = Kp / 32;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k = 0; k < Kp; ++k)
        op[n * Kp + k] = static_cast<float>(nibble(w + n * Kp / 2, k)) * static_cast<float>(scales[n * G + k / 32])
                         + static_cast<float>(mins[n * G + k / 32]);
  });
  return out;
}

at::Tensor int4_matvec(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && scales.dim() == 2 && mins.dim() == 2,
              "int4_matvec: x (M, K), w (N, Kp/2), scales and mins (N, Kp/32)");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), Kp = 2 * w.size(1), G = Kp / 32;
  TORCH_CHECK(Kp % kInt4Block == 0 && K <= Kp && scales.size(0) == N && scales.size(1) == G && mins.sizes() == scales.sizes(),
              "int4_matvec: x ", x.sizes(), ", w ", w.sizes(), ", scales ", scales.sizes(), ", mins ", mins.sizes(),
              " do not fit (w holds a multiple of 64 inputs per row, at least K; one scale and min per 32)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte && scales.scalar_type() == at::kHalf
              && mins.scalar_type() == at::kHalf, "int4_matvec: expects fp32 x, uint8 w, fp16 scales and mins");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && scales.device().is_cpu() && mins.device().is_cpu(),
              "int4_matvec: CPU tensors only");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = scales.contiguous(), mc = mins.contiguous();
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  const at::Half* sp = sc.data_ptr<at::Half>();
  const at::Half* mp = mc.data_ptr<at::Half>();
  if (M > kMaxMatvecRows) return at::mm(xc, dequantize_int4(wp, sp, mp, N, Kp).narrow(1, 0, K).t());
  at::Tensor y = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // each row of x as int8 with a scale per 16 inputs (zero past K; the scales in dot_int4's order: per 8
  // blocks of 32, their first halves', then their last halves'), and the sums per 32 of the rounded values, so
  // that the minimums meet the same activations as the 4-bit values: the rounding then moves Σ W x by
  // Σ W (x̂ - x), not by Σ (W - min) (x̂ - x), about half as much (a block's min is about -range/2; llama.cpp's
  // Q8_1 keeps the rounded sum too). A row that is not finite takes the float product, so that NaN and inf come
  // out as they would; a 16 whose largest |x| is below ~4e-37 (127 / FLT_MAX) counts as zeros.
  std::vector<int8_t> xq(M * Kp, 0);
  std::vector<float> xscale(M * 2 * G, 0.f), xsum(M * G, 0.f);
  std::vector<char> finite(M, 1);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t h = 0; h * 16 < K; ++h) {
      // 16 inputs, in vectors (rounded to nearest, even); the last, part of a 16, from a copy padded with zeros
      // (zeros change neither the largest |x| nor the sum, and the row of xq has room: Kp is a multiple of 64)
      alignas(32) float part[16];
      const float* xh = xp + m * K + h * 16;
      if (h * 16 + 16 > K) {
        std::fill(std::copy(xh, xp + m * K + K, part), part + 16, 0.f);
        xh = part;
      }
      const __m256 sign = _mm256_set1_ps(-0.f), huge = _mm256_set1_ps(FLT_MAX);  // (NaN and inf fail a <= FLT_MAX)
      const __m256 x0 = _mm256_loadu_ps(xh), x1 = _mm256_loadu_ps(xh + 8);
      const __m256 a0 = _mm256_andnot_ps(sign, x0), a1 = _mm256_andnot_ps(sign, x1);
      if (_mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(a0, huge, _CMP_LE_OQ), _mm256_cmp_ps(a1, huge, _CMP_LE_OQ))) != 0xFF) {
        finite[m] = 0;
        break;
      }
      __m128 big4 = _mm_max_ps(_mm256_castps256_ps128(_mm256_max_ps(a0, a1)), _mm256_extractf128_ps(_mm256_max_ps(a0, a1), 1));
      big4 = _mm_max_ps(big4, _mm_movehl_ps(big4, big4));
      const float big = _mm_cvtss_f32(_mm_max_ss(big4, _mm_movehdup_ps(big4)));
      const float scale = big / 127.f, inv = big > 0.f && std::isfinite(127.f / big) ? 127.f / big : 0.f;
      const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, _mm256_set1_ps(inv)));
      const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, _mm256_set1_ps(inv)));
      const __m256i q16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);  // 16 int16, in order
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq.data() + m * Kp + h * 16),
                       _mm_packs_epi16(_mm256_castsi256_si128(q16), _mm256_extracti128_si256(q16, 1)));
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi32(q0, q1));
      int32_t qsum = 0;
      for (int i = 0; i < 8; ++i) qsum += lanes[i];
      // block b = h / 2 of a full 8 at b0 = b - b % 8: first halves at 2·b0 + b % 8, last at 2·b0 + 8 + b % 8;
      // the blocks left (fewer than 8, taken 2 at a time): first halves at 2·b0 + b % 2, last + 2
      const int64_t b = h / 2;
      const bool of_eight = b / 8 * 8 <= G - 8;
      const int64_t b0 = of_eight ? b / 8 * 8 : b / 2 * 2, width = of_eight ? 8 : 2;
      xscale[m * 2 * G + 2 * b0 + (h % 2) * width + (b - b0)] = scale;
      xsum[m * G + b] += static_cast<float>(qsum) * scale;
    }
  }
  const int64_t row_bytes = Kp / 2;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = wp + n * row_bytes;
      const at::Half* sr = sp + n * G;
      const at::Half* mr = mp + n * G;
      if (n + kAheadRows < n1)  // the memory's own prefetcher alone leaves it waiting (measured)
        for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(wr + kAheadRows * row_bytes + off), _MM_HINT_T0);
      for (int64_t m = 0; m < M; ++m) {
        if (!finite[m]) {  // plain float, so that NaN and inf come out as they would
          float s = 0.f;
          for (int64_t k = 0; k < K; ++k)
            s += (static_cast<float>(nibble(wr, k)) * static_cast<float>(sr[k / 32]) + static_cast<float>(mr[k / 32])) * xp[m * K + k];
          yp[m * N + n] = s;
          continue;
        }
        yp[m * N + n] = dot_int4(xq.data() + m * Kp, xscale.data() + m * 2 * G, xsum.data() + m * G, wr, sr, mr, G);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(attnlab, m) {
  m.def("int8_matvec(Tensor x, Tensor w, Tensor scales) -> Tensor");
  m.def("int4_matvec(Tensor x, Tensor w, Tensor scales, Tensor mins) -> Tensor");
}
TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("int8_matvec", &int8_matvec);
  m.impl("int4_matvec", &int4_matvec);
}
