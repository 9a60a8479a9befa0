"""One full training step (forward, label-smoothed cross-entropy, backward, AdamW) of the same seq2seq architecture, side by side:
attnlab (a copy of the HF model made with ``from_hf``, so the weights are equal), Hugging Face
``MarianMTModel`` and ``torch.nn.Transformer`` (PyTorch's translation-tutorial model: embeddings ×√d,
sinusoidal positions, nn.Transformer, output projection). fp32, and bf16 autocast where the CPU has
native bf16 (``accel.bf16_native``). Two shapes: d256/4 heads/3+3/d_ff 1024, 64 pairs × 24 tokens; and
d512/8 heads/6+6/d_ff 2048, 32 × 32. Each side runs in a process of its own (class ``Side``) and the sides take
turns (``--rounds``, each timing ``--steps`` steps after one warm-up step, the order rotating; the median round is
reported). Prints target tokens/s, ratios, the side's peak RSS over its imports, its minor page faults and system
time per step, and the model FLOP utilisation against a matmul peak measured in the same run (the highest of one
read before the shapes and one before each round, ``run_shape``). Each side trains
the way its own tool does: attnlab with its trainer's loss (the output projection fused with the
cross-entropy: no logits tensor), fused AdamW, its CPU dropout and its trainer's heap setting (freed memory kept
for the next step, ``accel.keep_freed_memory``); HF and the tutorial with
``nn.CrossEntropyLoss(label_smoothing=0.1)`` on fp32 logits, torch's default AdamW and glibc's default heap.
``--heap kept`` gives every side attnlab's heap setting, ``--heap default`` none of them. ``--profile`` then
profiles each side's step (``profile_units``): its self time in matrix products (GEMMs, which run near the matmul
peak on every side), in PyTorch's fused attention, its costliest operators and its minor page faults while
profiled (the profiler can make a step fault pages it would reuse, ``profile_units``); and the bound on attnlab's lead
were everything but its products free (``attnlab_vs_hf_if_only_products``) and were its products at the peak too
(``attnlab_vs_hf_at_peak``, 1 / HF's MFU). ``--nanogpt`` with ``--profile`` profiles attnlab's eager updates.

``--device cuda`` (or ``mps``) runs the step tables on a GPU (the models built on the CPU, so the weights are
still equal, then moved; the clocks read after the GPU's queue has run; the peak GPU memory per side; the MFU
against a square matmul on the GPU; with ``--profile`` the operators' GPU time); ``--dtype fp32|bf16`` one
precision only. The other tables are CPU tables.

``--as-avx2`` runs everything with PyTorch's kernels, oneDNN and MKL capped at AVX2 and no native bf16
(``accel.AVX2_ENVIRONMENT``, inherited by every side's process and by nanoGPT's): the stand-in for an AVX2-only
CPU on a wider one. The step tables are then fp32 only, and attnlab's fp32 products take MKL's GEMM, as the
peers' do (``accel.onednn_training_gemm_ok`` wants AVX-512).

With ``--nanogpt PATH`` (your checkout of karpathy/nanoGPT) it also times nanoGPT's Tiny Shakespeare
step: nanoGPT's own ``train.py`` with its README's CPU configuration (4 layers, 4 heads, d 128, block
64, batch 12, dropout 0, fp32) against ``attnlab train``'s update with the same model and recipe
(``--preset shakespeare-char``), fp32 and (native-bf16 CPUs) bf16. Each side is a fresh process
that times every iteration the way nanoGPT's loop does (batch, forward, backward, clip, AdamW);
the ms/iter reported is the median after 10 warm-up iterations, the sides taking turns for
``--rounds`` rounds so drift reaches all of them (``..._by_round``: the ratio of each round's processes, how far the
machine's speed moved between rounds). With ``--compile`` both tools also run their
``torch.compile`` of the step (nanoGPT's ``--compile=True``, ``attnlab train --compile``), each set against
nanoGPT's README run and the compiled attnlab sides also against nanoGPT compiled.

    python benchmarks/train_speed.py [--steps 10] [--shapes small,large] [--threads 2] [--heap tools|kept|default] [--profile]
    python benchmarks/train_speed.py --gemm [--shapes small,large] [--rounds 3]
    python benchmarks/train_speed.py --linear-kernel [--shapes small,large] [--steps 3] [--rounds 8]  # C++ linear, dW
    python benchmarks/train_speed.py --gelu [--shapes small,large] [--steps 3] [--rounds 8] [--as-avx2]  # GELU kernel vs F.gelu
    python benchmarks/train_speed.py --attention-kernel [--shapes small,large] [--steps 3] [--rounds 8] [--as-avx2]
    python benchmarks/train_speed.py --packed-attention [--shapes small,large] [--steps 3] [--rounds 8]  # packed vs split
    python benchmarks/train_speed.py --ablate [--shapes small,large] [--steps 3] [--rounds 10]  # each part's cost in the update
    python benchmarks/train_speed.py --as-avx2 [--steps 5] [--rounds 3] [--nanogpt ~/nanoGPT]  # an AVX2-only CPU's stand-in
    PYTHONPATH=src python3 benchmarks/train_speed.py --device cuda --dtype bf16 --steps 20 --rounds 3 --profile  # a GPU
    python benchmarks/train_speed.py --attention-products [--shapes small,large] [--rounds 3]  # bf16 vs fp32 products in ShortAttention
    python benchmarks/train_speed.py --shapes none --nanogpt ~/nanoGPT [--nanogpt-iters 60] [--rounds 3] [--compile]
    python benchmarks/train_speed.py --shapes none --nanogpt ~/nanoGPT --interleaved [--rounds 6]  # in one process
    python benchmarks/train_speed.py --shapes none --corpus [PAIRS.tsv] [--pairs 1024] [--rounds 3]
    python benchmarks/train_speed.py --shapes none --attention [--rounds 5]   # the fused kernel vs ShortAttention
    python benchmarks/train_speed.py --shapes none --attention-keys 128,256,512 [--rounds 6]  # the same, whole updates
    python benchmarks/train_speed.py --dropout [--shapes small,large] [--rounds 5]  # attnlab's dropout kernel vs its torch path
    python benchmarks/train_speed.py --shapes none --loss-paths [--loss-vocab 65,256,512] [--rounds 6]  # fused vs plain loss
"""

import argparse
import contextlib
import importlib.util
import io
import json
import math
import os
import pickle
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from torch import nn

from attnlab import accel
from attnlab.interop.hf import from_hf
from attnlab.model import attention
from attnlab.train.tasks.base import output_loss
from attnlab.train.trainer import make_adamw
import tinyshakespeare  # (benchmarks/tinyshakespeare.py; benchmarks/ is on sys.path)

SHAPES = {"small": dict(d=256, heads=4, layers=3, ff=1024, batch=64, length=24),
          "large": dict(d=512, heads=8, layers=6, ff=2048, batch=32, length=32),
          "tiny": dict(d=32, heads=2, layers=1, ff=64, batch=4, length=8)}  # the smoke test's
VOCAB = 8000


class TorchSeq2Seq(nn.Module):
    """The PyTorch tutorial's model: token embeddings ×√d + sinusoidal positions → nn.Transformer → linear."""

    def __init__(self, s):
        super().__init__()
        d = s["d"]
        self.src_emb, self.tgt_emb = nn.Embedding(VOCAB, d), nn.Embedding(VOCAB, d)
        pos = torch.arange(512)[:, None] * torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        self.register_buffer("pe", torch.cat([pos.sin(), pos.cos()], 1))
        self.tf = nn.Transformer(d, s["heads"], s["layers"], s["layers"], s["ff"], 0.1, batch_first=True)
        self.out = nn.Linear(d, VOCAB)
        self.scale = math.sqrt(d)

    def forward(self, src, tgt, src_pad=None, tgt_pad=None):
        """``src_pad``/``tgt_pad``: (B, T) bool, True at padding (the tutorial's key padding masks)."""
        T = tgt.shape[1]
        x = self.src_emb(src) * self.scale + self.pe[: src.shape[1]]
        y = self.tgt_emb(tgt) * self.scale + self.pe[:T]
        causal = nn.Transformer.generate_square_subsequent_mask(T)
        return self.out(self.tf(x, y, tgt_mask=causal, tgt_is_causal=True, src_key_padding_mask=src_pad,
                                tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad))


def synchronize(device: str = "cpu") -> None:
    """Wait for ``device``'s queued work (a GPU's calls return before it has run them): before reading a clock."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def matmul_peak(dtype, n: int = 2048, device: str = "cpu") -> float:
    """FLOP/s of a large square matmul on ``device``, now (the roofline the MFU is measured against): on CPU
    the faster of PyTorch's ``mm`` (MKL in fp32 on x86) and oneDNN's linear, where this build has it
    (attnlab's fp32 training products take oneDNN's on AVX-512 CPUs, where it can be the faster)."""
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    products = [lambda: a @ b]
    if accel.onednn_linear_ops() and torch.device(device).type == "cpu":
        products.append(lambda: accel.onednn_product(a, b))
    best = float("inf")
    for product in products:
        try:
            product()
        except RuntimeError:  # (oneDNN's linear in a dtype this CPU cannot run: MKL's peak alone)
            continue
        for _ in range(3):  # the best of three: a peak, not a sample of the machine's noise
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(5):
                product()
            synchronize(device)
            best = min(best, time.perf_counter() - t0)
    return 5 * 2 * n ** 3 / best


def model_flops(s) -> float:
    """Forward+backward FLOPs of one step ≈ 6 · (non-embedding matmul parameters) · tokens, plus attention."""
    d, L, ff = s["d"], s["layers"], s["ff"]
    per_token = L * (4 * d * d + 2 * d * ff) + L * (8 * d * d + 2 * d * ff) + d * VOCAB
    tokens = s["batch"] * s["length"]
    attn = 3 * 2 * 2 * s["batch"] * s["length"] ** 2 * d * L  # self + causal + cross, QK and AV
    return 6 * per_token * tokens + 3 * attn


def build_side(s, key: str, device: str = "cpu") -> nn.Module:
    """One side's model, in training mode, on ``device``: HF Marian (seed 0), attnlab's ``from_hf`` copy of that
    same model, or the tutorial model (seed 0); built on the CPU, so the weights are the same on every device.
    Each side process builds only its own."""
    return _build_side(s, key).to(device)


def _build_side(s, key: str) -> nn.Module:
    import transformers
    torch.manual_seed(0)
    if key == "torch_nn_transformer":
        return TorchSeq2Seq(s).train()
    cfg = transformers.MarianConfig(vocab_size=VOCAB, d_model=s["d"], encoder_layers=s["layers"],
                                    decoder_layers=s["layers"], encoder_attention_heads=s["heads"],
                                    decoder_attention_heads=s["heads"], encoder_ffn_dim=s["ff"], decoder_ffn_dim=s["ff"],
                                    max_position_embeddings=512, pad_token_id=0, eos_token_id=2,
                                    decoder_start_token_id=1, scale_embedding=True)
    hf = transformers.MarianMTModel(cfg).train()
    if key.startswith("hf_marian"):
        return hf
    # attnlab's side as its trainer sets a model up (accel.accelerate_for_training: oneDNN's fp32 GEMMs on
    # CPUs where they outrun MKL's)
    return accel.accelerate_for_training(from_hf(hf).train())


def make_optimizer(key, model):
    # each side's own optimizer: attnlab's trainer takes the fused AdamW kernel where it exists
    # (train.trainer.make_adamw); HF's Trainer and the PyTorch tutorial use torch's default (foreach)
    return (make_adamw if key == "attnlab" else torch.optim.AdamW)(model.parameters(), lr=1e-4)


def attnlab_update(model, opt, bf16: bool, pad: int | None = None):
    """attnlab's update on one batch: the trainer's loss (train.tasks.base: projection and loss fused, no
    logits). ``pad``: the label id left out of the loss (None: every label counts)."""
    def step(src, tgt_in, labels, src_mask=None):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(src.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = output_loss(model, model(src, tgt_in, src_mask, hidden_only=True), labels, pad, 0.1)[0]
        loss.backward()
        opt.step()
    return step


def attnlab_step(model, opt, src, tgt_in, labels, bf16: bool):
    """attnlab's update on one fixed batch (the step tables)."""
    update = attnlab_update(model, opt, bf16)
    return lambda: update(src, tgt_in, labels)


