// Attention over short keys for training on CPU, fp32, forward and backward: attnlab::short_attention and
// attnlab::short_attention_backward, the kernel behind attnlab.model.attention.ShortAttention.
//
// softmax(QKᵀ·scale + bias)·V for each (batch, head), with the textbook backward
//   dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P ⊙ (dP − rowsum(dP ⊙ P)),  dQ = dS·K·scale,  dK = dSᵀ·Q·scale.
// Why a kernel: with tens of keys each (batch, head) is a few kilobytes, and the same work as batched matmuls
// (ShortAttention's torch path) spends as long moving the heads as multiplying them: q, k and v copied out of
// the projection's (B, T, h, hd) memory into (B·h, T, hd) before the products, the output and the three
// gradients copied back (8 copies per attention), plus the softmax and its backward as separate passes. Here
// one task per (batch, key/value head) reads its rows where they are, keeps the scores, probabilities and
// gradients of that head in cache, and writes the output and the gradients straight into (B, T, h, hd) memory,
// which the caller merges with a view. With causal=True the products skip the keys after each query
// (key j is seen by query i when j <= i + Tk − Tq: the queries are the last Tq positions), about half the work.
// What it gains in a training step: docs/results.md (twenty-fourth #13 session).
//
// The products are register-blocked loops over GCC vector types (16 floats with AVX-512, 8 with AVX2 and 4
// elsewhere), so one source serves every CPU the build targets (attnlab.accel.own_kernel_target). So are the
// softmax and its backward, row by row, on rows padded to whole vectors (the probabilities are saved so). GQA: the g
// query heads that share a key/value head run in the same task, which sums their dK and dV. Built on first use
// by torch.utils.cpp_extension (attnlab.accel.build_torch_ops); tests/test_pitfalls.py compares it with float64.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec_math.h"

