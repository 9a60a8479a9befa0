"""Scaled dot-product attention, masks, the multi-head attention module and its KV cache.

Mask convention (one for the whole library, the same as ``torch.nn.functional.
scaled_dot_product_attention``'s boolean ``attn_mask``): a **boolean tensor, True = this query may
attend to this key**, broadcastable to (batch, heads, query_len, key_len). Masks combine with
logical AND. A query row whose keys are *all* masked (e.g. a left-padding position of a
decoder-only batch under the causal mask) outputs exactly zeros, never NaN.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .embedding import apply_rotary

# -- masks ----------------------------------------------------------------------------------------


def padding_mask(key_is_token: torch.Tensor) -> torch.Tensor:
    """(B, Tk) bool, True for real tokens → (B, 1, 1, Tk): padding keys get no attention.

    Cross-attention uses the *source* padding mask and no causal mask."""
    return key_is_token.bool()[:, None, None, :]


def causal_mask(q_len: int, k_len: int | None = None, device: torch.device | None = None) -> torch.Tensor:
    """(1, 1, Tq, Tk) bool: query i may see keys j ≤ i — the *lower* triangle, diagonal included.

    With k_len > q_len the queries are the last q_len positions (incremental decoding with a KV
    cache), so the triangle is shifted right by k_len - q_len."""
    k_len = q_len if k_len is None else k_len
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)[None, None]


def combine_masks(*masks: torch.Tensor | None) -> torch.Tensor | None:
    """Logical AND of the given masks (None = no restriction)."""
    out = None
    for m in masks:
        if m is not None:
            out = m if out is None else out & m
    return out


# -- the attention function -----------------------------------------------------------------------


def scaled_dot_product_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    mask: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
    is_causal: bool = False, dropout_p: float = 0.0, need_weights: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax(QKᵀ/√d_k + bias)·V with d_k the *per-head* dimension (``scale`` replaces 1/√d_k;
    T5 uses 1).

    q: (B, h, Tq, hd); k, v: (B, kv, Tk, hd) with h a multiple of kv (GQA/MQA: query head i uses
    key/value head i // (h/kv)). ``mask`` is boolean (True = attend); ``bias`` is added to the
    scores (ALiBi, T5's relative positions). The fast path is PyTorch's fused kernel; ``need_weights=True`` takes the
    explicit path that also returns the (B, h, Tq, Tk) attention weights.
    """
    h, kv = q.shape[1], k.shape[1]
    causal_keys = is_causal  # (ShortAttention's kernel skips the hidden keys, folded into the mask or not)
    if is_causal and (mask is not None or bias is not None or need_weights or q.shape[2] != k.shape[2]):
        # (with fewer queries than keys the queries are the last positions: causal_mask's alignment,
        # which PyTorch's is_causal, aligned top-left, does not follow)
        mask = combine_masks(mask, causal_mask(q.shape[2], k.shape[2], q.device))
        is_causal = False
    valid_rows = None
    if mask is not None:
        # A row with no allowed key would be softmax over all -inf = NaN. Let such rows attend
        # anywhere (finite), then zero their output below.
        valid_rows = mask.any(dim=-1, keepdim=True)  # (B|1, 1, Tq, 1)
        mask = mask | ~valid_rows
    out_dtype, fp32_kernel = q.dtype, False
    training_on_cpu = (q.device.type == "cpu" and torch.is_grad_enabled() and not need_weights
                       and (q.requires_grad or k.requires_grad or v.requires_grad))
    # Training on CPU with short keys: two batched matmuls and a softmax, forward and backward, beat
    # PyTorch's fused kernel (see ShortAttention); so does attnlab's fp32 kernel up to longer keys.
    short = training_on_cpu and not dropout_p and (
        k.shape[2] <= SHORT_KEYS or (k.shape[2] <= SHORT_KEYS_KERNEL and not (bias is not None and bias.requires_grad)
                                     and ShortAttention.kernel_serves(q, k, v)))
    if q.dtype == torch.bfloat16 and q.requires_grad and training_on_cpu and k.shape[2] <= 512 and not short:
        # Training in bf16 on CPU with more keys than ShortAttention takes: PyTorch's fused kernel
        # computes its backward ~4x slower in bf16 than in fp32 for short sequences (measured at
        # 12x4 heads, T 64, d 32: 5.7 vs 1.4 ms forward+backward; still slower at T 256, faster only
        # from ~1k keys). The projections around it stay in half precision; autocast, which would
        # cast the inputs back, is off for this one call. (ShortAttention takes half-precision
        # inputs as they are and computes in fp32 itself.)
        q, k, v, fp32_kernel = q.float(), k.float(), v.float(), True
    scores_dtype = ShortAttention.compute_dtype(q) if short else q.dtype
    attn_mask = mask
    if bias is not None:
        attn_mask = (bias if mask is None else bias.masked_fill(~mask, float("-inf"))).to(scores_dtype)

    if short:
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # ShortAttention adds its mask
            attn_mask = torch.zeros(attn_mask.shape, dtype=scores_dtype, device=q.device).masked_fill_(
                ~attn_mask, float("-inf"))
        with torch.autocast("cpu", enabled=False):
            out = ShortAttention.apply(q, k, v, attn_mask,
                                       1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, causal_keys)
        weights = None
    elif need_weights or (q.shape[2] == 1 and q.device.type == "cpu" and not dropout_p
                          and (q.shape[0] > 1 or q.dtype != torch.float32)):
        # The explicit path; also the faster one on CPU for one query per row (incremental
        # decoding) of a batch or in bf16, where the fused kernel's setup costs more than the three
        # small matmuls; a single fp32 row is the exception (measured: docs/results.md).
        weights, out = _explicit_attention(q, k, v, attn_mask, valid_rows, dropout_p, scale)
        if not need_weights:
            weights = None
    else:
        with torch.autocast("cpu", enabled=False) if fp32_kernel else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                 is_causal=is_causal, enable_gqa=h != kv, scale=scale)
        weights = None
    out = out.to(out_dtype)
    if valid_rows is not None:
        out = torch.where(valid_rows, out, 0.0)  # (keeps ShortAttention's layout, where masked_fill makes it contiguous)
    return out, weights


