"""F.linear (MKL) vs attnlab's Linear with oneDNN pre-packed weights, CPU inference, side by side.

Two workloads: one SmolLM2-135M decode step (the 211 matrix-vector products of its 30 layers and its
output projection, batch 1) and the (rows × 256) products of batched translation with the issue's
Marian-size model (64 sentences greedy, 256 rows for beam 4). fp32 and bf16; best of N.

    python benchmarks/linear_kernels.py [--repeats 10] [--as-avx2]

--as-avx2 caps PyTorch, oneDNN and MKL at AVX2 (``accel.AVX2_ENVIRONMENT``): the stand-in for an
AVX2-only CPU (bf16 rows are then left out: no native bf16).
"""

import argparse
import json

import torch
import torch.nn.functional as F

from attnlab import accel
from attnlab.accel import PackedLinear as Linear
from generation_speed import best_time  # warm-up, then the best of N (benchmarks/ is on sys.path)

SMOLLM2 = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]  # (in, out)
MARIAN = [(256, 768), (256, 256), (256, 256), (256, 1024), (1024, 256)] * 3 + [(256, 8000)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--as-avx2", action="store_true", help="cap PyTorch, oneDNN and MKL at AVX2 (and no native bf16)")
    args = ap.parse_args()
    if args.as_avx2:
        accel.restart_capped_at_avx2()
    torch.manual_seed(0)
    results = {"cpu": f"{accel.cpu_name()} ({accel.cpu_isa()})", "threads": torch.get_num_threads(),
               "torch": torch.__version__}
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
