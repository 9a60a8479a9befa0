"""``python -m attnlab.doctor`` (= ``attnlab doctor``): what this machine supports and which paths
attnlab will take (CPU flags, bf16 native or emulated, packed linears, compiler, quantised kernels,
threads, torch)."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from . import accel, quant
from .accel import (bf16_native, can_compile, cpu_bf16_native, cpu_flags, cpu_isa, cpu_name, cxx_compiler,
                    glibc_version, heap_setting_refused, onednn_linear_ops, onednn_training_gemm_ok,
                    packed_linear_ok)


# attnlab's own C++ kernels (``csrc/``): the report's key for each, and the function that builds it on first use
# and answers whether it serves, the longest builds first. One table for both users: ``build_kernels`` runs each
# function in a child process of its own, ``report`` calls each here (looked up at the call, as a test may stand
# one in).
OWN_KERNELS = {"own_linear_kernel": "attnlab.accel:linear_kernel_serves",
               "own_attention_kernel": "attnlab.model.attention:fused_short_attention",
               "own_gelu_kernel": "attnlab.model.layers:fused_gelu",
               "own_dropout_kernel": "attnlab.model.layers:fused_dropout",
               "own_quant_kernels": "attnlab.quant:own_kernels",
               "own_clip_kernel": "attnlab.train.clipping:fused_clip"}
KERNEL_PROBES = tuple(OWN_KERNELS.values())


def _probe(path: str):
    """The function ``module:name`` names."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def build_kernels(jobs: int | None = None) -> bool:
    """Build attnlab's kernels for this CPU side by side, ``jobs`` at a time (default: the cores this process
    may use), one process each, so that the report's own probes (and every later process) only load them from
    torch's extension cache. Returns whether it ran the builds: not where a stamp in that cache says that this
    set of sources, build settings, compiler, PyTorch and Python built there, and that the libraries it made
    are still the ones there (each environment builds in folders of its own, ``accel.kernel_build_directory``).

    Why: each kernel is one C++ file compiled with PyTorch's headers, 10-25 s of one core on a 2-core AVX2
    EPYC, and a process builds the kernels it asks for one after another: side by side, a cold machine's doctor
    (and `make test`, which starts with it) waits about half as long on 2 cores. Where a child fails, nothing is
    lost: the report builds that kernel again itself and says what it found, and no stamp is written."""
    from concurrent.futures import ThreadPoolExecutor
    if not (accel.own_kernels_allowed() and accel.can_build_kernels()):
        return False
    here = Path(__file__).resolve().parent
    probe_modules = sorted({probe.split(":")[0] for probe in KERNEL_PROBES})  # (they set the build settings)
    sources = [*sorted((here / "csrc").glob("*.[ch]*")),
               *(Path(importlib.import_module(m).__file__) for m in probe_modules)]
    key = hashlib.sha256(repr((sys.executable, torch.__version__, accel.cxx_compiler(), accel.own_kernel_target(True),
                               os.environ.get("ATTNLAB_QUANT_KERNELS"),
                               [(p.name, p.read_bytes()) for p in sources])).encode()).hexdigest()[:16]
    root = Path(accel.kernel_cache_root()).resolve()
    stamp = root / f"attnlab_kernels_{key}.built"

    def libraries() -> set[str]:  # this environment's kernel libraries in the cache now, with their times
        return {f"{p} {p.stat().st_mtime_ns}" for p in root.glob(f"attnlab_*-{accel.environment_tag()}/attnlab_*.so")}

    if stamp.is_file() and set(stamp.read_text().splitlines()) <= libraries():  # (libraries added since: no matter)
        return False
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root)} if "TORCH_EXTENSIONS_DIR" in os.environ else None

    def build(probe: str) -> int:
        # the child's exit status: 1 where a build failed (the probes' "<kernel>-build" notes), not where a kernel
        # does not apply here (no AVX2 for the quantised products); run from the folder holding this attnlab, so
        # that `-c`'s current-folder entry on sys.path finds this package and no other
        module, name = probe.split(":")
        code = (f"import sys; from {module} import {name}; {name}(); accel = sys.modules.get('attnlab.accel'); "
                "sys.exit(bool(accel) and any(k.endswith('-build') for k in accel._said))")
        return subprocess.run([sys.executable, "-c", code], cwd=here.parent, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode

    if jobs is None:
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print("building attnlab's C++ kernels for this CPU, side by side (once; a minute or two)...", file=sys.stderr,
          flush=True)
    with ThreadPoolExecutor(max(1, jobs or 1)) as pool:
        codes = list(pool.map(build, KERNEL_PROBES))
    if not any(codes):
        try:
            stamp.write_text("\n".join(sorted(libraries())))
        except OSError:  # (a cache folder this user cannot write: the next doctor runs the children again)
            pass
    return True


def report() -> dict:
    """Everything ``attnlab doctor`` prints, as a dict."""
    flags = cpu_flags()
    interesting = ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni",
                   "avx_ne_convert", "amx_bf16", "amx_tile", "asimd", "bf16", "sve", "i8mm"]
    cuda = torch.cuda.is_available()
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu": cpu_name(),
        "cpu_isa": cpu_isa(),
        "cpu_flags": [f for f in interesting if f in flags],
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if cuda else None,
        "mps": mps,
        "bf16_native_cpu": cpu_bf16_native(),
        "bf16_native_cuda": bf16_native("cuda") if cuda else None,
        "onednn": onednn_linear_ops(),
        "packed_linear_fp32": packed_linear_ok(torch.float32),
        "packed_linear_bf16": packed_linear_ok(torch.bfloat16),
        "training_gemm_fp32": "oneDNN" if onednn_training_gemm_ok() else "MKL",
        "cxx_compiler": cxx_compiler(),
        "compile_cpu": can_compile("cpu"),
        **{key: _probe(path)() for key, path in OWN_KERNELS.items()},  # (each built on first use: seconds, then cached)
        "own_quant_kernels_compiled": quant.own_kernels_in_compiled_step(),
        "training_heap_refused": heap_setting_refused(),  # None: training keeps freed memory (accel.keep_freed_memory)
        "glibc": glibc_version(),
        "switches": {k: os.environ[k] for k in ("ATTNLAB_PACKED_LINEAR", "ATTNLAB_NO_BF16", "ATTNLAB_COMPILE",
                                                "ATTNLAB_OWN_KERNELS", "ATTNLAB_QUANT_KERNELS", "ATTNLAB_KEEP_FREED_MEMORY")
                     if k in os.environ},
    }