# Keys up to which ShortAttention replaces PyTorch's fused kernel while training on CPU. Measured by
# `python benchmarks/train_speed.py --shapes none --attention` (2 threads, AVX-512, fp32, self-attention
# forward + backward as the model runs it, warm; docs/results.md): in alternating turns the fused kernel over
# ShortAttention is 1.08x at 64 keys (nanoGPT's 12 x 4 heads, d 32), 1.12x for vit-mnist's 50 tokens, 0.69-0.96x
# at 24-32 keys with heads of 64, 0.78x at 128 (the torch path, before attnlab's kernel; for the kernel see
# SHORT_KEYS_KERNEL); inside the whole training step, where the data comes from memory, ShortAttention wins at
# 24-32 keys too (the fused kernel's step 1.010-1.016x longer). Under torch.compile the gap is larger: inductor
# fuses ShortAttention's softmax with the ops around it, where the fused kernel stays one opaque call.
SHORT_KEYS = 64
# Keys up to which ShortAttention serves where attnlab's fp32 kernel computes it (fp32 q, k and v, no gradient for a
# bias, the kernel built here). Measured by `python benchmarks/train_speed.py --shapes none --attention-keys
# 128,256,512` (2 threads, AVX-512; docs/results.md, twenty-eighth #13 session): the whole training update of
# nanoGPT's Shakespeare model (4 layers, 4 heads of 32, batch 12) with blocks of 128, 256 and 512 tokens ran 1.20x,
# 1.20x and 1.39x faster than on PyTorch's fused kernel (1.15x, 1.23x, 1.35x and 1.10x, 1.19x, 1.29x in two earlier
# runs), one of d 256 (4 heads of 64) 1.07x and 1.11x at 128 and 256 (ad hoc); the same command's encoder-decoder
# rows (the small step table's model, whose encoder self-attention and cross-attention are not causal) 1.05x, 1.07x
# and 1.17x at 128, 256 and 512 keys (thirtieth session). Not further: the kernel keeps the
# (B, h, Tq, Tk) probabilities for the backward where the fused kernel keeps one number a row: h·T floats a token
# against ~16·d for the rest of a pre-norm layer's saved activations (nanoGPT's model, counted), so at 256 keys a
# quarter more with heads of 64 and half as much again with heads of 32, and twice that at 512. (Under bf16
# autocast, where the torch path serves, nanoGPT's model ran 1.01x, 0.92x and 0.86x as fast at 128, 256 and 512 keys
# as on the fused kernel, 0.95x, 0.97x and 0.89x in an earlier run: that path keeps SHORT_KEYS.)
SHORT_KEYS_KERNEL = 256
# Head size from which ShortAttention's bf16 inputs take bf16 products (see ShortAttention.product_dtype). Measured
# by `train_speed.py --attention-products` and nanoGPT's step (docs/results.md, nineteenth #13 session).
BF16_PRODUCTS_MIN_HEAD_DIM = 64


def _assume_constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing torch._dynamo at import time: that import
    alone takes ~1.5 s, most of every ``attnlab`` command's start. The decorator only sets this attribute
    (torch/_dynamo/decorators.py); tests/test_cli.py checks that the mark still makes torch.compile take the
    function's result as a constant."""
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _cpu_bf16_native() -> bool:
    # a constant to torch.compile (it cannot trace the /proc/cpuinfo read behind it: a graph break there
    # would leave ShortAttention eager); eager calls ask each time (ATTNLAB_NO_BF16 may change)
    from ..accel import cpu_bf16_native
    return cpu_bf16_native()