namespace {

// VL: lanes per vector; ACC: accumulators per block of a product; NBMAX: vectors of columns per block, at most
#if defined(__AVX512F__)
constexpr int VL = 16, ACC = 16, NBMAX = 4;  // (of 32 registers)
#elif defined(__AVX__)
// (of 16 registers: blocks of 6 rows × 2 vectors, the shape of AVX2 GEMM kernels, leave room for 2 vectors of a row
// and a broadcast; 2 rows × 4 vectors, 8 accumulators, took 1.03-1.39x as long for the attention's forward +
// backward on a native AVX2 CPU, 1.07-1.32x in the A/B before, docs/results.md, thirty-seventh #13 session)
constexpr int VL = 8, ACC = 12, NBMAX = 2;
#else
constexpr int VL = 4, ACC = 8, NBMAX = 4;
#endif
typedef float vec __attribute__((vector_size(VL * sizeof(float)), aligned(alignof(float))));
typedef int32_t ivec __attribute__((vector_size(VL * sizeof(int32_t)), aligned(alignof(int32_t))));

inline int64_t padded(int64_t n) { return (n + VL - 1) / VL * VL; }
inline vec load(const float* p) { return *reinterpret_cast<const vec*>(p); }
inline void store(float* p, vec x) { *reinterpret_cast<vec*>(p) = x; }
// The larger of two scores, or NaN where either is NaN (as torch's max and softmax propagate it)
inline vec nan_max(vec x, vec m) { return ((x > m) | (x != x)) ? x : m; }
// Constant lane vectors: {0, 1, …, VL − 1} + by, modulo VL
template <int by, int... l>
constexpr ivec lanes_from(std::integer_sequence<int, l...>) { return ivec{((l + by) % VL)...}; }
template <int by>
constexpr ivec lanes_from() { return lanes_from<by>(std::make_integer_sequence<int, VL>{}); }
// x's lanes moved down by `by` (lane l gets lane l + by, modulo VL)
template <int by, int... l>
inline vec rotated(vec x, std::integer_sequence<int, l...>) {
#if defined(__clang__)
  return __builtin_shufflevector(x, x, ((l + by) % VL)...);
#else
  return __builtin_shuffle(x, lanes_from<by>());  // (GCC before 12 has no __builtin_shufflevector)
#endif
}
// Across the lanes of a vector in log2(VL) steps of a lane shuffle (one lane at a time is a chain of VL)
template <int by = VL / 2, class Op>
inline float across_lanes(vec x, Op op) {
  if constexpr (by >= 1) {
    return across_lanes<by / 2>(op(x, rotated<by>(x, std::make_integer_sequence<int, VL>{})), op);
  } else {
    return x[0];
  }
}
inline float lanes_sum(vec x) { return across_lanes(x, [](vec a, vec b) { return a + b; }); }

// Which part of a product causal attention needs: with rows [i0, i0 + MR) of C,
// KEYS_IN_K: rows are queries, the sum runs over keys: k < i0 + MR + off (the block's last visible key + 1);
// QUERIES_IN_K: rows are keys, the sum runs over queries: k >= i0 − off (the first query that sees key i0);
// KEYS_IN_N: rows are queries, columns keys: columns < i0 + MR + off (rounded up to whole vectors; run's own loop,
// seen_columns: the columns no query of the block sees are not computed, and not read).
enum Skip { NONE, KEYS_IN_K, QUERIES_IN_K, KEYS_IN_N };

struct Product {
  int64_t M, N, K;          // C (M × N) (+)= A (M × K) · Bm (K × N); N a multiple of VL
  const float* A; int64_t sai, sak;  // A(i, k) = A[i·sai + k·sak]
  const float* Bm; int64_t sb;       // row k of Bm at Bm + k·sb, contiguous
  float* C; int64_t sc;              // row i of C at C + i·sc, contiguous
  bool accumulate;
  Skip skip; int64_t off;            // off = Tk − Tq, for causal skipping
};

// rows [i0, i0 + MR) × columns [n0, n0 + NB·VL) of C, over k in [kb, ke)
template <int MR, int NB>
inline void block(const Product& p, int64_t i0, int64_t n0, int64_t kb, int64_t ke) {
  vec c[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NB; ++v)
      c[r][v] = p.accumulate ? *reinterpret_cast<const vec*>(p.C + (i0 + r) * p.sc + n0 + v * VL) : vec{};
  for (int64_t k = kb; k < ke; ++k) {
    vec b[NB];
    for (int v = 0; v < NB; ++v) b[v] = *reinterpret_cast<const vec*>(p.Bm + k * p.sb + n0 + v * VL);
    for (int r = 0; r < MR; ++r) {
      const float a = p.A[(i0 + r) * p.sai + k * p.sak];
      for (int v = 0; v < NB; ++v) c[r][v] += a * b[v];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NB; ++v) *reinterpret_cast<vec*>(p.C + (i0 + r) * p.sc + n0 + v * VL) = c[r][v];
}

template <int MR, int NB>
inline void block_skipping(const Product& p, int64_t i0, int64_t n0) {
  int64_t kb = 0, ke = p.K;
  if (p.skip == KEYS_IN_K) ke = std::min(p.K, std::max<int64_t>(0, i0 + MR + p.off));
  if (p.skip == QUERIES_IN_K) kb = std::min(p.K, std::max<int64_t>(0, i0 - p.off));
  block<MR, NB>(p, i0, n0, kb, ke);
}

// nv whole vectors of columns from column 0, as blocks of NBMAX vectors and one block of those left (3, 2 or 1):
// f(std::integral_constant<int, NB>{}, n0) for each block of NB vectors from column n0 (both loop orders below
// share it: columns outside, rows inside for run's plain products; rows outside for KEYS_IN_N)
template <class F>
inline void in_vector_blocks(int64_t nv, F&& f) {
  int64_t n0 = 0;
  for (; nv >= NBMAX; nv -= NBMAX, n0 += NBMAX * VL) f(std::integral_constant<int, NBMAX>{}, n0);
  if constexpr (NBMAX > 3) if (nv == 3) f(std::integral_constant<int, 3>{}, n0);
  if constexpr (NBMAX > 2) if (nv == 2) f(std::integral_constant<int, 2>{}, n0);
  if (nv == 1) f(std::integral_constant<int, 1>{}, n0);
}

template <int NB>
void columns(const Product& p, int64_t n0) {
  constexpr int MR = ACC / NB > 6 ? 6 : (ACC / NB < 1 ? 1 : ACC / NB);
  int64_t i = 0;
  for (; i + MR <= p.M; i += MR) block_skipping<MR, NB>(p, i, n0);
  for (; i < p.M; ++i) block_skipping<1, NB>(p, i, n0);
}

// KEYS_IN_N: each block of MR rows computes the whole vectors of columns its queries see, no further (of a causal
// head's scores and their gradients, 5/8 at 64 keys on AVX-512, nearer half for longer rows)
template <int MR>
void seen_columns(const Product& p, int64_t i0) {
  const int64_t nv = std::min(p.N, padded(std::max<int64_t>(0, i0 + MR + p.off))) / VL;
  in_vector_blocks(nv, [&](auto nb, int64_t n0) { block<MR, decltype(nb)::value>(p, i0, n0, 0, p.K); });
}

void run(const Product& p) {
  if (p.skip == KEYS_IN_N) {
    constexpr int MR = ACC / NBMAX > 1 ? ACC / NBMAX : 1;  // (the accumulators of NBMAX vectors of columns)
    int64_t i = 0;
    for (; i + MR <= p.M; i += MR) seen_columns<MR>(p, i);
    for (; i < p.M; ++i) seen_columns<1>(p, i);
    return;
  }
  in_vector_blocks(p.N / VL, [&](auto nb, int64_t n0) { columns<decltype(nb)::value>(p, n0); });
}

// Rows of a (rows × cols) slice with row stride s, as rows of P floats (P a multiple of VL): the slice itself
// where cols == P, else copied into buf with zeros after cols. Returns the rows and sets their stride.
const float* rows_of(const float* src, int64_t s, int64_t rows, int64_t cols, int64_t P, float* buf, int64_t* stride) {
  if (cols == P) {
    *stride = s;
    return src;
  }
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(buf + r * P, src + r * s, cols * sizeof(float));
    std::fill(buf + r * P + cols, buf + (r + 1) * P, 0.f);
  }
  *stride = P;
  return buf;
}

// dst (cols × P) = the transpose of a (rows × cols) slice with row stride s, zeros after rows. (Whole vectors
// stored: a plain loop of scalar stores ran the forward 1.08-1.26x faster on 32 keys of 64 dimensions with the
// data warm, but inside nanoGPT's training update, with K and V read from memory, the backward ~1.26x slower.)
void transposed(const float* src, int64_t s, int64_t rows, int64_t cols, int64_t P, float* dst) {
  for (int64_t c = 0; c < cols; ++c) std::fill(dst + c * P + rows, dst + (c + 1) * P, 0.f);
  int64_t r = 0;
  for (; r + VL <= rows; r += VL)  // VL rows at a time: each column's VL values stored as one vector
    for (int64_t c = 0; c < cols; ++c) {
      vec x;
      for (int l = 0; l < VL; ++l) x[l] = src[(r + l) * s + c];
      store(dst + c * P + r, x);
    }
  for (; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * P + r] = src[r * s + c];
}

// The probabilities are saved with rows of a multiple of 16 floats (a multiple of VL on every build), so that
// the softmax and its backward read and write whole vectors: (B, h, Tq, probs_stride(Tk)), handed out as the
// (B, h, Tq, Tk) view of it.
inline int64_t probs_stride(int64_t Tk) { return (Tk + 15) / 16 * 16; }
// How many keys query i sees: all Tk, or with causal those up to its position (the queries are the last Tq of the Tk
// positions: off = Tk − Tq)
inline int64_t seen_keys(int64_t i, bool causal, int64_t Tk, int64_t off) {
  return causal ? std::min(Tk, std::max<int64_t>(0, i + off + 1)) : Tk;
}
inline ivec seen_lanes(int64_t j, int64_t seen) {  // all ones in lane l where j + l < seen
  constexpr ivec lane = lanes_from<0>();
  return lane + static_cast<int32_t>(j) < static_cast<int32_t>(seen);
}

// The softmax of a head's rows of scores, in place: row i of s (stride ss) holds S over [0, seen(i)) (garbage
// after), and gets softmax(S·scale + bias) there and zeros after (up to Tk, and whole vectors); bias: the head's
// bias (rows at stride brs, columns at stride bcs), or null; m: Tq floats of scratch. In vectors, in three
// passes over the rows (scale, mask and maximum; exp and sum; the division), each pass a loop whose rows are
// independent: a row's maximum and sum are reductions across the lanes of a vector, chains of shuffles that
// the CPU can run beside the next rows' work (one row through all three passes at a time: forwards 1.0-1.1x
// slower on the shapes of benchmarks/train_speed.py --attention). The exp is the costliest part of the softmax.
// (Lanes past seen are masked in registers: a scalar store read back by a vector load stalls.)
template <class Seen>
void softmax_rows(float* s, int64_t ss, int64_t Tq, Seen seen_of, int64_t Tk, float scale, const float* bias,
                  int64_t brs, int64_t bcs, float* m) {
  for (int64_t i = 0; i < Tq; ++i) {
    float* r = s + i * ss;
    const int64_t seen = seen_of(i), n = padded(seen);
    vec mv = vec{} - INFINITY;
    for (int64_t j = 0; j < n; j += VL) {
      vec x = load(r + j) * scale;
      if (bias) {
        vec bv = vec{};
        for (int l = 0; l < VL && j + l < seen; ++l) bv[l] = bias[i * brs + (j + l) * bcs];
        x += bv;
      }
      x = seen_lanes(j, seen) ? x : vec{} - INFINITY;  // (exp(−inf) = 0)
      store(r + j, x);
      mv = nan_max(x, mv);  // the row's maximum, or NaN if a score is NaN (then every probability is NaN, as in
    }                       // torch's softmax)
    m[i] = across_lanes(mv, nan_max);
  }
  const ivec sign = ivec{} + static_cast<int32_t>(0x80000000u);
  for (int64_t i = 0; i < Tq; ++i) {
    float* r = s + i * ss;
    const int64_t seen = seen_of(i), n = padded(seen);
    vec sum = vec{};
    for (int64_t j = 0; j < n; j += VL) {
      // exp(−|s − m|)
      const vec e = attnlab_vec::exp_nonpositive<vec, ivec>((vec)((ivec)(load(r + j) - m[i]) | sign));
      store(r + j, e);  // (−0.0 at the maximum: exp = 1)
      sum += e;
    }
    m[i] = seen ? 1.0f / lanes_sum(sum) : 0.f;  // (a query that sees no key: probabilities and output 0)
  }
  for (int64_t i = 0; i < Tq; ++i) {
    float* r = s + i * ss;
    const int64_t seen = seen_of(i), n = padded(seen);
    for (int64_t j = 0; j < n; j += VL) store(r + j, seen_lanes(j, seen) ? load(r + j) * m[i] : vec{});
    if (n < Tk) std::fill(r + n, r + Tk, 0.f);  // (read by the blocks of rows that see further, and by the backward)
  }
}

// Whether (B, h, Tq, Tk) probabilities lie in rows of PS floats, PS a multiple of VL and at least TP, one after
// the other, the last one's padding inside the storage too (the forward's layout)
bool whole_vector_rows(const at::Tensor& p, int64_t TP) {
  const int64_t PS = p.stride(2);
  return p.scalar_type() == at::kFloat && p.stride(3) == 1 && PS >= TP && PS % VL == 0 &&
         p.stride(1) == p.size(2) * PS && p.stride(0) == p.size(1) * p.size(2) * PS &&
         p.storage().nbytes() >= (p.storage_offset() + p.size(0) * p.stride(0)) * sizeof(float);
}

// The softmax's backward for one row, in place: d[0, seen) holds dP (garbage after), p the probabilities
// (whole vectors readable); d gets dS·scale = P ⊙ (dP − rowsum(dP ⊙ P))·scale, zeros after seen up to TP
void softmax_backward_row(float* d, const float* p, int64_t seen, int64_t TP, float scale) {
  const int64_t n = padded(seen);
  vec acc = vec{};
  for (int64_t j = 0; j < n; j += VL) acc += seen_lanes(j, seen) ? load(p + j) * load(d + j) : vec{};
  const float rs = lanes_sum(acc);
  for (int64_t j = 0; j < n; j += VL)
    store(d + j, seen_lanes(j, seen) ? load(p + j) * (load(d + j) - rs) * scale : vec{});
  std::fill(d + n, d + TP, 0.f);  // (read by the blocks of rows that see further)
}

at::Tensor float_rows(const at::Tensor& t, const char* name) {  // fp32 on CPU, each row contiguous
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "attnlab::short_attention: ", name,
              " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() == 4, "attnlab::short_attention: ", name, " must be (B, heads, T, head dim), got ", t.sizes());
  return t.stride(3) == 1 ? t : t.contiguous();
}

void check_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(3) == k.size(3) && k.size(1) > 0 &&
                  q.size(1) % k.size(1) == 0 && k.size(2) > 0,
              "attnlab::short_attention: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(),
              ": expected q (B, h, Tq, hd), k and v (B, kv, Tk, hd), h a multiple of kv, Tk > 0");
}