def _quantised_path(r: dict) -> str:
    """Whose int8/int4 products decoding runs (``attnlab.quant``): attnlab's own kernels (eager; and in the
    compiled step where PyTorch runs AVX2) or PyTorch's."""
    if not r["own_quant_kernels"]:
        return "PyTorch's int8/int4 kernels (attnlab's own: not built here or switched off)"
    compiled = "attnlab's" if r["own_quant_kernels_compiled"] else "inductor's GEMM"
    return f"attnlab's own AVX2 kernels (eager); compiled step: {compiled}"


def doctor_text(r: dict | None = None) -> str:
    r = r or report()
    yes = {True: "yes", False: "no", None: "-"}
    bf16_cpu = "native (fast)" if r["bf16_native_cpu"] else "emulated (slow): --bf16 runs fp32"
    dropout_path = ("attnlab's kernel (one pass, no mask stored)" if r["own_dropout_kernel"]
                    else "torch operations (attnlab's kernel: not built here or switched off)")
    lines = [
        f"attnlab on {r['platform']}, Python {r['python']}, PyTorch {r['torch']}",
        f"CPU          {r['cpu']} ({r['cpu_isa']}), {r['cores']} cores, {r['threads']} torch threads",
        f"CPU flags    {' '.join(r['cpu_flags']) or '(none of interest found)'}",
        f"GPU          {r['cuda'] or ('Apple MPS' if r['mps'] else 'none')}",
        f"bf16 on CPU  {bf16_cpu}",
        "",
        "paths attnlab takes here:",
        f"  CPU inference linears, fp32   {'oneDNN pre-packed weights' if r['packed_linear_fp32'] else 'F.linear (plain)'}",
        f"  CPU inference linears, bf16   {'oneDNN pre-packed weights' if r['packed_linear_bf16'] else 'F.linear (plain)'}",
        f"  train --bf16 on CPU           {'bf16 autocast' if r['bf16_native_cpu'] else 'fp32 (bf16 not native)'}",
        f"  train, fp32 products (CPU)    {f'oneDNN GEMM (AMD, AVX-512; products from {accel.ONEDNN_TRAINING_MIN_MACS:,} multiply-adds)' if r['training_gemm_fp32'] == 'oneDNN' else 'MKL (F.linear)'}",
        "  ... their autograd            " + ("attnlab's kernel (C++; the weight gradient on oneDNN too)"
                                             if r["own_linear_kernel"] else "Python (the weight gradient on MKL; attnlab's "
                                             "kernel: not built here or switched off)"),
        f"  --compile decode step (CPU)   {'inductor, compiler ' + r['cxx_compiler'] if r['compile_cpu'] else 'eager (no compiler or switched off)'}",
        f"  --quantize, decoding (CPU)    {_quantised_path(r)}",
        f"  dropout, training (CPU)       {dropout_path}",
        "  GELU, training (CPU, fp32)    " + ("attnlab's kernel (its slope kept for the backward)" if r["own_gelu_kernel"]
                                             else "F.gelu (attnlab's kernel: not built here or switched off)"),
        "  short attention, train (CPU)  " + ("attnlab's kernel (fp32; bf16 and T5's learned bias: ShortAttention's "
                                              "torch ops)" if r["own_attention_kernel"] else
                                              "ShortAttention's torch ops (attnlab's kernel: not built here or switched off)"),
        "  gradient clipping (CPU, fp32) " + ("attnlab's kernel (all gradients in one pass for the norm, one to scale)"
                                             if r["own_clip_kernel"] else "torch.nn.utils.clip_grad_norm_ (attnlab's "
                                             "kernel: not built here or switched off)"),
        "  freed memory, training (CPU)  " + (f"kept in the heap for the next step (glibc {r['glibc']} mallopt)"
                                             if r["training_heap_refused"] is None
                                             else f"the C library's default heap: {r['training_heap_refused']}"),
        f"  oneDNN ops in this build      {yes[r['onednn']]}",
    ]
    if r["switches"]:
        lines.append("switches     " + " ".join(f"{k}={v}" for k, v in r["switches"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    build_kernels()
    print(json.dumps(report(), indent=2) if "--json" in argv else doctor_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
