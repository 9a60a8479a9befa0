// GELU for training on CPU, forward and backward in one pass: gelu_and_slope(h) = (GELU(h), GELU'(h)), fp32.
//
// GELU(x) = x·Φ(x) (exact: Φ the normal CDF, through erf) and GELU'(x) = Φ(x) + x·φ(x). The trainer keeps the
// slope for the backward in place of h, which then is one multiply, dh = dA · slope
// (attnlab.model.layers.gelu). Why: PyTorch's gelu_backward recomputes erf and exp from h, a second pass of
// transcendental functions over the largest activation of the layer (d_ff wide), read cold from memory; here
// both come out of one exp: Φ(x) = 1 − ½·erfc(x/√2) and erfc(z) = poly(t)·exp(−z²) (Abramowitz & Stegun
// 7.1.26, |error| ≤ 1.5e-7, the formula of PyTorch's vectorised erf), and φ(x) = exp(−x²/2)/√(2π) is the
// same exp. What it gains in a training step: docs/results.md (twenty-third #13 session).
//
// The loop is branch-free (the exp's clamp an integer min, Φ's sign a copysign), so that the compiler
// vectorises it with AVX2 as with AVX-512. Built on first use by torch.utils.cpp_extension
// (attnlab.accel.build_torch_ops); tests/test_pitfalls.py compares it with float64.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "vec_math.h"

namespace {

using attnlab_vec::exp_nonpositive;

void gelu_block(const float* __restrict h, float* __restrict out, float* __restrict slope, int64_t len) {
  for (int64_t i = 0; i < len; ++i) {
    const float x = h[i];
    const float z = std::fabs(x) * 0.70710678118654752f;  // |x|/√2
    const float t = 1.0f / (1.0f + 0.3275911f * z);
    const float e = exp_nonpositive(-z * z);  // exp(−x²/2)
    const float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
    const float tail = 0.5f * poly * e;  // Φ(−|x|) = ½·erfc(|x|/√2)
    const float cdf = 0.5f + std::copysign(0.5f - tail, x);  // Φ(x)
    out[i] = x * cdf;
    slope[i] = cdf + x * e * 0.39894228040143268f;  // Φ(x) + x·φ(x)
  }
}

std::tuple<at::Tensor, at::Tensor> gelu_and_slope(const at::Tensor& h) {
  TORCH_CHECK(h.device().is_cpu() && h.scalar_type() == at::kFloat,
              "attnlab::gelu_and_slope: a float32 CPU tensor is expected, got ", h.scalar_type(), " on ", h.device());
  const at::Tensor hc = h.contiguous();
  at::Tensor out = at::empty_like(hc), slope = at::empty_like(hc);
  const float* hp = hc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = slope.data_ptr<float>();
  at::parallel_for(0, hc.numel(), 16384, [&](int64_t begin, int64_t end) {
    gelu_block(hp + begin, op + begin, sp + begin, end - begin);
  });
  return {out, slope};
}

// GELU(h) with its autograd here: the forward keeps the slope, the backward is dA · slope. Why C++: the same as a
// Python autograd.Function cost ~70 µs a call of Python (forward and backward; ~0.3 ms of nanoGPT's ~28 ms CPU
// update, docs/results.md, thirty-second #13 session). h is not kept, so there is no second derivative: under
// create_graph the gradient comes out behind a node that refuses to be differentiated, as Python's
// @once_differentiable does it.
struct GeluWithSlope : public torch::autograd::Function<GeluWithSlope> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h) {
    static const auto op = c10::Dispatcher::singleton()  // (through the dispatcher: fake tensors take its shapes)
                               .findSchemaOrThrow("attnlab::gelu_and_slope", "")
                               .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&)>();
    auto [out, slope] = op.call(h);
    ctx->save_for_backward({slope});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor slope = ctx->get_saved_variables()[0];
    if (!grads[0].defined()) return {at::Tensor()};
    at::Tensor dh;
    {
      at::NoGradGuard no_grad;
      dh = grads[0] * slope;
    }
    if (at::GradMode::is_enabled() && grads[0].requires_grad()) {  // (create_graph)
      auto refuse = std::make_shared<torch::autograd::DelayedError>(
          "attnlab::gelu_training has no second derivative (its input is not kept)", 1);
      dh = refuse->apply({dh.detach().requires_grad_(true)})[0];
    }
    return {dh};
  }
};

at::Tensor gelu_training(const at::Tensor& h) { return GeluWithSlope::apply(h); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("gelu_and_slope(Tensor h) -> (Tensor, Tensor)");
  m.def("gelu_training(Tensor h) -> Tensor");
}
TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("gelu_and_slope", &gelu_and_slope);
}
TORCH_LIBRARY_IMPL(attnlab, CompositeImplicitAutograd, m) {
  m.impl("gelu_training", &gelu_training);
}
