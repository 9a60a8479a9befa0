"""Norms, the position-wise feed-forward network, residual wiring, and the two layer types.

Every layer keeps the shape (batch, seq, d_model): that is what lets layers stack.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import TransformerConfig
from .attention import KVCache, MultiHeadAttention


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · g — LayerNorm without the mean subtraction and the bias
    (Zhang & Sennrich 2019; T5, Llama). Computed in fp32 for stability, returned in x's dtype."""

    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


class Dropout(nn.Dropout):
    """Inverted dropout: zero each value with probability p and scale the rest by 1/(1-p) while
    training, so inference needs no rescaling. nn.Dropout everywhere but on CPU, where PyTorch
    draws one random number per element, serially (bernoulli_, ~3–6 ns each: 17 of them were 10% of
    a Marian training step in bf16). p is rounded to a multiple of 1/65536 (0.1 → 0.100006) and the
    kept values are scaled by 1/(1 − that p), so the expected value is unchanged.

    On CPU, where attnlab's kernel builds (``csrc/dropout.cpp``, :func:`fused_dropout`): one pass, the
    16 random bits of each element a hash of its index and a seed drawn from torch's generator (one
    draw per call, so seeds and resumed runs stay reproducible), the backward the same function of the
    gradient, no mask stored. Forward + backward of a (64, 24, 256) fp32 activation (2 threads): ~0.2
    ms, against ~1.1 for the torch path below. Elsewhere (no compiler, not Linux,
    ``ATTNLAB_OWN_KERNELS=0``) that torch path: one 64-bit draw of torch's generator per four elements,
    four 16-bit uniforms, one comparison, a ``torch.where`` (its masks are not the kernel's: a seed gives
    one run per path). Both make NaN and inf in dropped positions 0, where nn.Dropout's NaN·0 keeps NaN.

    Under ``torch.compile`` (``attnlab train --compile``) the torch path, whose draw is a graph break:
    dynamo does not trace ``random_``. Kept so on purpose: letting inductor make the masks itself
    (``F.dropout`` in the graph, no break) was slower, its per-element CPU generator costing more than
    the breaks (Marian d256 step, fp32, 2 threads, before the kernel: 551 ms against 465 with the
    breaks, eager 474; eager with the kernel: 446)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x  # (no F.dropout call: a decoding step passes ~90 of these)
        dropped = round(self.p * 65536)
        if dropped == 65536 or x.device.type != "cpu":  # (p within 1/131072 of 1 rounds to all dropped)
            return super().forward(x)
        if x.dtype in _KERNEL_DTYPES and fused_dropout():
            return _FusedDropout.apply(x, _seed(), dropped)
        n = x.numel()
        draws = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_(-2 ** 63, None)
        lanes = draws.view(torch.int16)[:n].view(x.shape)  # 4 lanes per draw, each uniform on [-32768, 32767]
        keep = lanes >= dropped - 32768  # (bool: the 1-byte mask is what autograd keeps)
        return torch.where(keep, x * (65536 / (65536 - dropped)), 0.0)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + dropout(x), the residual connection. With the kernel, one pass (``attnlab::dropout_add``:
        bit for bit the kernel's dropout, a cast and an add), where those were three, each a full read and
        write of an activation, memory-bound on CPU (forward + backward of a Marian d512 step in bf16: ~1%)."""
        if not self.training or self.p == 0.0:
            return _residual_add(residual, x)
        dropped = round(self.p * 65536)
        if (0 < dropped < 65536 and x.device.type == "cpu" and residual.shape == x.shape
                and x.dtype in _KERNEL_DTYPES and residual.dtype in _KERNEL_DTYPES
                and torch.promote_types(x.dtype, residual.dtype) == residual.dtype and fused_dropout()):
            return _FusedDropoutAdd.apply(x, residual, _seed(), dropped)
        return _residual_add(residual, self(x))


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _seed() -> int:
    """64 random bits from torch's CPU generator: the kernels' seed, one draw per call."""
    return int(torch.empty((), dtype=torch.int64, device="cpu").random_(-2 ** 63, None))


