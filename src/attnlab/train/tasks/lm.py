"""Language modelling: decoder-only, next-token prediction on contiguous blocks (nanoGPT's sampler)."""

from __future__ import annotations

from pathlib import Path

import torch

from ...config import TransformerConfig
from ...data.readers import DataError, read_text
from ...data.tokenizer import Tokenizer, char_tokenizer, train_tokenizer
from ...evaluate.scoring import lm_loss
from .base import DataPosition, Task, config_with_own_vocab, forward_to_output_loss


class LanguageModelTask(Task):
    """Decoder-only LM on plain text: contiguous blocks of ``block_size`` tokens at random offsets
    (nanoGPT's sampler), deterministic from (seed, step, micro-batch, rank) so resume is exact."""
    name = "lm"
    summary = "decoder-only language model on text (char or BPE tokens)"
    family = "decoder-only"
    default_preset = "gpt-mini"
    default_label_smoothing = 0.0
    options = ("tokenizer", "block_size", "eval_batches")  # flags that only this task reads

    def prepare(self, args, out: Path, log) -> None:
        text = read_text(args.train)
        if (out / "tokenizer.json").exists() and (args.resume or args.reuse_tokenizer):
            self.tok = Tokenizer.load(out / "tokenizer.json")
        elif args.tokenizer == "char":
            self.tok = char_tokenizer(text)
        else:
            self.tok = train_tokenizer(text.splitlines(), args.vocab_size)
        ids = torch.tensor(self.tok.encode(text), dtype=torch.long)
        if args.dev:
            self.train_ids, self.val_ids = ids, torch.tensor(self.tok.encode(read_text(args.dev)), dtype=torch.long)
        else:  # the first 90% trains, the last 10% validates (nanoGPT's split)
            cut = int(len(ids) * (1 - args.val_fraction))
            self.train_ids, self.val_ids = ids[:cut], ids[cut:]
        if len(self.train_ids) <= args.block_size + 1:
            raise DataError(f"{args.train}: {len(self.train_ids)} training tokens, fewer than --block-size "
                            f"{args.block_size} + 1")
        self.args = args
        log(f"language model data: {len(self.train_ids):,} train / {len(self.val_ids):,} val tokens, "
            f"vocabulary {self.tok.vocab_size} ({args.tokenizer})")

    @property
    def n_train(self) -> int:
        return len(self.train_ids)

    def model_config(self, args) -> TransformerConfig:
        return config_with_own_vocab(self, args, min_positions=args.block_size)

    def artifacts(self) -> dict:
        return {"tokenizer": self.tok, "task": {"task": "lm", "block_size": self.args.block_size,
                                                "tokenizer": self.args.tokenizer}}

    def block_offsets(self, n_tokens: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """Start offsets such that x = data[i:i+T] and y = data[i+1:i+T+1] stay inside the data."""
        return torch.randint(0, n_tokens - self.args.block_size, (batch_size,), generator=generator)

    def batch(self, position: DataPosition):
        # hash() of a tuple of ints is the same in every process (unlike strings'), so this stream is
        # reproducible; it is the stream docs/results.md's Tiny Shakespeare runs were measured with.
        g = torch.Generator().manual_seed(
            hash((self.args.seed, position.step, position.micro, position.rank)) % 2 ** 62)
        T = self.args.block_size
        ix = self.block_offsets(len(self.train_ids), self.args.batch_size, g)
        x = torch.stack([self.train_ids[i: i + T] for i in ix.tolist()])
        y = torch.stack([self.train_ids[i + 1: i + 1 + T] for i in ix.tolist()])
        return x, y

    def training_forward(self, model, forward):
        return forward_to_output_loss(model, forward, None)

    def loss(self, forward, batch, smoothing):
        x, y = batch
        loss, n = forward(x, y, smoothing)
        return loss, n, n

    @torch.no_grad()
    def evaluate(self, model, device, bf16) -> dict:
        """Loss over the whole validation split in consecutive blocks (exact, not sampled)."""
        return lm_loss(model, self.val_ids, self.args.block_size, device, bf16, self.args.eval_batches)

    def describe(self, r: dict) -> str:
        return f"val loss {r['val_loss']:.4f}  perplexity {r['val_ppl']:.2f}"