def peer_step(model, opt, bf16: bool, forward, labels, ignore_pad: bool = False):
    """A peer's update: its logits in fp32, ``nn.CrossEntropyLoss(label_smoothing=0.1)`` (HF's Trainer and the
    tutorial), backward, torch's AdamW. ``ignore_pad``: labels equal to 0 (padding) are left out, as HF's -100."""
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)

    def step(*batch):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = forward(model, *batch)
        y = labels(*batch)
        loss = loss_fn(logits.float().reshape(-1, VOCAB), (y.masked_fill(y == 0, -100) if ignore_pad else y).reshape(-1))
        loss.backward()
        opt.step()
    return step


def shape_side(name: str, key: str, bf16: bool, device: str = "cpu"):
    """(warm-up, timed unit) of one side on one of SHAPES: a step on one random batch (seed 1, the same in
    every side's process), on ``device``."""
    s = SHAPES[name]
    model = build_side(s, key, device)
    torch.manual_seed(1)
    src, tgt_in, labels = (torch.randint(4, VOCAB, (s["batch"], s["length"])).to(device) for _ in range(3))
    opt = make_optimizer(key, model)
    if key == "attnlab":
        step = attnlab_step(model, opt, src, tgt_in, labels, bf16)
    else:
        forward = ((lambda m: m(src, tgt_in)) if key == "torch_nn_transformer"
                   else (lambda m: m(input_ids=src, decoder_input_ids=tgt_in).logits))
        step = peer_step(model, opt, bf16, forward, lambda: labels)
    return step, step


# the operators that are matrix products (GEMMs): what the device's BLAS (MKL or oneDNN on a CPU, cuBLAS on a
# GPU) runs at close to its peak
PRODUCT_OPS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::addbmm",
               "mkldnn::_linear_pointwise", "aten::mkldnn_linear", "aten::_mkldnn_linear_backward_weights"}


def profile_units(unit, n: int, device: str = "cpu") -> dict:
    """``n`` calls of ``unit`` under torch.profiler: per call, the wall time, the self time of the matrix products
    (:data:`PRODUCT_OPS`), of PyTorch's fused attention kernels (``aten::_scaled_dot_product_*``, their products
    inside) and the costliest operators. Why: the products run near the matmul peak on every side, so a step can
    be no faster than its products alone; what a tool can still win is the rest.

    Also the minor page faults per call while profiled: the profiler's own allocations share the C heap with the
    step's tensors and can split the blocks a step would reuse, so under it a step whose heap is kept (0 faults
    a step unprofiled, once settled) can fault fresh pages again, and the operators that write those pages (an
    activation's first writer) read slower than they run. Measured ad hoc on the large fp32 step, profiled as
    here (no shapes recorded) after three steps: 17,161 faults a step, against 0-1,845 unprofiled."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.device(device).type == "cuda"  # then each operator's time on the GPU (its kernels')
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(n):
            unit()
        synchronize(device)
        wall = time.perf_counter() - t0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0.ru_minflt  # (before the profiler builds its results)
    products = fused_attention = 0.0
    ops = []
    for event in prof.key_averages():
        if event.device_type != DeviceType.CPU:  # a GPU kernel: its time is its operator's already
            continue
        ms = (event.self_device_time_total if cuda else event.self_cpu_time_total) / 1e3 / n
        if event.key in PRODUCT_OPS:
            products += ms
        elif event.key.startswith(("aten::_scaled_dot_product", "aten::_flash_attention", "aten::_efficient_attention")):
            fused_attention += ms
        ops.append((ms, event.key))
    # three decimals: a GPU's step takes milliseconds, and the bounds divide by the products' time
    return {"profiled_ms": round(wall / n * 1e3, 3), "products_ms": round(products, 3),
            "fused_attention_ms": round(fused_attention, 3), "minor_faults_per_call": round(faults / n),
            "top_ops_ms": {key: round(ms, 3) for ms, key in sorted(ops, reverse=True)[:6]}}


class Side:
    """One side of a comparison in a process of its own, timed on request (``time``), so the sides can take
    turns. Why processes: the C heap's state is per process (glibc's adaptive mmap threshold, what it has
    trimmed back to the kernel), and in one shared process one side's allocations changed another's page
    faults; each side also runs with its own tool's heap setting (``--heap``: attnlab's trainer keeps freed
    memory, accel.keep_freed_memory; HF's Trainer and the tutorial leave glibc's defaults)."""

    def __init__(self, name: str, build: str, build_args: tuple, keep_heap: bool, threads: int, device: str = "cpu"):
        import multiprocessing
        ctx = multiprocessing.get_context("spawn")  # not fork: torch's and OpenMP's threads do not survive one
        self.name, (self.conn, child) = name, ctx.Pipe()
        self.proc = ctx.Process(target=_side_main, args=(child, build, build_args, keep_heap, threads, device), daemon=True)
        self.proc.start()
        child.close()

    def answer(self):
        """The side's next answer; a side that failed or died is an error that names it (never a wait forever:
        a dead process's pipe reads as closed)."""
        try:
            status, answer = self.conn.recv()
        except EOFError:
            self.proc.join(timeout=5)
            raise SystemExit(f"{self.name}'s process died (exit code {self.proc.exitcode})") from None
        if status == "error":
            raise SystemExit(f"{self.name}'s process failed:\n{answer}")
        return answer

    def ask(self, *message):
        self.conn.send(message)
        return self.answer()

    def close(self):
        try:
            self.conn.send(("stop",))
        except OSError:  # (it has exited already)
            pass
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.terminate()