// q (B, h, Tq, hd), k and v (B, kv, Tk, hd), any strides; bias additive, broadcastable to (B, h, Tq, Tk)
// → (the output (B, h, Tq, hd) in (B, Tq, h, hd) memory, the probabilities (B, h, Tq, Tk) for the backward)
std::tuple<at::Tensor, at::Tensor> short_attention(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                                   const c10::optional<at::Tensor>& bias_, double scale_, bool causal) {
  const at::Tensor q = float_rows(q_, "q"), k = float_rows(k_, "k"), v = float_rows(v_, "v");
  check_shapes(q, k, v);
  const int64_t B = q.size(0), h = q.size(1), Tq = q.size(2), hd = q.size(3), kv = k.size(1), Tk = k.size(2);
  const int64_t g = h / kv, TP = padded(Tk), HP = padded(hd), off = Tk - Tq;
  const float scale = static_cast<float>(scale_);
  at::Tensor bias;
  if (bias_.has_value() && bias_->defined()) {
    TORCH_CHECK(bias_->scalar_type() == at::kFloat, "attnlab::short_attention: bias must be float32, got ",
                bias_->scalar_type());
    bias = bias_->expand({B, h, Tq, Tk});  // (a view: broadcast axes keep stride 0)
  }
  at::Tensor out = at::empty({B, Tq, h, hd}, q.options());
  const int64_t PS = probs_stride(Tk);
  at::Tensor probs = at::empty({B, h, Tq, PS}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float *op = out.data_ptr<float>(), *pp = probs.data_ptr<float>();
  at::parallel_for(0, B * kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt(hd * TP), vbuf(hd == HP ? 0 : Tk * HP), O(hd == HP ? 0 : Tq * HP), m(Tq);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv, c = task % kv;
      transposed(kp + b * k.stride(0) + c * k.stride(1), k.stride(2), Tk, hd, TP, kt.data());  // Kᵀ (hd, TP)
      int64_t sv;
      const float* vr = rows_of(vp + b * v.stride(0) + c * v.stride(1), v.stride(2), Tk, hd, HP, vbuf.data(), &sv);
      for (int64_t r = 0; r < g; ++r) {
        const int64_t head = c * g + r;
        const float* qh = qp + b * q.stride(0) + head * q.stride(1);
        float* ph = pp + (b * h + head) * Tq * PS;  // (Tq, PS)
        run({Tq, TP, hd, qh, q.stride(2), 1, kt.data(), TP, ph, PS, false, causal ? KEYS_IN_N : NONE, off});  // S
        const float* bh = bp ? bp + b * bias.stride(0) + head * bias.stride(1) : nullptr;
        const auto seen = [&](int64_t i) { return seen_keys(i, causal, Tk, off); };
        softmax_rows(ph, PS, Tq, seen, Tk, scale, bh, bp ? bias.stride(2) : 0, bp ? bias.stride(3) : 0, m.data());
        float* oh = op + (b * Tq * h + head) * hd;  // row i at oh + i·h·hd
        float* dst = hd == HP ? oh : O.data();
        const int64_t sd = hd == HP ? h * hd : HP;
        run({Tq, HP, Tk, ph, PS, 1, vr, sv, dst, sd, false, causal ? KEYS_IN_K : NONE, off});  // O = P·V
        if (hd != HP)
          for (int64_t i = 0; i < Tq; ++i) std::memcpy(oh + i * h * hd, O.data() + i * HP, hd * sizeof(float));
      }
    }
  });
  return {out.transpose(1, 2), probs.narrow(3, 0, Tk)};
}

