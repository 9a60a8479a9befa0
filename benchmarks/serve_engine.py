"""What limits `attnlab serve` at N concurrent streams, without HTTP: SmolLM2's engine driven directly.

1. One decoding step of ``--rows`` rows (a padded key mask, a cache ~50 long): its time, and with
   ``--profile`` the operators that take it (torch.profiler).
2. The continuous-batching engine (``attnlab.serve.engine.Engine``) fed by ``--clients`` callers that
   each submit serve_load's next chat prompt when their last one ends (greedy, ``--max-tokens`` new
   tokens; a comma list gives the requests those budgets in turn, so that they end at different steps and
   newcomers join one by one, as under a server's traffic; one value: they end, and join, in waves)
   tokens): output tokens/s, steps, ms per step, prefix-reuse hits and packed prefills.

    python benchmarks/serve_engine.py --threads 2 --clients 16 --requests 48
    python benchmarks/serve_engine.py --threads 2 --quantize int8 [--as-avx2]   # `attnlab serve --quantize int8`

Not a comparison with a peer (serve_load.py is): a diagnosis of the engine's ceiling on this machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import PROMPTS  # noqa: E402  (the same prompts as the load benchmark)


def step_time(net, rows: int, repeats: int, profile: bool) -> dict:
    B, P = rows, 40
    with torch.inference_mode():
        mask = torch.ones(B, P, dtype=torch.bool)
        mask[::2, :3] = False  # left padding on every other row, as in a mixed batch
        cache = net.new_cache(P + 2 * repeats + 8)
        net(torch.randint(0, 1000, (B, P)), mask, cache=cache, last_only=True)
        last = torch.randint(0, 1000, (B, 1))

        def step():
            nonlocal mask
            mask = torch.cat([mask, mask.new_ones(B, 1)], 1)
            net(last, mask, cache=cache, last_only=True)
        step()
        t0 = time.perf_counter()
        for _ in range(repeats):
            step()
        out = {"rows": rows, "step_ms": round((time.perf_counter() - t0) / repeats * 1e3, 1)}
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(repeats):
                    step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), file=sys.stderr)
    return out


def engine_throughput(m, clients: int, n_requests: int, budgets: list[int]) -> dict:
    from attnlab.pretrained import apply_chat_template
    from attnlab.serve.engine import Engine, Request
    ids = [m.tokenizer.encode(apply_chat_template(m.chat_template, [{"role": "user", "content": p}]))
           for p in PROMPTS]
    eng = Engine(m, max_batch=max(16, clients))
    finished, tokens, errors = threading.Semaphore(0), [0], []

    class Counted(Request):
        def _emit(self, event):
            if event[0] == "token":
                tokens[0] += 1
            elif event[0] in ("done", "error"):
                if event[0] == "error":
                    errors.append(repr(event[1]))
                finished.release()

    def run(n):
        sent = min(clients, n)
        for k in range(sent):
            eng.submit(Counted(prompt=ids[k % len(ids)], max_new_tokens=budgets[k % len(budgets)]))
        for _ in range(n):
            finished.acquire()
            if sent < n:
                eng.submit(Counted(prompt=ids[sent % len(ids)], max_new_tokens=budgets[sent % len(budgets)]))
                sent += 1
    try:
        run(min(clients, n_requests))  # warm: the first prefills, the allocator
        tokens[0], steps0 = 0, eng.steps
        t0 = time.perf_counter()
        run(n_requests)
        dt, steps = time.perf_counter() - t0, eng.steps - steps0
    finally:
        eng.close()
    return {"clients": clients, "requests": n_requests, "tokens": tokens[0], "seconds": round(dt, 2),
            "tok_s": round(tokens[0] / dt, 1), "steps": steps, "ms_per_step": round(dt / max(1, steps) * 1e3, 1),
            "prefix_hits": eng.prefix_hits, "packed_prefills": eng.packed_prefills, "errors": errors}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", type=int, default=16, help="rows of the timed decoding step (default 16)")
    ap.add_argument("--repeats", type=int, default=10, help="timed steps (default 10)")
    ap.add_argument("--profile", action="store_true", help="print the step's operator profile to stderr")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", default="64", help="new tokens per request; a comma list: the budgets in turn")
    ap.add_argument("--quantize", choices=["int8", "int4"], help="weight-only quantised SmolLM2, as serve --quantize")
    ap.add_argument("--as-avx2", action="store_true", help="cap PyTorch, oneDNN and MKL at AVX2 (no native bf16)")
    args = ap.parse_args()
    if args.as_avx2:
        from attnlab import accel
        accel.restart_capped_at_avx2()
    try:
        budgets = [int(v) for v in args.max_tokens.split(",")]
    except ValueError:
        ap.error(f"--max-tokens: integers separated by commas, got {args.max_tokens!r}")
    if min(args.rows, args.repeats, args.clients, args.requests, *budgets) < 1:
        ap.error("--rows, --repeats, --clients, --requests and --max-tokens must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    import attnlab
    from attnlab.accel import cpu_isa, cpu_name
    m = attnlab.load("smollm2", quantize=args.quantize)
    report = {"cpu": f"{cpu_name()} ({cpu_isa()})", "threads": torch.get_num_threads(), "quantize": args.quantize,
              "step": step_time(m.module, args.rows, args.repeats, args.profile),
              "engine": engine_throughput(m, args.clients, args.requests, budgets)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
