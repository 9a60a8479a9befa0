"""SmolLM2-135M greedy decoding, batch 1, 128 new tokens: attnlab vs transformers `generate` on the
same (dequantised GGUF) weights, in fp32 and bf16, side by side in one run. Also reports the
memory-bandwidth bound (bytes of weights read per token ÷ measured copy bandwidth) and, when
llama-cpp-python is installed, llama.cpp on the same GGUF file as the outside reference.

    python benchmarks/smollm2_speed.py [--tokens 128] [--repeats 2] [--threads 2] [--compile] [--quantize int8,int4]
                                       [--as-avx2]

--compile also times ``generate(..., compile=True)`` (torch.compile of the decode step, fp32 with
oneDNN's packed products as frozen constants, see ``accel.compiled_step``; the compilation time is
reported separately, as ``compile_s``). attnlab, its compiled step and transformers are timed in
turns, best of --repeats rounds each. --quantize adds attnlab rows with weight-only int8 / int4 weights
(``attnlab.quant``), eager and — with --compile — compiled, timed in turns with llama.cpp's Q4_1 on
the same file (best of --repeats rounds each), with how many greedy tokens agree with attnlab's fp32.
Where attnlab's own kernels take the eager products (``quant.own_kernels``), each kind also gets an eager
row on PyTorch's kernels (``ATTNLAB_OWN_KERNELS=0`` for that row), timed in the same turns.
--as-avx2 runs everything with PyTorch, oneDNN and MKL capped at AVX2 (``accel.AVX2_ENVIRONMENT``):
the stand-in for an AVX2-only CPU. Those variables do not reach llama.cpp, which picks its kernels when
it is built: ``--llama-cpp-python DIR`` imports llama_cpp from DIR instead, e.g. a build made with
``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"
pip install --no-deps --target DIR llama-cpp-python`` to stand in for llama.cpp on the same AVX2 CPU.
"""

import argparse
import json
import os
import sys
import time
from unittest import mock

import torch
from peers import transformers_from_gguf  # (benchmarks/peers.py)

PROMPT = "The Transformer architecture"