// Where the backward writes a gradient: element (b, row, head, d) at base + b·batch + row·row_stride + head·hd + d
struct GradMemory {
  float* base;
  int64_t batch, row_stride;
};

// dq, dk, dv of (q, k, v) into the memory given (dk and dv with one row stride)
void backward_into(const at::Tensor& grad_out_, const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                   const at::Tensor& probs_, double scale_, bool causal, GradMemory gq, GradMemory gk, GradMemory gv) {
  const at::Tensor q = float_rows(q_, "q"), k = float_rows(k_, "k"), v = float_rows(v_, "v");
  const at::Tensor go = float_rows(grad_out_, "grad_out");
  check_shapes(q, k, v);
  const int64_t B = q.size(0), h = q.size(1), Tq = q.size(2), hd = q.size(3), kv = k.size(1), Tk = k.size(2);
  TORCH_CHECK(go.sizes() == q.sizes() && probs_.sizes() == at::IntArrayRef({B, h, Tq, Tk}) &&
                  probs_.scalar_type() == at::kFloat,
              "attnlab::short_attention_backward: grad_out ", go.sizes(), " and probs ", probs_.sizes(),
              " do not match q ", q.sizes(), " and k ", k.sizes());
  const int64_t g = h / kv, TP = padded(Tk), HP = padded(hd), off = Tk - Tq;
  const float scale = static_cast<float>(scale_);
  at::Tensor probs = probs_;  // the forward's, whole vectors readable after each row; any other layout copied
  if (!whole_vector_rows(probs, TP)) {
    probs = at::zeros({B, h, Tq, probs_stride(Tk)}, probs_.options());
    probs.narrow(3, 0, Tk).copy_(probs_);
  }
  const int64_t PS = probs.stride(2);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = go.data_ptr<float>(), *pp = probs.data_ptr<float>();
  const bool pad = hd != HP;
  at::parallel_for(0, B * kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> vt(hd * TP), kbuf(pad ? Tk * HP : 0), qbuf(pad ? Tq * HP : 0), gbuf(pad ? Tq * HP : 0),
        D(Tq * TP), dQ(pad ? Tq * HP : 0), dK(pad ? Tk * HP : 0), dV(pad ? Tk * HP : 0);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv, c = task % kv;
      int64_t sk, sq, sg;
      const float* kr = rows_of(kp + b * k.stride(0) + c * k.stride(1), k.stride(2), Tk, hd, HP, kbuf.data(), &sk);
      transposed(vp + b * v.stride(0) + c * v.stride(1), v.stride(2), Tk, hd, TP, vt.data());  // Vᵀ (hd, TP)
      float* dkh = gk.base + b * gk.batch + c * hd;  // (row j at dkh + j·row_stride)
      float* dvh = gv.base + b * gv.batch + c * hd;
      for (int64_t r = 0; r < g; ++r) {
        const int64_t head = c * g + r;
        const float* gh = gp + b * go.stride(0) + head * go.stride(1);
        const float* qr = rows_of(qp + b * q.stride(0) + head * q.stride(1), q.stride(2), Tq, hd, HP, qbuf.data(), &sq);
        const float* gr = rows_of(gh, go.stride(2), Tq, hd, HP, gbuf.data(), &sg);
        const float* ph = pp + (b * h + head) * Tq * PS;  // (Tq, PS)
        run({Tq, TP, hd, gh, go.stride(2), 1, vt.data(), TP, D.data(), TP, false, causal ? KEYS_IN_N : NONE, off});  // dP
        for (int64_t i = 0; i < Tq; ++i) {
          softmax_backward_row(D.data() + i * TP, ph + i * PS, seen_keys(i, causal, Tk, off), TP, scale);
        }
        const Skip queries = causal ? QUERIES_IN_K : NONE, keys = causal ? KEYS_IN_K : NONE;
        // dV (+)= Pᵀ·dO and dK (+)= dSᵀ·Q·scale, straight into dk and dv's (B, Tk, kv, hd) memory where the head size
        // is whole vectors
        const int64_t sdk = pad ? HP : gk.row_stride, sdv = pad ? HP : gv.row_stride;
        run({Tk, HP, Tq, ph, 1, PS, gr, sg, pad ? dV.data() : dvh, sdv, r > 0, queries, off});
        run({Tk, HP, Tq, D.data(), 1, TP, qr, sq, pad ? dK.data() : dkh, sdk, r > 0, queries, off});
        float* dqh = gq.base + b * gq.batch + head * hd;  // row i at dqh + i·row_stride
        run({Tq, HP, Tk, D.data(), TP, 1, kr, sk, pad ? dQ.data() : dqh, pad ? HP : gq.row_stride, false, keys, off});  // dQ
        if (pad)
          for (int64_t i = 0; i < Tq; ++i) std::memcpy(dqh + i * gq.row_stride, dQ.data() + i * HP, hd * sizeof(float));
      }
      for (int64_t j = 0; pad && j < Tk; ++j) {
        std::memcpy(dkh + j * gk.row_stride, dK.data() + j * HP, hd * sizeof(float));
        std::memcpy(dvh + j * gv.row_stride, dV.data() + j * HP, hd * sizeof(float));
      }
    }
  });
}

