"""Classification: encoder-only, a head on the pooled output; from scratch or from a pretrained encoder."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ...config import TransformerConfig
from ...data.batching import TokenBatchSampler, padded
from ...data.encoding import encode_for_classifier
from ...data.readers import DataError, read_labeled
from ...data.tokenizer import Tokenizer, train_tokenizer
from ...evaluate.scoring import predict_classes
from .base import DataPosition, ListBatches, Task, config_with_own_vocab


class ClassificationTask(Task):
    """Encoder-only classifier on ``label<TAB>text`` (or CSV) rows, from scratch or fine-tuning a
    pretrained encoder (``--init minilm``) with a classification head on the pooled output."""
    name = "classify"
    summary = "encoder-only text classification (from scratch, or --init minilm / an mlm directory)"
    family = "encoder-only"
    default_preset = "bert-mini"
    default_label_smoothing = 0.0
    options = ("label_col", "text_col", "init")  # flags that only this task reads

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
            from ...modeldir import load
            from ...pretrained import Pretrained
            model, tok, _ = load(args.init, need_tokenizer=True)
            if model.config.family != "encoder-only":
                raise DataError(f"--init {args.init}: a {model.config.family} model cannot initialise a classifier")
            self.init, self.tok = Pretrained(model, tok), tok
        elif args.init:
            from ...pretrained import load_pretrained
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
        self.batches = ListBatches(TokenBatchSampler([len(x) for x in self.train_x], [1] * len(self.train_x),
                                                      args.max_tokens, seed=args.seed, max_sentences=args.batch_size))
        log(f"classification data: {len(self.train_x):,} train / {len(self.dev_x):,} dev examples, "
            f"labels {self.labels}")

    def _encode(self, texts):
        return encode_for_classifier(self.tok, texts, {"add_bos": self.add_bos, "max_len": self.args.max_len})

    @property
    def n_train(self) -> int:
        return len(self.train_x)

    def model_config(self, args) -> TransformerConfig:
        if self.init is not None:
            base = self.init.model.config
            return base.replace(n_classes=len(self.labels), **args.config_overrides)
        return config_with_own_vocab(self, args, min_positions=args.max_len, n_classes=len(self.labels))

    def init_weights(self, model) -> None:
        if self.init is not None:
            missing, unexpected = model.load_state_dict(self.init.model.state_dict(), strict=False)
            assert not unexpected and all(m.startswith("classifier") for m in missing), (missing, unexpected)

    def artifacts(self) -> dict:
        return {"tokenizer": self.tok, "task": {"task": "classify", "labels": self.labels,
                                                "add_bos": self.add_bos, "max_len": self.args.max_len,
                                                "init": self.args.init}}

    def batch(self, position: DataPosition):
        b = self.batches.next(position)
        pad = self.tok.pad_id if self.add_bos else self.init.model.config.pad_id
        x, mask = padded([self.train_x[i] for i in b], pad)
        return x, mask, torch.tensor([self.train_y[i] for i in b])

    def training_forward(self, model, forward):
        """The classification head on the pooled hidden states of the (possibly DDP-wrapped) forward."""
        return lambda x, mask: model.classifier(model.pool(forward(x, mask), mask))

    def loss(self, forward, batch, smoothing):
        x, mask, y = batch
        logits = forward(x, mask)
        return F.cross_entropy(logits.float(), y, label_smoothing=smoothing), len(y), int(mask.sum())

    @torch.no_grad()
    def evaluate(self, model, device, bf16) -> dict:
        from ...evaluate.classification import classification_scores
        pred = predict_classes(model, self.dev_x, device, bf16)[0]
        s = classification_scores(self.dev_y, pred, len(self.labels))
        return {"dev_accuracy": s["accuracy"], "dev_macro_f1": s["macro_f1"], "score": s["accuracy"]}

    def describe(self, r: dict) -> str:
        return f"dev accuracy {r['dev_accuracy']:.4f}  macro-F1 {r['dev_macro_f1']:.4f}"
