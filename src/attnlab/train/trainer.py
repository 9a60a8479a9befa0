"""Training with the paper's recipe: teacher forcing, label smoothing, Adam(0.9, 0.98, 1e-9) with
warmup, token-budget batches, gradient accumulation and clipping, bf16 autocast, validation with
BLEU, best-checkpoint keeping, early stopping, exact resume, and DistributedDataParallel under
``torchrun``."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..config import load_config
from ..data.batching import TokenBatchSampler, collate_pairs
from ..data.readers import DataError, read_pairs, to_simplified
from ..data.tokenizer import Tokenizer, train_tokenizer
from ..model import build_model
from ..modeldir import atomic_write, atomic_write_text, load_weights, save_model_dir


@dataclass
class TrainArgs:
    """Every option of ``attnlab train`` (saved as training_args.json)."""
    out: str = "runs/model"
    train: str = ""                 # TSV file, or SRC_FILE,TGT_FILE
    dev: str = ""
    src_col: int = 0
    tgt_col: int = 1
    reverse: bool = False
    zh_simplified: bool = False     # OpenCC Traditional → Simplified on the Chinese target
    preset: str = "mt-small"
    config_overrides: dict = field(default_factory=dict)
    vocab_size: int = 8000          # per side (separate) or joint
    joint_vocab: bool = False
    max_len: int = 128              # tokens per side; longer pairs are filtered (counted)
    max_tokens: int = 4000          # tokens per batch (per process)
    update_freq: int = 1
    lr: float | None = None         # peak learning rate; None: the paper's d^-0.5 · warmup^-0.5
    schedule: str = "inverse_sqrt"  # inverse_sqrt (= the paper's), cosine, constant
    warmup: int = 4000
    min_lr: float = 0.0
    label_smoothing: float = 0.1
    clip_norm: float = 1.0
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.98)
    eps: float = 1e-9
    bf16: bool = False
    compile: bool = False
    seed: int = 1
    max_steps: int | None = None
    minutes: float | None = None
    eval_every: int = 500
    eval_sentences: int = 300       # dev subset for BLEU during training
    beam: int = 1                   # beam size for dev BLEU
    patience: int = 0               # early stopping after N evaluations without improvement (0: off)
    save_every: int = 500
    keep_last: int = 5              # step checkpoints kept for `attnlab average`
    resume: bool = False
    threads: int | None = None
    progress: bool = True
    device: str = "auto"


def pick_device(name: str = "auto") -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def learning_rate(step: int, args: TrainArgs, d_model: int, progress: float | None = None) -> float:
    """The paper: lr = d^-0.5 · min(step^-0.5, step · warmup^-1.5): linear warmup to
    d^-0.5·warmup^-0.5, then ∝ 1/√step. ``--lr`` sets another peak with the same shape.
    cosine: warmup, then a half cosine to min_lr over the run (``progress`` ∈ [0, 1])."""
    step = max(step, 1)
    peak = args.lr if args.lr is not None else d_model ** -0.5 * args.warmup ** -0.5
    if step < args.warmup:
        return peak * step / args.warmup
    if args.schedule == "inverse_sqrt":
        return peak * math.sqrt(args.warmup / step)
    if args.schedule == "cosine":
        p = min(max(progress or 0.0, 0.0), 1.0)
        return args.min_lr + 0.5 * (peak - args.min_lr) * (1 + math.cos(math.pi * p))
    return peak


# -- distributed -------------------------------------------------------------------------------------


def dist_info() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init_distributed(device: torch.device) -> None:
    import torch.distributed as dist
    if dist_info()[1] > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


# -- data ----------------------------------------------------------------------------------------------


@dataclass
class TranslationData:
    src_tok: Tokenizer
    tgt_tok: Tokenizer
    train_src: list[list[int]]
    train_tgt: list[list[int]]
    dev_src_text: list[str]
    dev_tgt_text: list[str]
    dev_src: list[list[int]]
    dev_tgt: list[list[int]]
    filtered: int


def prepare_translation_data(args: TrainArgs, out: Path, log=print) -> TranslationData:
    train = read_pairs(args.train, args.src_col, args.tgt_col, args.reverse)
    dev = read_pairs(args.dev, args.src_col, args.tgt_col, args.reverse) if args.dev else None
    train_tgt_text = to_simplified(train.tgt) if args.zh_simplified else train.tgt
    if (out / "tokenizer.json").exists():  # resume: the saved vocabulary, never a retrained one
        src_tok = Tokenizer.load(out / "tokenizer.json")
        tgt_tok = Tokenizer.load(out / "tgt_tokenizer.json") if (out / "tgt_tokenizer.json").exists() else src_tok
    elif args.joint_vocab:
        src_tok = tgt_tok = train_tokenizer(train.src + train_tgt_text, args.vocab_size)
    else:
        src_tok = train_tokenizer(train.src, args.vocab_size)
        tgt_tok = train_tokenizer(train_tgt_text, args.vocab_size)
    src_ids = src_tok.encode_batch(train.src, eos=True)
    tgt_ids = tgt_tok.encode_batch(train_tgt_text, bos=True, eos=True)
    keep = [i for i in range(len(src_ids)) if len(src_ids[i]) <= args.max_len and len(tgt_ids[i]) <= args.max_len + 1]
    filtered = len(src_ids) - len(keep)
    if filtered:
        log(f"filtered {filtered} of {len(src_ids)} training pairs longer than --max-len {args.max_len} tokens")
    if not keep:
        raise DataError(f"{args.train}: no training pairs left after filtering by --max-len {args.max_len}")
    dev_src_text, dev_tgt_text = (dev.src, dev.tgt) if dev else ([], [])
    return TranslationData(
        src_tok, tgt_tok, [src_ids[i] for i in keep], [tgt_ids[i] for i in keep], dev_src_text, dev_tgt_text,
        src_tok.encode_batch(dev_src_text, eos=True), tgt_tok.encode_batch(dev_tgt_text, bos=True, eos=True),
        filtered)


# -- the trainer ---------------------------------------------------------------------------------------


def label_smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, pad_id: int, smoothing: float):
    """Cross-entropy with label smoothing ε (the paper: 0.1), padding ignored. Returns the mean over
    real tokens and the count of real tokens."""
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                           ignore_index=pad_id, label_smoothing=smoothing)
    return loss, int((labels != pad_id).sum())


class Trainer:
    def __init__(self, args: TrainArgs, log=print):
        self.args, self.log = args, log
        self.rank, self.world = dist_info()
        self.device = pick_device(args.device)
        if self.world > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        init_distributed(self.device)
        if args.threads:
            torch.set_num_threads(args.threads)
        self.out = Path(args.out)
        self.is_main = self.rank == 0

    # -- setup ------------------------------------------------------------------------------------
    def setup(self) -> None:
        args = self.args
        torch.manual_seed(args.seed)
        random.seed(args.seed)
        np.random.seed(args.seed)
        self.data = prepare_translation_data(args, self.out, self.log if self.is_main else (lambda *a: None))
        joint = self.data.src_tok is self.data.tgt_tok
        overrides = dict(args.config_overrides)
        overrides.update(vocab_size=self.data.src_tok.vocab_size, pad_id=0, bos_id=1, eos_id=2, unk_id=3)
        if joint:
            overrides.update(tgt_vocab_size=None)
        else:
            overrides.update(tgt_vocab_size=self.data.tgt_tok.vocab_size, share_embeddings=False)
        cfg = load_config(args.preset, **overrides)
        self.model = build_model(cfg).to(self.device)
        self.config = cfg
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=0.0, betas=tuple(args.betas), eps=args.eps)
        self.ddp_model = self.model
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel
            self.ddp_model = DistributedDataParallel(self.model, device_ids=[self.device.index]
                                                     if self.device.type == "cuda" else None)
        self.forward = torch.compile(self.ddp_model) if args.compile else self.ddp_model
        self.sampler = TokenBatchSampler([len(s) for s in self.data.train_src], [len(t) for t in self.data.train_tgt],
                                         args.max_tokens, seed=args.seed)
        self.step, self.epoch, self.batch_in_epoch = 0, 0, 0
        self.elapsed_before = 0.0
        self.best, self.bad_evals = None, 0
        self.history: list[dict] = []
        if args.resume and (self.out / "checkpoint_last.pt").exists():
            self._load_state()
        elif self.is_main:
            save_model_dir(self.out, self.model, self.data.src_tok, None if joint else self.data.tgt_tok,
                           training_args=dataclasses.asdict(args))

    # -- checkpoints --------------------------------------------------------------------------------
    def _state(self) -> dict:
        return {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
            "elapsed": self.elapsed_before + (time.time() - self.t0),
            "best": self.best, "bad_evals": self.bad_evals,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        }

    def save_checkpoint(self) -> None:
        if not self.is_main:
            return
        state = self._state()
        atomic_write(self.out / "checkpoint_last.pt", lambda tmp: torch.save(state, tmp))
        from ..modeldir import save_weights
        ckpt_dir = self.out / "checkpoints"
        save_weights(self.model, ckpt_dir / f"step_{self.step:08d}.safetensors")
        for old in sorted(ckpt_dir.glob("step_*.safetensors"))[: -self.args.keep_last]:
            old.unlink()

    def _load_state(self) -> None:
        state = torch.load(self.out / "checkpoint_last.pt", map_location="cpu", weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.elapsed_before = state["elapsed"]
        self.best, self.bad_evals = state["best"], state["bad_evals"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        self.log(f"resumed from {self.out / 'checkpoint_last.pt'} at step {self.step}")

    def _metrics(self, record: dict) -> None:
        if not self.is_main:
            return
        self.history.append(record)
        with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    # -- evaluation -----------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        from ..evaluate.metrics import corpus_scores
        from ..generate.search import GenerationConfig
        from ..generate.translate import translate
        model, d = self.model, self.data
        model.eval()
        losses, tokens = 0.0, 0
        idx = list(range(len(d.dev_src)))
        for s in range(0, len(idx), 64):
            b = idx[s: s + 64]
            src, src_mask, tgt_in, labels = collate_pairs([d.dev_src[i] for i in b], [d.dev_tgt[i] for i in b], 0)
            src, src_mask, tgt_in, labels = (t.to(self.device) for t in (src, src_mask, tgt_in, labels))
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.args.bf16):
                logits = model(src, tgt_in, src_mask)
            loss, n = label_smoothed_loss(logits, labels, 0, 0.0)
            losses += loss.item() * n
            tokens += n
        n = min(self.args.eval_sentences, len(d.dev_src_text))
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.args.bf16):
            hyps = translate(model, d.src_tok, d.tgt_tok, d.dev_src_text[:n],
                             GenerationConfig(num_beams=self.args.beam), max_src_len=self.args.max_len)
        scores = corpus_scores(hyps, d.dev_tgt_text[:n])
        model.train()
        return {"dev_loss": round(losses / max(tokens, 1), 4), "dev_bleu": scores["bleu"], "dev_chrf": scores["chrf"]}

    # -- the loop -------------------------------------------------------------------------------------
    def _batches(self):
        """(epoch, index in epoch, batch) forever, starting at the saved data position. With N
        processes, process r takes batches r, r+N, … so one optimizer step sees N·update_freq
        batches in total, exactly as one process with update_freq·N would."""
        while True:
            batches = self.sampler.batches(self.epoch)
            usable = len(batches) - len(batches) % self.world
            while self.batch_in_epoch + self.world <= usable:
                i = self.batch_in_epoch
                self.batch_in_epoch += self.world  # before yielding: a checkpoint saved after this
                yield batches[i + self.rank]       # step must resume at the *next* batch
            self.epoch += 1
            self.batch_in_epoch = 0

    def train(self) -> dict:
        args, model, d = self.args, self.model, self.data
        self.setup() if not hasattr(self, "model") else None
        model, d = self.model, self.data
        model.train()
        self.t0 = time.time()
        budget = args.minutes * 60 if args.minutes else None
        bar = None
        if self.is_main and args.progress:
            from tqdm import tqdm
            bar = tqdm(total=args.max_steps or int(budget or 0) or None, initial=self.step if args.max_steps else 0,
                       unit="step" if args.max_steps else "s", dynamic_ncols=True, mininterval=1.0)
        batches = self._batches()
        tok_count, loss_sum, loss_n, t_log = 0, 0.0, 0, time.time()
        stop_reason = "max steps"
        while True:
            elapsed = self.elapsed_before + time.time() - self.t0
            if args.max_steps is not None and self.step >= args.max_steps:
                break
            if budget is not None and elapsed >= budget:
                stop_reason = "time budget"
                break
            progress = (self.step / args.max_steps if args.max_steps else elapsed / budget if budget else 0.0)
            lr = learning_rate(self.step + 1, args, self.config.d_model, progress)
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            self.optimizer.zero_grad(set_to_none=True)
            for micro in range(args.update_freq):
                b = next(batches)
                src, src_mask, tgt_in, labels = collate_pairs([d.train_src[i] for i in b], [d.train_tgt[i] for i in b], 0)
                src, src_mask, tgt_in, labels = (t.to(self.device) for t in (src, src_mask, tgt_in, labels))
                sync = micro == args.update_freq - 1 or self.world == 1
                ctx = self.ddp_model.no_sync() if (self.world > 1 and not sync) else _nullcontext()
                with ctx:
                    with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=args.bf16):
                        logits = self.forward(src, tgt_in, src_mask)
                    loss, n = label_smoothed_loss(logits, labels, 0, args.label_smoothing)
                    (loss / args.update_freq).backward()
                loss_sum += loss.item() * n
                loss_n += n
                tok_count += int(src_mask.sum()) + n
            if args.clip_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
            self.optimizer.step()
            self.step += 1
            if bar is not None:
                now = time.time()
                if args.max_steps:
                    bar.update(1)
                else:
                    bar.n = min(int(self.elapsed_before + now - self.t0), bar.total or 0)
                bar.set_postfix_str(f"step {self.step} loss {loss_sum / max(loss_n, 1):.3f} lr {lr:.2e} "
                                    f"tok/s {tok_count * self.world / max(now - t_log, 1e-9):,.0f}", refresh=False)
            if self.step % 50 == 0:
                now = time.time()
                self._metrics({"step": self.step, "train_loss": round(loss_sum / max(loss_n, 1), 4), "lr": lr,
                               "tokens_per_s": round(tok_count * self.world / max(now - t_log, 1e-9)),
                               "elapsed": round(self.elapsed_before + now - self.t0, 1)})
                tok_count, loss_sum, loss_n, t_log = 0, 0.0, 0, now
            if args.eval_every and self.step % args.eval_every == 0 and d.dev_src:
                if self._evaluate_and_keep_best():
                    stop_reason = "early stopping"
                    break
            if args.save_every and self.step % args.save_every == 0:
                self.save_checkpoint()
        if bar is not None:
            bar.close()
        result = {"steps": self.step, "stop": stop_reason,
                  "elapsed": round(self.elapsed_before + time.time() - self.t0, 1)}
        if d.dev_src and (not self.history or self.history[-1].get("step") != self.step or "dev_bleu" not in self.history[-1]):
            self._evaluate_and_keep_best()
        self.save_checkpoint()
        if self.is_main and self.best is None:  # no dev set: the last weights are the model
            from ..modeldir import save_weights
            save_weights(model, self.out / "model.safetensors")
        result["best"] = self.best
        if self.world > 1:
            import torch.distributed as dist
            dist.barrier()
        return result

    def _evaluate_and_keep_best(self) -> bool:
        """Evaluate on dev; keep the best weights (by BLEU) as model.safetensors. True = stop early."""
        if not self.is_main:
            return False
        scores = self.evaluate()
        scores["step"] = self.step
        scores["elapsed"] = round(self.elapsed_before + time.time() - self.t0, 1)
        self._metrics(scores)
        self.log(f"step {self.step}: dev loss {scores['dev_loss']:.3f}  BLEU {scores['dev_bleu']:.2f}  "
                 f"chrF {scores['dev_chrf']:.2f}")
        if self.best is None or scores["dev_bleu"] > self.best["dev_bleu"]:
            self.best, self.bad_evals = scores, 0
            from ..modeldir import save_weights
            save_weights(self.model, self.out / "model.safetensors")
        else:
            self.bad_evals += 1
        return bool(self.args.patience and self.bad_evals >= self.args.patience)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def average_checkpoints(directory: str | Path, last: int = 5, out: str | Path | None = None) -> Path:
    """Average the weights of the last N step checkpoints (the paper averages the last 5 for base
    models) into ``out`` (default: DIR/model.safetensors)."""
    from safetensors.torch import load_file, save_file
    d = Path(directory)
    files = sorted((d / "checkpoints").glob("step_*.safetensors"))[-last:]
    if not files:
        raise FileNotFoundError(f"{d}/checkpoints: no step_*.safetensors to average")
    total = None
    for f in files:
        state = load_file(str(f))
        if total is None:
            total = {k: v.double() for k, v in state.items()}
        else:
            for k, v in state.items():
                total[k] += v.double()
    avg = {k: (v / len(files)).float() for k, v in total.items()}
    target = Path(out) if out else d / "model.safetensors"
    atomic_write(target, lambda tmp: save_file(avg, tmp, metadata={"format": "pt", "averaged": str(len(files))}))
    return target


__all__ = ["TrainArgs", "Trainer", "learning_rate", "average_checkpoints", "label_smoothed_loss",
           "load_weights", "atomic_write_text"]
