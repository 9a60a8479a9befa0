"""Translate sentences with an encoder-decoder: batching by length, detokenised output."""

from __future__ import annotations

import torch

from ..data.batching import by_length, padded
from .search import GenerationConfig, generate


@torch.no_grad()
def translate(model, src_tokenizer, tgt_tokenizer, sentences: list[str], config: GenerationConfig | None = None,
              batch_size: int = 64, max_src_len: int | None = None, nbest: bool = False):
    """Sentences in, translations out (same order). Batches are formed from sentences of similar
    length so little work is spent on padding. With ``nbest``, returns lists of (text, score)."""
    cfg = config or GenerationConfig()
    device = model.device
    encoded = src_tokenizer.encode_batch(sentences, eos=True)
    if max_src_len:
        encoded = [e[: max_src_len - 1] + [src_tokenizer.eos_id] if len(e) > max_src_len else e for e in encoded]
    out: list = [None] * len(sentences)
    for idx in by_length(encoded, batch_size):
        src, src_mask = padded([encoded[i] for i in idx], model.config.pad_id)
        res = generate(model, src.to(device), src_mask.to(device), cfg)
        for j, i in enumerate(idx):
            if nbest:
                out[i] = [(tgt_tokenizer.decode(h.tokens), h.score) for h in res.nbest[j]]
            else:
                out[i] = tgt_tokenizer.decode(res.sequences[j])
    return out