class _FusedDropout(torch.autograd.Function):
    """``attnlab::dropout``: y = keep ⊙ x · scale with keep a function of (seed, element index), so the
    gradient is the same function of dy (and its gradient again: any order), and so is a forward-mode
    tangent."""

    @staticmethod
    def forward(x, seed: int, dropped: int):
        return torch.ops.attnlab.dropout(x, seed, dropped, 65536 / (65536 - dropped))

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.seed, ctx.dropped = inputs

    @staticmethod
    def backward(ctx, grad):
        return _FusedDropout.apply(grad, ctx.seed, ctx.dropped), None, None

    @staticmethod
    def jvp(ctx, x_t, *_):
        return _FusedDropout.apply(x_t, ctx.seed, ctx.dropped)


class _FusedDropoutAdd(torch.autograd.Function):
    """``attnlab::dropout_add``: residual + keep ⊙ x · scale, in the residual's dtype. The residual's
    gradient is dy; x's is the dropout of dy cast to x's dtype (as the cast and the add it replaces)."""

    @staticmethod
    def forward(x, residual, seed: int, dropped: int):
        return torch.ops.attnlab.dropout_add(x, residual, seed, dropped, 65536 / (65536 - dropped))

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, residual, ctx.seed, ctx.dropped = inputs
        ctx.x_dtype, ctx.out_dtype = x.dtype, residual.dtype

    @staticmethod
    def backward(ctx, grad):
        dx = _FusedDropout.apply(grad.to(ctx.x_dtype), ctx.seed, ctx.dropped) if ctx.needs_input_grad[0] else None
        return dx, grad if ctx.needs_input_grad[1] else None, None, None

    @staticmethod
    def jvp(ctx, x_t, residual_t, *_):
        x_t = None if x_t is None else _FusedDropout.apply(x_t, ctx.seed, ctx.dropped).to(ctx.out_dtype)
        return x_t if residual_t is None else residual_t if x_t is None else residual_t + x_t


_FUSED: dict = {}  # "ok" → whether attnlab::dropout is built and right here (once per process)


def fused_dropout() -> bool:
    """Whether :class:`Dropout` takes attnlab's kernel on CPU: not while torch.compile or torch.jit traces (a
    traced seed would be a constant), and where ``accel.own_kernel_serves`` says so (not
    ``ATTNLAB_OWN_KERNELS=0``, Linux, built once per process for this CPU's vector extensions, and right on a
    check)."""
    from .. import accel
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    return accel.own_kernel_serves(_FUSED, _build_fused_dropout)


def _build_fused_dropout() -> bool:
    def check():
        one = torch.ones(4096, dtype=torch.float32, device="cpu")
        y = torch.ops.attnlab.dropout(one, 12345, 32768, 2.0)  # p = 1/2
        ok = bool(((y == 0) | (y == 2)).all()) and 1800 < int((y == 2).sum()) < 2300
        return ok and torch.equal(torch.ops.attnlab.dropout_add(one, one, 12345, 32768, 2.0), y + 1)

    def dropout(x, seed, dropped, scale):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    def dropout_add(x, residual, seed, dropped, scale):
        return torch.empty_like(residual, memory_format=torch.contiguous_format)

    from .. import accel
    suffix, cflags = accel.own_kernel_target()
    return _own_kernel("dropout kernel", "torch's operations", "attnlab_dropout" + suffix, "dropout.cpp", cflags,
                       {"dropout": dropout, "dropout_add": dropout_add}, check)


def _own_kernel(what: str, instead: str, library: str, source: str, cflags: list[str], fakes: dict, check) -> bool:
    """Whether attnlab's own CPU kernel ``what`` serves here: ``csrc/<source>`` built (or loaded from torch's
    extension cache) as ``library`` with ``cflags`` (``accel.build_torch_ops``), its operators' shape functions
    (``fakes``: name → function, for tracing and fake tensors) registered the first time, and ``check()`` true.
    Otherwise False, said once (no compiler or ninja, a failed build, wrong results), and ``instead`` serves."""
    from .. import accel
    first_op = next(iter(fakes))
    try:
        loaded = hasattr(torch.ops.attnlab, first_op)
        why_not = accel.build_torch_ops(library, source, cflags, first_op)
        if why_not:
            accel._once(f"{source}-tools", f"attnlab's {what}: {why_not}; {instead} instead")
            return False
        if not loaded:
            for name, fake in fakes.items():
                torch.library.register_fake(f"attnlab::{name}")(fake)
        ok = check()
    except Exception as e:  # a compiler that cannot build it, a failed load
        accel._once(f"{source}-build", f"attnlab's {what} did not build ({str(e).strip().splitlines()[:2]}): "
                    f"{instead} instead")
        return False
    if not ok:
        accel._once(f"{source}-wrong", f"attnlab's {what} gives wrong results here: {instead} instead")
    return ok