def copy_bandwidth(size_mb=512, repeats=5):
    """Bytes moved per second by a large tensor copy (read + write), best of ``repeats``."""
    src = torch.empty(size_mb * 2 ** 20 // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_time(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * src.numel() * 4 / best


def _time(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--compile", action="store_true", help="also time attnlab with torch.compile")
    ap.add_argument("--quantize", default="", help="comma-separated: int8, int4 (attnlab rows with quantised weights)")
    ap.add_argument("--as-avx2", action="store_true", help="cap PyTorch, oneDNN and MKL at AVX2 (and no native bf16)")
    ap.add_argument("--llama-cpp-python", metavar="DIR", help="import llama_cpp from this folder (e.g. an AVX2-only build)")
    args = ap.parse_args()
    if args.llama_cpp_python:
        sys.path.insert(0, args.llama_cpp_python)
    from attnlab import accel
    if args.as_avx2:
        accel.restart_capped_at_avx2()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    from attnlab.generate import generate
    from attnlab.pretrained import load_pretrained, smollm2_path
    path = smollm2_path()
    n = args.tokens
    ours = load_pretrained("smollm2")
    ids = torch.tensor([ours.tokenizer.encode(PROMPT)])
    hf = transformers_from_gguf(path)
    bw = copy_bandwidth()
    params = ours.model.num_parameters()
    results = {"cpu": f"{accel.cpu_name()} ({accel.cpu_isa()})", "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
               "new_tokens": n, "copy_bandwidth_GBps": round(bw / 1e9, 1), "parameters": params,
               "llama_cpp_python_from": args.llama_cpp_python or "the environment"}
    for dtype in (torch.float32,) + ((torch.bfloat16,) if accel.bf16_native("cpu") else ()):  # no emulated bf16
        ours.model.to(dtype)
        hf.to(dtype)
        bound = bw / (params * (4 if dtype == torch.float32 else 2))  # tokens/s if weights stream once per token

        def run_ours():
            return generate(ours.model, ids, max_new_tokens=n, min_new_tokens=n).sequences[0]

        def run_hf():
            with torch.no_grad():
                return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True)[0, ids.shape[1]:].tolist()
        def run_compiled():
            return generate(ours.model, ids, max_new_tokens=n, min_new_tokens=n, compile=True).sequences[0]

        a, b = run_ours(), run_hf()  # warm-up, and the outputs must agree
        runs = {"ours": run_ours, "hf": run_hf}
        row = {}
        if args.compile:
            t0 = time.perf_counter()
            c = run_compiled()  # the first call compiles
            row["compile_s"] = round(time.perf_counter() - t0, 1)
            runs["compiled"] = run_compiled
        best = {k: float("inf") for k in runs}
        for _ in range(args.repeats):  # in turns: this machine drifts within minutes
            for k, run in runs.items():
                best[k] = min(best[k], _time(run))
        t_ours, t_hf = best["ours"], best["hf"]
        name = "fp32" if dtype == torch.float32 else "bf16"
        row.update({"attnlab_tok_s": round(n / t_ours, 1), "transformers_tok_s": round(n / t_hf, 1),
                    "speedup": round(t_hf / t_ours, 2), "bandwidth_bound_tok_s": round(bound, 1),
                    "attnlab_fraction_of_bound": round(n / t_ours / bound, 2), "same_tokens": a == b})
        if args.compile:
            t_comp = best["compiled"]
            row.update({"attnlab_compiled_tok_s": round(n / t_comp, 1), "compiled_speedup": round(t_hf / t_comp, 2),
                        "compiled_fraction_of_bound": round(n / t_comp / bound, 2),
                        "compiled_same_tokens_as_eager": c == a, "compiled_same_tokens_as_transformers": c == b})
        results[name] = row
        if name == "fp32":
            a_fp32 = a
        print(name, json.dumps(row), flush=True)
    del hf, ours
    if args.quantize:
        _quantised_rows(args, results, ids, a_fp32, path)
    else:
        llm = _llama(path)
        results["llama_cpp_Q4_1_tok_s"] = None
        if llm is not None:
            best = max(n / _time(lambda: _run_llama(llm, n)) for _ in range(args.repeats))
            results["llama_cpp_Q4_1_tok_s"] = round(best, 1)
            for key in [k for k in ("fp32", "bf16") if k in results]:
                results[key]["vs_llama_cpp"] = round(results[key]["attnlab_tok_s"] / best, 2)
    print(json.dumps(results))


def _llama(path):
    """llama.cpp (llama-cpp-python) on the same GGUF file, warmed up; None where it is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(path), n_threads=torch.get_num_threads(), n_threads_batch=torch.get_num_threads(),
                n_ctx=512, verbose=False)
    llm(PROMPT, max_tokens=8, temperature=0.0, top_k=1)
    return llm


def _run_llama(llm, n):
    out = llm(PROMPT, max_tokens=n, temperature=0.0, top_k=1)  # its 4-token prompt is in the time
    assert out["usage"]["completion_tokens"] == n, out["usage"]  # greedy, no EOS in these 64-128 tokens
    return out


def _quantised_rows(args, results, ids, a_fp32, path):
    """attnlab with int8 / int4 weights (eager, and compiled with --compile) and llama.cpp's Q4_1, timed
    in turns: every round times each of them once, best round each (the machine drifts within minutes)."""
    from attnlab.accel import accelerate_for_inference
    from attnlab.generate import generate
    from attnlab.pretrained import load_pretrained
    from attnlab.quant import own_kernels, quantize_model
    n = args.tokens
    runs = {}  # name → a function that decodes n tokens
    # where attnlab's own kernels take the eager products, the eager step on PyTorch's kernels beside it
    eager_sides = [(False, None)] + ([(False, "0")] if own_kernels() else [])
    for kind in args.quantize.split(","):
        q = load_pretrained("smollm2")
        accelerate_for_inference(quantize_model(q.model, kind).eval())
        for compiled, own_env in eager_sides + ([(True, None)] if args.compile else []):
            name = kind + (" compiled" if compiled else "") + (" (PyTorch's kernels)" if own_env == "0" else "")

            def run(model=q.model, compiled=compiled, own_env=own_env):
                with mock.patch.dict(os.environ, {"ATTNLAB_OWN_KERNELS": own_env} if own_env else {}):
                    return generate(model, ids, max_new_tokens=n, min_new_tokens=n, compile=compiled).sequences[0]
            t0 = time.perf_counter()
            out = run()  # warm-up (for the compiled step: the compilation)
            row = {"same_tokens_as_fp32": out == a_fp32,
                   "same_prefix_as_fp32": next((i for i, (x, y) in enumerate(zip(out, a_fp32)) if x != y), n)}
            if compiled:
                row["compile_s"] = round(time.perf_counter() - t0, 1)
            results[name] = row
            runs[name] = run
    llm = _llama(path)
    if llm is not None:
        runs["llama.cpp"] = lambda: _run_llama(llm, n)
    best = {name: 0.0 for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            best[name] = max(best[name], n / _time(run))
    for name in runs:
        if name != "llama.cpp":
            results[name].update({"attnlab_tok_s": round(best[name], 1),
                                  "vs_fp32": round(best[name] / results["fp32"]["attnlab_tok_s"], 2)})
    results["llama_cpp_Q4_1_tok_s"] = round(best["llama.cpp"], 1) if llm is not None else None
    for key in [k for k in results if isinstance(results[k], dict) and "attnlab_tok_s" in results[k]]:
        if llm is not None:
            results[key]["vs_llama_cpp"] = round(results[key]["attnlab_tok_s"] / best["llama.cpp"], 2)
    for name in runs:
        print(name, json.dumps(results.get(name, {"tok_s": round(best[name], 1)})), flush=True)


if __name__ == "__main__":
    main()
