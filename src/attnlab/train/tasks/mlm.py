"""Masked-language-model pretraining: BERT's objective for an encoder-only model."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ...config import TransformerConfig
from ...data.batching import TokenBatchSampler, padded
from ...data.encoding import mask_tokens, mlm_rows, n_special
from ...data.readers import DataError, read_text
from ...data.tokenizer import Tokenizer, train_tokenizer
from ...evaluate.scoring import mlm_scores
from .base import DataPosition, ListBatches, Task, config_with_own_vocab


class MaskedLMTask(Task):
    """Encoder-only masked-language-model pretraining (BERT) on plain text, one example per line
    (``<s>`` … ``</s>``, truncated to ``--max-len``), token-budget batches, fresh masks every step
    drawn from (seed, step, micro-batch, rank) so resume is exact. The pretrained directory can then
    initialise a classifier: ``attnlab train --task classify --init DIR``."""
    name = "mlm"
    summary = "encoder-only masked-LM pretraining (BERT's 15%% / 80-10-10)"
    family = "encoder-only"
    default_preset = "bert-mini"
    default_label_smoothing = 0.0
    options = ()  # flags that only this task reads
    mask_prob = 0.15

    def prepare(self, args, out: Path, log) -> None:
        lines = [l.strip() for l in read_text(args.train).splitlines() if l.strip()]
        if args.dev:
            dev = [l.strip() for l in read_text(args.dev).splitlines() if l.strip()]
        else:  # a seeded share of the lines is held out
            perm = torch.randperm(len(lines), generator=torch.Generator().manual_seed(args.seed)).tolist()
            n_dev = max(1, int(len(lines) * args.val_fraction))
            dev, lines = [lines[i] for i in sorted(perm[:n_dev])], [lines[i] for i in sorted(perm[n_dev:])]
        if (out / "tokenizer.json").exists() and (args.resume or args.reuse_tokenizer):
            self.tok = Tokenizer.load(out / "tokenizer.json")
        else:
            self.tok = train_tokenizer(lines, args.vocab_size, extra_specials=("<mask>",))
        if self.tok.mask_id is None:
            raise DataError(f"{out / 'tokenizer.json'}: the tokenizer has no <mask> token")
        self.n_special = n_special(self.tok)
        self.args = args
        self.train_x, self.dev_x = mlm_rows(self.tok, lines, args.max_len), mlm_rows(self.tok, dev, args.max_len)
        self.batches = ListBatches(TokenBatchSampler([len(x) for x in self.train_x], [1] * len(self.train_x),
                                                      args.max_tokens, seed=args.seed, max_sentences=args.batch_size))
        log(f"masked-LM data: {len(self.train_x):,} train / {len(self.dev_x):,} dev lines, "
            f"vocabulary {self.tok.vocab_size}")

    @property
    def n_train(self) -> int:
        return len(self.train_x)

    def model_config(self, args) -> TransformerConfig:
        return config_with_own_vocab(self, args, min_positions=args.max_len)

    def artifacts(self) -> dict:
        return {"tokenizer": self.tok, "task": {"task": "mlm", "max_len": self.args.max_len}}

    def _masked(self, rows: list[list[int]], g: torch.Generator):
        x, is_token = padded(rows, self.tok.pad_id)
        inputs, labels = mask_tokens(x, is_token, self.tok.mask_id, self.tok.vocab_size, self.n_special, g,
                                     self.mask_prob)
        return inputs, is_token, labels

    def batch(self, position: DataPosition):
        rows = [self.train_x[i] for i in self.batches.next(position)]
        return self._masked(rows, position.generator(self.args.seed))

    def training_forward(self, model, forward):
        """The output projection only at the masked positions (the rest would be thrown away)."""
        return lambda x, mask, targets: model.mlm_logits(forward(x, mask)[targets])

    def loss(self, forward, batch, smoothing):
        inputs, is_token, labels = batch
        targets = labels != -100
        logits = forward(inputs, is_token, targets)  # (n_targets, V): the head runs on targets only
        n = int(targets.sum())
        if n == 0:  # a batch where no token was drawn: nothing to learn, keep the graph connected
            return logits.sum() * 0.0, 0, int(is_token.sum())
        return F.cross_entropy(logits.float(), labels[targets], label_smoothing=smoothing), n, int(is_token.sum())

    @torch.no_grad()
    def evaluate(self, model, device, bf16) -> dict:
        return mlm_scores(model, self.dev_x, self.tok, device, bf16, seed=self.args.seed)

    def describe(self, r: dict) -> str:
        return f"dev masked-LM loss {r['dev_mlm_loss']:.4f}  accuracy {r['dev_mlm_accuracy']:.4f}"
