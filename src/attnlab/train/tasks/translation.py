"""Translation: the paper's task (encoder-decoder, teacher forcing, label smoothing, dev BLEU)."""

from __future__ import annotations

from pathlib import Path

import torch

from ...config import TransformerConfig, load_config
from ...data.batching import TokenBatchSampler, collate_pairs
from ...data.readers import DataError, Pairs, read_pairs, to_simplified
from ...data.tokenizer import Tokenizer, train_tokenizer
from .base import DataPosition, ListBatches, Task, label_smoothed_loss, forward_to_output_loss


def with_source_prefix(pairs: Pairs, prefix: str) -> Pairs:
    """T5's task prefix ("translate English to German: ") before every source sentence. It is added
    once, as the pairs are read, so the tokenizer, training and dev BLEU all see the sentences the
    model is trained on; task.json keeps it and ``attnlab.load(dir).translate`` adds it the same way."""
    return Pairs([prefix + s for s in pairs.src], pairs.tgt, pairs.source) if prefix else pairs


class TranslationTask(Task):
    """Encoder-decoder translation on TSV pairs or two aligned files: teacher forcing with label
    smoothing, token-budget batches, dev loss + BLEU."""
    name = "translation"
    summary = "encoder-decoder translation on pairs (the paper)"
    family = "encoder-decoder"
    default_preset = "mt-small"
    default_label_smoothing = 0.1
    options = ("src_col", "tgt_col", "reverse", "zh_simplified", "joint_vocab", "eval_sentences", "beam",
               "source_prefix")

    def prepare(self, args, out: Path, log) -> None:
        train = with_source_prefix(read_pairs(args.train, args.src_col, args.tgt_col, args.reverse),
                                   args.source_prefix)
        dev = with_source_prefix(read_pairs(args.dev, args.src_col, args.tgt_col, args.reverse),
                                 args.source_prefix) if args.dev else None
        tgt_text = to_simplified(train.tgt) if args.zh_simplified else train.tgt
        if (out / "tokenizer.json").exists() and (args.resume or args.reuse_tokenizer):  # the saved vocabulary
            self.src_tok = Tokenizer.load(out / "tokenizer.json")
            self.tgt_tok = Tokenizer.load(out / "tgt_tokenizer.json") if (out / "tgt_tokenizer.json").exists() else self.src_tok
        elif args.joint_vocab:
            self.src_tok = self.tgt_tok = train_tokenizer(train.src + tgt_text, args.vocab_size)
        else:
            self.src_tok = train_tokenizer(train.src, args.vocab_size)
            self.tgt_tok = train_tokenizer(tgt_text, args.vocab_size)
        self._encode(train, dev, tgt_text, args, log)

    def _encode(self, train, dev, tgt_text, args, log) -> None:
        src = self.src_tok.encode_batch(train.src, eos=True)
        tgt = self.tgt_tok.encode_batch(tgt_text, bos=True, eos=True)
        keep = [i for i in range(len(src)) if len(src[i]) <= args.max_len and len(tgt[i]) <= args.max_len + 1]
        if len(keep) < len(src):
            log(f"filtered {len(src) - len(keep)} of {len(src)} training pairs longer than --max-len {args.max_len} tokens")
        if not keep:
            raise DataError(f"{args.train}: no training pairs left after filtering by --max-len {args.max_len}")
        self.train_src, self.train_tgt = [src[i] for i in keep], [tgt[i] for i in keep]
        self.dev_src_text, self.dev_tgt_text = (dev.src, dev.tgt) if dev else ([], [])
        self.dev_src = self.src_tok.encode_batch(self.dev_src_text, eos=True)
        self.dev_tgt = self.tgt_tok.encode_batch(self.dev_tgt_text, bos=True, eos=True)
        self.batches = ListBatches(TokenBatchSampler([len(s) for s in self.train_src],
                                                      [len(t) for t in self.train_tgt], args.max_tokens, seed=args.seed))
        self.args = args

    @property
    def has_dev(self) -> bool:
        return bool(self.dev_src)

    @property
    def n_train(self) -> int:
        return len(self.train_src)

    def model_config(self, args) -> TransformerConfig:
        over = dict(args.config_overrides, vocab_size=self.src_tok.vocab_size, pad_id=0, bos_id=1, eos_id=2, unk_id=3)
        if self.src_tok is self.tgt_tok:
            over.update(tgt_vocab_size=None)
        else:
            over.update(tgt_vocab_size=self.tgt_tok.vocab_size, share_embeddings=False)
        return load_config(args.preset or self.default_preset, **over)

    def artifacts(self) -> dict:
        task = {"task": "translation"}
        if self.args.source_prefix:  # attnlab.load(dir).translate puts it before every input
            task["source_prefix"] = self.args.source_prefix
        return {"tokenizer": self.src_tok, "tgt_tokenizer": None if self.src_tok is self.tgt_tok else self.tgt_tok,
                "task": task}

    def batch(self, position: DataPosition):
        b = self.batches.next(position)
        return collate_pairs([self.train_src[i] for i in b], [self.train_tgt[i] for i in b], 0)

    def training_forward(self, model, forward):
        return forward_to_output_loss(model, forward, 0)

    def loss(self, forward, batch, smoothing):
        src, src_mask, tgt_in, labels = batch
        loss, n = forward(src, tgt_in, src_mask, labels, smoothing)
        return loss, n, int(src_mask.sum()) + n

    @torch.no_grad()
    def evaluate(self, model, device, bf16) -> dict:
        from ...evaluate.metrics import corpus_scores
        from ...generate.search import GenerationConfig
        from ...generate.translate import translate
        from ...model import eval_mode
        losses, tokens = 0.0, 0
        with eval_mode(model):  # no dropout in the dev loss (generation below sets eval mode itself)
            for s in range(0, len(self.dev_src), 64):
                batch = collate_pairs(self.dev_src[s: s + 64], self.dev_tgt[s: s + 64], 0)
                src, src_mask, tgt_in, labels = (t.to(device) for t in batch)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    logits = model(src, tgt_in, src_mask)
                loss, n = label_smoothed_loss(logits, labels, 0, 0.0)
                losses += loss.item() * n
                tokens += n
        n = min(self.args.eval_sentences, len(self.dev_src_text))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            hyps = translate(model, self.src_tok, self.tgt_tok, self.dev_src_text[:n],
                             GenerationConfig(num_beams=self.args.beam), max_src_len=self.args.max_len)
        scores = corpus_scores(hyps, self.dev_tgt_text[:n])
        return {"dev_loss": round(losses / max(tokens, 1), 4), "dev_bleu": scores["bleu"],
                "dev_chrf": scores["chrf"], "score": scores["bleu"]}

    def describe(self, r: dict) -> str:
        return f"dev loss {r['dev_loss']:.3f}  BLEU {r['dev_bleu']:.2f}  chrF {r['dev_chrf']:.2f}"