class ShortAttention(torch.autograd.Function):
    """softmax(QKᵀ·scale + bias)·V with a hand-written backward, for training on CPU with short keys (up to
    ``SHORT_KEYS``; up to ``SHORT_KEYS_KERNEL`` where attnlab's fp32 kernel computes it).

    PyTorch's fused CPU kernel tiles for long sequences and recomputes the probabilities in its
    backward; with tens of keys its blocks are mostly overhead. Here the forward is two batched
    matmuls and a softmax and saves the probabilities, and the backward is the textbook one:
    dV = Pᵀ·dO, dP = dO·Vᵀ, dS = P ⊙ (dP − rowsum(dP ⊙ P)), dQ = dS·K·scale, dK = dSᵀ·Q·scale.
    For GQA the g = h/kv query heads that share a key/value head are stacked along the query axis,
    so K and V are never repeated. ``bias``: additive, broadcastable to (B, h, Tq, Tk), with a gradient
    where it needs one (T5's learned relative positions: dS summed over the axes it was broadcast along);
    every row must keep one finite score (the caller unmasks empty rows, then zeros their output). ``causal``: key j
    is also hidden from query i when j > i + Tk − Tq (the queries are the last Tq positions, as ``causal_mask``);
    a bias given with it hides those keys already (``scaled_dot_product_attention`` folds its causal mask into the
    bias, unmasking rows that see no key), so the torch path adds the causal mask only where there is no bias,
    and the kernel takes the flag to skip the hidden keys' work.

    fp32 inputs under eager autograd take attnlab's own kernel where it builds (``csrc/short_attention.cpp``,
    :func:`fused_short_attention`): the same formulas, one task per (batch, key/value head) that reads q, k, v in
    the projection's memory and writes the output and dQ, dK, dV in the (B, T, h, hd) memory the heads are merged
    from, with no copies between, and that skips the keys ``causal`` hides. A bias that needs a gradient (T5), other
    dtypes and ``torch.compile`` (whose inductor fuses the torch path below) keep the torch path.

    Precision, for bf16 inputs: the scores QKᵀ and dP = dO·Vᵀ, which the softmax and its backward read, are
    fp32 products (of the bf16 values, exact in fp32), and so are the softmax and dS. With heads of 64 or more
    on a CPU with native bf16 (:meth:`product_dtype`) the four products whose results are rounded to bf16
    anyway (P·V and the gradients of q, k, v) take bf16 operands: P and dS·scale are rounded to bf16 first, as
    FlashAttention-2 rounds them on GPUs. With the trainer's heap the attention alone runs 1.1-1.35x faster so,
    and the whole step within the noise (±3%; 3.5-4% faster with glibc's default heap); the result's error stays
    near bf16's own rounding (measured against float64: docs/results.md). Otherwise all six are fp32 products.
    """

    @staticmethod
    def compute_dtype(q: torch.Tensor) -> torch.dtype:
        # fp32 for half-precision inputs: unscaled scores and saved probabilities would lose range and
        # bits in fp16/bf16 (the fused kernel also computes bf16 training in fp32)
        return torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype

    @staticmethod
    def product_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.dtype:
        """The operands' dtype for P·V and the three input gradients: bf16 for bf16 inputs with heads of 64 or
        more on a CPU with native bf16, else :meth:`compute_dtype`. (Measured on whole training steps, in
        alternating turns: 3.5-4% faster with heads of 64, the Marian shapes of train_speed.py, with glibc's
        default heap, and 0.97-1.03x with the trainer's (docs/results.md, twentieth #13 session); nothing gained
        with nanoGPT's heads of 32 (1.009x), which so keep the more exact fp32 products. Without native bf16
        the bf16 products are emulated.)"""
        if (q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.shape[-1] >= BF16_PRODUCTS_MIN_HEAD_DIM
                and q.device.type == "cpu" and _cpu_bf16_native()):
            return torch.bfloat16
        return ShortAttention.compute_dtype(q)

    @staticmethod
    def kernel_serves(q, k, v) -> bool:
        """Whether attnlab's fp32 kernel computes a call with these inputs (fp32, the kernel built here, eager
        autograd), given a float32 bias, if any, that needs no gradient."""
        return q.dtype == k.dtype == v.dtype == torch.float32 and _kernel_serves()

    @staticmethod
    def forward(ctx, q, k, v, bias, scale, causal):
        ctx.kernel, ctx.scale, ctx.causal = False, scale, causal
        if ((bias is None or bias.dtype == torch.float32) and not ctx.needs_input_grad[3]
                and ShortAttention.kernel_serves(q, k, v)):
            out, probs = torch.ops.attnlab.short_attention(q, k, v, bias, scale, causal)  # (B, h, Tq, hd), (B, h, Tq, Tk)
            ctx.save_for_backward(*_compact(q, k, v), probs)
            ctx.kernel = True
            return out
        B, h, Tq, hd = q.shape
        kv, Tk = k.shape[1], k.shape[2]
        dtype, products = ShortAttention.compute_dtype(q), ShortAttention.product_dtype(q, k, v)
        ctx.dtypes = q.dtype, k.dtype, v.dtype
        qg = _dense(q, products).view(B * kv, (h // kv) * Tq, hd)                           # (B·kv, g·Tq, hd)
        k, v = _dense(k, products).view(B * kv, Tk, hd), _dense(v, products).view(B * kv, Tk, hd)  # (B·kv, Tk, hd)
        scores = torch.bmm(qg.to(dtype), k.to(dtype).transpose(1, 2)).view(B, h, Tq, Tk)  # (B, h, Tq, Tk)
        scores = scores.mul_(scale) if bias is None else torch.add(bias, scores, alpha=scale)
        if causal and bias is None:
            scores = scores.masked_fill_(~causal_mask(Tq, Tk, q.device), float("-inf"))
        probs = scores.softmax(dim=-1).view(B * kv, (h // kv) * Tq, Tk)  # (B·kv, g·Tq, Tk)
        ctx.save_for_backward(qg, k, v, probs)
        ctx.scale, ctx.q_shape, ctx.kv_shape = scale, q.shape, (B, kv, Tk, hd)
        ctx.bias_shape, ctx.bias_dtype = (None, None) if bias is None else (bias.shape, bias.dtype)
        out = torch.bmm(probs.to(products), v).view(B, h, Tq, hd)
        # Returned in the input's dtype and in the (B, Tq, h, hd) memory the caller merges the heads
        # from: the cast and the transpose are one copy, and the caller's merge is a view.
        return torch.empty(B, Tq, h, hd, dtype=q.dtype, device=q.device).transpose(1, 2).copy_(out)  # (B, h, Tq, hd)

    @staticmethod
    @torch.autograd.function.once_differentiable  # a second derivative through this backward would be wrong: refuse it
    def backward(ctx, grad_out):
        if ctx.kernel:
            q, k, v, probs = ctx.saved_tensors
            grads = torch.ops.attnlab.short_attention_backward(grad_out, q, k, v, probs, ctx.scale, ctx.causal)
            return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None, None, None)
        qg, k, v, probs = ctx.saved_tensors
        dtype, products = probs.dtype, v.dtype  # products: the forward's choice (bf16 operands, or all fp32)
        dq = dk = dv = dbias = None
        with torch.autocast("cpu", enabled=False):  # as the forward ran, even where backward() runs under autocast
            grad_p = _dense(grad_out, products).view(qg.shape)                           # (B·kv, g·Tq, hd)
            if ctx.needs_input_grad[2]:
                dv = _heads_last(torch.bmm(probs.to(products).transpose(1, 2), grad_p), ctx.kv_shape, ctx.dtypes[2])
            if ctx.needs_input_grad[0] or ctx.needs_input_grad[1] or ctx.needs_input_grad[3]:
                # dP in fp32: the softmax's backward subtracts rowsum(dP ⊙ P) from it
                dp = torch.bmm(grad_p.to(dtype), v.to(dtype).transpose(1, 2))             # (B·kv, g·Tq, Tk)
                ds = torch._softmax_backward_data(dp, probs, -1, probs.dtype)
                if ctx.needs_input_grad[3]:  # the bias's gradient is dS, summed where it was broadcast
                    B, h, Tq, _ = ctx.q_shape
                    dbias = ds.view(B, h, Tq, -1).sum_to_size(ctx.bias_shape).to(ctx.bias_dtype)
                if products != dtype:  # dS·scale rounded once, then two bf16 products
                    ds, scale = (ds * ctx.scale).to(products), None
                else:
                    scale = ctx.scale
                if ctx.needs_input_grad[0]:
                    dq = _heads_last(torch.bmm(ds, k), ctx.q_shape, ctx.dtypes[0], scale)
                if ctx.needs_input_grad[1]:
                    dk = _heads_last(torch.bmm(ds.transpose(1, 2), qg), ctx.kv_shape, ctx.dtypes[1], scale)
        return dq, dk, dv, dbias, None, None


def _compact(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The kernel's inputs as its backward keeps them: as they are where together they cover their memory (q, k and
    v split from one fused projection, or k and v from the memory's), so nothing is copied and nothing more is
    kept; a compact copy of one that is a view into a larger tensor it would keep alive (v beside RoPE's new q and
    k, a KV cache's buffer, which a later step also writes in place)."""
    covered: dict[int, int] = {}
    for t in {id(t): t for t in tensors}.values():
        key = t.untyped_storage().data_ptr()
        covered[key] = covered.get(key, 0) + t.numel() * t.element_size()
    return [t if covered[t.untyped_storage().data_ptr()] >= t.untyped_storage().nbytes() else t.contiguous()
            for t in tensors]


_SHORT: dict = {}  # "ok" → whether attnlab::short_attention is built and right here (once per process)


def _kernel_serves() -> bool:
    from ..accel import eager_autograd
    return eager_autograd() and fused_short_attention()


def packed_kernel_serves(qkv: torch.Tensor) -> bool:
    """Whether a self-attention over the fused projection ``qkv`` can take ``attnlab::packed_self_attention``
    (ShortAttention's kernel behind a C++ autograd function, ``csrc/short_attention.cpp``): fp32 on CPU, in training
    (a gradient wanted, eager autograd, not under autocast), the kernel built here. The caller checks the rest
    (no mask, bias, rotary positions, cache, recorded weights or dropout; at most SHORT_KEYS_KERNEL keys)."""
    return (qkv.device.type == "cpu" and qkv.requires_grad and torch.is_grad_enabled()
            and not torch.is_autocast_enabled("cpu") and ShortAttention.kernel_serves(qkv, qkv, qkv))


def fused_short_attention() -> bool:
    """Whether ShortAttention's fp32 inputs take attnlab's kernel (``csrc/short_attention.cpp``): as
    ``accel.own_kernel_serves`` says (not ``ATTNLAB_OWN_KERNELS=0``, Linux, built once per process for this
    CPU's vector extensions, and right on a check against float64)."""
    from .. import accel
    return accel.own_kernel_serves(_SHORT, _build_short_attention)


def _build_short_attention() -> bool:
    def check():
        # against float64 written out (no autograd: the first call may come from inside a forward under
        # saved-tensor hooks or no_grad): GQA, a head size that is not a multiple of the vector, a padding bias,
        # the causal skipping with fewer queries than keys, a query that sees no key (0 out); and the packed
        # operator's backward (dq, dk, dv written into one gradient of the fused projection)
        g = torch.Generator().manual_seed(0)

        def want(q, k, v, gout, b, causal):  # (out, dq, dk, dv) in float64
            q64, k64, v64, g64 = (t.double() for t in (q, k, v, gout))
            group = q.shape[1] // k.shape[1]  # query heads per key/value head
            k64, v64 = k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1)  # (B, h, Tk, hd)
            s = q64 @ k64.transpose(-1, -2) * 0.5 + (0 if b is None else b.double())
            if causal:
                s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], "cpu"), float("-inf"))
            p = s.softmax(-1)
            dp = g64 @ v64.transpose(-1, -2)
            ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * 0.5
            return (p @ v64, ds @ k64, (ds.transpose(-1, -2) @ q64).unflatten(1, (-1, group)).sum(2),
                    (p.transpose(-1, -2) @ g64).unflatten(1, (-1, group)).sum(2))

        def close(got, wanted):
            return all(torch.allclose(a.double(), w, rtol=1e-4, atol=1e-5) for a, w in zip(got, wanted, strict=True))

        q, gout = (torch.randn(2, 4, 5, 20, generator=g, dtype=torch.float32, device="cpu") for _ in range(2))
        k, v = (torch.randn(2, 2, 7, 20, generator=g, dtype=torch.float32, device="cpu") for _ in range(2))
        bias = torch.zeros(2, 1, 1, 7, dtype=torch.float32, device="cpu")
        bias[1, ..., -2:] = float("-inf")
        ok = True
        for causal, b in ((False, bias), (True, None)):
            out, probs = torch.ops.attnlab.short_attention(q, k, v, b, 0.5, causal)
            got = (out, *torch.ops.attnlab.short_attention_backward(gout, q, k, v, probs, 0.5, causal))
            ok = ok and close(got, want(q, k, v, gout, b, causal))
        # 4 query heads, 2 key/value heads; 20 dims (the kernel's padded copies on AVX2 and AVX-512) and 16 (written
        # straight into the gradient at its row stride, the GQA pair summed there)
        for hd in (20, 16):
            qkv = torch.randn(2, 7, 8 * hd, generator=g, dtype=torch.float32, device="cpu")  # (B, T, (4 + 2·2)·hd)
            gout = torch.randn(2, 7, 4 * hd, generator=g, dtype=torch.float32, device="cpu")  # (B, T, h·hd)
            blocks = [4 * hd, 2 * hd, 2 * hd]
            heads = [t.unflatten(2, (-1, hd)).transpose(1, 2) for t in qkv.split(blocks, 2)]  # (B, heads, T, hd)
            out, probs = torch.ops.attnlab.short_attention(*heads, None, 0.5, True)
            dqkv = torch.ops.attnlab.packed_attention_backward(gout, qkv, probs, 4, 2, 0.5, True)
            got = [t.unflatten(2, (-1, hd)).transpose(1, 2) for t in dqkv.split(blocks, 2)]
            ok = ok and close(got, want(*heads, gout.unflatten(2, (4, hd)).transpose(1, 2), None, True)[1:])
        one = torch.ones(1, 1, 3, 4, dtype=torch.float32, device="cpu")  # 3 queries, 2 keys: the first sees none
        out, _ = torch.ops.attnlab.short_attention(one, one[:, :, :2], one[:, :, :2], None, 1.0, True)
        return ok and bool((out[0, 0, 0] == 0).all() and (out[0, 0, 1:] == 1).all())

    def short_attention(q, k, v, bias, scale, causal):  # (the probabilities' rows padded to 16 floats, as the kernel's)
        B, h, Tq, hd = q.shape
        Tk = k.shape[2]
        return q.new_empty(B, Tq, h, hd).transpose(1, 2), q.new_empty(B, h, Tq, (Tk + 15) // 16 * 16)[..., :Tk]

    def short_attention_backward(grad_out, q, k, v, probs, scale, causal):
        B, kv, Tk, hd = k.shape
        return (q.new_empty(B, q.shape[2], q.shape[1], hd).transpose(1, 2),
                *(k.new_empty(B, Tk, kv, hd).transpose(1, 2) for _ in range(2)))

    def packed_attention_backward(grad, qkv, probs, heads, kv_heads, scale, causal):
        return qkv.new_empty(qkv.shape)

    from .. import accel
    from .layers import _own_kernel
    suffix, cflags = accel.own_kernel_target(fma=True)
    return _own_kernel("attention kernel", "ShortAttention's torch path", "attnlab_short_attention" + suffix,
                       "short_attention.cpp", cflags, {"short_attention": short_attention,
                                                       "short_attention_backward": short_attention_backward,
                                                       "packed_attention_backward": packed_attention_backward}, check)


def _heads_last(t: torch.Tensor, shape, dtype: torch.dtype, scale: float | None = None) -> torch.Tensor:
    """A gradient (B, h, T, hd) laid out in (B, T, h, hd) memory and in ``dtype``, scaled first.

    The projections were split into heads by a view and a transpose, so their gradients go back through
    the transpose and the view: in this layout the view's backward is a view too, where a contiguous
    (B, h, T, hd) gradient would be copied once more (in half precision after a cast of its own, which
    the copy here does). ``t`` is a fresh product: scaled in place (a non-contiguous ``out=`` would break
    torch.compile's graph, and in half precision PyTorch would compute it in a temporary anyway)."""
    B, h, T, hd = shape
    out = torch.empty(B, T, h, hd, dtype=dtype, device=t.device).transpose(1, 2)  # (B, h, T, hd)
    return out.copy_(t.view(shape) if scale is None else t.view(shape).mul_(scale))


def _dense(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` contiguous in ``dtype`` with one copy at most (``.to(dtype).contiguous()`` casts, then
    copies again to reorder a view such as a head-split (B, h, T, hd) of a (B, T, h, hd) tensor)."""
    return t.contiguous() if t.dtype == dtype else torch.empty(t.shape, dtype=dtype, device=t.device).copy_(t)


def _explicit_attention(q, k, v, attn_mask, valid_rows, dropout_p, scale=None):
    """softmax(QKᵀ/√d + mask)·V with the weights. For GQA the g = h/kv query heads that share a
    key/value head are stacked along the query axis, so K and V are never copied per head."""
    B, h, Tq, hd = q.shape
    kv, Tk = k.shape[1], k.shape[2]
    dtype = q.dtype
    if q.device.type == "cpu" and dtype != torch.float32:
        # CPU half-precision batched matmuls of this size are slower than casting up (measured on
        # SmolLM2's decode step); fp32 softmax is also the more exact one.
        q, k, v = q.float(), k.float(), v.float()
    qg = q.reshape(B * kv, (h // kv) * Tq, hd)  # (B·kv, g·Tq, hd)
    k, v = _fold_heads(k), _fold_heads(v)      # (B·kv, Tk, hd), no copy of a KV cache
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    scores = (torch.bmm(qg, k.transpose(1, 2)) * scale).view(B, h, Tq, Tk)  # (B, h, Tq, Tk)
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask)
    weights = scores.softmax(dim=-1)
    if valid_rows is not None:
        weights = weights.masked_fill(~valid_rows, 0.0)
    out = torch.bmm(F.dropout(weights, dropout_p).view(B * kv, (h // kv) * Tq, Tk), v)  # (B·kv, g·Tq, hd)
    return weights.to(dtype), out.view(B, h, Tq, hd).to(dtype)


def _fold_heads(t: torch.Tensor) -> torch.Tensor:
    """(B, kv, T, hd) → (B·kv, T, hd) for ``bmm``. A KV cache is a view of a larger buffer (B, kv,
    capacity, hd), which ``reshape`` would copy at every step; its batch and head strides still
    nest (stride(0) = kv·stride(1)), so the fold is a view of the same memory."""
    B, kv, T, hd = t.shape
    if t.stride(0) == kv * t.stride(1) and t.stride(3) == 1:
        return t.as_strided((B * kv, T, hd), (t.stride(1), t.stride(2), 1))
    return t.reshape(B * kv, T, hd)


# -- KV cache -------------------------------------------------------------------------------------


class KVCache:
    """Keys and values of one attention module across decoding steps.

    Self-attention appends each step's new K/V into a preallocated buffer (no O(T²) re-copying);
    cross-attention stores the encoder's K/V once, since the memory never changes.
    """

    def __init__(self, capacity: int = 0):
        self.capacity = capacity
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0
        self._spare: tuple[torch.Tensor, torch.Tensor] | None = None  # the buffers before the last reorder

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (B, kv, T, hd) for the new positions → all keys/values so far."""
        t = k.shape[2]
        if self.k is None or self.length + t > self.k.shape[2]:
            size = max(self.capacity, 2 * (self.length + t), 16)
            new_k = k.new_empty(k.shape[0], k.shape[1], size, k.shape[3])
            new_v = v.new_empty(v.shape[0], v.shape[1], size, v.shape[3])
            if self.k is not None:
                new_k[:, :, : self.length] = self.k[:, :, : self.length]
                new_v[:, :, : self.length] = self.v[:, :, : self.length]
            self.k, self.v = new_k, new_v
        self.k[:, :, self.length: self.length + t] = k
        self.v[:, :, self.length: self.length + t] = v
        self.length += t
        return self.k[:, :, : self.length], self.v[:, :, : self.length]

    def set(self, k: torch.Tensor, v: torch.Tensor) -> None:
        # contiguous once (the projection's permute is not), or every decoding step's bmm copies it
        self.k, self.v, self.length = k.contiguous(), v.contiguous(), k.shape[2]

    def reorder(self, index: torch.Tensor, start: int = 0) -> None:
        """Keep batch rows ``index`` (beam search reordering, finished rows dropped) and positions
        ``start:`` (a serving batch cuts columns that have become padding in every row). Only the
        filled part is copied, by one ``index_select`` straight into the buffers the previous reorder
        left (two buffers taking turns: no allocation, no temporary; beam 4 over 256 rows of a Marian
        layer, ad-hoc timing: 0.22 vs 1.04 ms for a new buffer filled from an ``index_select``'s
        temporary). Rows keep the buffer's own strides, so a compiled decoding step sees one stride
        pattern, not a view's (which would make it compile again)."""
        if self.k is None:
            return
        n, rows, cols = self.length, index.numel(), self.k.shape[2] - start
        spare = self._spare
        if spare is None or not all(s.shape[0] >= rows and s.shape[1] == t.shape[1] and s.shape[2] >= cols
                                    and s.shape[3] == t.shape[3] and s.dtype == t.dtype and s.device == t.device
                                    for s, t in zip(spare, (self.k, self.v))):
            spare = tuple(t.new_empty(rows, t.shape[1], cols, t.shape[3]) for t in (self.k, self.v))
        new_k, new_v = spare[0][:rows], spare[1][:rows]
        torch.index_select(self.k[:, :, start:n], 0, index, out=new_k[:, :, :n - start])
        torch.index_select(self.v[:, :, start:n], 0, index, out=new_v[:, :, :n - start])
        self._spare = (self.k, self.v)
        self.k, self.v, self.length = new_k, new_v, n - start


@dataclass
class Segment:
    """One group of rows in a packed forward: ``rows`` × ``length`` tokens with their own mask, RoPE
    angles, bias and KV cache. A packed forward runs every linear layer once over the tokens of all
    segments (rows concatenated) and attention per segment — e.g. a serving engine's one-token
    decoding step and a newcomer's prompt, in one stream of the weights instead of two."""
    rows: int
    length: int
    mask: torch.Tensor | None = None
    is_causal: bool = False
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    bias: torch.Tensor | None = None
    cache: KVCache | None = None


# -- the module -----------------------------------------------------------------------------------


class MultiHeadAttention(nn.Module):
    """Multi-head attention for self-, causal self- and cross-attention, with MHA/GQA/MQA.

    Self-attention projects Q, K and V with one fused matrix (one GEMM instead of three);
    cross-attention projects Q from the decoder stream and K, V (fused) from the encoder output.
    Heads come from one reshape + transpose — never a Python loop over heads — so h heads of
    d_k = d_model/h cost the same FLOPs as one big head.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, *,
                 bias: bool = True, dropout: float = 0.0, cross: bool = False, scale: float | None = None):
        super().__init__()
        self.scale = scale  # None: 1/√head_dim
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.head_dim = d_model // n_heads
        self.cross = cross
        self.dropout = dropout
        q_dim, kv_dim = n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        if cross:
            self.q_proj = nn.Linear(d_model, q_dim, bias=bias)
            self.kv_proj = nn.Linear(d_model, 2 * kv_dim, bias=bias)
        else:
            self.qkv_proj = nn.Linear(d_model, q_dim + 2 * kv_dim, bias=bias)
        self.out_proj = nn.Linear(q_dim, d_model, bias=bias)
        # Set by attnlab.inspect.record_attention to keep the last attention weights (pictures).
        self.record_weights = False
        self.last_weights: torch.Tensor | None = None

    def project_memory(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention keys and values from the encoder output: 2 × (B, kv, S, hd)."""
        B, S, _ = memory.shape
        k, v = self.kv_proj(memory).view(B, S, 2, self.n_kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return k, v

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor | None = None, *,
        mask: torch.Tensor | None = None, is_causal: bool = False,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None, bias: torch.Tensor | None = None,
        cache: KVCache | None = None, segments: list[Segment] | None = None,
    ) -> torch.Tensor:
        """x (B, T, d) → (B, T, d). With ``segments`` (self-attention only), x is (1, N, d): the
        tokens of every segment, rows concatenated; each segment attends within itself."""
        if segments is not None:
            qkv = self.qkv_proj(x[0])  # (N, q + 2·kv dims): one GEMM for all segments
            outs, start = [], 0
            for s in segments:
                n = s.rows * s.length
                out = self._self_attend(qkv[start:start + n].view(s.rows, s.length, -1), s.mask, s.is_causal,
                                        s.rope, s.bias, s.cache)
                outs.append(out.view(n, -1))
                start += n
            return self.out_proj(torch.cat(outs)[None])  # (1, N, d)
        B, T, _ = x.shape
        h, hd = self.n_heads, self.head_dim
        if not self.cross:
            return self.out_proj(self._self_attend(self.qkv_proj(x), mask, is_causal, rope, bias, cache))
        if memory is None and (cache is None or cache.k is None):
            raise ValueError("cross-attention needs the encoder output (memory)")
        q = self.q_proj(x).view(B, T, h, hd).transpose(1, 2)  # (B, h, T, hd)
        if cache is not None and cache.k is not None:
            k, v = cache.k, cache.v  # encoder K/V computed once, reused every step
        else:
            k, v = self.project_memory(memory)
            if cache is not None:
                cache.set(k, v)
        return self.out_proj(self._attend(q, k, v, mask, is_causal, bias))

    def _self_attend(self, qkv, mask, is_causal, rope, bias, cache) -> torch.Tensor:
        """(B, T, q + 2·kv dims) projections → attention output (B, T, h·hd), before out_proj."""
        B, T, _ = qkv.shape
        h, kv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        if (mask is None and bias is None and rope is None and cache is None and not self.record_weights
                and not (self.training and self.dropout) and T <= SHORT_KEYS_KERNEL and packed_kernel_serves(qkv)):
            # fp32 training on CPU: what the split below, scaled_dot_product_attention and ShortAttention's kernel
            # compute, in one operator whose gradient is qkv's (its C++ autograd writes dq, dk, dv into one tensor)
            return torch.ops.attnlab.packed_self_attention(qkv, h, kv, 1.0 / math.sqrt(hd) if self.scale is None
                                                           else self.scale, is_causal)
        q, k, v = qkv.split([h * hd, kv * hd, kv * hd], dim=-1)
        q = q.view(B, T, h, hd).transpose(1, 2)  # (B, h, T, hd)
        k = k.view(B, T, kv, hd).transpose(1, 2)  # (B, kv, T, hd)
        v = v.view(B, T, kv, hd).transpose(1, 2)  # (B, kv, T, hd)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, kv, past+T, hd)
        return self._attend(q, k, v, mask, is_causal, bias)

    def _attend(self, q, k, v, mask, is_causal, bias) -> torch.Tensor:
        B, h, T, hd = q.shape
        out, weights = scaled_dot_product_attention(
            q, k, v, mask, bias, is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0, need_weights=self.record_weights,
            scale=self.scale)
        if self.record_weights:
            self.last_weights = weights.detach()
        # transpose makes the tensor non-contiguous; view needs contiguous memory (the classic bug
        # is a view that silently scrambles heads, or an error).
        return out.transpose(1, 2).contiguous().view(B, T, h * hd)  # (B, T, h·hd)