// → (dq, dk, dv): (B, h, Tq, hd) in (B, Tq, h, hd) memory and (B, kv, Tk, hd) in (B, Tk, kv, hd) memory
std::tuple<at::Tensor, at::Tensor, at::Tensor> short_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
    const at::Tensor& probs, double scale, bool causal) {
  const at::Tensor q = float_rows(q_, "q"), k = float_rows(k_, "k"), v = float_rows(v_, "v");
  check_shapes(q, k, v);
  const int64_t B = q.size(0), h = q.size(1), Tq = q.size(2), hd = q.size(3), kv = k.size(1), Tk = k.size(2);
  at::Tensor dq = at::empty({B, Tq, h, hd}, q.options());
  at::Tensor dk = at::empty({B, Tk, kv, hd}, q.options());
  at::Tensor dv = at::empty({B, Tk, kv, hd}, q.options());
  backward_into(grad_out, q, k, v, probs, scale, causal, {dq.data_ptr<float>(), Tq * h * hd, h * hd},
                {dk.data_ptr<float>(), Tk * kv * hd, kv * hd}, {dv.data_ptr<float>(), Tk * kv * hd, kv * hd});
  return {dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)};
}

// Self-attention over one fused projection qkv (B, T, (h + 2·kv)·hd), its q, k, v the heads of its three column
// blocks → the output (B, T, h·hd), the heads merged, with its autograd here: the gradient is one (B, T, (h + 2·kv)·hd)
// tensor that the backward writes dq, dk and dv into, where ShortAttention's path returns three for the split's
// backward to concatenate, behind a dozen view and transpose nodes and a Python autograd function (nanoGPT's update
// 1.034x faster so, docs/results.md, thirty-second #13 session). Under create_graph the backward takes differentiable
// ops, so a second derivative is right (ShortAttention refuses one).
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::tuple<at::Tensor, at::Tensor, at::Tensor> heads_of(const at::Tensor& qkv, int64_t h, int64_t kv) {
  const int64_t B = qkv.size(0), T = qkv.size(1), hd = qkv.size(2) / (h + 2 * kv);
  return {qkv.narrow(2, 0, h * hd).view({B, T, h, hd}).transpose(1, 2),  // (B, h, T, hd)
          qkv.narrow(2, h * hd, kv * hd).view({B, T, kv, hd}).transpose(1, 2),  // (B, kv, T, hd)
          qkv.narrow(2, (h + kv) * hd, kv * hd).view({B, T, kv, hd}).transpose(1, 2)};
}

