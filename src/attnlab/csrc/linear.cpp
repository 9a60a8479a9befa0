// fp32 training products on oneDNN's GEMM (attnlab.accel.OneDNNLinear's operator, in C++): onednn_linear(x, w, b)
// = F.linear(x, w, b) with its autograd here, and transposed(x) = x.t().contiguous(), the weight gradient's
// operand turned token-major.
//
// Why C++: the Python autograd.Function around the same three products cost ~55 µs a linear (forward and backward,
// profiled in nanoGPT's update: ~0.9 ms of its ~31), where a C++ autograd function costs a few. Why transposed: a
// linear's weight gradient dW = dYᵀ·X sums over the N tokens, and oneDNN's GEMM runs it ~10-20% faster than MKL's
// on the training shapes of docs/results.md when one operand comes with the tokens contiguous; but its PyTorch op
// copies a transposed view with PyTorch's strided copy, which for (768, 512) floats took 320 µs, longer than the
// product gains (ad hoc, the reference CPU, 2 threads). Here: tiles of 32 × 32, each 8 × 8 block turned in eight
// AVX registers (unpack, shuffle, permute: the classic 8 × 8 transpose), 47 µs; a plain loop without AVX2.
// Built on first use by torch.utils.cpp_extension (attnlab.accel.build_torch_ops); tests/test_linear.py compares
// the transpose with PyTorch's copy (equal) and the linear's results and gradients with F.linear's in float64.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
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

// x @ w.t() (+ b) on oneDNN's GEMM: w (out, in) plain or a transposed view (oneDNN reads it as it is)
at::Tensor onednn_product(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  if (x.size(-1) == 0) return at::linear(x, w, b);  // (no inputs: oneDNN refuses K = 0; the output is the bias)
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(w);
  // (oneDNN reads the bias as contiguous whatever its strides: a strided or expanded one is copied first)
  stack.emplace_back(b.has_value() && b->defined() ? c10::IValue(b->contiguous()) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// transposed() through the dispatcher, so that a profile names it (attnlab::transposed)
at::Tensor turned(const at::Tensor& x) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("attnlab::transposed", "").typed<at::Tensor(const at::Tensor&)>();
  return op.call(x);
}

// dyᵀ·x (out, in) from dy (N, out) and x (N, in): the narrower of the two turned token-major, the other read as a
// transposed view; where that is x, the product is dWᵀ, turned back (a weight's size, small)
at::Tensor weight_grad(const at::Tensor& dy, const at::Tensor& x) {
  const at::Tensor dyc = dy.contiguous(), xc = x.contiguous();
  if (dyc.size(1) <= xc.size(1)) return onednn_product(turned(dyc), xc.t(), std::nullopt);  // (out, N)·(N, in)
  return turned(onednn_product(turned(xc), dyc.t(), std::nullopt));  // ((in, N)·(N, out))ᵀ
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// F.linear's autograd with the products above. It keeps what F.linear keeps: x only if w wants a gradient, w only if
// x does. With create_graph (a double backward) the gradients are differentiable matmul and mm.
struct OneDNNLinearFunction : public torch::autograd::Function<OneDNNLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& b, bool onednn_weight_grad) {
    ctx->save_for_backward({w.requires_grad() ? x : at::Tensor(), x.requires_grad() ? w : at::Tensor()});
    ctx->saved_data["has_bias"] = b.has_value();
    ctx->saved_data["onednn_weight_grad"] = onednn_weight_grad;
    return onednn_product(x, w, b);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &dy = grads[0];
    const bool differentiable = at::GradMode::is_enabled();
    at::Tensor dx, dw, db;
    const at::Tensor rows = dy.flatten(0, -2);  // (N, out) (flatten, not reshape(-1, out): out may be 0)
    if (ctx->needs_input_grad(0)) dx = differentiable ? dy.matmul(w) : onednn_product(dy, w.t(), std::nullopt);
    if (ctx->needs_input_grad(1)) {
      const at::Tensor x_rows = x.flatten(0, -2);  // (N, in)
      dw = (differentiable || !ctx->saved_data["onednn_weight_grad"].toBool()) ? rows.t().mm(x_rows)
                                                                                : weight_grad(rows, x_rows);
    }
    // (an absent bias is no input of the node: ask for index 2 only where there is one)
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) db = rows.sum(0);
    return {dx, dw, db, at::Tensor()};
  }
};

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                         bool onednn_weight_grad) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.dim() >= 2 && w.dim() == 2,
              "attnlab::onednn_linear: float32 x (..., in) and w (out, in) are expected, got ", x.scalar_type(), " ",
              x.sizes(), " and ", w.scalar_type(), " ", w.sizes());
  return OneDNNLinearFunction::apply(x, w, b, onednn_weight_grad);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("transposed(Tensor x) -> Tensor");
  m.def("onednn_linear(Tensor x, Tensor w, Tensor? b, bool onednn_weight_grad) -> Tensor");
}
TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("transposed", &transposed);
}
TORCH_LIBRARY_IMPL(attnlab, CompositeImplicitAutograd, m) {
  m.impl("onednn_linear", &onednn_linear);
}