def make_norm(cfg: TransformerConfig) -> nn.Module:
    """LayerNorm normalises each position over its features (not over the batch, unlike
    BatchNorm), so padding and batch composition never change a token's result."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU(x) = x·Φ(x), exact (Φ through erf): ``F.gelu``, but while training on CPU in fp32 where attnlab's
    kernel builds (``csrc/gelu.cpp``, :func:`fused_gelu`), one pass that computes GELU(x) and its slope
    Φ(x) + x·φ(x) from one exp and keeps the slope for the backward in place of x: the backward is then one
    multiply, where PyTorch's ``gelu_backward`` computes erf and exp again over the FFN's widest activation.
    Equal to ``F.gelu`` and its gradient to ~1e-6 (tests/test_pitfalls.py, against float64). Eager autograd
    only (not under ``torch.compile``, which fuses ``F.gelu`` itself, ``torch.jit`` tracing, ``torch.func``
    transforms or forward-mode AD), and no second derivative: x is not kept."""
    from .. import accel
    if (x.dtype == torch.float32 and x.device.type == "cpu" and x.requires_grad and torch.is_grad_enabled()
            and x.is_contiguous()  # (a view, such as a GLU's gate, would cost a copy and a slope kept beside it)
            and accel.eager_autograd() and fused_gelu()):
        return torch.ops.attnlab.gelu_training(x)  # (its autograd in C++: the slope kept, the backward one multiply)
    return F.gelu(x)


_GELU: dict = {}  # "ok" → whether attnlab::gelu_and_slope is built and right here (once per process)


def fused_gelu() -> bool:
    """Whether :func:`gelu` takes attnlab's kernel (``csrc/gelu.cpp``): as ``accel.own_kernel_serves`` says
    (not ``ATTNLAB_OWN_KERNELS=0``, Linux, built once per process for this CPU's vector extensions, and right
    on a check)."""
    from .. import accel
    return accel.own_kernel_serves(_GELU, _build_fused_gelu)


def _build_fused_gelu() -> bool:
    def check():
        # against the closed forms in float64, not through autograd: the first call may come from inside a forward
        # that saved-tensor hooks watch (torch.utils.checkpoint), or under no_grad
        x = torch.linspace(-10, 10, 4001, dtype=torch.float32, device="cpu")  # (whatever the process's defaults)
        out, slope = torch.ops.attnlab.gelu_and_slope(x)
        x64 = x.double()
        cdf = 0.5 * (1 + torch.erf(x64 / 2 ** 0.5))
        return bool(torch.allclose(out.double(), x64 * cdf, rtol=1e-5, atol=2e-6)
                    and torch.allclose(slope.double(), cdf + x64 * torch.exp(-x64 * x64 / 2) / (2 * torch.pi) ** 0.5,
                                       rtol=1e-5, atol=2e-6))

    def gelu_and_slope(h):
        return (torch.empty_like(h, memory_format=torch.contiguous_format),
                torch.empty_like(h, memory_format=torch.contiguous_format))

    from .. import accel
    suffix, cflags = accel.own_kernel_target(fma=True)
    return _own_kernel("GELU kernel", "F.gelu", "attnlab_gelu" + suffix, "gelu.cpp", cflags,
                       {"gelu_and_slope": gelu_and_slope}, check)


ACTIVATIONS = {
    "relu": F.relu,
    "gelu": gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's "gelu_new"
    "silu": F.silu,
    "swiglu": F.silu,  # gate activation of the GLU variants
    "geglu": F.gelu,  # (the gate is a view of the fused projection: gelu would copy it)
    "geglu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # T5 v1.1's gated-GELU ("gelu_new")
}


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = act(x·W1 + b1)·W2 + b2, applied to each position independently.

    d_ff = 4·d_model in the paper (512 → 2048). The GLU variants (SwiGLU in Llama) multiply an
    activated gate with a linear "up" projection: act(x·W_gate) ⊙ (x·W_up), then W_down. Gate and
    up are one fused matrix here ([gate; up] along the output dimension).
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", bias: bool = True,
                 dropout: float = 0.0):
        super().__init__()
        self.glu = activation in ("swiglu", "geglu", "geglu_tanh")
        self.act = ACTIVATIONS[activation]
        self.w_in = nn.Linear(d_model, 2 * d_ff if self.glu else d_ff, bias=bias)
        self.w_out = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w_in(x)  # (B, T, d_ff or 2·d_ff)
        if self.glu:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return self.w_out(self.dropout(h))


