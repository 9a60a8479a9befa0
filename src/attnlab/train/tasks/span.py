"""Span corruption: T5's pretraining objective for an encoder-decoder (Raffel et al. 2020, §3.1.4).

About 15% of each sentence's tokens are dropped in spans of about 3 tokens. The encoder reads the
sentence with every dropped span replaced by one sentinel token; the decoder writes the dropped
spans back, each after its sentinel:

    original  Thank you for inviting me to your party last week .
    input     Thank you <extra_id_0> me to your party <extra_id_1> week . </s>
    target    <extra_id_0> for inviting <extra_id_1> last </s>

The target is short (the noise only), so a step costs little decoder work, and the model learns
to use context on both sides of a gap — the same encoder-decoder then fine-tunes to translation.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...config import TransformerConfig
from ...data.batching import TokenBatchSampler, collate_pairs
from ...data.readers import DataError, read_text
from ...data.tokenizer import Tokenizer, train_tokenizer
from .base import DataPosition, ListBatches, Task, config_with_own_vocab, label_smoothed_loss, forward_to_output_loss


def sentinel(i: int) -> str:
    """The i-th sentinel token (T5's spelling)."""
    return f"<extra_id_{i}>"


def sentinel_tokens(k: int) -> tuple:
    """The first k sentinels as special tokens for ``train_tokenizer``. They take in the spaces around
    them (lstrip/rstrip), so a typed ``"her <extra_id_0> become"`` encodes as the ids of "her become"
    with the sentinel between them — what training builds from ids — not with a lone "▁" before it."""
    from tokenizers import AddedToken
    return tuple(AddedToken(sentinel(i), special=True, lstrip=True, rstrip=True) for i in range(k))


def noise_counts(n: int, noise_density: float, mean_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of an example of ``n`` ≥ 2 tokens, as T5 rounds them: at least one
    noise token and one kept token, at least one span. There are also never more spans than kept
    tokens, so spans can be kept apart (T5 leaves that case degenerate: density near 1, short spans)."""
    num_noise = min(max(round(n * noise_density), 1), n - 1)
    num_spans = max(round(num_noise / mean_span_length), 1)
    return num_noise, min(num_spans, n - num_noise)


def random_segmentation(num_items: int, num_segments: int, g: torch.Generator) -> list[int]:
    """``num_items`` split into ``num_segments`` non-empty parts, every such split equally likely
    (T5's ``_random_segmentation``): the cuts are distinct positions among the num_items - 1 gaps."""
    cuts = sorted((torch.randperm(num_items - 1, generator=g)[: num_segments - 1] + 1).tolist())
    bounds = [0, *cuts, num_items]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def random_spans_noise_mask(n: int, noise_density: float, mean_span_length: float,
                            g: torch.Generator) -> torch.Tensor:
    """T5's ``random_spans_noise_mask``: (n,) bool, True = noise. The noise tokens and the kept tokens
    are each split at random into spans, and the spans alternate, kept first — so spans never touch,
    and the numbers of noise tokens and spans are exact, not a coin flip per token.

    One change: T5 splits the kept tokens into as many parts as there are noise spans, so the last
    noise span always ends the example. T5 trains on 512-token chunks of running text, where that is
    one span in ~26; on one short sentence per line it is the only span (n < ~25 tokens at 15%), and
    the task would degenerate to "write the last 3 tokens". Here the kept tokens get one more part,
    and the first and last parts may be empty: every placement of the spans is possible and the
    spans still never touch (T5's own remedy, ``random_roll``, would also cut a span in two)."""
    num_noise, num_spans = noise_counts(n, noise_density, mean_span_length)
    noise = random_segmentation(num_noise, num_spans, g)
    kept = random_segmentation(n - num_noise + 2, num_spans + 1, g)  # then 1 off each end: may be empty
    kept[0], kept[-1] = kept[0] - 1, kept[-1] - 1
    mask = torch.zeros(n, dtype=torch.bool)
    start = 0
    for k, s in zip(kept, noise):  # kept_0 noise_0 kept_1 noise_1 … noise_last kept_last
        mask[start + k: start + k + s] = True
        start += k + s
    return mask


def corrupt_spans(ids: list[int], mask: torch.Tensor, sentinels: list[int], bos: int,
                  eos: int) -> tuple[list[int], list[int]]:
    """(encoder input, decoder target) of one example: the input keeps the unmasked tokens and has
    sentinel i in place of noise span i, then ``</s>``; the target is ``<s>`` then sentinel i followed
    by span i's tokens, for every span in order, then ``</s>`` (T5's order: the teacher-forced
    decoder input and labels are cut from it by ``collate_pairs``)."""
    inputs, target, span = [], [bos], -1
    flags = mask.tolist()
    for j, (t, is_noise) in enumerate(zip(ids, flags)):
        if is_noise:
            if j == 0 or not flags[j - 1]:  # a span starts: one sentinel on each side
                span += 1
                inputs.append(sentinels[span])
                target.append(sentinels[span])
            target.append(t)
        else:
            inputs.append(t)
    return inputs + [eos], target + [eos]


def sentinel_ids(tok: Tokenizer) -> list[int]:
    """The ids of ``<extra_id_0>``, ``<extra_id_1>``, … in the tokenizer (stops at the first missing)."""
    out = []
    while (i := tok.tk.token_to_id(sentinel(len(out)))) is not None:
        out.append(i)
    return out


class SpanCorruptionTask(Task):
    """Encoder-decoder pretraining by span corruption (T5) on plain text, one example per line
    (truncated to ``--max-len`` - 1 tokens, lines of fewer than 2 tokens dropped with a count).
    Fresh noise every step, drawn from (seed, step, micro-batch, rank) so resume is exact; the dev
    split is corrupted once from the seed, so every evaluation scores the same task.

    The sentinels are special tokens of the task's own BPE vocabulary (ids 4, 5, …, right after
    <pad> <s> </s> <unk>), as many as the longest admissible example needs, saved in tokenizer.json.
    The model directory loads as a translator: ``attnlab translate --text "Thank you <extra_id_0> me"``
    writes the spans it guesses, after their sentinels."""
    name = "span"
    summary = "encoder-decoder span-corruption pretraining (T5)"
    family = "encoder-decoder"
    default_preset = "t5-mini"
    default_label_smoothing = 0.0
    options = ("noise_density", "mean_span_length")  # flags that only this task reads

    def prepare(self, args, out: Path, log) -> None:
        lines = [l.strip() for l in read_text(args.train).splitlines() if l.strip()]
        if args.dev:
            dev = [l.strip() for l in read_text(args.dev).splitlines() if l.strip()]
        else:  # a seeded share of the lines is held out (as --task mlm)
            perm = torch.randperm(len(lines), generator=torch.Generator().manual_seed(args.seed)).tolist()
            n_dev = max(1, int(len(lines) * args.val_fraction))
            dev, lines = [lines[i] for i in sorted(perm[:n_dev])], [lines[i] for i in sorted(perm[n_dev:])]
        self.args = args
        # Enough sentinels for the longest example the task admits (span counts grow with length).
        needed = noise_counts(args.max_len - 1, args.noise_density, args.mean_span_length)[1]
        if (out / "tokenizer.json").exists() and (args.resume or args.reuse_tokenizer):
            self.tok = Tokenizer.load(out / "tokenizer.json")
        else:
            self.tok = train_tokenizer(lines, args.vocab_size, extra_specials=sentinel_tokens(needed))
        self.sentinels = sentinel_ids(self.tok)
        if len(self.sentinels) < needed:
            raise DataError(f"{out / 'tokenizer.json'}: {len(self.sentinels)} sentinel tokens <extra_id_N>, but "
                            f"--max-len {args.max_len} with --noise-density {args.noise_density} and "
                            f"--mean-span-length {args.mean_span_length} needs {needed}")
        self.train_ids, dropped = self._rows(lines)
        if dropped:
            log(f"dropped {dropped} of {len(lines)} training lines shorter than 2 tokens")
        if not self.train_ids:
            raise DataError(f"{args.train}: no training lines of 2 tokens or more")
        g = torch.Generator().manual_seed(args.seed)
        self.dev_pairs = [self._corrupt(ids, g) for ids in self._rows(dev)[0]]
        src_lens, tgt_lens = zip(*(self._lengths(len(ids)) for ids in self.train_ids))
        self.batches = ListBatches(TokenBatchSampler(list(src_lens), list(tgt_lens), args.max_tokens, seed=args.seed,
                                                      max_sentences=args.batch_size))
        log(f"span-corruption data: {len(self.train_ids):,} train / {len(self.dev_pairs):,} dev lines, "
            f"vocabulary {self.tok.vocab_size} with {len(self.sentinels)} sentinels")

    def _rows(self, lines: list[str]) -> tuple[list[list[int]], int]:
        """Token ids per line, cut to leave room for ``</s>``; lines of fewer than 2 tokens (nothing to
        both keep and drop) are left out and counted."""
        rows = [ids[: self.args.max_len - 1] for ids in self.tok.encode_batch(lines)]
        kept = [ids for ids in rows if len(ids) >= 2]
        return kept, len(rows) - len(kept)

    def _lengths(self, n: int) -> tuple[int, int]:
        """(input, target) lengths of an example of n tokens: fixed by n, whatever the draw."""
        num_noise, num_spans = noise_counts(n, self.args.noise_density, self.args.mean_span_length)
        return n - num_noise + num_spans + 1, 1 + num_spans + num_noise + 1

    def _corrupt(self, ids: list[int], g: torch.Generator) -> tuple[list[int], list[int]]:
        mask = random_spans_noise_mask(len(ids), self.args.noise_density, self.args.mean_span_length, g)
        return corrupt_spans(ids, mask, self.sentinels, self.tok.bos_id, self.tok.eos_id)

    @property
    def has_dev(self) -> bool:
        return bool(self.dev_pairs)

    @property
    def n_train(self) -> int:
        return len(self.train_ids)

    def model_config(self, args) -> TransformerConfig:
        # One vocabulary for both sides; a target is at most max_len + 1 tokens (<s> … </s>).
        return config_with_own_vocab(self, args, min_positions=args.max_len + 1, tgt_vocab_size=None)

    def artifacts(self) -> dict:
        return {"tokenizer": self.tok, "tgt_tokenizer": None,
                "task": {"task": "span", "max_len": self.args.max_len, "noise_density": self.args.noise_density,
                         "mean_span_length": self.args.mean_span_length, "sentinels": len(self.sentinels)}}

    def batch(self, position: DataPosition):
        g = position.generator(self.args.seed)
        pairs = [self._corrupt(self.train_ids[i], g) for i in self.batches.next(position)]
        src, tgt = zip(*pairs)
        return collate_pairs(list(src), list(tgt), self.tok.pad_id)  # src, src_mask, tgt_in, labels

    def training_forward(self, model, forward):
        return forward_to_output_loss(model, forward, self.tok.pad_id)

    def loss(self, forward, batch, smoothing):
        src, src_mask, tgt_in, labels = batch
        loss, n = forward(src, tgt_in, src_mask, labels, smoothing)
        return loss, n, int(src_mask.sum()) + n

    @torch.no_grad()
    def evaluate(self, model, device, bf16) -> dict:
        """Loss and accuracy (greedy next token under teacher forcing) over every target token of the
        dev split, sentinels and ``</s>`` included."""
        from ...model import eval_mode
        total, correct, count = 0.0, 0, 0
        with eval_mode(model):
            for s in range(0, len(self.dev_pairs), 64):
                src, tgt = zip(*self.dev_pairs[s: s + 64])
                batch = collate_pairs(list(src), list(tgt), self.tok.pad_id)
                src, src_mask, tgt_in, labels = (t.to(device) for t in batch)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    logits = model(src, tgt_in, src_mask)  # (B, T, V)
                loss, n = label_smoothed_loss(logits, labels, self.tok.pad_id, 0.0)
                total += loss.item() * n
                correct += int((logits.argmax(-1) == labels)[labels != self.tok.pad_id].sum())
                count += n
        loss = total / max(count, 1)
        return {"dev_span_loss": round(loss, 4), "dev_span_accuracy": round(correct / max(count, 1), 4),
                "tokens": count, "score": -loss}

    def describe(self, r: dict) -> str:
        return f"dev span loss {r['dev_span_loss']:.4f}  accuracy {r['dev_span_accuracy']:.4f}"