// qkv's gradient (B, T, (h + 2·kv)·hd) from the output's (B, T, h·hd): dq, dk, dv written into their column blocks
at::Tensor packed_attention_backward(const at::Tensor& grad, const at::Tensor& qkv, const at::Tensor& probs,
                                     int64_t h, int64_t kv, double scale, bool causal) {
  TORCH_CHECK(qkv.dim() == 3 && h > 0 && kv > 0 && h % kv == 0 && qkv.size(2) % (h + 2 * kv) == 0 &&
                  grad.dim() == 3 && grad.size(0) == qkv.size(0) && grad.size(1) == qkv.size(1) &&
                  grad.size(2) == h * (qkv.size(2) / (h + 2 * kv)),
              "attnlab::packed_attention_backward: qkv (B, T, (h + 2·kv)·hd) and grad (B, T, h·hd) are expected, got ",
              qkv.sizes(), " and ", grad.sizes(), " for h ", h, " and kv ", kv);
  const int64_t B = qkv.size(0), T = qkv.size(1), W = qkv.size(2), hd = W / (h + 2 * kv);
  const auto [q, k, v] = heads_of(qkv, h, kv);
  const at::Tensor go = grad.reshape({B, T, h, hd}).transpose(1, 2);  // (B, h, T, hd)
  at::Tensor dqkv = at::empty({B, T, W}, qkv.options());
  float* d = dqkv.data_ptr<float>();
  backward_into(go, q, k, v, probs, scale, causal, {d, T * W, W}, {d + h * hd, T * W, W},
                {d + (h + kv) * hd, T * W, W});
  return dqkv;
}

