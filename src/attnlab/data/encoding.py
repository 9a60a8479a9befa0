"""Texts to model inputs for the encoder tasks: classifier rows, masked-LM rows and BERT's masking."""

from __future__ import annotations

import torch


def encode_for_classifier(tok, texts: list[str], info: dict) -> list[list[int]]:
    """attnlab's own tokenizers: ``<s>`` (the pooled [CLS] position) + ids, cut to ``max_len``;
    a pretrained tokenizer (``add_bos`` False) adds [CLS] … [SEP] and truncates itself."""
    if info.get("add_bos", True):
        return [ids[: info.get("max_len", 128) - 1] for ids in tok.encode_batch(texts, bos=True)]
    return tok.encode_batch(texts)


def mlm_rows(tok, lines: list[str], max_len: int) -> list[list[int]]:
    """One example per line: ``<s>`` ids ``</s>``, truncated to ``max_len`` tokens."""
    n = max_len - 2
    return [[tok.bos_id] + ids[:n] + [tok.eos_id] for ids in tok.encode_batch(lines)]


def n_special(tok) -> int:
    """Ids below this are special (padding, <s>, </s>, <unk>, <mask>): never masked, never drawn."""
    return max(tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id, tok.mask_id) + 1


def mask_tokens(ids: torch.Tensor, is_token: torch.Tensor, mask_id: int, vocab_size: int, n_special: int,
                generator: torch.Generator, p: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's corruption (Devlin et al. 2019, §3.1): choose 15% of the real tokens as prediction
    targets; of those, 80% become [MASK], 10% a random token and 10% stay unchanged, so the model
    cannot learn that only [MASK] positions matter (there is no [MASK] at fine-tuning time).
    Padding and special tokens (ids < ``n_special``) are never chosen.
    Returns (inputs, labels) with labels = the original id at chosen positions, -100 elsewhere."""
    chosen = (torch.rand(ids.shape, generator=generator) < p) & is_token & (ids >= n_special)
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    r = torch.rand(ids.shape, generator=generator)
    random_ids = torch.randint(n_special, vocab_size, ids.shape, generator=generator)
    inputs = torch.where(chosen & (r < 0.8), torch.full_like(ids, mask_id), ids)
    inputs = torch.where(chosen & (r >= 0.8) & (r < 0.9), random_ids, inputs)
    return inputs, labels


__all__ = ["encode_for_classifier", "mlm_rows", "n_special", "mask_tokens"]