class SublayerConnection(nn.Module):
    """The residual connection around each sublayer, with the norm in one of two places.

    Post-Norm (the paper): LayerNorm(x + Dropout(Sublayer(x))).
    Pre-Norm (GPT-2, Llama): x + Dropout(Sublayer(LayerNorm(x))) — the residual stream is never
    normalised, gradients flow straight through it, so deep stacks train without careful warmup;
    the stack then needs a final norm.
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.norm = make_norm(cfg)
        self.dropout = Dropout(cfg.dropout)
        self.pre_norm = cfg.norm_placement == "pre"

    def forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        if self.pre_norm:
            return self._add(x, sublayer(self.norm(x)))
        return self.norm(self._add(x, sublayer(x)))

    def _add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x + Dropout(y) (in one pass where Dropout.add_to can; any other module put in self.dropout is called)."""
        drop = self.dropout
        return drop.add_to(x, y) if type(drop) is Dropout else _residual_add(x, drop(y))


def _residual_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y. Under autocast the residual stream stays fp32 while the sublayer returns bf16/fp16;
    PyTorch's CPU add of two dtypes casts element by element inside its loop, ~2.5x slower than one
    vectorised cast first (0.163 against 0.064 ms on a (32, 32, 512) activation, 2 threads)."""
    if x.dtype != y.dtype and x.device.type == "cpu":
        dtype = torch.promote_types(x.dtype, y.dtype)
        x, y = x.to(dtype), y.to(dtype)
    return x + y


def _attention(cfg: TransformerConfig, cross: bool = False) -> MultiHeadAttention:
    return MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.kv_heads, bias=cfg.bias,
                              dropout=cfg.attention_dropout, cross=cross,
                              scale=None if cfg.attention_scale else 1.0)


def _ffn(cfg: TransformerConfig) -> PositionwiseFeedForward:
    return PositionwiseFeedForward(cfg.d_model, cfg.d_ff, cfg.activation, cfg.bias,
                                   cfg.activation_dropout)


class EncoderLayer(nn.Module):
    """Self-attention (every position sees every non-padding position) → FFN."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.self_attn = _attention(cfg)
        self.feed_forward = _ffn(cfg)
        self.attn_residual = SublayerConnection(cfg)
        self.ffn_residual = SublayerConnection(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *,
                rope=None, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = self.attn_residual(x, lambda y: self.self_attn(y, mask=mask, rope=rope, bias=bias))
        return self.ffn_residual(x, self.feed_forward)


class DecoderLayer(nn.Module):
    """Masked (causal) self-attention → cross-attention over the encoder output → FFN.

    In cross-attention the queries come from the decoder and the keys/values from the encoder
    output ("memory"). A decoder-only model (GPT, Llama) is this layer without cross-attention.
    """

    def __init__(self, cfg: TransformerConfig, cross_attention: bool = True):
        super().__init__()
        self.self_attn = _attention(cfg)
        self.attn_residual = SublayerConnection(cfg)
        self.cross_attn = _attention(cfg, cross=True) if cross_attention else None
        self.cross_residual = SublayerConnection(cfg) if cross_attention else None
        self.feed_forward = _ffn(cfg)
        self.ffn_residual = SublayerConnection(cfg)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None, *,
                mask: torch.Tensor | None = None, is_causal: bool = False,
                memory_mask: torch.Tensor | None = None, rope=None,
                bias: torch.Tensor | None = None,
                cache: tuple[KVCache, KVCache | None] | None = None, segments=None) -> torch.Tensor:
        """``segments`` (decoder-only): a packed forward, see ``MultiHeadAttention``."""
        self_cache, cross_cache = cache if cache is not None else (None, None)
        x = self.attn_residual(x, lambda y: self.self_attn(
            y, mask=mask, is_causal=is_causal, rope=rope, bias=bias, cache=self_cache, segments=segments))
        if self.cross_attn is not None:
            x = self.cross_residual(x, lambda y: self.cross_attn(
                y, memory, mask=memory_mask, cache=cross_cache))
        return self.ffn_residual(x, self.feed_forward)
