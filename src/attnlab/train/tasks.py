"""What differs between training a translator, a language model and a classifier: the data, the
tokenizer, the batches, the loss and the validation metric. Everything else (optimizer, schedule,
accumulation, bf16, checkpoints, exact resume, DDP) is the one trainer in trainer.py.

A task provides ``prepare`` (data + tokenizers), ``model_config``, ``save_artifacts``,
``batch(trainer)`` (the next micro-batch), ``loss(forward, batch)`` and ``evaluate(model)``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import TransformerConfig, load_config
from ..data.batching import TokenBatchSampler, collate_pairs, pad_batch
from ..data.readers import DataError, read_labeled, read_pairs, read_text, to_simplified
from ..data.tokenizer import Tokenizer, char_tokenizer, train_tokenizer


def label_smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, pad_id: int | None, smoothing: float):
    """Cross-entropy with label smoothing ε (the paper: 0.1), padding ignored. Returns the mean over
    real tokens and their count."""
    ignore = pad_id if pad_id is not None else -100
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                           ignore_index=ignore, label_smoothing=smoothing)
    return loss, int((labels != ignore).sum())


def _config_with_own_vocab(task, args, family: str, min_positions: int = 0, **extra) -> TransformerConfig:
    """The preset with the task's own tokenizer (attnlab's special ids 0–3): checks the family and
    lets learned positions cover the longest training sequence."""
    over = dict(args.config_overrides, vocab_size=task.tok.vocab_size, pad_id=0, bos_id=1, eos_id=2, unk_id=3, **extra)
    cfg = load_config(args.preset or task.default_preset, **over)
    if cfg.family != family:
        raise DataError(f"--task {task.name} needs a {family} preset, {args.preset!r} is {cfg.family}")
    if cfg.positions == "learned" and cfg.max_len < min_positions:
        cfg = cfg.replace(max_len=min_positions)
    return cfg


class _ListBatches:
    """Token-budget batches over a list of examples, epoch by epoch, from the trainer's saved data
    position. With N processes, process r takes batches r, r+N, … (one optimizer step sees
    N·update_freq batches, as one process with update_freq·N would)."""

    def __init__(self, sampler: TokenBatchSampler):
        self.sampler = sampler

    def iterate(self, trainer):
        while True:
            batches = self.sampler.batches(trainer.epoch)
            usable = len(batches) - len(batches) % trainer.world
            while trainer.batch_in_epoch + trainer.world <= usable:
                i = trainer.batch_in_epoch
                trainer.batch_in_epoch += trainer.world  # before yielding: a checkpoint saved after
                yield batches[i + trainer.rank]          # this step resumes at the *next* batch
            trainer.epoch += 1
            trainer.batch_in_epoch = 0


# -- translation ------------------------------------------------------------------------------------


class TranslationTask:
    name = "translation"
    default_preset = "mt-small"
    default_label_smoothing = 0.1

    def prepare(self, args, out: Path, log) -> None:
        train = read_pairs(args.train, args.src_col, args.tgt_col, args.reverse)
        dev = read_pairs(args.dev, args.src_col, args.tgt_col, args.reverse) if args.dev else None
        tgt_text = to_simplified(train.tgt) if args.zh_simplified else train.tgt
        if (out / "tokenizer.json").exists() and (args.resume or args.reuse_tokenizer):  # the saved vocabulary
            self.src_tok = Tokenizer.load(out / "tokenizer.json")
            self.tgt_tok = Tokenizer.load(out / "tgt_tokenizer.json") if (out / "tgt_tokenizer.json").exists() else self.src_tok
        elif args.joint_vocab:
            self.src_tok = self.tgt_tok = train_tokenizer(train.src + tgt_text, args.vocab_size)
        else:
            self.src_tok = train_tokenizer(train.src, args.vocab_size)
            self.tgt_tok = train_tokenizer(tgt_text, args.vocab_size)
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
        self.batches = _ListBatches(TokenBatchSampler([len(s) for s in self.train_src],
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

    def save_artifacts(self, out: Path) -> dict:
        return {"tokenizer": self.src_tok, "tgt_tokenizer": None if self.src_tok is self.tgt_tok else self.tgt_tok,
                "task": {"task": "translation"}}

    def batch(self, trainer):
        if not hasattr(self, "_it"):
            self._it = self.batches.iterate(trainer)
        b = next(self._it)
        return collate_pairs([self.train_src[i] for i in b], [self.train_tgt[i] for i in b], 0)

    def loss(self, forward, batch, smoothing):
        src, src_mask, tgt_in, labels = batch
        loss, n = label_smoothed_loss(forward(src, tgt_in, src_mask), labels, 0, smoothing)
        return loss, n, int(src_mask.sum()) + n

    @torch.no_grad()
    def evaluate(self, model, device, bf16) -> dict:
        from ..evaluate.metrics import corpus_scores
        from ..generate.search import GenerationConfig
        from ..generate.translate import translate
        losses, tokens = 0.0, 0
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


# -- language modelling -------------------------------------------------------------------------------


class LanguageModelTask:
    """Decoder-only LM on plain text: contiguous blocks of ``block_size`` tokens at random offsets
    (nanoGPT's sampler), deterministic from (seed, step, micro-batch, rank) so resume is exact."""
    name = "lm"
    default_preset = "gpt-mini"
    default_label_smoothing = 0.0

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

    has_dev = True

    @property
    def n_train(self) -> int:
        return len(self.train_ids)

    def model_config(self, args) -> TransformerConfig:
        return _config_with_own_vocab(self, args, "decoder-only", min_positions=args.block_size)

    def save_artifacts(self, out: Path) -> dict:
        return {"tokenizer": self.tok, "task": {"task": "lm", "block_size": self.args.block_size,
                                                "tokenizer": self.args.tokenizer}}

    def block_offsets(self, n_tokens: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """Start offsets such that x = data[i:i+T] and y = data[i+1:i+T+1] stay inside the data."""
        return torch.randint(0, n_tokens - self.args.block_size, (batch_size,), generator=generator)

    def batch(self, trainer):
        micro = getattr(self, "_micro", 0)
        self._micro = micro + 1
        g = torch.Generator().manual_seed(
            hash((self.args.seed, trainer.step, micro % self.args.update_freq, trainer.rank)) % 2 ** 62)
        T = self.args.block_size
        ix = self.block_offsets(len(self.train_ids), self.args.batch_size, g)
        x = torch.stack([self.train_ids[i: i + T] for i in ix.tolist()])
        y = torch.stack([self.train_ids[i + 1: i + 1 + T] for i in ix.tolist()])
        return x, y

    def loss(self, forward, batch, smoothing):
        x, y = batch
        loss, n = label_smoothed_loss(forward(x), y, None, smoothing)
        return loss, n, n

    @torch.no_grad()
    def evaluate(self, model, device, bf16) -> dict:
        """Loss over the whole validation split in consecutive blocks (exact, not sampled)."""
        return lm_loss(model, self.val_ids, self.args.block_size, device, bf16, self.args.eval_batches)

    def describe(self, r: dict) -> str:
        return f"val loss {r['val_loss']:.4f}  perplexity {r['val_ppl']:.2f}"


@torch.no_grad()
def lm_loss(model, ids: torch.Tensor, block_size: int, device, bf16: bool = False, max_blocks: int = 0,
            batch_size: int = 32) -> dict:
    n_blocks = (len(ids) - 1) // block_size
    if max_blocks:
        n_blocks = min(n_blocks, max_blocks)
    if n_blocks == 0:
        raise DataError(f"evaluation text has {len(ids)} tokens, fewer than one block of {block_size}")
    total, count = 0.0, 0
    was = model.training
    model.eval()
    for s in range(0, n_blocks, batch_size):
        starts = range(s * block_size, min(n_blocks, s + batch_size) * block_size, block_size)
        x = torch.stack([ids[i: i + block_size] for i in starts]).to(device)
        y = torch.stack([ids[i + 1: i + 1 + block_size] for i in starts]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
        total += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
        count += y.numel()
    model.train(was)
    loss = total / count
    return {"val_loss": round(loss, 4), "val_ppl": round(math.exp(loss), 3), "score": -loss, "tokens": count}


# -- classification -------------------------------------------------------------------------------


class ClassificationTask:
    """Encoder-only classifier on ``label<TAB>text`` (or CSV) rows, from scratch or fine-tuning a
    pretrained encoder (``--init minilm``) with a classification head on the pooled output."""
    name = "classify"
    default_preset = "bert-mini"
    default_label_smoothing = 0.0

    def prepare(self, args, out: Path, log) -> None:
        train = read_labeled(args.train, args.label_col, args.text_col)
        self.labels = sorted(set(train.labels))
        if args.dev:
            dev = read_labeled(args.dev, args.label_col, args.text_col, known_labels=self.labels)
        else:  # hold out a seeded dev split from the training file
            g = torch.Generator().manual_seed(args.seed)
            perm = torch.randperm(len(train.labels), generator=g).tolist()
            n_dev = max(1, int(len(perm) * args.val_fraction))
            dev_idx, train_idx = set(perm[:n_dev]), perm[n_dev:]
            dev = type(train)([train.labels[i] for i in sorted(dev_idx)], [train.texts[i] for i in sorted(dev_idx)], train.source)
            train = type(train)([train.labels[i] for i in train_idx], [train.texts[i] for i in train_idx], train.source)
        self.init = None
        self.add_bos = True  # attnlab's tokenizers: BOS is the pooled ([CLS]) position
        if args.init and (Path(args.init) / "config.json").exists():  # e.g. a `--task mlm` directory
            from ..modeldir import load
            from ..pretrained import Pretrained
            model, tok, _ = load(args.init, need_tokenizer=True)
            if model.config.family != "encoder-only":
                raise DataError(f"--init {args.init}: a {model.config.family} model cannot initialise a classifier")
            self.init, self.tok = Pretrained(model, tok), tok
        elif args.init:
            from ..pretrained import load_pretrained
            self.init = load_pretrained(args.init)
            self.tok = self.init.tokenizer
            self.tok.tk.enable_truncation(min(args.max_len, self.init.model.config.max_len))
            self.add_bos = False  # the pretrained tokenizer adds [CLS] … [SEP] itself
        elif (out / "tokenizer.json").exists() and args.resume:
            self.tok = Tokenizer.load(out / "tokenizer.json")
        else:
            self.tok = train_tokenizer(train.texts, args.vocab_size)
        self.args = args
        enc = self._encode(train.texts)
        self.train_x, self.train_y = enc, [self.labels.index(l) for l in train.labels]
        self.dev_x, self.dev_y = self._encode(dev.texts), [self.labels.index(l) for l in dev.labels]
        self.batches = _ListBatches(TokenBatchSampler([len(x) for x in self.train_x], [1] * len(self.train_x),
                                                      args.max_tokens, seed=args.seed, max_sentences=args.batch_size))
        log(f"classification data: {len(self.train_x):,} train / {len(self.dev_x):,} dev examples, "
            f"labels {self.labels}")

    def _encode(self, texts):
        return encode_for_classifier(self.tok, texts, {"add_bos": self.add_bos, "max_len": self.args.max_len})

    has_dev = True

    @property
    def n_train(self) -> int:
        return len(self.train_x)

    def model_config(self, args) -> TransformerConfig:
        if self.init is not None:
            base = self.init.model.config
            return base.replace(n_classes=len(self.labels), **args.config_overrides)
        return _config_with_own_vocab(self, args, "encoder-only", min_positions=args.max_len,
                                      n_classes=len(self.labels))

    def init_weights(self, model) -> None:
        if self.init is not None:
            missing, unexpected = model.load_state_dict(self.init.model.state_dict(), strict=False)
            assert not unexpected and all(m.startswith("classifier") for m in missing), (missing, unexpected)

    def save_artifacts(self, out: Path) -> dict:
        return {"tokenizer": self.tok, "task": {"task": "classify", "labels": self.labels,
                                                "add_bos": self.add_bos, "max_len": self.args.max_len,
                                                "init": self.args.init}}

    def batch(self, trainer):
        if not hasattr(self, "_it"):
            self._it = self.batches.iterate(trainer)
        b = next(self._it)
        pad = self.tok.pad_id if self.add_bos else self.init.model.config.pad_id
        x = pad_batch([self.train_x[i] for i in b], pad)
        mask = torch.zeros_like(x, dtype=torch.bool)
        for j, i in enumerate(b):
            mask[j, : len(self.train_x[i])] = True
        return x, mask, torch.tensor([self.train_y[i] for i in b])

    def loss(self, forward, batch, smoothing):
        x, mask, y = batch
        logits = forward(x, mask)
        return F.cross_entropy(logits.float(), y, label_smoothing=smoothing), len(y), int(mask.sum())

    @torch.no_grad()
    def evaluate(self, model, device, bf16) -> dict:
        from ..evaluate.classification import classification_scores
        pred = predict_classes(model, self.dev_x, device, bf16)[0]
        s = classification_scores(self.dev_y, pred, len(self.labels))
        return {"dev_accuracy": s["accuracy"], "dev_macro_f1": s["macro_f1"], "score": s["accuracy"]}

    def describe(self, r: dict) -> str:
        return f"dev accuracy {r['dev_accuracy']:.4f}  macro-F1 {r['dev_macro_f1']:.4f}"


@torch.no_grad()
def predict_classes(model, encoded: list[list[int]], device, bf16: bool = False, batch_size: int = 64):
    """(predicted class ids, probabilities of the prediction) for already tokenized texts."""
    was = model.training
    model.eval()
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    pred, prob = [0] * len(encoded), [0.0] * len(encoded)
    for s in range(0, len(order), batch_size):
        idx = order[s: s + batch_size]
        x = pad_batch([encoded[i] for i in idx], model.config.pad_id).to(device)
        mask = torch.zeros_like(x, dtype=torch.bool)
        for j, i in enumerate(idx):
            mask[j, : len(encoded[i])] = True
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            p = model.classify(x, mask).float().softmax(-1)
        top = p.max(-1)
        for j, i in enumerate(idx):
            pred[i], prob[i] = int(top.indices[j]), float(top.values[j])
    model.train(was)
    return pred, prob


# -- masked-language-model pretraining --------------------------------------------------------------


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


def mlm_rows(tok, lines: list[str], max_len: int) -> list[list[int]]:
    """One example per line: ``<s>`` ids ``</s>``, truncated to ``max_len`` tokens."""
    n = max_len - 2
    return [[tok.bos_id] + ids[:n] + [tok.eos_id] for ids in tok.encode_batch(lines)]


def _n_special(tok) -> int:
    """Ids below this are special (padding, <s>, </s>, <unk>, <mask>): never masked, never drawn."""
    return max(tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id, tok.mask_id) + 1


class MaskedLMTask:
    """Encoder-only masked-language-model pretraining (BERT) on plain text, one example per line
    (``<s>`` … ``</s>``, truncated to ``--max-len``), token-budget batches, fresh masks every step
    drawn from (seed, step, micro-batch, rank) so resume is exact. The pretrained directory can then
    initialise a classifier: ``attnlab train --task classify --init DIR``."""
    name = "mlm"
    default_preset = "bert-mini"
    default_label_smoothing = 0.0
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
        self.n_special = _n_special(self.tok)
        self.args = args
        self.train_x, self.dev_x = mlm_rows(self.tok, lines, args.max_len), mlm_rows(self.tok, dev, args.max_len)
        self.batches = _ListBatches(TokenBatchSampler([len(x) for x in self.train_x], [1] * len(self.train_x),
                                                      args.max_tokens, seed=args.seed, max_sentences=args.batch_size))
        log(f"masked-LM data: {len(self.train_x):,} train / {len(self.dev_x):,} dev lines, "
            f"vocabulary {self.tok.vocab_size}")

    has_dev = True

    @property
    def n_train(self) -> int:
        return len(self.train_x)

    def model_config(self, args) -> TransformerConfig:
        return _config_with_own_vocab(self, args, "encoder-only", min_positions=args.max_len)

    def save_artifacts(self, out: Path) -> dict:
        return {"tokenizer": self.tok, "task": {"task": "mlm", "max_len": self.args.max_len}}

    def _masked(self, rows: list[list[int]], g: torch.Generator):
        x = pad_batch(rows, self.tok.pad_id)
        is_token = torch.zeros_like(x, dtype=torch.bool)
        for j, r in enumerate(rows):
            is_token[j, : len(r)] = True
        inputs, labels = mask_tokens(x, is_token, self.tok.mask_id, self.tok.vocab_size, self.n_special, g,
                                     self.mask_prob)
        return inputs, is_token, labels

    def batch(self, trainer):
        if not hasattr(self, "_it"):
            self._it = self.batches.iterate(trainer)
        micro = getattr(self, "_micro", 0)
        self._micro = micro + 1
        g = torch.Generator().manual_seed(
            hash((self.args.seed, trainer.step, micro % self.args.update_freq, trainer.rank, "mlm")) % 2 ** 62)
        return self._masked([self.train_x[i] for i in next(self._it)], g)

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


@torch.no_grad()
def mlm_scores(model, encoded: list[list[int]], tok, device, bf16: bool = False, seed: int = 1,
               batch_size: int = 64) -> dict:
    """Masked-LM loss and accuracy on the chosen positions, with masks drawn from a fixed seed (so
    evaluations of different checkpoints see the same corruption)."""
    was = model.training
    model.eval()
    g = torch.Generator().manual_seed(seed)
    total, correct, count = 0.0, 0, 0
    for s in range(0, len(encoded), batch_size):
        rows = encoded[s: s + batch_size]
        x = pad_batch(rows, tok.pad_id)
        is_token = torch.zeros_like(x, dtype=torch.bool)
        for j, r in enumerate(rows):
            is_token[j, : len(r)] = True
        inputs, labels = mask_tokens(x, is_token, tok.mask_id, tok.vocab_size, _n_special(tok), g)
        targets = labels != -100
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model.mlm_logits(model(inputs.to(device), is_token.to(device))[targets.to(device)]).float()
        y = labels[targets].to(device)
        total += F.cross_entropy(logits, y, reduction="sum").item()
        correct += int((logits.argmax(-1) == y).sum())
        count += len(y)
    model.train(was)
    loss = total / max(count, 1)
    return {"dev_mlm_loss": round(loss, 4), "dev_mlm_accuracy": round(correct / max(count, 1), 4),
            "dev_mlm_ppl": round(math.exp(min(loss, 50)), 3), "score": -loss, "tokens": count}


TASKS = {"translation": TranslationTask, "lm": LanguageModelTask, "classify": ClassificationTask,
         "mlm": MaskedLMTask}


def save_task_info(out: Path, info: dict) -> None:
    """task.json: what the model directory was trained for (labels, block size, …)."""
    from ..modeldir import atomic_write_text
    atomic_write_text(out / "task.json", json.dumps(info, ensure_ascii=False, indent=2) + "\n")


def load_task_info(directory) -> dict:
    d = Path(directory)
    if not d.exists():
        raise FileNotFoundError(f"{d}: no such model directory")
    if not (d / "config.json").exists():
        raise FileNotFoundError(f"{d}: not a model directory (no config.json)")
    p = d / "task.json"
    if not p.exists():
        return {"task": "translation"}
    try:
        info = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{p}: not UTF-8 text (a damaged model directory?)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}:{e.lineno}: not valid JSON ({e.msg}); a damaged model directory?") from None
    if not isinstance(info, dict) or info.get("task") not in TASKS:
        raise ValueError(f"{p}: expected a JSON object with \"task\": one of {', '.join(TASKS)}")
    if info["task"] == "classify" and not (isinstance(info.get("labels"), list) and info["labels"]):
        raise ValueError(f"{p}: a classifier's task.json needs its \"labels\" list")
    return info


def encode_for_classifier(tok, texts: list[str], info: dict) -> list[list[int]]:
    if info.get("add_bos", True):
        return [ids[: info.get("max_len", 128) - 1] for ids in tok.encode_batch(texts, bos=True)]
    return tok.encode_batch(texts)
