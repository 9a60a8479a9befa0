// attnlab::int8_matvec: y = (x · Wᵀ) ⊙ scales for a few rows of fp32 activations x (M, K) and int8
// weights W (N, K) with one fp32 scale per output channel: the product of weight-only int8 decoding
// (attnlab.quant.Int8Linear) on CPUs with AVX2 + FMA.
//
// Why a kernel of our own: decoding one token reads every weight once, so the product should run at
// the memory's speed. PyTorch's _weight_int8pack_mm and inductor's GEMM template are built around
// bf16 activations and AVX-512; capped at AVX2 they read SmolLM2's int8 weights at ~7 and ~20 GB/s.
// Here each weight row is read once, 64 int8 at a time, widened to int16 and multiplied against the row
// of activations rounded to int16 (one scale per row, finer than bf16's rounding for all but tiny
// elements), summed exactly in int32, the rows split over PyTorch's own threads. Built on first use by
// torch.utils.cpp_extension (attnlab.quant._build_int8_kernel).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
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
// 16 inputs, so the four accumulators together hold 256 such steps (K = 4096) without overflow; longer
// rows are summed in blocks of that length, in int64.
constexpr int64_t kInt16Block = 4096;

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

at::Tensor int8_matvec(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && scales.dim() == 1, "int8_matvec: x (M, K), w (N, K), scales (N,)");
  TORCH_CHECK(x.size(1) == w.size(1) && scales.size(0) == w.size(0), "int8_matvec: x ", x.sizes(), ", w ", w.sizes(),
              ", scales ", scales.sizes(), " do not fit");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat,
              "int8_matvec: expects fp32 x, int8 w, fp32 scales");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && scales.device().is_cpu(), "int8_matvec: CPU tensors only");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = scales.contiguous();
  const int64_t M = xc.size(0), N = wc.size(0), K = wc.size(1);
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
      for (int64_t m = 0; m < M; ++m) {  // a few rows: the weight row stays in L1 between them
        yp[m * N + n] = std::isnan(xscale[m])
            ? dot(xp + m * K, wr, K) * sp[n]
            : static_cast<float>(static_cast<double>(dot_int16(xq.data() + m * K, wr, K)) * xscale[m]) * sp[n];
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(attnlab, m) { m.def("int8_matvec(Tensor x, Tensor w, Tensor scales) -> Tensor"); }
TORCH_LIBRARY_IMPL(attnlab, CPU, m) { m.impl("int8_matvec", &int8_matvec); }