// The autograd function calls the two kernels through the dispatcher, so that fake tensors (tracing) take their
// shape functions (attnlab.model.attention registers them)
struct PackedSelfAttention : public torch::autograd::Function<PackedSelfAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& qkv, int64_t h, int64_t kv, double scale,
                            bool causal) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("attnlab::short_attention", "")
                               .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                          const at::Tensor&,
                                                                          const std::optional<at::Tensor>&, double, bool)>();
    const auto [q, k, v] = heads_of(qkv, h, kv);
    const auto [out, probs] = op.call(q, k, v, std::nullopt, scale, causal);
    ctx->save_for_backward({qkv, probs});
    ctx->saved_data["h"] = h;
    ctx->saved_data["kv"] = kv;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["causal"] = causal;
    return out.transpose(1, 2).reshape({qkv.size(0), qkv.size(1), h * q.size(3)});  // (B, T, h·hd): a view here
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("attnlab::packed_attention_backward", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                                 int64_t, double, bool)>();
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &qkv = saved[0], &probs = saved[1];
    const variable_list none = {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    if (!grads[0].defined()) return {at::Tensor(), none[0], none[1], none[2], none[3]};
    const int64_t h = ctx->saved_data["h"].toInt(), kv = ctx->saved_data["kv"].toInt();
    const double scale = ctx->saved_data["scale"].toDouble();
    const bool causal = ctx->saved_data["causal"].toBool();
    if (at::GradMode::is_enabled()) {  // create_graph (a double backward): the gradient of the same attention in
      // differentiable ops, so that its own gradient is right; taken at an alias of qkv, so that qkv's own hooks run
      // once, when the outer backward reaches it
      const at::Tensor alias = qkv.view_as(qkv);
      const at::Tensor again = differentiable_attention(alias, h, kv, scale, causal);
      return {torch::autograd::grad({again}, {alias}, {grads[0]}, true, true)[0], none[0], none[1], none[2], none[3]};
    }
    return {op.call(grads[0], qkv, probs, h, kv, scale, causal), none[0], none[1], none[2], none[3]};
  }

  // softmax(QKᵀ·scale (causal: keys after the query hidden))·V in plain ATen ops, (B, T, h·hd)
  static at::Tensor differentiable_attention(const at::Tensor& qkv, int64_t h, int64_t kv, double scale, bool causal) {
    const auto [q, k, v] = heads_of(qkv, h, kv);
    const int64_t B = qkv.size(0), T = qkv.size(1), hd = q.size(3);
    at::Tensor s = at::matmul(q, k.repeat_interleave(h / kv, 1).transpose(-1, -2)) * scale;  // (B, h, T, T)
    if (causal) s = s.masked_fill(at::ones({T, T}, qkv.options().dtype(at::kBool)).triu(1), -INFINITY);
    return at::matmul(at::softmax(s, -1), v.repeat_interleave(h / kv, 1)).transpose(1, 2).reshape({B, T, h * hd});
  }
};

