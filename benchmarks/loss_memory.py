"""The output projection and the label-smoothed loss of one training step, forward and backward:
attnlab's fused ``output_loss`` (no (tokens × vocabulary) logits, no gradient of that size) against
the way HF's Trainer and nanoGPT compute it (``F.linear``, fp32 logits, ``F.cross_entropy``).

Each side runs in a fresh process, so its peak resident memory (``ru_maxrss``) above what the process
held before its first step is the memory the step needs; the time is the median of ``--steps``
steps after a warm-up. Two shapes: a Marian training batch (1,536 target tokens, d 256, 8,000 tokens
of vocabulary, an output bias) and a SmolLM2-135M one (2,048 tokens, d 576, 49,152, no bias).

    python benchmarks/loss_memory.py [--steps 5] [--threads 2] [--shapes marian,smollm2]
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from attnlab import accel

SHAPES = {"marian": dict(tokens=1536, d=256, vocab=8000, bias=True),
          "smollm2": dict(tokens=2048, d=576, vocab=49152, bias=False),
          "tiny": dict(tokens=64, d=16, vocab=500, bias=True)}  # the smoke test's


class Head(torch.nn.Module):
    """What ``output_loss`` reads from a model: ``lm_head`` and ``head_input``."""

    def __init__(self, d, vocab, bias):
        super().__init__()
        self.lm_head = torch.nn.Linear(d, vocab, bias=bias)

    def head_input(self, h):
        return h


def child(shape: str, side: str, steps: int) -> dict:
    from attnlab.train.tasks.base import output_loss
    s = SHAPES[shape]
    torch.manual_seed(0)
    model = Head(s["d"], s["vocab"], s["bias"])
    h = torch.randn(s["tokens"], s["d"], requires_grad=True)
    labels = torch.randint(0, s["vocab"], (s["tokens"],))

    def step():
        h.grad, model.lm_head.weight.grad = None, None
        if side == "attnlab":
            loss = output_loss(model, h, labels, None, 0.1)[0]
        else:
            logits = model.lm_head(h)
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=0.1)
        loss.backward()
        return loss.item()

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    loss = step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"loss": round(loss, 5), "peak_MB": round(peak / 1024), "ms": round(statistics.median(times) * 1e3, 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="marian,smollm2")
    ap.add_argument("--child", nargs=2, metavar=("SHAPE", "SIDE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(child(*args.child, args.steps)))
        return
    out = {"cpu": f"{accel.cpu_name()} ({accel.cpu_isa()})", "threads": args.threads, "torch": torch.__version__}
    for shape in args.shapes.split(","):
        row = {}
        for side in ("attnlab", "torch"):
            res = subprocess.run([sys.executable, __file__, "--child", shape, side, "--steps", str(args.steps),
                                  "--threads", str(args.threads)], capture_output=True, text=True)
            if res.returncode:
                raise SystemExit(f"{shape}/{side} failed:\n{res.stderr[-2000:]}")
            row[side] = json.loads(res.stdout.splitlines()[-1])
        row["same_loss"] = abs(row["attnlab"]["loss"] - row["torch"]["loss"]) < 1e-3
        row["memory_ratio"] = round(row["torch"]["peak_MB"] / max(row["attnlab"]["peak_MB"], 1), 2)
        row["speed_ratio"] = round(row["torch"]["ms"] / row["attnlab"]["ms"], 2)
        print(shape, json.dumps(row), flush=True)
        out[shape] = row
    print(json.dumps(out))


if __name__ == "__main__":
    main()
