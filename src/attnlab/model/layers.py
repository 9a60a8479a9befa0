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
    draws one random number per element (bernoulli_, ~3–6 ns each: 17 of them were 10% of a
    Marian training step in bf16). Here one 64-bit draw of torch's generator (so seeds and
    resumed runs stay reproducible) gives four 16-bit uniforms: p is rounded to a multiple of
    1/65536 (0.1 → 0.100006) and the kept values are scaled by 1/(1 − that p), so the expected
    value is unchanged. One comparison makes the mask (15-bit lanes needed a mask-and first), and
    the mask multiplies: the old mask with ``masked_fill``, forward and backward, took 1.1–1.7× as
    long on a (64, 24, 256) activation (2 threads)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x  # (no F.dropout call: a decoding step passes ~90 of these)
        dropped = round(self.p * 65536)
        if dropped == 65536 or x.device.type != "cpu":  # (p within 1/131072 of 1 rounds to all dropped)
            return super().forward(x)
        n = x.numel()
        draws = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_(-2 ** 63, None)  # 64 random bits
        lanes = draws.view(torch.int16)[:n].view(x.shape)  # 4 lanes, each uniform on [-32768, 32767]
        keep = lanes >= dropped - 32768  # (bool: the 1-byte mask is what autograd keeps)
        return (x * keep).mul_(65536 / (65536 - dropped))


def make_norm(cfg: TransformerConfig) -> nn.Module:
    """LayerNorm normalises each position over its features (not over the batch, unlike
    BatchNorm), so padding and batch composition never change a token's result."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's "gelu_new"
    "silu": F.silu,
    "swiglu": F.silu,  # gate activation of the GLU variants
    "geglu": F.gelu,
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
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


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
