"""Token-budget batches from length buckets (fairseq's --max-tokens).

Sentences of similar length are batched together so little compute is spent on padding; a batch
holds as many sentences as fit in ``max_tokens`` (counting padding). The order of batches is
shuffled each epoch from (seed, epoch), so a run is reproducible and can resume mid-epoch.
"""

from __future__ import annotations

import random

import torch


class TokenBatchSampler:
    def __init__(self, src_lens: list[int], tgt_lens: list[int], max_tokens: int, seed: int = 0,
                 shuffle: bool = True, max_sentences: int | None = None):
        self.src_lens, self.tgt_lens = src_lens, tgt_lens
        self.max_tokens = max_tokens
        self.seed = seed
        self.shuffle = shuffle
        self.max_sentences = max_sentences

    def batches(self, epoch: int) -> list[list[int]]:
        rng = random.Random(self.seed * 100003 + epoch)
        n = len(self.src_lens)
        idx = list(range(n))
        if self.shuffle:
            rng.shuffle(idx)  # random order among equal lengths
        idx.sort(key=lambda i: (max(self.src_lens[i], self.tgt_lens[i]), self.src_lens[i]))
        batches, cur, longest = [], [], 0
        for i in idx:
            length = max(self.src_lens[i], self.tgt_lens[i])
            if cur and (max(longest, length) * (len(cur) + 1) > self.max_tokens
                        or (self.max_sentences and len(cur) >= self.max_sentences)):
                batches.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, length)
        if cur:
            batches.append(cur)
        if self.shuffle:
            rng.shuffle(batches)
        return batches


def pad_batch(seqs: list[list[int]], pad_id: int, left: bool = False) -> torch.Tensor:
    longest = max(len(s) for s in seqs)
    out = torch.full((len(seqs), longest), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        if left:
            out[i, longest - len(s):] = torch.tensor(s, dtype=torch.long)
        else:
            out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def collate_pairs(src: list[list[int]], tgt: list[list[int]], pad_id: int):
    """Source ids + mask; decoder input (BOS + target) and labels (target + EOS): teacher forcing,
    the gold target shifted right. ``tgt`` sequences carry BOS … EOS."""
    src_ids = pad_batch(src, pad_id)
    tgt_ids = pad_batch(tgt, pad_id)
    return src_ids, src_ids != pad_id, tgt_ids[:, :-1], tgt_ids[:, 1:]


def padded(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, is_token): right-padded ids (B, T) and the boolean mask of real tokens (B, T)."""
    ids = pad_batch(seqs, pad_id)
    lengths = torch.tensor([len(s) for s in seqs])
    return ids, torch.arange(ids.shape[1])[None, :] < lengths[:, None]


def by_length(encoded: list[list[int]], batch_size: int):
    """Batches of indices of sequences of similar length (little padding), shortest first."""
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    for s in range(0, len(order), batch_size):
        yield order[s: s + batch_size]
