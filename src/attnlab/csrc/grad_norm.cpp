// Gradient clipping by the global L2 norm on CPU, fp32, in two parallel passes over all gradients together.
//
// What torch.nn.utils.clip_grad_norm_(parameters, max_norm) computes (norm_type 2): the norm of every gradient
// together, ‖g‖ = √Σg², and then each gradient times c = max_norm / (‖g‖ + 1e-6), where c < 1 (c ≥ 1 leaves them
// as they are). Why a kernel: PyTorch's multi-tensor ("foreach") operators have no CPU kernels, so on CPU
// clip_grad_norm_'s _foreach_norm and _foreach_mul_ fall back to one norm and one multiply per parameter, each
// split over the threads on its own, with a stack and a norm of the norms between. Here the gradients' chunks make
// one list, split over the threads once for the sums of squares and once for the multiply. Inside nanoGPT's
// Shakespeare update (27 parameters, 0.8 M weights, 2 threads): 1.48 ms of clipping → 0.63 ms
// (docs/results.md, thirty-ninth #13 session).
//
// The same numbers as torch's, but for the norm's last bit: the squares are summed in float64 (torch sums them in
// float32; a sum past float32's range is inf, as torch's), c is computed from the float32 norm as torch computes
// it (the reciprocal of norm + 1e-6, times max_norm, in float32), and the multiply is a float32 multiply, as
// torch's mul_. Where c ≥ 1 the multiply is skipped: torch multiplies by exactly 1 (to avoid a sync on a GPU),
// which changes no bit. A non-finite norm gives c = 0 or NaN, and the multiply then makes the gradients 0 or NaN
// as torch's. The partial sums are added in the chunks' order: the norm does not depend on the number of threads.
// The gradients must not share memory (attnlab.train.clipping leaves repeated ones to torch). Built on first use
// by torch.utils.cpp_extension (attnlab.accel.build_torch_ops); tests/test_train.py compares it with torch's
// clip_grad_norm_ and with float64.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kChunk = 16384;         // floats a thread takes at a time (64 KB)
constexpr int64_t kParallelMin = 65536;   // fewer floats in all: one thread (a split costs more than it saves)

struct Chunk {
  float* data;
  int64_t len;
};

double sum_of_squares(const float* p, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // (eight lanes: the compiler vectorises the inner loop)
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += static_cast<double>(p[i + j]) * p[i + j];
  }
  double s = 0;
  for (; i < n; ++i) s += static_cast<double>(p[i]) * p[i];
  for (int j = 0; j < 8; ++j) s += acc[j];
  return s;
}

at::Tensor clip_grad_norm_(at::TensorList grads, double max_norm) {
  TORCH_CHECK(!grads.empty(), "attnlab::clip_grad_norm_: no gradients");
  std::vector<Chunk> chunks;
  int64_t total = 0;
  for (const at::Tensor& g : grads) {
    TORCH_CHECK(g.defined() && g.device().is_cpu() && g.scalar_type() == at::kFloat && g.is_contiguous(),
                "attnlab::clip_grad_norm_: contiguous float32 CPU gradients are expected, got ", g.scalar_type(),
                " on ", g.device());
    float* p = g.data_ptr<float>();
    for (int64_t b = 0; b < g.numel(); b += kChunk) chunks.push_back({p + b, std::min(kChunk, g.numel() - b)});
    total += g.numel();
  }
  const int64_t n = static_cast<int64_t>(chunks.size());
  const int64_t grain = total >= kParallelMin ? 1 : std::max<int64_t>(n, 1);
  std::vector<double> partial(n, 0.0);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) partial[c] = sum_of_squares(chunks[c].data, chunks[c].len);
  });
  double sum = 0;
  for (double s : partial) sum += s;
  const float norm = sum > std::numeric_limits<float>::max() ? std::numeric_limits<float>::infinity()
                                                               : static_cast<float>(std::sqrt(sum));
  // torch: clip_coef = max_norm / (total_norm + 1e-6), a float over a float32 tensor, which Tensor.__rdiv__
  // computes as (total_norm + 1e-6).reciprocal() * max_norm; then clamped to 1
  const float coef = (1.0f / (norm + 1e-6f)) * static_cast<float>(max_norm);
  if (!(coef >= 1.0f)) {  // (NaN too)
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        float* p = chunks[c].data;
        for (int64_t i = 0; i < chunks[c].len; ++i) p[i] *= coef;
      }
    });
  }
  at::Tensor out = at::empty({}, grads[0].options());
  *out.data_ptr<float>() = norm;
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("clip_grad_norm_(Tensor(a!)[] grads, float max_norm) -> Tensor");
}
TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("clip_grad_norm_", &clip_grad_norm_);
}
