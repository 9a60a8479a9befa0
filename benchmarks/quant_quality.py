"""Weight-only quantisation (attnlab.quant) of SmolLM2-135M: what int8 and int4 cost in quality and
what they buy in batch-1 decoding speed, next to fp32 and bf16. Every row is ``attnlab.load(model,
bf16=..., quantize=...)``, the path of ``attnlab generate --quantize``.

* **ppl**: perplexity on the first ``--tokens`` tokens of Tiny Shakespeare's validation split (the
  last 10% of ``input.txt``, as nanoGPT splits it), in independent blocks of ``--block`` tokens;
* **top-1 = fp32**: share of those positions where the next-token argmax is fp32's (teacher forced);
* **greedy = fp32**: 5 prompts × ``--new`` greedy tokens; the share of tokens before the first one
  that differs from fp32's continuation, and how many of the 5 are identical;
* **weights MB**: parameters and buffers, with the int4 kernel's packed copy once it exists;
* **decode tok/s**: greedy, batch 1, ``--new`` tokens after a short prompt (best of ``--repeats``,
  same threads for every row);
* with ``--compile``, for the quantised rows, the same measures of the compiled decode step
  (``generate(..., compile=True)``), which computes differently from the eager one (fused ops,
  inductor's own int8/int4 GEMMs): perplexity and top-1 over the same blocks fed one token at a time
  through it (the KV cache's path), greedy agreement, speed.

Rows ``int8``/``int4`` keep fp32 activations (on x86 PyTorch's decoding kernels still compute in bf16,
attnlab's own AVX2 ones round them, int8's to int16 per row, int4's to int8 per 16 inputs: see
attnlab/quant.py); ``int8+bf16``/``int4+bf16`` load with
``bf16=True`` as well. ``int4`` keeps the output projection at int8 (attnlab's default);
``int4/head-int4`` quantises it to int4 too.

Mind the baseline: SmolLM2 ships as a Q4_1 GGUF, so "fp32" is those 4-bit weights dequantised. Its
linear layers are then exactly int4 groups of 32 (int4 re-quantisation is lossless here, see
tests/test_quant.py), while int8's per-channel scales re-round them: on this model int8 measures
requantisation error that int4 does not have.

    python benchmarks/quant_quality.py [--tokens 20000] [--threads 2] [--quick] [--model smollm2]
        [--configs fp32,bf16,int8,int4] [--data input.txt(.gz)] [--block 1024] [--new 64] [--compile]
        [--as-avx2]

``--quick`` (1,000 tokens, 16 new tokens, one repeat) is what the smoke test runs, on a tiny model
directory given as ``--model DIR``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import tinyshakespeare  # (benchmarks/tinyshakespeare.py)

PROMPTS = ["To be, or not to be", "Once upon a time", "The capital of France is", "def fibonacci(n):",
           "In machine learning, attention"]
SPEED_PROMPT = "The Transformer architecture"
# name → (bf16, quantize, the output projection's kind where it differs); the default --configs are
# the first six
CONFIGS = {"fp32": (False, None, None), "bf16": (True, None, None), "int8": (False, "int8", None),
           "int4": (False, "int4", None), "int8+bf16": (True, "int8", None), "int4+bf16": (True, "int4", None),
           "int4/head-int4": (False, "int4", "int4")}
DEFAULT_CONFIGS = list(CONFIGS)[:6]


def validation_text(path: Path) -> str:
    raw = tinyshakespeare.required(path)
    return raw[int(0.9 * len(raw)):]  # nanoGPT's split: the last 10%


@torch.no_grad()
def perplexity(module, ids: torch.Tensor, block: int):
    """(perplexity, next-token argmax at every scored position) over consecutive independent blocks."""
    nll, count, top = 0.0, 0, []
    for s in range(0, len(ids) - 1, block):
        x = ids[s: s + block + 1]
        if len(x) < 2:
            break
        logits = module(x[None, :-1])[0].float()  # (T, V)
        nll += F.cross_entropy(logits, x[1:], reduction="sum").item()
        count += len(x) - 1
        top.append(logits.argmax(-1))
    return math.exp(nll / count), torch.cat(top)


@torch.no_grad()
def stepped_perplexity(module, ids: torch.Tensor, block: int):
    """:func:`perplexity` over the same blocks and positions, one token at a time through the compiled
    decode step (the KV cache's path: what ``generate(..., compile=True)`` computes)."""
    from attnlab.accel import compiled_step
    step = compiled_step(module, module)
    nll, count, top = 0.0, 0, []
    for s in range(0, len(ids) - 1, block):
        x = ids[s: s + block + 1]
        if len(x) < 2:
            break
        cache = module.new_cache(capacity=len(x))
        rows = [module(x[None, :1], cache=cache, last_only=True)]  # the first position: the eager prefill
        rows += [step(x[None, t: t + 1], None, cache=cache, last_only=True) for t in range(1, len(x) - 1)]
        logits = torch.cat(rows).float()  # (T, V)
        nll += F.cross_entropy(logits, x[1:], reduction="sum").item()
        count += len(x) - 1
        top.append(logits.argmax(-1))
    return math.exp(nll / count), torch.cat(top)


def weight_megabytes(module) -> float:
    """Parameters and buffers, plus what the quantised layers derived from them for their kernels (the
    int4 kernel's packed copy, bf16 copies of scales): the memory the weights hold after decoding."""
    tensors = list(module.parameters()) + list(module.buffers())
    for m in module.modules():
        for _, t in getattr(m, "_derived", {}).values():  # a tensor, a dict of them (attnlab's own kernels) or None
            tensors += list(t.values()) if isinstance(t, dict) else [t] * (t is not None)
    seen, total = set(), 0
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    mb = total / 2 ** 20
    return round(mb, 1 if mb >= 10 else 3)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="anything attnlab.load reads (default smollm2)")
    ap.add_argument("--tokens", type=int, default=20000, help="validation tokens scored (default 20000)")
    ap.add_argument("--block", type=int, default=1024, help="tokens per scored block (capped at the context)")
    ap.add_argument("--new", type=int, default=64, help="greedy tokens per prompt, and timed (default 64)")
    ap.add_argument("--repeats", type=int, default=2, help="decode timings, best of (default 2)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: PyTorch's)")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated, from {', '.join(CONFIGS)} (default: all but the last)")
    ap.add_argument("--data", default=str(tinyshakespeare.DEFAULT), help=tinyshakespeare.HELP)
    ap.add_argument("--compile", action="store_true",
                    help="also the compiled decode step of the quantised rows: its greedy agreement and speed")
    ap.add_argument("--quick", action="store_true", help="1,000 tokens, 16 new tokens, one repeat (a smoke test)")
    ap.add_argument("--as-avx2", action="store_true",
                    help="cap PyTorch, oneDNN and MKL at AVX2 (no native bf16): attnlab's own AVX2 kernels serve")
    args = ap.parse_args()
    if args.as_avx2:
        from attnlab import accel
        accel.restart_capped_at_avx2()
    if args.quick:
        args.tokens, args.new, args.repeats = min(args.tokens, 1000), min(args.new, 16), 1
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {unknown} (choose from {', '.join(CONFIGS)})")
    if args.threads:
        torch.set_num_threads(args.threads)

    import attnlab
    from attnlab.accel import cpu_isa, cpu_name
    from attnlab.generate import generate
    from attnlab.quant import kernel_dtype, own_kernel_max_rows, own_kernels, quant_kernels_ok, quantize_model

    text = validation_text(Path(args.data))
    rows, ref = [], None
    for name in configs:
        bf16, quantize, head = CONFIGS[name]
        t0 = time.perf_counter()
        if head is None:
            m = attnlab.load(args.model, device="cpu", bf16=bf16, quantize=quantize)
        else:  # not a load option: the same steps by hand
            m = attnlab.load(args.model, device="cpu")
            dtype = torch.bfloat16 if bf16 else torch.float32
            quantize_model(m.module, quantize, head=head).to(dtype)
        load_s = time.perf_counter() - t0
        if ref is None:  # the token ids and prompts, once
            ids = torch.tensor(m.tokenizer.encode(text)[: args.tokens + 1])
            block = min(args.block, m.config.max_len)
            prompts = [torch.tensor([m.prompt_ids(p)]) for p in PROMPTS]
            speed_ids = torch.tensor([m.prompt_ids(SPEED_PROMPT)])
        ppl, top = perplexity(m.module, ids, block)
        n = args.new
        greedy = [generate(m.module, p, max_new_tokens=n, min_new_tokens=n).sequences[0] for p in prompts]
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            generate(m.module, speed_ids, max_new_tokens=n, min_new_tokens=n)
            times.append(time.perf_counter() - t0)
        weight_mb = weight_megabytes(m.module)  # before compiling adds the kernels' own copies
        compiled = None
        if args.compile and quantize:  # the compiled step computes differently (fused, its own GEMMs)
            t0 = time.perf_counter()
            greedy_c = [generate(m.module, p, max_new_tokens=n, min_new_tokens=n, compile=True).sequences[0]
                        for p in prompts]
            compile_s = time.perf_counter() - t0
            ppl_c, top_c = stepped_perplexity(m.module, ids, block)
            ctimes = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                generate(m.module, speed_ids, max_new_tokens=n, min_new_tokens=n, compile=True)
                ctimes.append(time.perf_counter() - t0)
            compiled = {"greedy": greedy_c, "tok_s": round(n / min(ctimes), 1), "compile_s": round(compile_s, 1),
                        "ppl": ppl_c, "top": top_c}
        row = {"config": name, "weights": (quantize + (f" (head {head})" if head else "")) if quantize
               else str(next(m.module.parameters()).dtype).replace("torch.", ""),
               "activations": str(next(m.module.parameters()).dtype).replace("torch.", ""),
               "weight_MB": weight_mb, "ppl": round(ppl, 3),
               "decode_tok_s": round(n / min(times), 1), "load_s": round(load_s, 1)}
        if name == "fp32":
            ref = {"ppl": ppl, "top": top, "greedy": greedy}
        if ref is not None:
            row["ppl_vs_fp32"] = f"{100 * (ppl / ref['ppl'] - 1):+.2f}%"
            row["top1_same"] = round((top == ref["top"]).float().mean().item(), 4)
            row["greedy_same_prefix"] = round(sum(common_prefix(a, b) for a, b in zip(greedy, ref["greedy"]))
                                              / sum(len(b) for b in ref["greedy"]), 3)
            row["greedy_identical"] = f"{sum(a == b for a, b in zip(greedy, ref['greedy']))}/{len(greedy)}"
        if compiled is not None:
            row["compiled_tok_s"], row["compile_s"] = compiled["tok_s"], compiled["compile_s"]
            row["compiled_ppl"] = round(compiled["ppl"], 3)
            if ref is not None:
                row["compiled_ppl_vs_fp32"] = f"{100 * (compiled['ppl'] / ref['ppl'] - 1):+.2f}%"
                row["compiled_top1_same"] = round((compiled["top"] == ref["top"]).float().mean().item(), 4)
                g = compiled["greedy"]
                row["compiled_greedy_same_prefix"] = round(sum(common_prefix(a, b) for a, b in zip(g, ref["greedy"]))
                                                           / sum(len(b) for b in ref["greedy"]), 3)
                row["compiled_greedy_identical"] = f"{sum(a == b for a, b in zip(g, ref['greedy']))}/{len(g)}"
        rows.append(row)
        print(name, json.dumps(row), flush=True)
        del m

    kernels = {k: quant_kernels_ok(k, kernel_dtype(torch.float32)) for k in ("int8", "int4")}
    print(f"\n{args.model}: {cpu_name()} ({cpu_isa()}), {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{len(ids) - 1} validation tokens of Tiny Shakespeare in blocks of {block}, {len(PROMPTS)} prompts × "
          f"{args.new} greedy tokens; decoding kernels (in {kernel_dtype(torch.float32)}): "
          + ", ".join(f"{k} {'yes' if v else 'no (eager)'}" for k, v in kernels.items())
          + (f"; attnlab's own AVX2 kernels for up to {own_kernel_max_rows('int8')} (int8) and "
             f"{own_kernel_max_rows('int4')} (int4) rows (fp32 in; activations int16 per row, int4: int8 per 16 inputs)"
             if own_kernels() else "") + "\n")
    cols = ["config", "weights", "activations", "weight_MB", "ppl", "ppl_vs_fp32", "top1_same", "greedy_same_prefix",
            "greedy_identical", "decode_tok_s"]
    heads = ["config", "weights", "activations", "weights MB", "perplexity", "vs fp32", "top-1 = fp32",
             "greedy = fp32 (prefix)", "identical", "decode tok/s"]
    if args.compile:
        cols += ["compiled_ppl", "compiled_ppl_vs_fp32", "compiled_top1_same", "compiled_greedy_same_prefix",
                 "compiled_greedy_identical", "compiled_tok_s"]
        heads += ["compiled: perplexity", "vs fp32", "top-1 = fp32", "greedy = fp32 (prefix)", "identical", "tok/s"]
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "–")) for c in cols) + " |")
    print(json.dumps({"model": args.model, "cpu": cpu_name(), "isa": cpu_isa(), "threads": torch.get_num_threads(),
                      "torch": torch.__version__, "tokens": len(ids) - 1, "block": block, "new_tokens": args.new,
                      "kernels": kernels, "rows": rows}))


if __name__ == "__main__":
    main()
