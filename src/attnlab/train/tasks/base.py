"""The task contract: what a task gives the one trainer, and what the trainer gives it back.

A task is what differs between training a translator, a language model and a classifier: the data,
the tokenizer, the batches, the loss, the validation metric and what the model directory records.
Everything else (optimizer, schedule, accumulation, bf16, checkpoints, exact resume, DDP) is the
trainer's. The two talk only through this contract — a task never sees the trainer:

* ``prepare(args, out, log)`` reads the data and builds (or reloads, on resume) the tokenizer;
* ``model_config(args)`` is the model to build; ``init_weights(model)`` may load pretrained weights;
* ``batch(position)`` is the next micro-batch for a :class:`DataPosition`, which it advances; the
  trainer saves the position in every checkpoint, so a resumed run continues with the next batch;
* ``training_forward(model, forward)`` adapts the (possibly DDP-wrapped) forward to the task's loss
  (e.g. a classification head on the pooled output); ``loss(forward, batch, smoothing)``;
* ``evaluate(model, device, bf16)`` scores the dev split (``"score"``: higher is better) and
  ``describe`` says it in one line; ``artifacts()`` are the tokenizers and the task record (task.json).

Adding a task: subclass :class:`Task`, register it in ``TASKS`` (``train/tasks/__init__.py``).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ...accel import onednn_product, onednn_training_gemm_ok
from ...config import TransformerConfig, load_config
from ...data.batching import TokenBatchSampler
from ...data.readers import DataError


@dataclass
class DataPosition:
    """Where training is in the data. ``epoch``/``batch_in_epoch`` are saved in checkpoints; ``step``,
    ``micro`` (the micro-batch within a step, for accumulation), ``rank`` and ``world`` are set by the
    trainer before each ``batch`` call so random batches are drawn from them, never from hidden state."""
    epoch: int = 0
    batch_in_epoch: int = 0
    step: int = 0
    micro: int = 0
    rank: int = 0
    world: int = 1

    def generator(self, *salt: int) -> torch.Generator:
        """A generator seeded from (salt, step, micro, rank): the same batch in any process and on resume."""
        key = repr((*salt, self.step, self.micro, self.rank)).encode()
        return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little") % 2 ** 62)


class Task(ABC):
    name: str = ""
    summary: str = ""              # one line for --help
    family: str = ""               # the model family the task trains
    default_preset: str = ""
    default_label_smoothing: float = 0.0
    options: tuple[str, ...] = ()  # TrainArgs fields only this task reads (other tasks reject them as flags)

    @abstractmethod
    def prepare(self, args, out: Path, log) -> None: ...

    @abstractmethod
    def model_config(self, args) -> TransformerConfig: ...

    def init_weights(self, model) -> None:
        """Start from pretrained weights (default: the fresh initialisation stays)."""

    @abstractmethod
    def batch(self, position: DataPosition) -> tuple[torch.Tensor, ...]: ...

    def training_forward(self, model, forward):
        """What ``loss`` calls: the model's forward (possibly DDP-wrapped) adapted to the task."""
        return forward

    @abstractmethod
    def loss(self, forward, batch, smoothing: float) -> tuple[torch.Tensor, int, int]:
        """(mean loss, number of predictions it averages, number of input tokens)."""

    @abstractmethod
    def evaluate(self, model, device, bf16: bool) -> dict: ...

    @abstractmethod
    def describe(self, scores: dict) -> str: ...

    @abstractmethod
    def artifacts(self) -> dict:
        """{"tokenizer": …, "tgt_tokenizer": … or None, "task": the task.json record}."""

    @property
    def has_dev(self) -> bool:
        return True

    @property
    @abstractmethod
    def n_train(self) -> int: ...


class ListBatches:
    """Token-budget batches over a list of examples, epoch by epoch, from a data position. With N
    processes, process r takes batches r, r+N, … (one optimizer step sees N·update_freq batches, as
    one process with update_freq·N would)."""

    def __init__(self, sampler: TokenBatchSampler):
        self.sampler = sampler
        self._epoch, self._batches = None, []

    def next(self, pos: DataPosition) -> list[int]:
        while True:
            if self._epoch != pos.epoch:
                self._epoch, self._batches = pos.epoch, self.sampler.batches(pos.epoch)
            usable = len(self._batches) - len(self._batches) % pos.world
            if pos.batch_in_epoch + pos.world <= usable:
                i = pos.batch_in_epoch
                pos.batch_in_epoch += pos.world  # advanced before use: a checkpoint saved after this step
                return self._batches[i + pos.rank]  # resumes at the *next* batch
            pos.epoch, pos.batch_in_epoch = pos.epoch + 1, 0


