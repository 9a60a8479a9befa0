"""The tensor shape after every stage of a forward pass, recorded with forward hooks."""

from __future__ import annotations

import torch
from torch import nn

from ..model.attention import MultiHeadAttention
from ..model.embedding import (LearnedPositionalEmbedding, PatchEmbedding, SinusoidalPositionalEncoding,
                               TokenEmbedding)
from ..model.layers import DecoderLayer, EncoderLayer, PositionwiseFeedForward, SublayerConnection
from ..model.transformer import Decoder, Embeddings, Encoder

_STAGES = (TokenEmbedding, SinusoidalPositionalEncoding, LearnedPositionalEmbedding, Embeddings, PatchEmbedding,
           MultiHeadAttention, PositionwiseFeedForward, SublayerConnection, EncoderLayer,
           DecoderLayer, Encoder, Decoder)


def sample_batch(model: nn.Module, batch: int = 2, src_len: int = 10, tgt_len: int = 9):
    """A padded sample batch of random ids for the model's family; random images for an image model."""
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    if cfg.is_image_model:
        return (torch.randn(batch, cfg.n_channels, cfg.image_size, cfg.image_size, generator=g),)
    low = min(4, cfg.vocab_size - 1)
    src = torch.randint(low, cfg.vocab_size, (batch, src_len), generator=g)
    src_mask = torch.ones(batch, src_len, dtype=torch.bool)
    src_mask[1:, src_len - 3:] = False  # the second sentence is shorter: padding
    src = src.masked_fill(~src_mask, cfg.pad_id)
    if cfg.family == "encoder-decoder":
        tgt = torch.randint(low, cfg.target_vocab_size, (batch, tgt_len), generator=g)
        return (src, tgt, src_mask)
    return (src, src_mask)


def trace_shapes(model: nn.Module, inputs: tuple | None = None) -> list[tuple[str, tuple]]:
    """Run one forward pass; return (module name, output shape) in execution order."""
    inputs = inputs if inputs is not None else sample_batch(model)
    records: list[tuple[str, tuple]] = []
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, _STAGES) or name in ("lm_head", "classifier", "embed.proj"):  # proj: the patch grid
            def hook(mod, args, out, name=name):
                t = out[0] if isinstance(out, tuple) else out
                records.append((name, tuple(t.shape)))
            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = model(*inputs)
            if model.config.is_image_model and model.classifier is not None:
                model.classifier(model.pool(out))
            elif model.config.family == "encoder-only":
                model.lm_head(out)
    finally:
        for h in handles:
            h.remove()
    return records


def shapes_report(model: nn.Module) -> str:
    inputs = sample_batch(model)
    cfg = model.config
    lines = ["sample batch: " + ", ".join(f"{n} {tuple(t.shape)}" for n, t in
             zip(("src", "tgt", "src_mask") if cfg.family == "encoder-decoder" else ("images",) if cfg.is_image_model
                 else ("ids", "mask"), inputs))]
    for name, shape in trace_shapes(model, inputs):
        depth = name.count(".")
        lines.append(f"{'  ' * min(depth, 4)}{name:<{60 - 2 * min(depth, 4)}} {shape}")
    return "\n".join(lines)
