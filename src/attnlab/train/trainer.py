"""Training with the paper's recipe: teacher forcing, label smoothing, Adam(0.9, 0.98, 1e-9) with
warmup, token-budget batches, gradient accumulation and clipping, bf16 autocast, validation with
BLEU, best-checkpoint keeping, early stopping, exact resume, and DistributedDataParallel under
``torchrun``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import torch

from ..accel import accelerate_for_training, keep_freed_memory, pick_device, resolve_bf16
from ..model import build_model
from ..modeldir import atomic_write, save_model_dir, save_task_info, save_weights
from .clipping import clip_grad_norm
from .options import TrainArgs
from .tasks import TASKS, DataPosition, label_smoothed_loss


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
    if args.schedule == "cosine":  # progress runs from the end of warmup to the end of training
        p = min(max(progress or 0.0, 0.0), 1.0)
        return args.min_lr + 0.5 * (peak - args.min_lr) * (1 + math.cos(math.pi * p))
    return peak


# -- distributed -------------------------------------------------------------------------------------


def make_adamw(groups, **kwargs) -> torch.optim.AdamW:
    """AdamW with PyTorch's fused kernel (one pass over each parameter for the whole update, instead of
    a dozen elementwise ops per parameter group), where this device has it; the multi-tensor
    ("foreach") implementation otherwise. Same algorithm, same state dict: checkpoints load either way."""
    try:
        opt = torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
        return torch.optim.AdamW(groups, **kwargs)
    # the fused kernel writes the parameters without bumping their version counters (the foreach one
    # does), and the version is how whatever is derived from the weights knows to renew itself
    # (accel.PackedLinear's packs for an evaluation, the compiled decode step's frozen weights)
    opt.register_step_post_hook(_bump_versions)
    return opt


def _bump_versions(opt, args, kwargs) -> None:
    torch.autograd.graph.increment_version([p for group in opt.param_groups for p in group["params"]])


def dist_info() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init_distributed(device: torch.device) -> None:
    import torch.distributed as dist
    if dist_info()[1] > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


# -- the trainer ---------------------------------------------------------------------------------------


def _log(*parts) -> None:
    print(*parts, flush=True)


class Trainer:
    """One loop for every task: accumulation, clipping, schedule, bf16, eval, checkpoints, resume."""

    def __init__(self, args: TrainArgs, log=_log):
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
        # --bf16 means bf16 where it is native; an emulating CPU trains in fp32 (one line says so).
        self.bf16 = resolve_bf16(args.bf16, self.device, self.log if self.is_main else (lambda m: None))
        if args.task not in TASKS:
            raise ValueError(f"--task {args.task!r} is not one of {', '.join(TASKS)}")
        self.task = TASKS[args.task]()
        self.smoothing = (args.label_smoothing if args.label_smoothing is not None
                          else self.task.default_label_smoothing)

    # -- setup ------------------------------------------------------------------------------------
    def setup(self) -> None:
        args = self.args
        torch.manual_seed(args.seed)
        random.seed(args.seed)
        np.random.seed(args.seed)
        self.task.prepare(args, self.out, self.log if self.is_main else (lambda *a: None))
        self.config = self.task.model_config(args)
        torch.manual_seed(args.seed)
        self.model = build_model(self.config)
        self.task.init_weights(self.model)
        accelerate_for_training(self.model.to(self.device))  # oneDNN's fp32 GEMMs where they are faster (accel)
        if self.device.type == "cpu":
            keep_freed_memory()  # each step reuses the last one's freed activations instead of faulting pages in
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = make_adamw(
            [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=0.0, betas=tuple(args.betas), eps=args.eps)
        self.ddp_model = self.model
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel
            self.ddp_model = DistributedDataParallel(self.model, device_ids=[self.device.index]
                                                     if self.device.type == "cuda" else None)
        inner = torch.compile(self.ddp_model) if args.compile else self.ddp_model
        self.forward = self.task.training_forward(self.model, inner)
        self.step = 0
        self.position = DataPosition(rank=self.rank, world=self.world)
        self.elapsed_before = 0.0
        self.best, self.bad_evals = None, 0
        if args.resume and (self.out / "checkpoint_last.pt").exists():
            self._load_state()
        elif self.is_main:
            art = self.task.artifacts()
            save_model_dir(self.out, self.model, art.get("tokenizer"), art.get("tgt_tokenizer"),
                           training_args=dataclasses.asdict(args))
            save_task_info(self.out, art["task"])
            if (self.out / "metrics.jsonl").exists():
                (self.out / "metrics.jsonl").unlink()

    # -- checkpoints --------------------------------------------------------------------------------
    def _state(self) -> dict:
        return {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "step": self.step, "epoch": self.position.epoch, "batch_in_epoch": self.position.batch_in_epoch,
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
        ckpt_dir = self.out / "checkpoints"
        save_weights(self.model, ckpt_dir / f"step_{self.step:08d}.safetensors")
        for old in sorted(ckpt_dir.glob("step_*.safetensors"))[: -self.args.keep_last]:
            old.unlink()

    def _load_state(self) -> None:
        path = self.out / "checkpoint_last.pt"
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, KeyError, EOFError, ValueError, OSError) as e:  # truncated, foreign, or another model
            raise ValueError(f"{path}: not a checkpoint of this run ({str(e).splitlines()[0][:200]}); the weights "
                             f"of the last saved steps are in {self.out / 'checkpoints'}") from None
        self.step = state["step"]
        self.position.epoch, self.position.batch_in_epoch = state["epoch"], state["batch_in_epoch"]
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
        with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    # -- the loop -------------------------------------------------------------------------------------
    def _progress(self, elapsed: float, budget: float | None) -> float:
        args = self.args
        if args.max_steps:
            return (self.step - args.warmup) / max(args.max_steps - args.warmup, 1)
        return elapsed / budget if budget else 0.0

    @contextlib.contextmanager
    def _stop_at_step_boundary(self):
        """Ctrl-C (SIGINT) or SIGTERM finish the update under way, then the loop saves a checkpoint
        and stops, so ``--resume`` continues exactly. A second Ctrl-C stops at once (the last
        checkpoint on disk is intact: every write is atomic)."""
        import signal
        import threading
        self.interrupted = None
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self.interrupted is not None:
                raise KeyboardInterrupt
            self.interrupted = signum
            if self.is_main:
                self.log(f"\n{signal.Signals(signum).name}: finishing step {self.step + 1}, then saving a checkpoint "
                         "(press Ctrl-C again to stop at once)")
        old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)

    STOPS = ("", "early stopping", "interrupted")  # a higher code wins when processes differ

    def _agreed_stop(self, code: int) -> str:
        """Every process stops at the same step, for the same reason: early stopping (only the main
        process evaluates) and an interruption are local, so their codes are all-reduced (max) under
        DDP. "" = go on."""
        return self.STOPS[int(self._all_max(code))]

    def _agreed_clock(self, elapsed: float) -> float:
        """The training time all processes use (the slowest one's), so a time budget ends every process
        at the same step and a time-based cosine schedule gives them the same learning rate."""
        return self._all_max(elapsed)

    def _all_max(self, value: float) -> float:
        if self.world == 1:
            return value
        import torch.distributed as dist
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def train(self) -> dict:
        if not hasattr(self, "model"):
            self.setup()
        with self._stop_at_step_boundary():
            return self._train()

    def _train(self) -> dict:
        args = self.args
        self.model.train()
        self.t0 = time.time()
        budget = args.minutes * 60 if args.minutes else None
        bar = None
        if self.is_main and args.progress:
            from tqdm import tqdm
            bar = tqdm(total=args.max_steps or int(budget or 0) or None, initial=self.step if args.max_steps else 0,
                       unit="step" if args.max_steps else "s", dynamic_ncols=True, mininterval=1.0)
        self._stats = {"tokens": 0, "loss_sum": 0.0, "loss_n": 0, "since": time.time()}
        stop_reason, last_eval = "max steps", None
        while True:
            if args.max_steps is not None and self.step >= args.max_steps:
                break
            elapsed = self._agreed_clock(self.elapsed_before + time.time() - self.t0)
            if budget is not None and elapsed >= budget:
                stop_reason = "time budget"
                break
            lr = learning_rate(self.step + 1, args, self.config.d_model, self._progress(elapsed, budget))
            self._update(lr)
            self._report(lr, bar)
            early = False
            if args.eval_every and self.step % args.eval_every == 0 and self.task.has_dev:
                last_eval = self.step
                early = self._evaluate_and_keep_best()
            if args.save_every and self.step % args.save_every == 0:
                self.save_checkpoint()
            agreed = self._agreed_stop(2 if self.interrupted is not None else 1 if early else 0)
            if agreed:
                stop_reason = agreed
                break
        if bar is not None:
            bar.close()
        return self._finish(stop_reason, last_eval)

    def _update(self, lr: float) -> None:
        """One optimizer step: ``update_freq`` micro-batches (gradients synchronised on the last under
        DDP), clipping, the step."""
        args, stats = self.args, self._stats
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        for micro in range(args.update_freq):
            self.position.step, self.position.micro = self.step, micro
            batch = tuple(t.to(self.device) for t in self.task.batch(self.position))
            sync = micro == args.update_freq - 1
            ctx = self.ddp_model.no_sync() if (self.world > 1 and not sync) else contextlib.nullcontext()
            with ctx:
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                    loss, n, n_in = self.task.loss(self.forward, batch, self.smoothing)
                (loss / args.update_freq).backward()
            stats["loss_sum"] += loss.item() * n
            stats["loss_n"] += n
            stats["tokens"] += n_in
        if args.clip_norm:
            clip_grad_norm(self.model.parameters(), args.clip_norm)
        self.optimizer.step()
        self.step += 1

    def _report(self, lr: float, bar) -> None:
        """The progress bar after every update; a metrics.jsonl row every 50 updates."""
        stats, now = self._stats, time.time()
        loss = stats["loss_sum"] / max(stats["loss_n"], 1)
        tok_s = stats["tokens"] * self.world / max(now - stats["since"], 1e-9)
        if bar is not None:
            if self.args.max_steps:
                bar.update(1)
            else:
                bar.update(min(int(self.elapsed_before + now - self.t0), bar.total or 0) - bar.n)
            bar.set_postfix_str(f"step {self.step} loss {loss:.3f} lr {lr:.2e} tok/s {tok_s:,.0f}", refresh=False)
        if self.step % 50 == 0:
            self._metrics({"step": self.step, "train_loss": round(loss, 4), "lr": lr, "tokens_per_s": round(tok_s),
                           "elapsed": round(self.elapsed_before + now - self.t0, 1)})
            self._stats = {"tokens": 0, "loss_sum": 0.0, "loss_n": 0, "since": now}

    def _finish(self, stop_reason: str, last_eval: int | None) -> dict:
        result = {"steps": self.step, "stop": stop_reason,
                  "elapsed": round(self.elapsed_before + time.time() - self.t0, 1)}
        if self.task.has_dev and last_eval != self.step and stop_reason != "interrupted":
            self._evaluate_and_keep_best()
        self.save_checkpoint()
        if self.is_main and self.best is None:  # no dev set: the last weights are the model
            save_weights(self.model, self.out / "model.safetensors")
        result["best"] = self.best
        if self.world > 1:
            import torch.distributed as dist
            dist.barrier()
        return result

    def _evaluate_and_keep_best(self) -> bool:
        """Evaluate on dev; keep the best weights (by the task's score) as model.safetensors.
        Returns True when early stopping says stop."""
        if not self.is_main:
            return False
        scores = self.task.evaluate(self.model, self.device, self.bf16)
        self.model.train()
        scores.update(step=self.step, elapsed=round(self.elapsed_before + time.time() - self.t0, 1))
        self._metrics(scores)
        self.log(f"step {self.step}: {self.task.describe(scores)}")
        if self.best is None or scores["score"] > self.best["score"]:
            self.best, self.bad_evals = scores, 0
            save_weights(self.model, self.out / "model.safetensors")
        else:
            self.bad_evals += 1
        return bool(self.args.patience and self.bad_evals >= self.args.patience)


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


__all__ = ["TrainArgs", "Trainer", "learning_rate", "average_checkpoints", "label_smoothed_loss"]
