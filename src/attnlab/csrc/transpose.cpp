// transposed(x) = x.t().contiguous() for a 2-D fp32 CPU tensor whose rows are contiguous: the weight gradient's
// operand, feature-major.
//
// Why: a linear's weight gradient dW = dYᵀ·X sums over the N tokens. oneDNN's GEMM runs it ~10-20% faster than
// MKL's on the training shapes of docs/results.md when one operand comes in with the tokens contiguous, but its
// PyTorch op copies a transposed view with PyTorch's strided copy, which for (768, 512) floats took 320 µs, longer
// than the product gains (ad hoc, the reference CPU, 2 threads). Here: tiles of 32 × 32, each 8 × 8 block turned
// in eight AVX registers (unpack, shuffle, permute: the classic 8 × 8 transpose), 47 µs; a plain loop over the
// tile without AVX2. (attnlab.accel.OneDNNLinear's backward; built on first use by torch.utils.cpp_extension,
// attnlab.accel.build_torch_ops; tests/test_linear.py compares it with PyTorch's copy, which it equals exactly.)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t TILE = 32;  // 32 × 32 floats: a tile's rows and columns stay in L1 while it is turned

#ifdef __AVX2__
// out[j][i] = in[i][j] for an 8 × 8 block (rows ld_in and ld_out floats apart)
inline void transpose_8x8(const float* in, int64_t ld_in, float* out, int64_t ld_out) {
  __m256 r0 = _mm256_loadu_ps(in + 0 * ld_in), r1 = _mm256_loadu_ps(in + 1 * ld_in);
  __m256 r2 = _mm256_loadu_ps(in + 2 * ld_in), r3 = _mm256_loadu_ps(in + 3 * ld_in);
  __m256 r4 = _mm256_loadu_ps(in + 4 * ld_in), r5 = _mm256_loadu_ps(in + 5 * ld_in);
  __m256 r6 = _mm256_loadu_ps(in + 6 * ld_in), r7 = _mm256_loadu_ps(in + 7 * ld_in);
  // pairs of rows interleaved, then quads: each 128-bit half then holds a 4 × 4 block's column
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  // the low halves are columns 0-3, the high halves columns 4-7
  _mm256_storeu_ps(out + 0 * ld_out, _mm256_permute2f128_ps(s0, s4, 0x20));
  _mm256_storeu_ps(out + 1 * ld_out, _mm256_permute2f128_ps(s1, s5, 0x20));
  _mm256_storeu_ps(out + 2 * ld_out, _mm256_permute2f128_ps(s2, s6, 0x20));
  _mm256_storeu_ps(out + 3 * ld_out, _mm256_permute2f128_ps(s3, s7, 0x20));
  _mm256_storeu_ps(out + 4 * ld_out, _mm256_permute2f128_ps(s0, s4, 0x31));
  _mm256_storeu_ps(out + 5 * ld_out, _mm256_permute2f128_ps(s1, s5, 0x31));
  _mm256_storeu_ps(out + 6 * ld_out, _mm256_permute2f128_ps(s2, s6, 0x31));
  _mm256_storeu_ps(out + 7 * ld_out, _mm256_permute2f128_ps(s3, s7, 0x31));
}
#endif

// rows [r0, r1) × columns [c0, c1) of in (rows ld floats apart) into out (rows n floats apart), transposed
void transpose_tile(const float* in, int64_t ld, float* out, int64_t n, int64_t r0, int64_t r1, int64_t c0,
                    int64_t c1) {
  int64_t r = r0;
#ifdef __AVX2__
  for (; r + 8 <= r1; r += 8) {
    int64_t c = c0;
    for (; c + 8 <= c1; c += 8) transpose_8x8(in + r * ld + c, ld, out + c * n + r, n);
    for (; c < c1; ++c)
      for (int64_t i = r; i < r + 8; ++i) out[c * n + i] = in[i * ld + c];
  }
#endif
  for (; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) out[c * n + r] = in[r * ld + c];
}

at::Tensor transposed(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "attnlab::transposed: a 2-D float32 CPU tensor is expected, got ", x.dim(), "-D ", x.scalar_type(),
              " on ", x.device());
  const int64_t n = x.size(0), c = x.size(1);
  const at::Tensor xc = (x.stride(1) == 1 && x.stride(0) >= c) ? x : x.contiguous();  // rows contiguous
  at::Tensor out = at::empty({c, n}, x.options());  // (c, n)
  if (n == 0 || c == 0) return out;
  const float* in = xc.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t ld = xc.stride(0), row_tiles = (n + TILE - 1) / TILE, col_tiles = (c + TILE - 1) / TILE;
  at::parallel_for(0, row_tiles * col_tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = (t / col_tiles) * TILE, c0 = (t % col_tiles) * TILE;
      transpose_tile(in, ld, o, n, r0, std::min(r0 + TILE, n), c0, std::min(c0 + TILE, c));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("transposed(Tensor x) -> Tensor");
}
TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("transposed", &transposed);
}
