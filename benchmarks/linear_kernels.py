"""F.linear (MKL) vs attnlab's Linear with oneDNN pre-packed weights, CPU inference, side by side.

Two workloads: one SmolLM2-135M decode step (the 211 matrix-vector products of its 30 layers and its
output projection, batch 1) and the (rows × 256) products of batched translation with the issue's
Marian-size model (64 sentences greedy, 256 rows for beam 4). fp32 and bf16; best of N.

    python benchmarks/linear_kernels.py [--repeats 10] [--as-avx2]
    python benchmarks/linear_kernels.py --quantized-rows 1,2,4,8,16,32,64 [--as-avx2]

--quantized-rows: SmolLM2's int8 products (its 30 layers and head) and int4 products (the layers; its head
stays int8) for each number of rows, on attnlab's own kernels against what the layer runs without them
(PyTorch's kernels, or past their rows the dequantised weight and a dense product), and with the layer's
own choice (``quant.own_kernel_max_rows``, "chosen"). The rows limits were chosen on this table. Where
attnlab's kernels do not serve (``ATTNLAB_OWN_KERNELS=0`` stands in), PyTorch's kernels against the
dequantised weight's dense product instead (``quant.KERNEL_MAX_ROWS``).

--as-avx2 caps PyTorch, oneDNN and MKL at AVX2 (``accel.AVX2_ENVIRONMENT``): the stand-in for an
AVX2-only CPU (bf16 rows are then left out: no native bf16).
"""

import argparse
import contextlib
import json
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from attnlab import accel
from attnlab.accel import PackedLinear as Linear
from generation_speed import best_time, best_times  # warm-up, then the best of N (benchmarks/ is on sys.path)

SMOLLM2 = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]  # (in, out)
MARIAN = [(256, 768), (256, 256), (256, 256), (256, 1024), (1024, 256)] * 3 + [(256, 8000)]


def quantized_rows(rows: list[int], layers: int, repeats: int, results: dict) -> None:
    """SmolLM2's quantised products for each number of rows: int8, ``layers`` decoder layers and the head;
    int4, the decoder layers (``--quantize int4`` keeps the head at int8: the int8 rows). Timed in turns,
    with the layer's own choice third: attnlab's own kernels against the layer's path without them
    (``quant.own_kernel_max_rows``); where they do not serve (not built, ``ATTNLAB_OWN_KERNELS=0``),
    PyTorch's kernel against the dequantised weight's dense product (``quant.KERNEL_MAX_ROWS``)."""
    from attnlab import quant
    own = quant.own_kernels()
    if own:
        names, rule = ("own", "without"), quant.own_kernel_max_rows

        def limited(limit):
            return mock.patch.object(quant, "own_kernel_max_rows", lambda kind: limit)
    else:
        print(f"attnlab's own quantised kernels do not serve here ({accel.cpu_isa()}): PyTorch's kernels instead")
        names, rule = ("pytorch_kernel", "dense"), quant.KERNEL_MAX_ROWS.__getitem__

        def limited(limit):
            return mock.patch.dict(quant.KERNEL_MAX_ROWS, {"int8": limit, "int4": limit})
    for kind in ("int8", "int4"):
        net = []
        for i, o in SMOLLM2[:4 * layers] + (SMOLLM2[-1:] if kind == "int8" else []):
            lin = nn.Linear(i, o, bias=False)
            net.append(quant.Int8Linear.from_linear(lin) if kind == "int8" else quant.Int4Linear.from_linear(lin, 32))
        for m in rows:
            xs = {i: torch.randn(m, i) for i in (576, 1536)}

            def step(patch):
                def run():
                    with patch:
                        return [layer(xs[layer.in_features]) for layer in net]
                return run
            with torch.inference_mode():
                fast, other, chosen = best_times([step(limited(m)), step(limited(0)), step(contextlib.nullcontext())],
                                                 repeats)
            key = f"{kind}_{m}_rows"
            results[key] = {f"{names[0]}_ms": round(fast * 1e3, 2), f"{names[1]}_ms": round(other * 1e3, 2),
                            f"{names[0]}_speedup": round(other / fast, 2),
                            "chosen": names[0] if m <= rule(kind) else names[1], "chosen_ms": round(chosen * 1e3, 2)}
            print(key, json.dumps(results[key]), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--as-avx2", action="store_true", help="cap PyTorch, oneDNN and MKL at AVX2 (and no native bf16)")
    ap.add_argument("--quantized-rows", help="comma list of row counts: the int8/int4 table instead (see above)")
    ap.add_argument("--layers", type=int, default=30, help="--quantized-rows: SmolLM2's decoder layers (default 30)")
    args = ap.parse_args()
    if args.as_avx2:
        accel.restart_capped_at_avx2()
    torch.manual_seed(0)
    results = {"cpu": f"{accel.cpu_name()} ({accel.cpu_isa()})", "threads": torch.get_num_threads(),
               "torch": torch.__version__}
    if args.quantized_rows:
        quantized_rows([int(r) for r in args.quantized_rows.split(",")], args.layers, args.repeats, results)
        print(json.dumps(results))
        return
    for name, shapes, rows in (("smollm2_decode_step", SMOLLM2, 1), ("marian_step_64_rows", MARIAN, 64),
                               ("marian_step_256_rows", MARIAN, 256)):
        for dtype in (torch.float32,) + ((torch.bfloat16,) if accel.bf16_native("cpu") else ()):
            layers = [Linear(i, o, bias=False).to(dtype) for i, o in shapes]
            xs = {i: torch.randn(rows, i, dtype=dtype) for i, _ in shapes}
            with torch.inference_mode():
                def plain():
                    return [F.linear(xs[m.in_features], m.weight) for m in layers]

                def packed():
                    return [m(xs[m.in_features]) for m in layers]
                if not accel.packed_linear_ok(dtype):  # e.g. bf16 on an AVX2-only CPU: nothing to compare
                    print(f"{name} {dtype}: packed path unavailable on this CPU ({accel.cpu_isa()})", flush=True)
                    continue
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(plain(), packed()))
                t_plain, t_packed = best_time(plain, args.repeats), best_time(packed, args.repeats)
            nbytes = sum(m.weight.numel() * m.weight.element_size() for m in layers)
            key = f"{name}_{'fp32' if dtype == torch.float32 else 'bf16'}"
            results[key] = {"F.linear_ms": round(t_plain * 1e3, 2), "packed_ms": round(t_packed * 1e3, 2),
                            "speedup": round(t_plain / t_packed, 2), "packed_GBps": round(nbytes / t_packed / 1e9, 1),
                            "max_abs_diff": err}
            print(key, json.dumps(results[key]), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