def _side_main(conn, build: str, build_args: tuple, keep_heap: bool, threads: int, device: str):
    import traceback
    try:
        torch.set_num_threads(threads)
        cuda = torch.device(device).type == "cuda"
        if cuda:  # (cuda:1: the peak-memory counters and the default stream are the current device's)
            torch.cuda.set_device(device)
        heap_kept = accel.keep_freed_memory() if keep_heap else False
        import transformers  # noqa: F401  (every side imports it before the baseline, the tutorial's too)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # after the imports: torch, transformers
        warm, unit = globals()[build](*build_args)
        conn.send(("ok", heap_kept))
        while True:
            message = conn.recv()
            if message[0] == "stop":
                return
            if message[0] == "profile":
                warm()
                conn.send(("ok", profile_units(unit, message[1], device)))
                continue
            _, n = message
            warm()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            synchronize(device)
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            for _ in range(n):
                unit()
            synchronize(device)
            t, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            conn.send(("ok", {"s": t / n, "minor_faults": (r1.ru_minflt - r0.ru_minflt) / n,
                              "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # (--as-avx2: capped here too)
                              "sys_s": (r1.ru_stime - r0.ru_stime) / n, "peak_rss_MB": (r1.ru_maxrss - base) / 1024,
                              **({"peak_gpu_MB": torch.cuda.max_memory_allocated() / 2 ** 20} if cuda else {})}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def sides_in_turns(build: str, keys: list[str], build_args, args, n: int, before_round=None) -> dict:
    """Each of ``keys`` in its own process (:class:`Side`), built with ``build(*build_args(key))``; ``--rounds``
    rounds of one warm-up and ``n`` timed units each, the order rotating every round (each side takes each place
    in the order equally often when the rounds are a multiple of the sides); ``before_round()``, if given, runs
    before each round. Per side: the rounds' times, page faults and system time per unit, peak RSS over the
    imports, and whether the heap was kept."""
    threads = torch.get_num_threads()
    on_cpu = torch.device(args.device).type == "cpu"  # (attnlab's trainer keeps freed memory when it trains on CPU)
    keep = {key: args.heap == "kept" or (args.heap == "tools" and key == "attnlab" and on_cpu) for key in keys}
    sides = {key: Side(key, build, build_args(key), keep[key], threads, args.device) for key in keys}
    try:
        kept = {key: side.answer() for key, side in sides.items()}  # (built: whether its heap is kept)
        rows = {key: [] for key in keys}
        for r in range(args.rounds):
            if before_round is not None:
                before_round()
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                rows[key].append(sides[key].ask("time", n))
        # --profile: the step tables' steps (an epoch of --corpus is not profiled)
        profiles = {key: sides[key].ask("profile", n) for key in keys} if args.profile and build == "shape_side" else {}
    finally:
        for side in sides.values():
            side.close()
    return {key: {"s": [x["s"] for x in rows[key]], "minor_faults_per_unit": round(statistics.median(x["minor_faults"] for x in rows[key])),
                  "sys_ms_per_unit": round(statistics.median(x["sys_s"] for x in rows[key]) * 1e3, 1),
                  "peak_rss_over_imports_MB": round(max(x["peak_rss_MB"] for x in rows[key])), "heap_kept": kept[key],
                  "cpu_capability": rows[key][0]["cpu_capability"],
                  **({"peak_gpu_MB": round(max(x["peak_gpu_MB"] for x in rows[key]))} if "peak_gpu_MB" in rows[key][0] else {}),
                  **({"profile": profiles[key]} if key in profiles else {})}
            for key in keys}


def run_shape(name, s, args, bf16: bool, peak: float) -> dict:
    """The three sides' steps on shape ``s`` in turns. The matmul peak the MFUs divide by is the highest of
    ``peak`` (measured before the shapes) and one measured before each round: the machine's speed can move
    by ±15% within minutes (docs/results.md), and one peak read in a slow stretch put MFUs above 1."""
    keys = ["attnlab", "hf_marian", "torch_nn_transformer"]
    dtype = torch.bfloat16 if bf16 else torch.float32
    peaks = [peak]
    sides = sides_in_turns("shape_side", keys, lambda key: (name, key, bf16, args.device), args, args.steps,
                           before_round=lambda: peaks.append(matmul_peak(dtype, args.peak_size, args.device)))
    peak = max(peaks)
    out, t = {"matmul_peak_GFLOPs": round(peak / 1e9, 1), "matmul_peak_FLOPs": peak,
              "matmul_peaks_GFLOPs_measured": [round(p / 1e9, 1) for p in peaks]}, {}
    # t: each side's median seconds per step, unrounded (a GPU's step takes milliseconds); the MFU to 3 significant
    # digits, not 3 decimals: a CPU's MFU of 0.022 read to 3 decimals is 2% off, and so would be 1 / MFU
    for key in keys:
        times = sides[key].pop("s")
        t[key] = statistics.median(times)
        out[key] = {"ms_per_step": round(t[key] * 1e3, 1), "tgt_tokens_per_s": round(s["batch"] * s["length"] / t[key]),
                    "mfu": float(f"{model_flops(s) / t[key] / peak:.3g}"), **sides[key],
                    "ms_per_step_by_round": [round(x * 1e3, 1) for x in times]}
    products = out["attnlab"]["profile"]["products_ms"] / 1e3 if args.profile else 0.0
    for peer, short in (("hf_marian", "hf"), ("torch_nn_transformer", "torch")):
        out[f"attnlab_vs_{short}"] = round(t[peer] / t["attnlab"], 2)
        if args.profile:
            # the most attnlab's step could lead by: were everything but its matrix products free (its products as
            # fast as they ran in its own step), and were its products at the matmul peak too (1 / the peer's MFU)
            if products > 0:  # (a profiler that saw none of PRODUCT_OPS: no bound)
                out[f"attnlab_vs_{short}_if_only_products"] = round(t[peer] / products, 2)
            out[f"attnlab_vs_{short}_at_peak"] = round(t[peer] * peak / model_flops(s), 2)
    return out


def in_turns(run, n: int, rounds: int, paths: dict) -> dict:
    """Median ms per call of ``run`` on each of ``paths`` ({key: a context manager factory that selects the
    path}), the paths taking turns for ``rounds`` rounds of one warm-up call and ``n`` timed ones. The order
    flips every round (A B, B A, ...): on this machine the path timed second in a round read up to ~13% faster
    with the same code on both sides (the attention alone; ~0.5% on a whole step), so use an even ``rounds``."""
    times = {key: [] for key in paths}
    for r in range(rounds):
        for key, select in (list(paths.items()) if r % 2 == 0 else list(paths.items())[::-1]):
            with select():
                run()
                t0 = time.perf_counter()
                for _ in range(n):
                    run()
                times[key].append((time.perf_counter() - t0) / n * 1e3)
    return {key: round(statistics.median(v), 3) for key, v in times.items()}


# -- the attention of a training step: PyTorch's fused kernel against ShortAttention ------------------

# (B, h, T, hd, causal): nanoGPT's step, the two Marian shapes' decoder, vit-mnist's 49 patches + [CLS], longer keys
ATTENTION_SHAPES = {"nanogpt": (12, 4, 64, 32, True), "small": (64, 4, 24, 64, True), "large": (32, 8, 32, 64, True),
                    "vit_mnist": (64, 4, 50, 16, False), "keys128": (8, 4, 128, 64, True),
                    "keys256": (4, 4, 256, 64, True), "keys512": (2, 4, 512, 64, True)}


def self_attention(B, h, T, hd, causal, dtype=torch.float32):
    """(run, n): one self-attention forward + backward as the model runs it (q, k, v views of one fused
    projection, the output merged back), and how many calls make about one nanoGPT step's worth per --steps."""
    qkv = torch.randn(B, T, 3 * h * hd, dtype=dtype, requires_grad=True)
    grad = torch.randn(B, T, h * hd, dtype=dtype)

    def run():
        q, k, v = (t.view(B, T, h, hd).transpose(1, 2) for t in qkv.split(h * hd, dim=-1))  # (B, h, T, hd)
        o, _ = attention.scaled_dot_product_attention(q, k, v, is_causal=causal)
        o.transpose(1, 2).reshape(B, T, h * hd).backward(grad)
        qkv.grad = None
    return run, 40 * 64 * 64 * 48 / (B * h * T * T)


def attnlab_shape_step(s: dict, bf16: bool):
    """(step, model, optimizer): attnlab's training step for shape ``s`` (one of SHAPES, or one with another batch and
    length) on a fresh model, fused AdamW, one random batch."""
    model = build_side(s, "attnlab")
    opt = make_adamw(model.parameters(), lr=1e-4)
    src, tgt_in, labels = (torch.randint(4, VOCAB, (s["batch"], s["length"])) for _ in range(3))
    return attnlab_step(model, opt, src, tgt_in, labels, bf16), model, opt


def attnlab_shape_steps(args, bf16: bool):
    """(name, step, model, optimizer) for each of ``--shapes``: :func:`attnlab_shape_step`."""
    for name in args.shapes:
        yield name, *attnlab_shape_step(SHAPES[name], bf16)


def fused_attention_only():
    """PyTorch's fused kernel for every training attention (ShortAttention switched off, its kernel's limit too)."""
    return mock.patch.multiple(attention, SHORT_KEYS=0, SHORT_KEYS_KERNEL=0)


def attention_keys_table(args) -> dict:
    """The trainer's update of nanoGPT's model (Tiny Shakespeare from ``--data``) with blocks of each of
    ``--attention-keys`` tokens, ShortAttention (attnlab's kernel in fp32) against PyTorch's fused kernel, in turns,
    fp32 and (native-bf16 CPUs) bf16: what ``attention.SHORT_KEYS_KERNEL`` and ``SHORT_KEYS`` are set by.

    nanoGPT's attention is all causal self-attention; an encoder-decoder also has the encoder's self-attention and the
    cross-attention, neither causal. So each length also times the small step table's model (d 256, 4 heads of 64,
    3 + 3 layers; attnlab's copy of HF Marian, as the step table builds it) on random pairs of that many source and
    target tokens, ``--keys-tokens // length`` pairs a batch (fp32: the kernel's limit is an fp32 one), where
    transformers is installed."""
    work = shakespeare_text(args)
    if work is None:
        return {"skipped": f"no Tiny Shakespeare in --data {args.data}"}
    paths = {"fused_ms": fused_attention_only,
             "short_ms": lambda: mock.patch.multiple(attention, SHORT_KEYS=1 << 20, SHORT_KEYS_KERNEL=1 << 20)}

    def row(run, n):
        r = in_turns(run, n, args.rounds, paths)
        return {**r, "fused_over_short": round(r["fused_ms"] / r["short_ms"], 3)}

    out = {}
    enc_dec = importlib.util.find_spec("transformers") is not None
    if not enc_dec:
        out["skipped"] = "the encoder-decoder rows: transformers is not installed (pip install -e '.[hf]')"
    for block in (int(b) for b in args.attention_keys.split(",")):
        for bf16 in [False] + ([True] if accel.bf16_native("cpu") else []):
            trainer = lm_trainer(str(work / "input.txt"), str(work / f"keys_lm_{block}"), 10 ** 6, bf16, args.threads,
                                 False, block_size=block)
            out[f"nanogpt update, {block} keys, {'bf16' if bf16 else 'fp32'}"] = row(
                lambda: trainer._update(1e-3), max(2, args.steps * 640 // block))
        if enc_dec:
            pairs = max(1, args.keys_tokens // block)
            step, *_ = attnlab_shape_step({**SHAPES["small"], "batch": pairs, "length": block}, False)
            out[f"marian small update, {pairs} x {block} keys, fp32"] = row(step, max(1, args.steps))
    return out


def attention_table(args) -> dict:
    """Self-attention forward + backward as the model runs it (:func:`self_attention`), PyTorch's fused
    kernel against ShortAttention, in turns."""
    out = {}
    for name, (B, h, T, hd, causal) in ATTENTION_SHAPES.items():
        if args.attention_shapes and name not in args.attention_shapes.split(","):
            continue
        run, per_step = self_attention(B, h, T, hd, causal)
        n = max(3, int(args.steps * per_step))
        row = in_turns(run, n, args.rounds, {"fused_ms": fused_attention_only,
                                             "short_ms": lambda T=T: mock.patch.object(attention, "SHORT_KEYS", T)})
        row["fused_over_short"] = round(row["fused_ms"] / row["short_ms"], 2)
        out[f"{name} B{B} h{h} T{T} hd{hd}{' causal' if causal else ''}"] = row
    return out


# -- the training loss: attnlab's fused loss against its plain path ------------------------------------

# (tokens, d): nanoGPT's update (12 × 64, d 128), the small Marian step's targets (64 × 24, d 256), a larger batch
LOSS_SHAPES = {"nanogpt": (768, 128), "marian_small": (1536, 256), "wide": (4096, 384)}


def loss_paths_table(args) -> dict:
    """The output projection and the label-smoothed loss, forward and backward, on their own: attnlab's fused loss
    (``LinearCrossEntropy``) against its plain path (the projection, then PyTorch's loss), in turns, for each of
    ``--loss-vocab``'s sizes; ``fused_over_plain`` above 1 where the plain path is faster. What sets
    ``train.tasks.base.FUSED_LOSS_MIN_VOCAB``; ``--dtype bf16`` (or both) under bf16 autocast too."""
    from attnlab.train.tasks import base
    out = {}
    for bf16 in [False, True] if args.dtype == "both" and accel.bf16_native("cpu") else [args.dtype == "bf16"]:
        for name, (N, d) in LOSS_SHAPES.items():
            for V in (int(v) for v in args.loss_vocab.split(",")):
                torch.manual_seed(0)
                head = nn.Linear(d, V, bias=False)
                h = torch.randn(N, d, requires_grad=True)
                labels = torch.randint(0, V, (N,))
                model = types.SimpleNamespace(lm_head=head, head_input=lambda x: x)

                def run():
                    h.grad = head.weight.grad = None
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        loss = base.output_loss(model, h, labels, None, 0.1)[0]
                    loss.backward()

                n = max(3, int(args.steps * 2e8 / (N * d * V)))
                row = in_turns(run, n, args.rounds,
                               {"fused_ms": lambda: mock.patch.object(base, "FUSED_LOSS_MIN_VOCAB", 0),
                                "plain_ms": lambda: mock.patch.object(base, "FUSED_LOSS_MIN_VOCAB", 1 << 62)})
                row["fused_over_plain"] = round(row["fused_ms"] / row["plain_ms"], 3)
                out[f"{name} {N} x d{d}, {V} classes, {'bf16' if bf16 else 'fp32'}"] = row
    return out


# -- dropout: attnlab's kernel against its torch path ------------------------------------------------

# (activation, dtype): the small shape's residual stream and FFN hidden layer, the large shape's residual in bf16
DROPOUT_ACTIVATIONS = {"small (64, 24, 256) fp32": ((64, 24, 256), torch.float32),
                       "small FFN (64, 24, 1024) fp32": ((64, 24, 1024), torch.float32),
                       "large (32, 32, 512) bf16": ((32, 32, 512), torch.bfloat16)}


def dropout_table(args) -> dict:
    """attnlab's ``Dropout(0.1)`` forward + backward on training activations, and attnlab's whole step on
    ``--shapes`` (fp32; bf16 where native), with its kernel (``csrc/dropout.cpp``) and with its torch path
    (``ATTNLAB_OWN_KERNELS=0``), the two in turns."""
    from attnlab.model.layers import Dropout, fused_dropout
    paths = {"kernel_ms": lambda: mock.patch.dict(os.environ, {"ATTNLAB_OWN_KERNELS": "1"}),
             "torch_ms": lambda: mock.patch.dict(os.environ, {"ATTNLAB_OWN_KERNELS": "0"})}
    with paths["kernel_ms"]():
        assert fused_dropout(), "attnlab's dropout kernel does not build here"

    def row(run, n) -> dict:
        r = in_turns(run, n, args.rounds, paths)
        return {**r, "torch_over_kernel": round(r["torch_ms"] / r["kernel_ms"], 3)}

    out = {}
    drop = Dropout(0.1).train()
    for name, (shape, dtype) in DROPOUT_ACTIVATIONS.items():
        x = torch.randn(shape, dtype=dtype, requires_grad=True)
        grad = torch.randn(shape, dtype=dtype)

        def run(x=x, grad=grad):
            drop(x).backward(grad)
            x.grad = None
        out[name] = row(run, max(3, args.steps * 40))
    for bf16 in [False] + ([True] if accel.bf16_native("cpu") else []):
        for name, step, *_ in attnlab_shape_steps(args, bf16):
            out[f"step {name} {'bf16' if bf16 else 'fp32'}"] = row(step, args.steps)
    return out


ONEDNN_SKIPPED = {"skipped": "attnlab's fp32 training products take MKL on this CPU (no AVX-512 for oneDNN)"}


def onednn_training_products() -> bool:
    """Whether attnlab's fp32 training products take oneDNN's GEMM on this CPU (``accel.onednn_training_gemm_ok``),
    asked with oneDNN's linears switched on, as the tables that compare them switch them themselves."""
    with mock.patch.dict(os.environ, {"ATTNLAB_PACKED_LINEAR": "1"}):
        return accel.onednn_training_gemm_ok()


def gemm_table(args) -> dict:
    """attnlab's fp32 step on ``--shapes`` with its training products on oneDNN's GEMM (where
    ``accel.onednn_training_gemm_ok``: AVX-512 CPUs) and on MKL's (``ATTNLAB_PACKED_LINEAR=0``), in turns."""
    paths = {"onednn_ms": lambda: mock.patch.dict(os.environ, {"ATTNLAB_PACKED_LINEAR": "1"}),
             "mkl_ms": lambda: mock.patch.dict(os.environ, {"ATTNLAB_PACKED_LINEAR": "0"})}
    if not onednn_training_products():
        return ONEDNN_SKIPPED
    out = {}
    for name, step, *_ in attnlab_shape_steps(args, False):
        r = in_turns(step, args.steps, args.rounds, paths)
        out[f"step {name} fp32"] = {**r, "mkl_over_onednn": round(r["mkl_ms"] / r["onednn_ms"], 3)}
    return out


def fp32_step_rows(args, row) -> dict:
    """{row name: ``row(run, n)``} for attnlab's fp32 steps of ``--shapes`` (``--steps`` calls a round) and, where
    ``--data`` has Tiny Shakespeare, the trainer's update of nanoGPT's model (:func:`nanogpt_update_rows`): the
    rows of the tables that time one of attnlab's kernels against its other path."""
    out = {f"step {name} fp32": row(step, args.steps) for name, step, *_ in attnlab_shape_steps(args, False)}
    return {**out, **nanogpt_update_rows(args, row)}


def nanogpt_update_rows(args, row) -> dict:
    """{"nanogpt update fp32": ``row(run, n)``} for the trainer's update of nanoGPT's model (``--steps`` × 10 calls
    a round), where ``--data`` has Tiny Shakespeare; else {}."""
    work = shakespeare_text(args)
    if work is None:
        return {}
    trainer = lm_trainer(str(work / "input.txt"), str(work / "kernel_lm"), 10 ** 6, False, args.threads, False)
    return {"nanogpt update fp32": row(lambda: trainer._update(1e-3), max(3, args.steps * 10))}


def own_kernel_table(args, what: str, cache: dict, built, other: str, rows=fp32_step_rows) -> dict:
    """attnlab's fp32 steps on ``--shapes`` and, where ``--data`` has Tiny Shakespeare, the trainer's update of
    nanoGPT's model (``rows``: which of them), with one of attnlab's own kernels (``built()``: whether it serves;
    ``cache``: its cached answer) and without it (that answer switched off, so ``other`` serves; the other own
    kernels stay on), in turns. Rows: ``kernel_ms``, ``<other>_ms`` and ``<other>_over_kernel``."""
    @contextlib.contextmanager
    def kernels(on: bool):  # attnlab's own kernels on (as --dropout does, whatever the environment says), this one or not
        with mock.patch.dict(os.environ, {"ATTNLAB_OWN_KERNELS": "1"}), \
                (contextlib.nullcontext() if on else mock.patch.dict(cache, {"ok": False})):
            yield

    with kernels(True):
        if not built():
            return {"skipped": f"attnlab's {what} does not build here (no C++ compiler or ninja, or not Linux)"}
    paths = {"kernel_ms": lambda: kernels(True), f"{other}_ms": lambda: kernels(False)}

    def row(step, n) -> dict:
        r = in_turns(step, n, args.rounds, paths)
        return {**r, f"{other}_over_kernel": round(r[f"{other}_ms"] / r["kernel_ms"], 3)}

    return rows(args, row)


# -- each part's cost inside the step: the part swapped for a one-pass stand-in, in turns ------------

def _stand_ins(model: nn.Module, optimizer, clips: bool) -> dict:
    """{row key: a context manager factory} that swaps one part of attnlab's update for a stand-in of the same
    shapes that costs about one pass over its activation: attention → q + mean(k + v) over the keys (q, k and v
    still get gradients, so the projections' products are the same); every norm → x · weight (+ bias);
    the FFN's activation → x · 1; the projection + loss → its other path (not a stand-in: the plain projection
    and PyTorch's loss where the update takes the fused one, ``base.FUSED_LOSS_MIN_VOCAB``, and the fused one where
    it takes the plain); gradient clipping (``clips``: where the update clips) and the optimizer step →
    nothing. ``as_is_again_ms``, the update as it is once more, is the control: its difference from
    ``as_is_ms`` is the run's noise. It comes last, so that the two stand at the ends of each round (the order
    flips every round) and the control sees the drift across a round, as the stand-ins in between do."""
    from attnlab.model import layers
    from attnlab.train import trainer as trainer_module
    from attnlab.train.tasks import base
    norms = [m for m in model.modules() if isinstance(m, (nn.LayerNorm, layers.RMSNorm))]
    ffns = [m for m in model.modules() if isinstance(m, layers.PositionwiseFeedForward)]
    fused = model.lm_head.weight.shape[0] >= base.FUSED_LOSS_MIN_VOCAB
    other_loss_path = 1 << 62 if fused else 0  # (the threshold that sends the loss the other way)

    def attend(self, q, k, v, mask, is_causal, bias):
        B, h, T, hd = q.shape
        return (q + (k + v).mean(dim=2, keepdim=True)).transpose(1, 2).reshape(B, T, h * hd)  # (B, T, h·hd)

    def norm(self, x):
        return x * self.weight + (self.bias if getattr(self, "bias", None) is not None else 0)

    def patched(*patches):
        stack = contextlib.ExitStack()
        for p in patches:
            stack.enter_context(p)
        return stack

    paths = {"as_is_ms": contextlib.nullcontext,
             # (and not the packed operator, which self-attention without a mask takes in place of _attend)
             "attention_stand_in_ms": lambda: patched(mock.patch.object(attention.MultiHeadAttention, "_attend", attend),
                                                      mock.patch.object(attention, "packed_kernel_serves",
                                                                        lambda qkv: False)),
             "norm_stand_in_ms": lambda: patched(*(mock.patch.object(m, "forward", norm.__get__(m)) for m in norms)),
             "activation_stand_in_ms": lambda: patched(*(mock.patch.object(m, "act", lambda x: x * 1.0) for m in ffns)),
             "loss_other_path_ms": lambda: mock.patch.object(base, "FUSED_LOSS_MIN_VOCAB", other_loss_path),
             "no_clipping_ms": lambda: mock.patch.object(trainer_module, "clip_grad_norm", lambda *a, **k: None),
             "no_optimizer_step_ms": lambda: mock.patch.object(optimizer, "step", lambda *a, **k: None)}
    if not clips:
        del paths["no_clipping_ms"]
    paths["as_is_again_ms"] = contextlib.nullcontext
    return paths


def ablation_table(args) -> dict:
    """What each part of attnlab's fp32 update costs where it runs, inside the update: the fp32 steps of
    ``--shapes`` and, where ``--data`` has Tiny Shakespeare, the trainer's update of nanoGPT's model, timed as
    they are and with one part swapped for a stand-in (:func:`_stand_ins`), in turns. ``<part>_costs_ms`` is
    the update as it is minus with the stand-in: the part's cost above about one pass over its activation
    (a profile's self times can say otherwise: the profiler slows the small operators, and an operator's time
    in isolation leaves out the caches it finds cold or warm inside the update). ``noise_ms``: the control's
    difference (the same update twice); a part's cost within a few times that is not told from nothing."""
    steps = [(f"step {name} fp32", step, model, opt, False, args.steps)
             for name, step, model, opt in attnlab_shape_steps(args, False)]
    work = shakespeare_text(args)
    if work is not None:
        trainer = lm_trainer(str(work / "input.txt"), str(work / "ablation_lm"), 10 ** 6, False, args.threads, False)
        steps.append(("nanogpt update fp32", lambda: trainer._update(1e-3), trainer.model, trainer.optimizer, True,
                      max(3, args.steps * 10)))
    out = {}
    for name, step, model, opt, clips, n in steps:
        row = in_turns(step, n, args.rounds, _stand_ins(model, opt, clips))
        row["noise_ms"] = round(abs(row.pop("as_is_again_ms") - row["as_is_ms"]), 3)
        for key in [k for k in row if k not in ("as_is_ms", "noise_ms")]:
            row[key.replace("_ms", "_costs_ms")] = round(row["as_is_ms"] - row[key], 3)
        out[name] = row
    return out


def gelu_table(args) -> dict:
    """``own_kernel_table`` for attnlab's GELU kernel (``csrc/gelu.cpp``, ``layers.gelu``) against ``F.gelu``."""
    from attnlab.model import layers
    return own_kernel_table(args, "GELU kernel", layers._GELU, layers.fused_gelu, "f_gelu")


def clip_table(args) -> dict:
    """``own_kernel_table`` for attnlab's gradient-clipping kernel (``csrc/grad_norm.cpp``, ``train.clipping``)
    against ``torch.nn.utils.clip_grad_norm_``, on the trainer's update of nanoGPT's model (which clips at 1.0, as
    nanoGPT does; the step tables' sides do not clip): {"skipped": why} without Tiny Shakespeare in ``--data``."""
    from attnlab.train import clipping
    return (own_kernel_table(args, "gradient-clipping kernel", clipping._CLIP, clipping.fused_clip, "torch_clip",
                             rows=nanogpt_update_rows)
            or {"skipped": f"--data {args.data}: no Tiny Shakespeare there"})


def attention_kernel_table(args) -> dict:
    """``own_kernel_table`` for attnlab's attention kernel (``csrc/short_attention.cpp``) against ShortAttention's
    torch ops (batched matmuls, softmax, the heads' copies)."""
    return own_kernel_table(args, "attention kernel", attention._SHORT, attention.fused_short_attention, "torch_ops")


def packed_attention_table(args) -> dict:
    """attnlab's fp32 steps on ``--shapes`` and, where ``--data`` has Tiny Shakespeare, the trainer's update of
    nanoGPT's model, with self-attention on the packed operator (``attnlab::packed_self_attention``: the fused
    projection in, the merged heads out, its autograd in C++ writing dq, dk and dv into one gradient) and on the split
    path (q, k and v split out of the projection, ShortAttention's kernel, their gradients concatenated), in turns.
    Both paths run the same attention kernels (``csrc/short_attention.cpp``); the table prices the wrapper."""
    with mock.patch.dict(os.environ, {"ATTNLAB_OWN_KERNELS": "1"}):
        if not attention.fused_short_attention():
            return {"skipped": "attnlab's attention kernel does not build here (no C++ compiler or ninja, or not Linux)"}
    serves, asked = attention.packed_kernel_serves, [0, 0]  # (self-attentions asked, of them served: the packed path's)

    def counted(qkv):
        ok = serves(qkv)
        asked[0], asked[1] = asked[0] + 1, asked[1] + ok
        return ok

    @contextlib.contextmanager
    def path(packed: bool):
        with mock.patch.dict(os.environ, {"ATTNLAB_OWN_KERNELS": "1"}), \
                mock.patch.object(attention, "packed_kernel_serves", counted if packed else (lambda qkv: False)):
            yield

    paths = {"packed_ms": lambda: path(True), "split_ms": lambda: path(False)}

    def row(step, n) -> dict:
        asked[:] = [0, 0]
        r = in_turns(step, n, args.rounds, paths)
        # packed_share: of the self-attentions that asked packed_kernel_serves on the packed path (those with no mask,
        # bias, rotary positions, cache, recorded weights or dropout, over at most SHORT_KEYS_KERNEL keys: the rest
        # take the split path on both), the share it served (0: the two paths were the same)
        return {**r, "split_over_packed": round(r["split_ms"] / r["packed_ms"], 3),
                "packed_share": round(asked[1] / max(asked[0], 1), 3)}

    return fp32_step_rows(args, row)


def linear_kernel_table(args) -> dict:
    """attnlab's fp32 steps on ``--shapes`` and, where ``--data`` has Tiny Shakespeare, the trainer's update of
    nanoGPT's model, with the oneDNN training linear as it ships (attnlab's kernel, ``csrc/linear.cpp``: its autograd
    in C++ and the weight gradient on oneDNN, one operand turned by ``attnlab::transposed``), with that kernel and the
    weight gradient on MKL's ``mm`` (``accel.ONEDNN_WEIGHT_GRAD`` off), and with the Python ``accel.OneDNNLinear``
    (MKL's weight gradient; the kernel switched off), in turns. Where the products take MKL anyway (no AVX-512 for
    oneDNN) the table is skipped with the reason."""
    if not onednn_training_products():
        return ONEDNN_SKIPPED

    @contextlib.contextmanager
    def path(kernel: bool, onednn_weight_grad: bool):
        with mock.patch.dict(os.environ, {"ATTNLAB_OWN_KERNELS": "1", "ATTNLAB_PACKED_LINEAR": "1"}), \
                mock.patch.object(accel, "ONEDNN_WEIGHT_GRAD", onednn_weight_grad), \
                (contextlib.nullcontext() if kernel else mock.patch.dict(accel._LINEAR_KERNEL, {"ok": False})):
            yield

    with path(True, True):
        if not accel.linear_kernel_serves():
            return {"skipped": "attnlab's linear kernel does not build here (no C++ compiler or ninja, or not Linux)"}
    paths = {"kernel_ms": lambda: path(True, True), "kernel_mkl_weight_grad_ms": lambda: path(True, False),
             "python_ms": lambda: path(False, False)}

    def row(step, n) -> dict:
        r = in_turns(step, n, args.rounds, paths)
        return {**r, "python_over_kernel": round(r["python_ms"] / r["kernel_ms"], 3),
                "mkl_weight_grad_over_kernel": round(r["kernel_mkl_weight_grad_ms"] / r["kernel_ms"], 3)}

    return fp32_step_rows(args, row)


def attention_products_table(args) -> dict:
    """ShortAttention under bf16 autocast (CPUs with native bf16): its P·V and input-gradient products in bf16
    (what it does there for heads of ``attention.BF16_PRODUCTS_MIN_HEAD_DIM`` or more) against all six in fp32
    (what it does elsewhere), in turns: one self-attention's forward + backward at the short-key shapes of
    ``--attention`` (both ways whatever the head size), attnlab's bf16 step on ``--shapes``; and the error of one
    large-shape attention (output, dq, dk, dv) against float64 on the same bf16 inputs, for scores of std ~1 and
    ~6, beside the fp32 result's own rounding to bf16."""
    if not accel.bf16_native("cpu"):
        return {"skipped": "no native bf16 on this CPU: ShortAttention's products are all fp32 here"}
    short = attention.ShortAttention
    fp32_products = staticmethod(lambda q, k, v: short.compute_dtype(q))
    paths = {"bf16_products_ms": lambda: mock.patch.object(attention, "BF16_PRODUCTS_MIN_HEAD_DIM", 0),  # any head size
             "fp32_products_ms": lambda: mock.patch.object(short, "product_dtype", fp32_products)}
    out = {}
    for name, (B, h, T, hd, causal) in ATTENTION_SHAPES.items():
        if T > attention.SHORT_KEYS:
            continue
        run, per_step = self_attention(B, h, T, hd, causal, torch.bfloat16)
        r = in_turns(run, max(3, int(args.steps * per_step)), args.rounds, paths)
        out[f"attention {name} B{B} h{h} T{T} hd{hd} bf16"] = {
            **r, "fp32_over_bf16": round(r["fp32_products_ms"] / r["bf16_products_ms"], 3),
            "bf16_products_taken": hd >= attention.BF16_PRODUCTS_MIN_HEAD_DIM}
    for name, step, *_ in attnlab_shape_steps(args, True):
        r = in_turns(step, args.steps, args.rounds, paths)
        out[f"step {name} bf16"] = {**r, "fp32_over_bf16": round(r["fp32_products_ms"] / r["bf16_products_ms"], 3)}
    B, h, T, hd, _ = ATTENTION_SHAPES["large"]
    g = torch.Generator().manual_seed(0)
    for spread in (1.0, 2.5):
        q, k = ((torch.randn(B, T, h, hd, generator=g) * spread).bfloat16().transpose(1, 2) for _ in range(2))
        v, grad = (torch.randn(B, T, h, hd, generator=g).bfloat16().transpose(1, 2) for _ in range(2))

        def attend(dtype, products=True):
            ins = [t.to(dtype, copy=True).requires_grad_() for t in (q, k, v)]  # (fresh leaves, no grad)
            with contextlib.nullcontext() if products else mock.patch.object(short, "product_dtype", fp32_products):
                o = short.apply(*ins, None, hd ** -0.5, False)
            o.backward(grad.to(dtype))
            return [o.detach()] + [t.grad for t in ins]
        exact = attend(torch.float64)

        def errors(got):
            return [float(f"{((a.double() - b).norm() / b.norm()).item():.3g}") for a, b in zip(got, exact)]
        scores_std = round((q.double() @ k.double().transpose(-1, -2) * hd ** -0.5).std().item(), 2)
        out[f"error vs float64, scores std {scores_std} (out, dq, dk, dv)"] = {
            "fp32_rounded_to_bf16": errors([t.bfloat16() for t in attend(torch.float32)]),
            "fp32_products": errors(attend(torch.bfloat16, products=False)),
            "bf16_products": errors(attend(torch.bfloat16))}
    return out


# -- an epoch of real pairs, each side batching the way its tool does -------------------------------

def corpus_ids(path: str, pairs: int) -> tuple[list[list[int]], list[list[int]]]:
    """``pairs`` pairs drawn at random (seed 0) from a SOURCE<TAB>TARGET file (the shipped one is sorted
    alphabetically), as ids of a joint BPE of VOCAB tokens trained on the file: sources end in EOS, targets
    are BOS … EOS (what ``attnlab train --task translation`` feeds)."""
    import random
    from attnlab.data.readers import read_tsv_pairs
    from attnlab.data.tokenizer import train_tokenizer
    from attnlab.demo import corpus_dir
    data = read_tsv_pairs(corpus_dir() / "train.tsv.gz" if path == "shipped" else path)
    tok = train_tokenizer(data.src + data.tgt, VOCAB)
    pick = random.Random(0).sample(range(len(data.src)), min(pairs, len(data.src)))
    return (tok.encode_batch([data.src[i] for i in pick], eos=True),
            tok.encode_batch([data.tgt[i] for i in pick], bos=True, eos=True))


def corpus_batches(src, tgt, batch: int) -> dict[str, list[list[int]]]:
    """Each tool's batches of the same pairs. HF's Trainer: random batches of ``batch`` pairs (its default)
    or, with ``group_by_length``, its ``LengthGroupedSampler`` (megabatches of 50 batches sorted by source
    length); the PyTorch tutorial: random batches; attnlab: its trainer's length buckets
    (``TokenBatchSampler``) capped at the same ``batch`` pairs and no token budget, so every side makes the
    same number of updates of the same size in pairs, and only which pairs share a batch differs."""
    from transformers.trainer_pt_utils import LengthGroupedSampler
    from attnlab.data.batching import TokenBatchSampler
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(src), generator=g).tolist()
    random_batches = [order[i:i + batch] for i in range(0, len(order), batch)]
    grouped = list(LengthGroupedSampler(batch, lengths=[len(x) for x in src], generator=g))
    tokens = TokenBatchSampler([len(x) for x in src], [len(t) for t in tgt], max_tokens=10 ** 9, seed=0,
                               max_sentences=batch).batches(0)
    return {"attnlab": tokens, "hf_marian": random_batches, "hf_marian_group_by_length":
            [grouped[i:i + batch] for i in range(0, len(grouped), batch)], "torch_nn_transformer": random_batches}


def corpus_side(shape: str, key: str, bf16: bool, src, tgt, plan):
    """(warm-up, timed unit) of one side on real pairs: a step on its first batch, and an epoch over its batches."""
    from attnlab.data.batching import collate_pairs
    model = build_side(SHAPES[shape], key)
    opt = make_optimizer(key, model)
    batches = [collate_pairs([src[i] for i in b], [tgt[i] for i in b], 0) for b in plan]
    if key == "attnlab":
        update = attnlab_update(model, opt, bf16, pad=0)

        def step(src_ids, src_mask, tgt_in, labels):
            update(src_ids, tgt_in, labels, src_mask)
    elif key == "torch_nn_transformer":
        step = peer_step(model, opt, bf16, lambda m, src_ids, src_mask, tgt_in, labels: m(src_ids, tgt_in, ~src_mask, tgt_in == 0),
                         lambda *batch: batch[3], ignore_pad=True)
    else:
        step = peer_step(model, opt, bf16, lambda m, src_ids, src_mask, tgt_in, labels: m(
            input_ids=src_ids, attention_mask=src_mask, decoder_input_ids=tgt_in).logits, lambda *batch: batch[3], ignore_pad=True)

    def epoch():
        for batch in batches:
            step(*batch)
    return (lambda: step(*batches[0])), epoch


def run_corpus(s, args, bf16: bool) -> dict:
    """One epoch over the same pairs per side (real target tokens per second), each side in its own process
    (:func:`sides_in_turns`), in turns."""
    from attnlab.data.batching import collate_pairs
    src, tgt = corpus_ids(args.corpus, args.pairs)
    plans = corpus_batches(src, tgt, s["batch"])
    keys = ["attnlab", "hf_marian", "hf_marian_group_by_length", "torch_nn_transformer"]
    sides = sides_in_turns("corpus_side", keys, lambda key: (args.corpus_shape, key, bf16, src, tgt, plans[key]), args, 1)
    real = sum(len(t) - 1 for t in tgt)  # labels: the target after BOS, EOS included
    out = {"pairs": len(src), "real_target_tokens": real,
           "mean_src_len": round(statistics.mean(len(x) for x in src), 1),
           "mean_tgt_len": round(statistics.mean(len(t) - 1 for t in tgt), 1)}
    for key in keys:
        times = sides[key].pop("s")
        t = statistics.median(times)
        batches = [collate_pairs([src[i] for i in b], [tgt[i] for i in b], 0) for b in plans[key]]
        padded = sum(b[0].numel() + b[2].numel() for b in batches)
        out[key] = {"epoch_s": round(t, 2), "real_tgt_tokens_per_s": round(real / t), "batches": len(batches),
                    "padding_share": round(1 - (sum(len(x) for x in src) + real) / padded, 3),
                    **sides[key],
                    "epoch_s_by_round": [round(x, 2) for x in times]}
    for key in keys[1:]:
        out[f"attnlab_vs_{key}"] = round(out[key]["epoch_s"] / out["attnlab"]["epoch_s"], 2)
    return out


# -- nanoGPT's Tiny Shakespeare step -----------------------------------------------------------------

NANOGPT_CPU_ARGS = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--log_interval=1",
                    "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
                    "--lr_decay_iters=2000", "--dropout=0.0", "--eval_interval=1000000", "--eval_iters=1"]
WARMUP_ITERS = 10

# attnlab's side: the trainer of `attnlab train --task lm --preset shakespeare-char` (the arguments of
# benchmarks/shakespeare_nanogpt.py), every update timed like nanoGPT's loop times its iterations.
def lm_trainer(text: str, out: str, iters: int, bf16: bool, threads: int | None, compile: bool, block_size: int = 64):
    """attnlab's trainer set up as ``attnlab train --task lm --preset shakespeare-char`` (nanoGPT's CPU recipe; other
    ``block_size``s for --attention-keys), its model in training mode: ``trainer._update(lr)`` is one timed update."""
    from attnlab.train.options import TrainArgs
    from attnlab.train.trainer import Trainer
    args = TrainArgs(task="lm", train=text, out=out, preset="shakespeare-char", tokenizer="char", block_size=block_size,
                     batch_size=12, max_steps=iters, lr=1e-3, min_lr=1e-4, schedule="cosine", warmup=100,
                     betas=[0.9, 0.99], eps=1e-8, weight_decay=0.1, clip_norm=1.0, eval_every=0, save_every=0,
                     progress=False, bf16=bf16, threads=threads or None, compile=compile)
    trainer = Trainer(args, log=lambda *a: None)
    trainer.setup()
    trainer.model.train()
    trainer._stats = {"tokens": 0, "loss_sum": 0.0, "loss_n": 0, "since": time.time()}
    return trainer


_ATTNLAB_LM_STEP = """
import json, sys, time, torch
side = json.loads(sys.argv[1])  # text, out, iters, bf16, threads, compile, profile (updates; 0: none), benchmarks
sys.path.append(side["benchmarks"])
from train_speed import lm_trainer, profile_units
iters = side["iters"]
trainer = lm_trainer(side["text"], side["out"], iters, side["bf16"], side["threads"], side["compile"])
times, t0 = [], time.time()
for _ in range(iters):
    trainer._update(1e-3)
    t1 = time.time()
    times.append(t1 - t0)
    t0 = t1
profiled = {}
if side["profile"]:  # --profile: the products' share of the update (train_speed.profile_units)
    profiled = profile_units(lambda: trainer._update(1e-3), side["profile"])
print(json.dumps({"ms": [round(t * 1e3, 3) for t in times], "bf16": trainer.bf16, "profile": profiled}))
"""


def shakespeare_text(args) -> Path | None:
    """``--workdir``, with Tiny Shakespeare from ``--data`` (input.txt or input.txt.gz, or their folder) written to
    its input.txt; None where ``--data`` has neither."""
    text, work = tinyshakespeare.tiny_shakespeare(args.data), Path(args.workdir)
    if text is None:
        return None
    work.mkdir(parents=True, exist_ok=True)
    (work / "input.txt").write_text(text, encoding="utf-8")
    return work


def prepared_nanogpt(args, needs: str) -> tuple[Path, Path]:
    """(the nanoGPT checkout ``--nanogpt``, ``--workdir`` with Tiny Shakespeare from ``--data``), its character data
    prepared by its own ``data/shakespeare_char/prepare.py`` (train.bin, val.bin, meta.pkl). ``needs``: the file
    of the checkout the caller runs."""
    ng = Path(args.nanogpt).resolve()
    if not (ng / needs).exists():
        raise SystemExit(f"--nanogpt {ng}: no {needs} there (a checkout of karpathy/nanoGPT is expected)")
    work = shakespeare_text(args)
    if work is None:
        raise SystemExit(f"--data {args.data}: no input.txt(.gz) of Tiny Shakespeare there")
    data_dir = ng / "data" / "shakespeare_char"
    shutil.copy(work / "input.txt", data_dir / "input.txt")  # prepare.py downloads only if absent
    subprocess.run([sys.executable, "prepare.py"], cwd=data_dir, check=True, capture_output=True)
    return ng, work


def nanogpt_step(args) -> dict:
    """ms/iter of nanoGPT's train.py and of attnlab's trainer on Tiny Shakespeare, the sides in turns."""
    ng, work = prepared_nanogpt(args, "train.py")
    iters = max(args.nanogpt_iters, WARMUP_ITERS + 1)
    threads = str(args.threads or torch.get_num_threads())
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    # --heap: attnlab's trainer keeps freed memory unless switched off; glibc's tunables give nanoGPT the same
    # setting for --heap kept (the 1 GiB threshold needs glibc >= 2.35)
    attnlab_env = {**env, "ATTNLAB_KEEP_FREED_MEMORY": "0" if args.heap == "default" else "1"}
    nanogpt_env = {**env, **({"GLIBC_TUNABLES": accel.KEPT_HEAP_TUNABLES} if args.heap == "kept" else {})}
    attnlab_sides = ["attnlab_fp32"] + (["attnlab_bf16"] if accel.bf16_native("cpu") else [])
    sides = ["nanogpt", *attnlab_sides]
    if args.compile:  # both tools' torch.compile: nanoGPT's --compile=True, attnlab's --compile
        sides += ["nanogpt_compiled", *(f"{side}_compiled" for side in attnlab_sides)]
    samples = {side: [] for side in sides}
    round_medians = {side: [] for side in sides}  # each process's median: a round's sides ran minutes apart at most
    profiles = {}  # --profile: attnlab's eager sides, one profile per round
    for _ in range(args.rounds):
        for side in sides:
            if side.startswith("nanogpt"):
                flags = [*NANOGPT_CPU_ARGS, "--compile=True"] if side.endswith("compiled") else NANOGPT_CPU_ARGS
                res = subprocess.run([sys.executable, "train.py", *flags, f"--max_iters={iters - 1}",
                                      f"--out_dir={(work / 'nanogpt').resolve()}"], cwd=ng, env=nanogpt_env,
                                     capture_output=True, text=True)
                if res.returncode:
                    raise SystemExit(f"nanoGPT's train.py failed:\n{res.stderr[-2000:]}")
                ms = [float(m) for m in re.findall(r"^iter \d+: loss [\d.]+, time ([\d.]+)ms", res.stdout, re.M)]
            else:
                spec = {"text": str(work / "input.txt"), "out": str(work / side), "iters": iters, "bf16": "bf16" in side,
                        "threads": int(threads), "compile": side.endswith("compiled"),
                        "profile": 20 if args.profile and not side.endswith("compiled") else 0,
                        "benchmarks": str(Path(__file__).resolve().parent)}
                res = subprocess.run([sys.executable, "-c", _ATTNLAB_LM_STEP, json.dumps(spec)],
                                     env=attnlab_env, capture_output=True, text=True)
                if res.returncode:
                    raise SystemExit(f"attnlab's step failed:\n{res.stderr[-2000:]}")
                answer = json.loads(res.stdout.strip().splitlines()[-1])
                ms = answer["ms"]
                if answer["profile"]:
                    profiles.setdefault(side, []).append(answer["profile"])
            if len(ms) < iters:
                raise SystemExit(f"{side}: {len(ms)} iterations timed, {iters} expected")
            samples[side].extend(ms[WARMUP_ITERS:])  # iteration 0 of nanoGPT includes its one evaluation
            round_medians[side].append(statistics.median(ms[WARMUP_ITERS:]))
    out = {"config": "nanoGPT README CPU run: 4 layers, 4 heads, d 128, block 64, batch 12, dropout 0",
           "iterations_timed_per_side": len(samples["nanogpt"])}
    for side in sides:
        out[side] = {"ms_per_iter_median": round(statistics.median(samples[side]), 2),
                     "ms_per_iter_p10": round(sorted(samples[side])[len(samples[side]) // 10], 2)}
    for side in sides:
        if side.startswith("attnlab"):
            # the target is written as attnlab's ms/iter over nanoGPT's (<= 0.75); a compiled side is also
            # set against nanoGPT compiled
            peers = ["nanogpt"] + (["nanogpt_compiled"] if side.endswith("compiled") else [])
            for peer in peers:
                out[f"{side}_over_{peer}"] = round(out[side]["ms_per_iter_median"] / out[peer]["ms_per_iter_median"], 3)
                # the same ratio round by round (each side's process against the peer's of the same round): how far
                # the machine's speed moved between rounds; the headline above pools every round's iterations
                out[f"{side}_over_{peer}_by_round"] = [round(a / b, 3) for a, b in zip(round_medians[side],
                                                                                       round_medians[peer])]
    for side, rounds in profiles.items():
        # the round with the median products time; the lowest ratio attnlab could reach were everything but its
        # matrix products free
        profile = sorted(rounds, key=lambda p: p["products_ms"])[len(rounds) // 2]
        out[side]["profile"] = profile
        out[f"{side}_over_nanogpt_if_only_products"] = round(profile["products_ms"] / out["nanogpt"]["ms_per_iter_median"], 3)
    return out


class NanoGPTLoop:
    """nanoGPT's train.py iteration, in this process: its ``model.py`` (GPT, GPTConfig) from the checkout ``ng``, built
    and trained as ``NANOGPT_CPU_ARGS`` say (4 layers, 4 heads, d 128, block 64, batch 12, dropout 0, no bias, lr 1e-3
    with 100 warm-up iterations and cosine decay over 2000, betas (0.9, 0.99), weight decay 0.1, clip 1.0, one
    micro-batch, its own ``configure_optimizers``; the recipe written here, not read from the checkout's config).
    ``iteration()`` is the body of train.py's loop, in its order: the lr set, the forward, the loss divided by the
    micro-batches, the next batch read from the memory-mapped train.bin, backward through the GradScaler (disabled
    on CPU), clipping, the step, zero_grad, and the log line (``loss.item()``, ``estimate_mfu``, the line printed, here
    to /dev/null). For :func:`nanogpt_interleaved`, which needs both tools in one process; the headline comparison
    runs train.py itself."""

    def __init__(self, ng: Path):
        spec = importlib.util.spec_from_file_location("nanogpt_model", ng / "model.py")
        nanogpt = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(nanogpt)
        data_dir = ng / "data" / "shakespeare_char"
        vocab = pickle.loads((data_dir / "meta.pkl").read_bytes())["vocab_size"]
        self.train_bin, self.batch_size, self.block_size, self.micro_batches = str(data_dir / "train.bin"), 12, 64, 1
        torch.manual_seed(1337)
        cfg = nanogpt.GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, bias=False, vocab_size=vocab, dropout=0.0)
        with contextlib.redirect_stdout(io.StringIO()):  # (its parameter count and optimizer lines)
            self.model = nanogpt.GPT(cfg)
            self.optimizer = self.model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
        self.scaler = torch.amp.GradScaler("cuda", enabled=False)  # (train.py's: enabled for float16, off without CUDA)
        self.log = open(os.devnull, "w")
        self.iter_num, self.local_iter_num, self.running_mfu = 0, 0, -1.0
        self.t0 = time.time()
        self.X, self.Y = self.get_batch()

    def get_batch(self):
        data = np.memmap(self.train_bin, dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - self.block_size, (self.batch_size,))
        x = torch.stack([torch.from_numpy((data[i:i + self.block_size]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + self.block_size]).astype(np.int64)) for i in ix])
        return x.to("cpu"), y.to("cpu")

    @staticmethod
    def get_lr(it, learning_rate=1e-3, warmup_iters=100, lr_decay_iters=2000, min_lr=1e-4):
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        if it > lr_decay_iters:
            return min_lr
        coeff = 0.5 * (1.0 + math.cos(math.pi * (it - warmup_iters) / (lr_decay_iters - warmup_iters)))
        return min_lr + coeff * (learning_rate - min_lr)

    def iteration(self):
        lr = self.get_lr(self.iter_num)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        logits, loss = self.model(self.X, self.Y)
        loss = loss / self.micro_batches
        self.X, self.Y = self.get_batch()
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        t1 = time.time()
        dt, self.t0 = t1 - self.t0, t1
        lossf = loss.item() * self.micro_batches
        if self.local_iter_num >= 5:
            mfu = self.model.estimate_mfu(self.batch_size * self.micro_batches, dt)
            self.running_mfu = mfu if self.running_mfu == -1.0 else 0.9 * self.running_mfu + 0.1 * mfu
        print(f"iter {self.iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, mfu {self.running_mfu * 100:.2f}%",
              file=self.log)
        self.iter_num += 1
        self.local_iter_num += 1


def nanogpt_interleaved(args) -> dict:
    """nanoGPT's iteration (:class:`NanoGPTLoop`, its own model and optimizer code) and attnlab's trainer update of the
    same model (fp32; bf16 where native) in one process, in blocks of ``--block-iters`` iterations taking turns, the
    order reversed every other round, for ``--rounds`` × 10 rounds (the first iteration of each block untimed). Why:
    this machine's speed moves by up to ~40% from one second to the next (attnlab's update read 30.6–49.7 ms in
    30-iteration blocks of one process), so train.py's processes, run one after the other, read ratios from 0.61 to
    0.91 round by round; blocks ~0.2 s long taken in turns see nearly the same machine. ``paired_over_nanogpt``: the
    median over rounds of each attnlab block's ratio to nanoGPT's block of the same round. Both sides share this
    process's heap: attnlab's trainer keeps freed memory (``--heap kept``'s setting for nanoGPT too, which if anything
    favours nanoGPT), so ``--heap default`` is refused here."""
    if args.heap == "default":
        raise SystemExit("--interleaved: both sides share attnlab's heap setting (freed memory kept); "
                         "--heap default needs the process per side (leave --interleaved out)")
    if args.block_iters < 2:
        raise SystemExit(f"--block-iters {args.block_iters}: at least 2 (the first iteration of a block is not timed)")
    ng, work = prepared_nanogpt(args, "model.py")
    loop = NanoGPTLoop(ng)
    sides = {"nanogpt": loop.iteration}
    for bf16 in [False] + ([True] if accel.bf16_native("cpu") else []):
        trainer = lm_trainer(str(work / "input.txt"), str(work / f"interleaved_{'bf16' if bf16 else 'fp32'}"), 10 ** 6,
                             bf16, args.threads, False)
        sides[f"attnlab_{'bf16' if bf16 else 'fp32'}"] = lambda trainer=trainer: trainer._update(1e-3)
    times = {key: [] for key in sides}  # per block: the median ms of its timed iterations
    try:
        for run in sides.values():  # (warm-up, as the headline's first 10 iterations)
            for _ in range(WARMUP_ITERS):
                run()
        for r in range(args.rounds * 10):
            for key, run in (list(sides.items()) if r % 2 == 0 else list(sides.items())[::-1]):
                run()
                ms = []
                for _ in range(args.block_iters - 1):
                    t0 = time.perf_counter()
                    run()
                    ms.append((time.perf_counter() - t0) * 1e3)
                times[key].append(statistics.median(ms))
    finally:
        loop.log.close()  # (nanoGPT's per-iteration prints, to /dev/null)
    out = {"config": "nanoGPT README CPU run: 4 layers, 4 heads, d 128, block 64, batch 12, dropout 0",
           "heap": "kept (attnlab's trainer's setting, both sides)", "blocks_per_side": len(times["nanogpt"]),
           "iterations_per_block": args.block_iters, "nanogpt_iterations_run": loop.iter_num}
    for key, blocks in times.items():
        out[key] = {"ms_per_iter_median": round(statistics.median(blocks), 2)}
    for key in [k for k in sides if k != "nanogpt"]:
        out[f"{key}_over_nanogpt"] = round(out[key]["ms_per_iter_median"] / out["nanogpt"]["ms_per_iter_median"], 3)
        out[f"{key}_paired_over_nanogpt"] = round(statistics.median(a / b for a, b in zip(times[key], times["nanogpt"])), 3)
    return out


# The CPU tables behind their --flags (the argparse names), run in this order after the step tables
TABLES = {"dropout": dropout_table, "gelu": gelu_table, "clip": clip_table, "attention_kernel": attention_kernel_table,
          "packed_attention": packed_attention_table, "gemm": gemm_table, "linear_kernel": linear_kernel_table,
          "attention_products": attention_products_table,
          "attention": attention_table, "ablate": ablation_table, "attention_keys": attention_keys_table,
          "loss_paths": loss_paths_table}
# ... those of them that time their own steps of --shapes, in place of the step tables
OWN_STEPS = ("dropout", "gelu", "clip", "attention_kernel", "packed_attention", "gemm", "linear_kernel", "attention_products",
             "ablate")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--shapes", default="small,large", help="comma-separated: small, large, tiny (the tests' shape), or none (only "
                                                               "--nanogpt)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu",
                    help="where the step tables run: cpu (default), cuda, mps (the other tables run on CPU only)")
    ap.add_argument("--dtype", choices=["both", "fp32", "bf16"], default="both",
                    help="the precision of the step tables and --corpus: fp32, bf16 autocast (where the device has native bf16), or both")
    ap.add_argument("--peak-size", type=int, default=None,
                    help="side of the square matmul that measures the peak (default 2048 on CPU, 8192 on a GPU; "
                         "smaller: a quicker, lower peak)")
    ap.add_argument("--nanogpt", default=None, help="a local checkout of karpathy/nanoGPT: also time its Shakespeare step")
    ap.add_argument("--nanogpt-iters", type=int, default=60, help="iterations per process (the first 10 are not timed)")
    ap.add_argument("--interleaved", action="store_true",
                    help="--nanogpt: nanoGPT's iteration (its model.py and optimizer, train.py's loop body) and attnlab's "
                         "update in one process, in blocks taking turns (in place of train.py's own processes)")
    ap.add_argument("--block-iters", type=int, default=6, help="--interleaved: iterations per block (the first untimed)")
    ap.add_argument("--attention", action="store_true",
                    help="also time one attention's forward + backward, PyTorch's fused kernel against ShortAttention")
    ap.add_argument("--attention-shapes", default=None, help="--attention: comma-separated names (default: all)")
    ap.add_argument("--attention-keys", default=None,
                    help="comma-separated block sizes (e.g. 128,256,512): the trainer's update of nanoGPT's model "
                         "with each, and the small encoder-decoder's (with transformers installed) on pairs of that many "
                         "tokens, ShortAttention against PyTorch's fused kernel, in turns (--data: Tiny Shakespeare)")
    ap.add_argument("--keys-tokens", type=int, default=2048,
                    help="--attention-keys: source (and target) tokens a batch of the encoder-decoder's rows")
    ap.add_argument("--dropout", action="store_true",
                    help="time attnlab's dropout kernel against its torch path (activations, and steps of --shapes)")
    ap.add_argument("--gelu", action="store_true",
                    help="time attnlab's fp32 steps of --shapes and nanoGPT's update with attnlab's GELU kernel "
                         "against F.gelu, in turns")
    ap.add_argument("--clip", action="store_true",
                    help="time nanoGPT's update with attnlab's gradient-clipping kernel against "
                         "torch.nn.utils.clip_grad_norm_, in turns (--data: Tiny Shakespeare)")
    ap.add_argument("--attention-kernel", action="store_true",
                    help="time attnlab's fp32 steps of --shapes and nanoGPT's update with attnlab's attention kernel "
                         "against ShortAttention's torch ops, in turns")
    ap.add_argument("--packed-attention", action="store_true",
                    help="time attnlab's fp32 steps of --shapes and nanoGPT's update with self-attention on the packed "
                         "operator against the split path (the same kernels), in turns")
    ap.add_argument("--gemm", action="store_true",
                    help="time attnlab's fp32 steps of --shapes on oneDNN's GEMM against MKL's, in turns")
    ap.add_argument("--linear-kernel", action="store_true",
                    help="time attnlab's fp32 steps of --shapes and nanoGPT's update with its linear kernel (autograd in "
                         "C++, the weight gradient on oneDNN), the kernel with MKL's weight gradient, and the Python "
                         "OneDNNLinear, in turns (AMD CPUs with AVX-512)")
    ap.add_argument("--attention-products", action="store_true",
                    help="time attnlab's bf16 steps of --shapes with ShortAttention's bf16 products against fp32 "
                         "ones, in turns, and their error against float64 (CPUs with native bf16)")
    ap.add_argument("--ablate", action="store_true",
                    help="time attnlab's fp32 steps of --shapes and nanoGPT's update with each part (attention, norms, "
                         "activation, loss, clipping, optimizer step) swapped for a one-pass stand-in, in turns: "
                         "what each part costs inside the update")
    ap.add_argument("--loss-paths", action="store_true",
                    help="time the output projection + loss on their own, attnlab's fused loss against its plain path, "
                         "in turns, for each of --loss-vocab's sizes (what sets FUSED_LOSS_MIN_VOCAB)")
    ap.add_argument("--loss-vocab", default="65,128,256,512,1024,8000", help="--loss-paths: comma-separated sizes")
    ap.add_argument("--compile", action="store_true",
                    help="--nanogpt: also time both tools' torch.compile of the step (nanoGPT --compile=True, attnlab --compile)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="the sides take turns this many times (median reported; --interleaved: ten times this many)")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed rounds, profile each side's step (the step tables; --nanogpt: attnlab's "
                         "eager sides): its time in matrix products, in fused attention and the costliest operators, "
                         "and the ratio attnlab would reach were everything but its products free")
    ap.add_argument("--heap", choices=["tools", "kept", "default"], default="tools",
                    help="the C heap of each side's process (also --corpus and --nanogpt): as each tool runs (attnlab's "
                         "trainer keeps freed memory, accel.keep_freed_memory; HF's Trainer, the tutorial and nanoGPT: "
                         "glibc's defaults), kept on every side, or glibc's defaults on every side")
    ap.add_argument("--data", default=str(tinyshakespeare.DEFAULT),
                    help="--nanogpt and the tables of nanoGPT's update: " + tinyshakespeare.HELP)
    ap.add_argument("--workdir", default="runs/train_speed")
    ap.add_argument("--corpus", default=None, nargs="?", const="shipped",
                    help="also time an epoch of real pairs (a SOURCE<TAB>TARGET file; bare: the shipped Tatoeba "
                         "en-zh pairs) on the small shape, each side batching as its tool does")
    ap.add_argument("--pairs", type=int, default=1024, help="--corpus: how many pairs (drawn at random, seed 0)")
    ap.add_argument("--corpus-shape", default="small", help="--corpus: the model shape (tiny: the smoke test's)")
    ap.add_argument("--as-avx2", action="store_true",
                    help="cap PyTorch, oneDNN and MKL at AVX2, no native bf16 (every side's process, nanoGPT's too)")
    args = ap.parse_args()
    args.shapes = [] if args.shapes == "none" else args.shapes.split(",")  # (parsed once: names of SHAPES)
    unknown = [name for name in args.shapes if name not in SHAPES]
    if unknown:
        ap.error(f"--shapes {','.join(args.shapes)}: no shape {unknown[0]!r} (one or more of {', '.join(SHAPES)}, "
                 f"comma-separated, or none)")
    if args.interleaved and not args.nanogpt:
        raise SystemExit("--interleaved: a comparison with nanoGPT (give --nanogpt PATH)")
    if args.as_avx2:
        if args.device != "cpu":
            raise SystemExit("--as-avx2: a CPU cap, for the CPU tables (leave --device out)")
        accel.restart_capped_at_avx2()  # (once: the program starts again with the variables set)
    try:
        device = accel.pick_device(args.device)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if device.type not in ("cpu", "cuda", "mps"):
        raise SystemExit(f"--device {args.device}: cpu, cuda or mps (a device the step can be trained and timed on)")
    args.device = str(device)
    cpu_tables = ["nanogpt", "corpus", *TABLES]
    if device.type != "cpu" and any(getattr(args, name) for name in cpu_tables):
        flags = [f"--{name.replace('_', '-')}" for name in cpu_tables]
        raise SystemExit(f"--device {args.device}: only the step tables (--shapes) run there; "
                         f"{', '.join(flags[:-1])} and {flags[-1]} are CPU tables")
    if args.peak_size is None:
        args.peak_size = 2048 if device.type == "cpu" else 8192
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.heap != "default":  # the tables timed in this process are attnlab's alone (its trainer's heap)
        accel.keep_freed_memory()
    results = {"cpu": f"{accel.cpu_name()} ({accel.cpu_isa()})", "threads": torch.get_num_threads(),
               "torch": torch.__version__, "heap": args.heap, "device": args.device}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    dtypes = {"both": [False] + ([True] if accel.bf16_native(device) else []), "fp32": [False], "bf16": [True]}[args.dtype]
    if True in dtypes and not accel.bf16_native(device):
        raise SystemExit(f"--dtype bf16: {args.device} has no native bf16 here (emulated bf16 is not a row)")
    shapes = [] if any(getattr(args, name) for name in OWN_STEPS) else args.shapes
    for bf16 in dtypes if shapes else []:
        peak = matmul_peak(torch.bfloat16 if bf16 else torch.float32, args.peak_size, args.device)
        for name in shapes:
            key = f"{name}_{'bf16' if bf16 else 'fp32'}"
            results[key] = run_shape(name, SHAPES[name], args, bf16, peak)
            peak = max(peak, results[key].pop("matmul_peak_FLOPs"))  # (the next shape's MFUs: the highest so far)
            print(key, json.dumps(results[key]), flush=True)
        results[f"matmul_peak_GFLOPs_{'bf16' if bf16 else 'fp32'}"] = round(peak / 1e9, 1)
    for bf16 in dtypes if args.corpus else []:
        key = f"corpus_{'bf16' if bf16 else 'fp32'}"
        results[key] = run_corpus(SHAPES[args.corpus_shape], args, bf16)
        print(key, json.dumps(results[key]), flush=True)
    for name, table in TABLES.items():  # (each behind its --flag, in this order)
        if getattr(args, name):
            results[name] = table(args)
            print(name, json.dumps(results[name]), flush=True)
    if args.nanogpt:
        key, table = ("nanogpt_interleaved", nanogpt_interleaved) if args.interleaved else ("nanogpt_shakespeare",
                                                                                           nanogpt_step)
        results[key] = table(args)
        print(key, json.dumps(results[key]), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