def label_smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, pad_id: int | None, smoothing: float):
    """Cross-entropy with label smoothing ε (the paper: 0.1), padding ignored. Returns the mean over
    real tokens and their count. Equal to ``F.cross_entropy(logits.float(), labels, label_smoothing=ε,
    ignore_index=pad)``, computed by ``ChunkedCrossEntropy``."""
    ignore = pad_id if pad_id is not None else -100
    logits, labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    if logits.numel() <= ChunkedCrossEntropy.CPU_CHUNK:  # one chunk: PyTorch's kernel has fewer steps
        loss = F.cross_entropy(logits.float(), labels, ignore_index=ignore, label_smoothing=smoothing)
    else:
        loss = ChunkedCrossEntropy.apply(logits, labels, ignore, smoothing)
    return loss, int((labels != ignore).sum())


class ChunkedCrossEntropy(torch.autograd.Function):
    """Label-smoothed cross-entropy over a few rows at a time, never a full-vocabulary fp32 copy of
    the logits: each chunk of rows is upcast, reduced (log-sum-exp, the target's logit, the mean
    logit) and dropped; the backward recomputes softmax chunk by chunk and writes the gradient in
    the logits' dtype. With bf16 logits F.cross_entropy(logits.float()) moves ~4 full-size fp32
    tensors each way (the copy, log-softmax, its gradient, the cast back) and on CPU those passes cost
    a quarter of a Marian training step (benchmarks/train_speed.py); here the chunks stay in cache.

    For row i with target y (ε = smoothing, V = vocabulary):
    loss_i = lse_i − (1−ε)·l_iy − ε·mean_j l_ij, and ∂loss_i/∂l_ij = softmax_ij − (1−ε)·[j = y] − ε/V.
    The result is the mean over rows whose label is not ``ignore`` (NaN when there are none, as
    F.cross_entropy)."""

    CPU_CHUNK = 1 << 20  # elements per chunk: 4 MB in fp32, within the last-level cache

    @staticmethod
    def _chunks(logits):
        rows = max(1, (ChunkedCrossEntropy.CPU_CHUNK if logits.device.type == "cpu" else 1 << 24) // logits.shape[1])
        return range(0, logits.shape[0], rows), rows

    @staticmethod
    def forward(ctx, logits, labels, ignore: int, smoothing: float):
        keep = labels != ignore
        target = labels.masked_fill(~keep, 0)[:, None]  # (N, 1)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        starts, rows = ChunkedCrossEntropy._chunks(logits)
        for s in starts:
            row_loss = _smoothed_row_loss(logits[s:s + rows].float(), target[s:s + rows], smoothing)
            total += row_loss.masked_fill(~keep[s:s + rows], 0.0).sum()
        count = keep.sum()
        ctx.save_for_backward(logits, target, keep, count)
        ctx.smoothing = smoothing
        return total / count

    @staticmethod
    @torch.autograd.function.once_differentiable  # (the softmax below is not differentiated again)
    def backward(ctx, grad_out):
        logits, target, keep, count = ctx.saved_tensors
        row_scale = keep.float() * (grad_out.float() / count)  # (N,): 0 on ignored rows
        grad = torch.empty_like(logits)
        starts, rows = ChunkedCrossEntropy._chunks(logits)
        for s in starts:
            g = logits[s:s + rows].to(torch.float32, copy=True)  # (rows, V): the saved logits stay as they are
            grad[s:s + rows] = _smoothed_logit_grad_(torch.softmax(g, dim=1, out=g), target[s:s + rows],
                                                     ctx.smoothing, row_scale[s:s + rows])
        return grad, None, None, None


def _smoothed_row_loss(logits: torch.Tensor, target: torch.Tensor, smoothing: float,
                       lse: torch.Tensor | None = None):
    """fp32 logits (R, V), targets (R, 1) → the loss per row: lse − (1−ε)·l_y − ε·mean(l), with the
    rows' log-sum-exp ``lse`` computed here unless given."""
    lse = torch.logsumexp(logits, dim=-1) if lse is None else lse
    return lse - (1 - smoothing) * logits.gather(1, target).squeeze(1) - smoothing * logits.mean(dim=-1)


def _smoothed_logit_grad_(probs: torch.Tensor, target: torch.Tensor, smoothing: float,
                          row_scale: torch.Tensor) -> torch.Tensor:
    """In place, fp32 softmax (R, V) → the logits' gradient: (softmax − (1−ε)·[j = y] − ε/V) · row_scale."""
    scale = row_scale[:, None]  # (R, 1)
    g = probs.mul_(scale).sub_(scale * (smoothing / probs.shape[1]))
    return g.scatter_add_(1, target, scale * (smoothing - 1))


def _smoothed_loss_and_grad_(logits: torch.Tensor, target: torch.Tensor, smoothing: float,
                             row_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, fp32 logits (R, V) → (loss per row, their gradient over the logits). One in-place
    softmax, which PyTorch's CPU kernel computes a row at a time in cache, and a few cheap
    reductions (max, mean), where ``logsumexp`` then ``sub_``/``exp_`` made ~6 full passes over the
    chunk (5.4–5.9 → 1.9–2.0 ms for 524 × 8,000 logits, 36–37 → 8–9 ms for 256 × 49,152; 2 threads,
    the EPYC of docs/results.md). The log-sum-exp comes back from the largest probability, at the
    largest logit: lse = max − log(p_max). p_max ≥ 1/V, so its log keeps fp32 accuracy where the
    target's probability could underflow to 0."""
    loss_but_log_p_max = _smoothed_row_loss(logits, target, smoothing, lse=logits.amax(dim=1))  # (before the overwrite)
    probs = torch.softmax(logits, dim=1, out=logits)
    row_loss = loss_but_log_p_max - probs.amax(dim=1).log()  # (the largest probability is the largest logit's)
    return row_loss, _smoothed_logit_grad_(probs, target, smoothing, row_scale)


def forward_to_output_loss(model, forward, pad_id: int | None):
    """A task's ``training_forward`` for a model that predicts tokens: ``(*inputs, labels, smoothing)
    → (loss, n)``, the last hidden states of the (possibly DDP-wrapped or compiled) ``forward`` fed
    to ``output_loss``, which fuses the output projection with the loss."""
    def run(*args):
        *inputs, labels, smoothing = args
        return output_loss(model, forward(*inputs, hidden_only=True), labels, pad_id, smoothing)
    return run


FUSED_LOSS_MIN_VOCAB = 257
"""Vocabularies narrower than this (characters, bytes) take the plain projection and PyTorch's loss in training.

Why: the fused loss exists to never hold (tokens × vocabulary) fp32 logits; with ≤ 256 classes those are at most
a couple of hidden states' worth, and PyTorch's one-kernel loss beats the fused one's ~25 small steps per chunk.
Forward + backward of the projection and loss on their own (2 threads, the AMD EPYC of docs/results.md), fused ÷
plain: 768 tokens × d 128 (nanoGPT's update) at 65 classes 1.92× (839 against 437 µs), 128 1.25× (bf16 autocast
1.35×), 512 0.75×; 4,096 × d 384 at 65 1.26×, 128 1.33×, 512 0.93×. At 256 about even in fp32, 0.99–1.15× over four
shapes, and 1.31–1.34× in bf16 (ad hoc). `python benchmarks/train_speed.py --shapes none --loss-paths` (the paths
in turns, three shapes, fp32 and bf16) read 1.06–1.28× at 65 classes, 0.95–1.16× at 128 and 256, and 0.77–1.04× from
512 up. From 512 classes up the fused loss is mostly the faster, and always the leaner."""


def output_loss(model, hidden: torch.Tensor, labels: torch.Tensor, pad_id: int | None, smoothing: float):
    """``label_smoothed_loss(model's logits, ...)`` from the last hidden states (B, T, d), with the
    output projection inside the loss (``LinearCrossEntropy``): in training, the (tokens × vocabulary)
    logits and their gradient are never held, a few rows at a time instead. Where there is no
    gradient to take, or the vocabulary is narrower than :data:`FUSED_LOSS_MIN_VOCAB`, it is the plain
    projection and ``label_smoothed_loss``."""
    head = model.lm_head
    h, labels = model.head_input(hidden).reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if (head.weight.shape[0] < FUSED_LOSS_MIN_VOCAB
            or not (torch.is_grad_enabled() and (h.requires_grad or head.weight.requires_grad))):
        return label_smoothed_loss(head(h), labels, pad_id, smoothing)
    ignore = pad_id if pad_id is not None else -100
    loss = LinearCrossEntropy.apply(h, head.weight, head.bias, labels, ignore, smoothing)
    return loss, int((labels != ignore).sum())


class LinearCrossEntropy(torch.autograd.Function):
    """The output projection and the label-smoothed cross-entropy in one function, the way
    Liger-Kernel's fused linear cross-entropy does it: for each chunk of rows the logits are
    computed into one reused buffer, reduced to the loss, turned into their gradient (softmax −
    smoothed one-hot, the formula of ``ChunkedCrossEntropy``) and multiplied straight into the
    gradients of the hidden states and of the weight. The loss is the last operation of the graph,
    so its gradient is known in the forward; the backward only scales what the forward left. The
    same matrix products as ``F.linear`` + its backward, none of the (tokens × vocabulary) tensors:
    with a 49k vocabulary and 2,048 tokens that is 800 MB of fp32 logits and gradient not allocated.

    Under autocast the products run in the autocast dtype (as ``F.linear`` would) and the softmax in
    fp32; the weight's gradient is accumulated in fp32 chunk by chunk."""

    CHUNK = 1 << 22  # logits per chunk (16 MB in fp32) ...
    MIN_ROWS = 256  # ... but never fewer rows than this: narrower products run below the GEMM's speed

    @staticmethod
    def forward(ctx, h, weight, bias, labels, ignore: int, smoothing: float):
        dev = h.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with torch.autocast(dev, enabled=False):
            x, w = h.to(dtype), weight.to(dtype)  # (N, d), (V, d)
            b = bias.to(dtype) if bias is not None else None
            (N, d), V = x.shape, w.shape[0]
            keep = labels != ignore
            count = keep.sum()
            target = labels.masked_fill(~keep, 0)[:, None]  # (N, 1)
            row_scale = keep.float() / count  # (N,): d(mean loss)/d(row loss), 0 on ignored rows
            rows = max(1, min(N, max(LinearCrossEntropy.MIN_ROWS, LinearCrossEntropy.CHUNK // V)))  # (N = 0: no chunk)
            # fp32 on a CPU where oneDNN's GEMM outruns MKL's (accel.onednn_training_gemm_ok): the logits and
            # the hidden states' gradient from oneDNN (each chunk's logits a new tensor), the weight's from MKL
            onednn = dtype == torch.float32 and h.device.type == "cpu" and onednn_training_gemm_ok()
            buffer = None if onednn else torch.empty(rows, V, dtype=dtype, device=h.device)  # one chunk's logits, reused
            upcast = torch.empty(rows, V, device=h.device) if dtype != torch.float32 else None  # their fp32 copy
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            grad_h = torch.empty_like(x) if need_h else None
            grad_w = None  # the first chunk's product is it, the others add to it (fp32)
            grad_b = torch.zeros(V, dtype=torch.float32, device=h.device) if need_b else None
            for s in range(0, N, rows):
                xc, t = x[s:s + rows], target[s:s + rows]
                if onednn:
                    logits = onednn_product(xc, w, b)  # (R, V)
                else:
                    logits = buffer[:xc.shape[0]]  # (R, V)
                    if b is not None:
                        torch.addmm(b, xc, w.t(), out=logits)
                    else:
                        torch.mm(xc, w.t(), out=logits)
                g = upcast[:xc.shape[0]].copy_(logits) if upcast is not None else logits  # fp32 logits
                row_loss, g = _smoothed_loss_and_grad_(g, t, smoothing, row_scale[s:s + rows])  # (R,), d loss / d logits
                total += row_loss.masked_fill(~keep[s:s + rows], 0.0).sum()
                if need_b:
                    grad_b += g.sum(0)
                if upcast is not None:
                    g = logits.copy_(g)  # back in the products' dtype, over the logits
                if need_h and onednn:
                    grad_h[s:s + rows] = onednn_product(g, w.t())
                elif need_h:
                    torch.mm(g, w, out=grad_h[s:s + rows])
                if need_w and grad_w is None:
                    grad_w = (g.t() @ xc).float()  # (V, d)
                elif need_w and dtype == torch.float32:
                    grad_w.addmm_(g.t(), xc)
                elif need_w:
                    # (cast first: PyTorch's CPU add of two dtypes is ~3x slower; the fp32 copy is one
                    # (V, d) temporary more, as F.linear's backward under autocast makes too)
                    grad_w += (g.t() @ xc).float()
            if need_w and grad_w is None:  # (no rows)
                grad_w = torch.zeros(V, d, dtype=torch.float32, device=h.device)
        ctx.save_for_backward(*(t if t is not None else torch.empty(0) for t in (grad_h, grad_w, grad_b)))
        ctx.dtypes = (h.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return total / count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        return (*(g.mul(grad_out).to(dt) if need else None
                  for g, dt, need in zip(saved, ctx.dtypes, ctx.needs_input_grad[:3])), None, None, None)


def config_with_own_vocab(task: Task, args, min_positions: int = 0, **extra) -> TransformerConfig:
    """The preset with the task's own tokenizer (attnlab's special ids 0–3): checks the family and
    lets learned positions cover the longest training sequence."""
    over = dict(args.config_overrides, vocab_size=task.tok.vocab_size, pad_id=0, bos_id=1, eos_id=2, unk_id=3, **extra)
    cfg = load_config(args.preset or task.default_preset, **over)
    if cfg.family != task.family:
        raise DataError(f"--task {task.name} needs a {task.family} preset, {args.preset!r} is {cfg.family}")
    if cfg.positions == "learned" and cfg.max_len < min_positions:
        cfg = cfg.replace(max_len=min_positions)
    return cfg