at::Tensor packed_self_attention(const at::Tensor& qkv_, int64_t h, int64_t kv, double scale, bool causal) {
  TORCH_CHECK(qkv_.dim() == 3 && h > 0 && kv > 0 && h % kv == 0 && qkv_.size(2) % (h + 2 * kv) == 0,
              "attnlab::packed_self_attention: qkv (B, T, (h + 2·kv)·hd) with h a multiple of kv is expected, got ",
              qkv_.sizes(), " for h ", h, " and kv ", kv);
  const at::Tensor qkv = qkv_.stride(2) == 1 ? qkv_ : qkv_.contiguous();  // (each head's rows contiguous)
  return PackedSelfAttention::apply(qkv, h, kv, scale, causal);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attnlab, m) {
  m.def("short_attention(Tensor q, Tensor k, Tensor v, Tensor? bias, float scale, bool causal) -> (Tensor, Tensor)");
  m.def("short_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor probs, float scale, "
        "bool causal) -> (Tensor, Tensor, Tensor)");
  m.def("packed_self_attention(Tensor qkv, int heads, int kv_heads, float scale, bool causal) -> Tensor");
  m.def("packed_attention_backward(Tensor grad, Tensor qkv, Tensor probs, int heads, int kv_heads, float scale, "
        "bool causal) -> Tensor");
}
TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("short_attention", &short_attention);
  m.impl("short_attention_backward", &short_attention_backward);
  m.impl("packed_attention_backward", &packed_attention_backward);
}
TORCH_LIBRARY_IMPL(attnlab, CompositeImplicitAutograd, m) {
  m.impl("packed_self_attention", &packed_self_attention);
}
