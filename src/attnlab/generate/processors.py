"""Logits processing between the model and the choice of the next token: minimum length,
repetition penalty, no-repeat-n-gram, top-k / top-p filtering."""

from __future__ import annotations

import torch


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty: logits of tokens already present are divided (if > 0) or multiplied by it."""
    picked = logits.gather(1, history)
    picked = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits.scatter(1, history, picked)


def banned_ngram_tokens(seqs: list[list[int]], n: int) -> list[list[int]]:
    """Tokens that would repeat an n-gram already in each sequence."""
    out = []
    for seq in seqs:
        if len(seq) < n:
            out.append([])
            continue
        prefix = tuple(seq[len(seq) - n + 1:]) if n > 1 else ()
        out.append([seq[i + n - 1] for i in range(len(seq) - n + 1) if tuple(seq[i: i + n - 1]) == prefix])
    return out


def top_k_top_p(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest set with mass >= p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(remove, float("-inf")))
    return logits


class LogitsProcessor:
    """min length, repetition penalty and no-repeat-n-gram. Histories are only built when a
    penalty needs them, so plain greedy/beam decoding pays nothing per step."""

    def __init__(self, cfg, eos_id: int, prompts: list[list[int]] | None,
                 pad_id: int | None = None):
        self.cfg, self.eos_id = cfg, eos_id
        self.pad_id = pad_id if pad_id != eos_id else None  # padding is never a prediction
        self.prompts = prompts  # decoder-only: penalties also see the prompt
        self.needs_history = cfg.repetition_penalty != 1.0 or cfg.no_repeat_ngram_size > 0

    def __call__(self, logits: torch.Tensor, generated, step: int) -> torch.Tensor:
        cfg = self.cfg
        if step < cfg.min_new_tokens:
            logits[:, self.eos_id] = float("-inf")
        if self.pad_id is not None:
            logits[:, self.pad_id] = float("-inf")
        if not self.needs_history:
            return logits
        generated = generated() if callable(generated) else generated
        hist = [(self.prompts[i] if self.prompts else []) + g for i, g in enumerate(generated)]
        if cfg.repetition_penalty != 1.0:
            longest = max(len(h) for h in hist)
            if longest:
                # pad each history by repeating a token it already has (a no-op for the penalty)
                idx = torch.tensor([h + [h[-1]] * (longest - len(h)) if h else [0] * longest for h in hist],
                                   device=logits.device)
                penalised = apply_repetition_penalty(logits, idx, cfg.repetition_penalty)
                has = torch.tensor([bool(h) for h in hist], device=logits.device)[:, None]
                logits = torch.where(has, penalised, logits)
        if cfg.no_repeat_ngram_size > 0:
            for row, banned in enumerate(banned_ngram_tokens(hist, cfg.no_repeat_ngram_size)):
                if banned:
                    logits[row, banned] = float("-inf")
        return logits
