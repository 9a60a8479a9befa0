"""What this machine runs fast, and which path attnlab takes: every capability check in one place.

The model files are plain PyTorch (``nn.Linear``, one attention function). The speed tricks live
here: ``accelerate_for_inference(model)`` gives every linear layer oneDNN pre-packed weights
(:class:`PackedLinear`), and ``accelerate_for_training(model)`` (the trainer's) the same layer, whose
fp32 products that need gradients run on oneDNN's GEMM where the CPU has AVX-512 (:func:`linear`); ``compiled_step`` (``generate/search.py``) asks :func:`can_compile`; bf16
autocast asks :func:`bf16_native`. Each is a *capability*, never an assumption. Each asks here first; where the answer is no, the plain PyTorch path runs with the
same results, and one debug line per process says so (``logging.getLogger("attnlab")``).

Why checks and not try/except around the hot path: the failures are not always errors. oneDNN's bf16
weight packing raises on a CPU without AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT, but bf16 *autocast* on
such a CPU silently emulates bf16 and runs ~6× slower than fp32 — only a capability check catches that.

Switches (environment variables, read at every check, so tests can flip them):

* ``ATTNLAB_PACKED_LINEAR=0`` — no oneDNN linears: never pre-pack weights, and fp32 training products on
  MKL (plain ``F.linear``);
* ``ATTNLAB_NO_BF16=1`` — treat the CPU as having no native bf16 (stands in for an AVX2-only CPU:
  ``--bf16`` falls back to fp32, bf16 weights are not packed);
* ``ATTNLAB_COMPILE=0`` — never ``torch.compile`` the decode step;
* ``ATTNLAB_KEEP_FREED_MEMORY=0`` — leave glibc's malloc at its defaults in training (:func:`keep_freed_memory`).

To measure an AVX2-only CPU on a wider one, :data:`AVX2_ENVIRONMENT` also caps PyTorch's own kernels,
oneDNN and MKL at AVX2 (variables read when torch loads: set them before starting Python, as the
benchmarks' ``--as-avx2`` does); :func:`cpu_isa` then says "AVX2 (capped on ...)".

``attnlab doctor`` (or ``python -m attnlab.doctor``) prints all of it for this machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("attnlab")
_said: set[str] = set()


def _once(key: str, message: str) -> None:
    """One debug line per process and topic: fallbacks are normal, not worth a warning each call."""
    if key not in _said:
        _said.add(key)
        log.debug(message)


def _env_off(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "no", "off")


def _env_on(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


# -- the C heap -------------------------------------------------------------------------------------

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
KEPT_MMAP_THRESHOLD, KEPT_TRIM_THRESHOLD = 1 << 30, (1 << 31) - 1  # keep_freed_memory's settings
# the same settings for a process attnlab does not start itself (a peer in a benchmark), through glibc's tunables
KEPT_HEAP_TUNABLES = (f"glibc.malloc.mmap_threshold={KEPT_MMAP_THRESHOLD}"
                      f":glibc.malloc.trim_threshold={KEPT_TRIM_THRESHOLD}")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


@lru_cache(maxsize=1)
def _glibc():
    """The process's C library where it is glibc (whose ``mallopt`` the heap setting needs), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p  # glibc only: musl's mallopt is a no-op
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def glibc_version() -> str | None:
    lib = _glibc()
    return lib.gnu_get_libc_version().decode() if lib is not None else None


def heap_setting_refused() -> str | None:
    """Why :func:`keep_freed_memory` would leave the C heap alone here (None: it would apply); changes nothing."""
    if _env_off("ATTNLAB_KEEP_FREED_MEMORY"):
        return "ATTNLAB_KEEP_FREED_MEMORY=0"
    if any(name in os.environ.get("LD_PRELOAD", "") for name in _OTHER_ALLOCATORS):
        return "another allocator is preloaded (LD_PRELOAD)"
    if (any(os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"))
            or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")):
        return "glibc's malloc is set by the environment (MALLOC_*_ or GLIBC_TUNABLES)"
    if _glibc() is None:
        return "the C library is not glibc"
    return None


def keep_freed_memory() -> bool:
    """Let the C heap keep what a CPU training step frees, for the next step to reuse (the trainer's setting).

    Why: glibc's malloc serves each block above its mmap threshold (128 KiB, adapting up to 32 MiB) with a
    fresh ``mmap`` and unmaps it on ``free``, and trims the heap's top back to the kernel. A training step
    frees every activation it made, so the next step's same-size tensors fault every page in again, zeroed by
    the kernel: on the Marian steps of benchmarks/train_speed.py that was 15,000-48,000 minor page faults a
    step, and attnlab's small step ran 1.15-1.21x faster in fp32 with the setting and 1.09-1.30x in bf16, the
    large bf16 one 1.06-1.08x (runs of docs/results.md's twentieth session, drift included); where the
    activations are small, nothing measurable.
    PyTorch's CPU tuning guide's remedy is a caching allocator (jemalloc or tcmalloc preloaded, as
    ``torch.backends.xeon.run_cpu`` does); this is the same effect from glibc itself: ``mallopt`` raises the
    mmap threshold (1 GiB; 32 MiB on glibc before 2.35, which caps it) and the trim threshold (2 GiB), so freed
    blocks stay in the heap. The cost: memory
    freed during training is not handed back to the kernel until the process ends, as with PyTorch's CUDA
    caching allocator, and the heap's fragments can hold more than the default would (peak RSS of the
    Marian steps' processes: attnlab's -7% to +12%, HF's and the tutorial's up to 29% higher; a loop of five
    blocks of 4-64 MiB, the pattern of tests/test_train.py's check: 420 MB against 320 MB, measured ad hoc).

    Process-wide and for good (the trainer calls it; a notebook that trains keeps the setting after); once;
    returns whether it applies. Not on a non-glibc C library, not where another allocator is preloaded
    (``LD_PRELOAD``: it caches already), not where the environment sets glibc's malloc (``MALLOC_*_``,
    ``GLIBC_TUNABLES``), not with ``ATTNLAB_KEEP_FREED_MEMORY=0``."""
    return _kept_mmap_threshold() > 0


@lru_cache(maxsize=1)
def _kept_mmap_threshold() -> int:
    """:func:`keep_freed_memory`'s work, once per process: the mmap threshold glibc accepted (0: heap left alone)."""
    why_not, threshold = heap_setting_refused(), 0
    if why_not is None:
        libc = _glibc()
        # glibc before 2.35 caps the mmap threshold at 32 MiB and refuses 1 GiB: blocks of 32 MiB or more
        # (a large vocabulary's logits) are then still unmapped on free
        threshold = next((size for size in (KEPT_MMAP_THRESHOLD, 32 << 20) if libc.mallopt(_M_MMAP_THRESHOLD, size)), 0)
        if not threshold:
            why_not = "glibc refused the mmap threshold"
        elif not libc.mallopt(_M_TRIM_THRESHOLD, KEPT_TRIM_THRESHOLD):
            why_not = "glibc refused the trim threshold"
    _once("heap", f"the C heap keeps freed memory for reuse (glibc mallopt, mmap threshold {threshold >> 20} MiB)"
          if why_not is None else f"the C heap left at its defaults: {why_not}")
    return threshold if why_not is None else 0


# -- the CPU ------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """ISA features of this CPU: /proc/cpuinfo's ``flags`` (x86) or ``Features`` (ARM) on Linux;
    ``sysctl hw.optional`` on macOS. Empty where neither can be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("flags", "features"):
                    return frozenset(value.split())
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["sysctl", "hw.optional"], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            return frozenset()
        # e.g. "hw.optional.arm.FEAT_BF16: 1"
        return frozenset(k.rsplit(".", 1)[-1].lower().removeprefix("feat_") for k, _, v in
                         (line.partition(": ") for line in out.splitlines()) if v.strip() == "1")
    return frozenset()


def _cpuinfo(*keys: str) -> str | None:
    """The first of ``keys`` in /proc/cpuinfo (Linux), or None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in keys:
                    return value.strip()
    except OSError:
        pass
    return None


@lru_cache(maxsize=1)
def cpu_name() -> str:
    return _cpuinfo("model name", "Model", "Hardware") or platform.processor() or platform.machine()


def cpu_bf16_native() -> bool:
    """Native bf16 arithmetic: AVX512-BF16 or AMX on x86, the BF16 extension on ARM."""
    if _env_on("ATTNLAB_NO_BF16"):
        return False
    flags = cpu_flags()
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & flags)


AVX2_ENVIRONMENT = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                    "ATTNLAB_NO_BF16": "1",
                    # inductor's own cache, apart: seen here (PyTorch 2.13), a capped run that reused kernels
                    # compiled uncapped on the same machine computed a wrong compiled step (fresh: right)
                    "TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), f"torchinductor_avx2_{os.getuid() if hasattr(os, 'getuid') else 0}")}


def restart_capped_at_avx2() -> None:
    """Run this Python program again from the start with :data:`AVX2_ENVIRONMENT` (once: a no-op when
    it is already set). For benchmarks that stand in for an AVX2-only CPU (``--as-avx2``)."""
    if not all(os.environ.get(k) == v for k, v in AVX2_ENVIRONMENT.items()):
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **AVX2_ENVIRONMENT})


def cpu_isa() -> str:
    """A short name for the widest vector unit: what a timing should be labelled with."""
    if all(os.environ.get(k) == v for k, v in AVX2_ENVIRONMENT.items()):
        return f"AVX2 (capped on {_widest_isa()})"
    return _widest_isa()


def _widest_isa() -> str:
    flags = cpu_flags()
    for name, needs in (("AMX", {"amx_bf16"}), ("AVX-512-BF16", {"avx512_bf16"}), ("AVX-512", {"avx512f"}),
                        ("AVX2", {"avx2"}), ("NEON+BF16", {"asimd", "bf16"}), ("NEON", {"asimd"})):
        if needs <= flags:
            return name
    return platform.machine() or "unknown"


# -- devices ------------------------------------------------------------------------------------------


def pick_device(name: str = "auto") -> torch.device:
    """``auto``: CUDA, else MPS, else CPU. A named device must exist here."""
    if name != "auto":
        try:
            device = torch.device(name)
        except RuntimeError:
            raise ValueError(f"--device {name!r}: not a device name (auto, cpu, cuda, cuda:1, mps)") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {name}: this PyTorch sees no CUDA GPU (use --device cpu or auto)")
        if device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise ValueError(f"--device {name}: MPS is not available here (use --device cpu or auto)")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


# -- bf16 ---------------------------------------------------------------------------------------------


def bf16_native(device: torch.device | str = "cpu") -> bool:
    """Whether bf16 compute is native (fast) on ``device``. On CPUs without it PyTorch emulates bf16,
    which is correct but several times slower than fp32."""
    device = torch.device(device)
    if device.type == "cuda":  # (not counting the emulation PyTorch offers on pre-Ampere GPUs: several times slower)
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "mps":
        return not _env_on("ATTNLAB_NO_BF16")
    return cpu_bf16_native()


def resolve_bf16(requested: bool, device: torch.device | str = "cpu", say=None) -> bool:
    """``--bf16`` means "bf16 where it is native": on a device without native bf16 it is fp32, and
    ``say`` (e.g. print to stderr) gets one line explaining it."""
    if not requested:
        return False
    if bf16_native(device):
        return True
    message = (f"--bf16: this {torch.device(device).type.upper()} has no native bf16 ({cpu_isa()}; bf16 needs "
               "AVX512-BF16 or AMX on x86, BF16 on ARM, Ampere+ on CUDA) and would emulate it several times "
               "slower: running in fp32")
    (say or (lambda m: print(m, file=sys.stderr, flush=True)))(message)
    return False


# -- pre-packed linear weights ----------------------------------------------------------------------------


def onednn_linear_ops() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


_packed_probe: dict[torch.dtype, bool] = {}


def _probe_packed(dtype: torch.dtype) -> bool:
    """Pack a small weight and compare with F.linear: the only check that matches what oneDNN itself
    decides (its bf16 packing needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT, and builds differ)."""
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 32, generator=g).to(dtype)
        x = torch.randn(3, 32, generator=g).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        out = onednn_product(x, packed)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return bool(torch.allclose(out.float(), F.linear(x, w).float(), atol=tol, rtol=tol))
    except (RuntimeError, TypeError, NotImplementedError) as e:
        _once(f"probe-{dtype}", f"oneDNN cannot pack {dtype} linear weights here ({str(e).splitlines()[0]})")
        return False


def packed_linear_ok(dtype: torch.dtype) -> bool:
    """Whether attnlab's Linear may use oneDNN pre-packed weights for inputs of ``dtype`` on CPU.
    Called for every linear layer of every decode step: one dict look-up once the answer is known."""
    key = (dtype, os.environ.get("ATTNLAB_PACKED_LINEAR"), os.environ.get("ATTNLAB_NO_BF16"))
    ok = _packed_ok.get(key)
    if ok is None:
        ok = _packed_ok[key] = _decide_packed(dtype)
    return ok


_packed_ok: dict = {}


def _decide_packed(dtype: torch.dtype) -> bool:
    if dtype not in (torch.float32, torch.bfloat16) or _env_off("ATTNLAB_PACKED_LINEAR"):
        return False
    if dtype == torch.bfloat16 and _env_on("ATTNLAB_NO_BF16"):
        _once("packed-bf16-off", "packed bf16 linears off (ATTNLAB_NO_BF16=1): plain F.linear")
        return False
    if dtype not in _packed_probe:
        _packed_probe[dtype] = onednn_linear_ops() and _probe_packed(dtype)
        if not _packed_probe[dtype]:
            _once(f"packed-{dtype}", f"packed {dtype} linears unavailable on this CPU: plain F.linear")
    return _packed_probe[dtype]


class PackedLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict keys) with oneDNN pre-packed weights for CPU
    inference.

    Why: on CPU, ``F.linear`` goes to MKL, which reads the (out, in) weight in its stored layout at
    every call; oneDNN can instead re-lay the weight out once into the blocked layout its kernels
    stream best (what ``torch.compile`` does on CPU when it freezes weights). The gain is largest for
    the matrix-vector products of decoding (measured ratios: docs/results.md, by CPU).

    The packed weight is a cache, never state: made on the first call that can use it and made again
    whenever the weight changes (PyTorch bumps a tensor's version counter on every in-place update,
    e.g. an optimizer step; ``.to()`` and ``load_state_dict`` give new storage or a new version), so
    training and reloading stay correct. One update does not bump it: PyTorch's fused AdamW kernel's;
    so a forward that records gradients drops the pack too. It is used only where nothing needs gradients, on CPU, in a
    dtype this CPU can pack (:func:`packed_linear_ok`), outside autocast (which must keep choosing the
    compute dtype) and outside ``torch.compile`` (which packs weights itself). It costs one extra copy
    of the weights in memory. Everywhere else the layer is :func:`linear` (``F.linear``, or oneDNN's GEMM
    for fp32 products that need gradients where that is the faster).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (_IN_COMPILED_STEP and torch.compiler.is_compiling() and x.device.type == "cpu" and x.dtype == w.dtype
                and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")):
            # traced by compiled_step (only there: another compile of this model, a training step, must
            # not see a frozen copy of weights it updates)
            if x.numel() <= STREAMED_MAX_ROWS * x.shape[-1]:
                return streamed_matvec(x, w, self.bias)
            if self._buffers.get("packed_weight") is not None:  # a frozen constant, oneDNN's kernel
                return onednn_product(x, self.packed_weight, self.bias)
        if (PACKED and x.device.type == "cpu" and x.dtype == w.dtype and x.dim() >= 2 and x.numel()
                and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))
                and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
                and packed_linear_ok(w.dtype)):
            try:
                key = (w._version, w.data_ptr(), w.dtype)  # in-place updates bump the version
            except RuntimeError:  # an inference-mode tensor has no version counter: no cache
                return F.linear(x, w, self.bias)
            entry = _packed.get(self)
            # The entry holds the storage it was packed from, so no new weight can reuse its address.
            if entry is None or entry[1] != key:
                entry = (w.detach(), key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_ROWS_HINT))
                _packed[self] = entry
            return onednn_product(x, entry[2], None if self.bias is None else self.bias.detach())
        if torch.is_grad_enabled() and w.requires_grad:
            # a product for training: an optimizer step may follow, and PyTorch's fused AdamW updates the
            # weights without bumping their version, so the pack is dropped (the next evaluation packs again)
            _packed.pop(self, None)
        return linear(x, w, self.bias)

    def prepare_for_compile(self) -> bool:
        """Before ``torch.compile`` traces this layer (``compiled_step``): register its pack as a
        non-persistent buffer, so that with frozen weights inductor keeps oneDNN's packed kernel (its own
        fp32 choice for a frozen linear is MKL's, slower for few rows) and fuses the small ops around
        it. Only fp32 on CPU (bf16 weights inductor packs for oneDNN itself). Whether it did."""
        w = self.weight
        if not (w.device.type == "cpu" and w.dtype == torch.float32 and packed_linear_ok(w.dtype)):
            return False
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_ROWS_HINT),
                             persistent=False)
        return True

    def _apply(self, fn, recurse=True):
        # the pack is an opaque oneDNN tensor that cannot be moved or cast: a cache, dropped (and made
        # again by the next compiled_step, whose key the new weights change)
        self._buffers.pop("packed_weight", None)
        return super()._apply(fn, recurse)


# -- fp32 training products: oneDNN's GEMM where it outruns MKL -----------------------------------------

# oneDNN reads its ISA cap once per process; so does this (a cap set or unset later does not reach oneDNN)
_ONEDNN_ISA_CAP = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()


def onednn_product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.t() (+ b) on oneDNN's GEMM: ``w`` (out, in) plain or a transposed view, or a oneDNN pack. (oneDNN
    reads the bias as contiguous whatever its strides: a strided or expanded one is copied first.)"""
    if not x.shape[-1]:  # (no inputs: oneDNN refuses K = 0; the output is the bias)
        return F.linear(x, w, b)
    return torch.ops.mkldnn._linear_pointwise(x, w, None if b is None else b.contiguous(), "none", [], "")


def onednn_training_gemm_ok() -> bool:
    """Whether fp32 products that need gradients go to oneDNN's GEMM (plain, unpacked weights) rather than
    MKL's, which ``F.linear`` and ``torch.mm`` call on CPU.

    Why: on the AMD EPYC of docs/results.md (AVX-512) oneDNN's kernels ran the training step's shapes
    5–20% faster than MKL's (the forward product and the input's gradient; the weight's gradient too, given one
    operand transposed by attnlab's kernel, :func:`linear_kernel_serves`, else MKL's), and MKL ran at the same
    speed with its instructions capped at AVX2: on AMD it takes its AVX2 path. With oneDNN capped at AVX2 the two were even. So: AMD CPUs with
    AVX-512 (F, BW, VL, DQ: oneDNN's avx512_core) only; on Intel CPUs MKL runs its own AVX-512 kernels and
    no timing says oneDNN is faster there. Off with ``ATTNLAB_PACKED_LINEAR=0`` (no oneDNN linears at
    all) or oneDNN capped below AVX-512 (``ONEDNN_MAX_CPU_ISA``); checked once against ``F.linear``."""
    key = (PACKED, os.environ.get("ATTNLAB_PACKED_LINEAR"), _ONEDNN_ISA_CAP)
    ok = _training_gemm_ok.get(key)
    if ok is None:
        ok = _training_gemm_ok[key] = _decide_training_gemm()
    return ok


_training_gemm_ok: dict = {}


@lru_cache(maxsize=1)
def cpu_vendor() -> str:
    return _cpuinfo("vendor_id") or ""


def _decide_training_gemm() -> bool:
    if not PACKED or _env_off("ATTNLAB_PACKED_LINEAR"):
        return False
    capped = not (_ONEDNN_ISA_CAP in ("ALL", "DEFAULT") or any(isa in _ONEDNN_ISA_CAP for isa in ("AVX512", "AVX10", "AMX")))
    if cpu_vendor() != "AuthenticAMD" or capped or not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags():
        _once("training-gemm", "fp32 training products: MKL (oneDNN's GEMM is taken on AMD CPUs with AVX-512 only)")
        return False
    if not onednn_linear_ops():
        _once("training-gemm", "fp32 training products: MKL (no oneDNN linear in this PyTorch build)")
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x, w, b, dy = (torch.randn(*shape, generator=g) for shape in ((2, 7, 48), (40, 48), (40,), (2, 7, 40)))
        if (torch.allclose(onednn_product(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
                and torch.allclose(onednn_product(dy, w.t()), dy @ w, atol=1e-4, rtol=1e-4)):
            return True
        _once("training-gemm", "fp32 training products: MKL (oneDNN's linear disagreed with F.linear here)")
    except (RuntimeError, TypeError, NotImplementedError) as e:
        _once("training-gemm", f"fp32 training products: MKL (oneDNN's linear failed here: {str(e).splitlines()[0]})")
    return False


class OneDNNLinear(torch.autograd.Function):
    """``F.linear(x, w, b)`` whose forward product and input gradient run on oneDNN's GEMM (see
    :func:`onednn_training_gemm_ok`); the weight's gradient is MKL's ``mm``, the bias's a sum. With
    ``create_graph`` (double backward) the input's gradient is a differentiable ``matmul`` instead. Where attnlab's
    linear kernel builds, ``attnlab::onednn_linear`` (``csrc/linear.cpp``) does the same in C++, with the weight's
    gradient on oneDNN too (:func:`linear_kernel_serves`); this is the fallback. It
    saves what the backward needs, as ``F.linear`` does: x only if w wants a gradient, w only if x does."""

    @staticmethod
    def forward(ctx, x, w, b):
        need_x, need_w = ctx.needs_input_grad[:2]
        ctx.save_for_backward(x if need_w else None, w if need_x else None)
        ctx.has_bias = b is not None
        return onednn_product(x, w, b)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        rows = dy.flatten(0, -2)  # (N, out) (flatten, not reshape(-1, out): out may be 0)
        dx = dw = db = None
        if need_x:  # (..., in)
            dx = dy.matmul(w) if torch.is_grad_enabled() else onednn_product(dy, w.t())
        if need_w:
            dw = rows.t().mm(x.flatten(0, -2))  # (out, in)
        if need_b and ctx.has_bias:
            db = rows.sum(0)
        return dx, dw, db


# Whether attnlab::onednn_linear gives the weight's gradient to oneDNN (one operand turned by attnlab::transposed) or
# to MKL's mm: oneDNN, measured by `python benchmarks/train_speed.py --linear-kernel` (docs/results.md, thirty-first
# #13 session: the large Marian step 1.049x, the small 1.014x, nanoGPT's update 1.116x faster so; 1.097x, 1.022x and
# 1.032x with the Python autograd function before it). A switch for that table.
ONEDNN_WEIGHT_GRAD = True
_LINEAR_KERNEL: dict = {}  # "ok" → whether attnlab::onednn_linear and attnlab::transposed are built and right here


def linear_kernel_serves() -> bool:
    """Whether :func:`linear`'s oneDNN products take attnlab's C++ autograd function (``csrc/linear.cpp``:
    ``attnlab::onednn_linear``, the weight's gradient on oneDNN too, see :data:`ONEDNN_WEIGHT_GRAD`) rather than
    :class:`OneDNNLinear`: as ``own_kernel_serves`` says (not ``ATTNLAB_OWN_KERNELS=0``, Linux, built once per
    process for this CPU's vector extensions, and right on a check)."""
    return own_kernel_serves(_LINEAR_KERNEL, _build_linear_kernel)


def _build_linear_kernel() -> bool:
    from .model.layers import _own_kernel

    def linear_right() -> bool:
        # both ways of turning the weight gradient's operand, against F.linear in float64
        g = torch.Generator().manual_seed(0)
        ok = True
        for out_f, in_f in ((12, 20), (20, 12)):
            x, w, b = (torch.randn(*s, generator=g).requires_grad_() for s in ((3, 5, in_f), (out_f, in_f), (out_f,)))
            dy = torch.randn(3, 5, out_f, generator=g)
            got = torch.autograd.grad(torch.ops.attnlab.onednn_linear(x, w, b, True), (x, w, b), dy)
            x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
            want = torch.autograd.grad(F.linear(x64, w64, b64), (x64, w64, b64), dy.double())
            ok = ok and all(torch.allclose(a.double(), r, atol=1e-4, rtol=1e-4) for a, r in zip(got, want))
        return ok

    def check():
        # the transpose: odd sizes (the 8 × 8 blocks' and the 32 × 32 tiles' edges), rows further apart than their
        # length; the linear through autograd on a thread of its own: grad mode and saved-tensor hooks are per thread,
        # and the first call may come from inside a forward under no_grad or under torch.utils.checkpoint's hooks
        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(n, c, generator=g) for n, c in ((37, 45), (64, 8), (1, 9), (9, 1), (40, 33))]
        xs.append(torch.randn(21, 50, generator=g)[:, 3:40])
        if not all(torch.equal(torch.ops.attnlab.transposed(x), x.t().contiguous()) for x in xs):
            return False
        result: list[bool] = []
        thread = threading.Thread(target=lambda: result.append(linear_right()), name="attnlab-linear-check")
        thread.start()
        thread.join()
        return result == [True]

    def transposed(x):
        return x.new_empty(x.shape[1], x.shape[0])

    suffix, cflags = own_kernel_target()
    return _own_kernel("linear kernel", "the Python OneDNNLinear with MKL's weight gradient",
                       "attnlab_linear" + suffix, "linear.cpp", cflags, {"transposed": transposed}, check)


def eager_autograd() -> bool:
    """Whether an operation runs under plain eager autograd, where a Python ``autograd.Function`` over one of
    attnlab's own CPU operators can serve: not while ``torch.compile`` traces (inductor picks its own kernels),
    not under ``torch.func`` transforms, forward-mode AD or ``torch.jit.trace``."""
    return (not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active()
            and not torch.jit.is_tracing() and getattr(torch.autograd.forward_ad, "_current_level", 0) < 0)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, with oneDNN's GEMM for fp32 products that need gradients on CPUs where it is the
    faster (:func:`onednn_training_gemm_ok`) and large enough to pay its fixed cost
    (:data:`ONEDNN_TRAINING_MIN_MACS`): eager autograd only, so outside autocast (which picks its
    own kernels), ``torch.compile`` (inductor picks its own), ``torch.func`` transforms, forward-mode AD
    and ``torch.jit.trace`` (none of which a Python autograd.Function over oneDNN's op serves)."""
    if (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and (bias is None or bias.dtype == torch.float32) and x.dim() >= 2 and x.shape[-1]
            and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            and x.numel() * weight.shape[0] >= ONEDNN_TRAINING_MIN_MACS
            and not torch.is_autocast_enabled("cpu") and eager_autograd() and onednn_training_gemm_ok()):
        if linear_kernel_serves():
            return torch.ops.attnlab.onednn_linear(x, weight, bias, ONEDNN_WEIGHT_GRAD)
        return OneDNNLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


# Multiply-adds (rows × in × out) from which a training product goes to oneDNN. oneDNN's call costs a fixed
# ~10-17 µs more than MKL's (one row: 16-23 against 2.5-6.6 µs), and its GEMM wins that back only on larger
# products: level at nanoGPT's 768 × 128 × 128 (12.6M), 5-20% faster at its 38-50M ones (ad hoc, the
# reference CPU). Whole updates, the two settings alternating in one process (docs/results.md, twenty-seventh
# #13 session): a 1 × 16-token, d 32 model 6.20 → 4.97 ms; 128 rows at d 128 and at d 256 level; nanoGPT's
# step, every layer's product above the threshold, unchanged. (The fused loss keeps its own choice.)
ONEDNN_TRAINING_MIN_MACS = 1 << 23


_IN_COMPILED_STEP = False  # True while compiled_step's step runs (dynamo guards on it)
STREAMED_MAX_ROWS = 1  # compiled steps of this many rows multiply as a streamed reduction (one more graph each)


def streamed_matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` written as a product and a sum over the input features, for
    ``torch.compile`` to turn into one loop over the weight's rows.

    Why: decoding one sequence multiplies every weight matrix by a single row, so a step is the time
    it takes to read the weights once: memory-bound. GEMM kernels (MKL's, oneDNN's) are built to
    re-use a weight block across many rows; for one row they read SmolLM2's matrices at ~11–22 GB/s on
    the reference CPU (ad-hoc measurement), where the memory gives ~31 GB/s to a plain sum. Inductor's
    code for this reduction reads each weight row once, vectorised along the row, the rows split over
    the threads: SmolLM2 fp32, batch 1, compiled, 54.0 tok/s against 25.8 eager and 16.4 for
    transformers (``benchmarks/smollm2_speed.py --compile``, docs/results.md). Accumulates in fp32
    (inductor upcasts bf16 reductions). With more rows the weights would be read once per row: two rows
    still gain a little, four lose, and :data:`STREAMED_MAX_ROWS` is 1 so that a serving batch needs one
    graph fewer."""
    out = (x.unsqueeze(-2) * weight).sum(-1)  # (..., 1, K) * (N, K) → (..., N)
    return out if bias is None else out + bias
PACKED = True  # programmatic switch for all oneDNN linears; ATTNLAB_PACKED_LINEAR=0 in the environment is checked per dtype
_PACK_ROWS_HINT = 64  # a pack for 64 rows serves 1…256-row inputs well; a pack for 1 row does not
_packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module → (source, key, packed)


def accelerate_for_inference(model: nn.Module) -> nn.Module:
    """Give every ``nn.Linear`` of ``model`` the pre-packed CPU inference path (in place; idempotent).
    Parameters, state-dict keys, training and results are unchanged: where packing does not apply
    (gradients, autocast, GPU, a dtype this CPU cannot pack) the layer is :func:`linear`."""
    for m in model.modules():
        if type(m) in (nn.Linear, TrainingLinear):
            m.__class__ = PackedLinear
    return model


class TrainingLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict keys) whose products go through :func:`linear`:
    oneDNN's GEMM for fp32 products that need gradients where it is the faster, ``F.linear`` otherwise.
    No packed weights, so a model in training holds no second copy of them (``accelerate_for_inference``
    turns it into a :class:`PackedLinear`, which keeps this training path)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def accelerate_for_training(model: nn.Module) -> nn.Module:
    """Every ``nn.Linear`` of ``model`` a :class:`TrainingLinear` (in place; idempotent): what the trainer
    and ``benchmarks/train_speed.py`` do to the model they train. Results are ``F.linear``'s to fp32
    rounding."""
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = TrainingLinear
    return model


# -- compilation -------------------------------------------------------------------------------------


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would use for CPU code (it needs one; a bare machine may have none)."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++", "cl"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


_PATH_LOCK = threading.RLock()  # (package_ninja_first: one PATH change at a time)


@contextlib.contextmanager
def package_ninja_first():
    """PATH with the ``ninja`` package's binary first (a dependency of attnlab), for the extension build it wraps;
    PATH as it was without the package. cpp_extension runs ``ninja`` from PATH, and ninja keeps a hash of each
    command it ran in the build folder, a hash that changes between ninja versions (Debian's 1.11 and pip's 1.13
    here): two processes that found different ninjas first (a shell with the virtual environment activated, one
    without) rebuilt each other's kernels in torch's extension cache, ~10 s a kernel, each time they took turns.
    One ninja for every attnlab process, whatever its PATH, builds a kernel once. (Builds in two threads take
    turns here, so that neither restores the PATH the other set.)"""
    try:
        import ninja
    except ImportError:
        yield
        return
    with _PATH_LOCK:
        before = os.environ.get("PATH")
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + (before or os.defpath)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("PATH", None)
            else:
                os.environ["PATH"] = before


def can_build_kernels() -> bool:
    """Whether attnlab's own kernels (``csrc/``) can be built here: a C++ compiler and ninja."""
    from torch.utils import cpp_extension
    with package_ninja_first():
        return cxx_compiler() is not None and cpp_extension.is_ninja_available()


def built_once(cache: dict, lock, build) -> bool:
    """``cache["ok"]``, set by ``build()`` the first time any thread asks (the others wait for ``lock``, a
    ``threading.Lock`` or ``RLock``): how attnlab's own kernels are built or found missing once per process."""
    if "ok" not in cache:
        with lock:
            if "ok" not in cache:
                cache["ok"] = build()
    return cache["ok"]


_OWN_KERNEL_LOCK = threading.RLock()  # (training threads, or a server's, may ask first at once: one builds)


def own_kernels_allowed() -> bool:
    """Whether attnlab's own CPU training kernels may be tried here: not ``ATTNLAB_OWN_KERNELS=0``, and on Linux
    (elsewhere the compiler flags differ)."""
    return not _env_off("ATTNLAB_OWN_KERNELS") and platform.system() == "Linux"


def own_kernel_serves(cache: dict, build) -> bool:
    """Whether one of attnlab's own CPU training kernels (``csrc/``: dropout, GELU, attention) serves here: where
    :func:`own_kernels_allowed`, and ``build()`` true, asked once per process (:func:`built_once`, its answer in
    ``cache["ok"]``): built for this CPU's vector extensions as PyTorch runs them (a C++ compiler and ninja) and
    right on its check."""
    return own_kernels_allowed() and built_once(cache, _OWN_KERNEL_LOCK, build)


def own_kernel_target(fma: bool = False) -> tuple[str, list[str]]:
    """(library name suffix, compiler flags) for attnlab's own CPU kernels (``csrc/``), for this CPU's vector
    extensions as PyTorch runs them (capped too): AVX-512, AVX2, or the compiler's baseline (SSE2 on x86, NEON
    on ARM). The kernels are loops the compiler vectorises for these flags, or GCC vector types of their width
    (the attention kernel: 16, 8 or 4 floats). ``fma``: with fused
    multiply-adds too where the CPU has them (one rounding per step of a polynomial or a product, and faster;
    the dropout kernel, bit-exact to its torch path, goes without)."""
    capability = torch.backends.cpu.get_cpu_capability()  # AVX512, AVX2 (also when capped), or another
    flags = cpu_flags()
    if capability == "AVX512" and {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2"} <= flags:
        suffix, cflags = "_avx512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2"]
    elif capability in ("AVX512", "AVX2") and "avx2" in flags:
        suffix, cflags = "_avx2", ["-mavx2"]
    else:
        return "", []
    return (suffix + "_fma", [*cflags, "-mfma"]) if fma and "fma" in flags else (suffix, cflags)


def build_torch_ops(name: str, source: str, cflags: list[str], op: str) -> str | None:
    """Build ``src/attnlab/csrc/<source>`` (a library of ``torch.ops.attnlab`` operators, ``op`` among them)
    with ``cflags``, or load it from torch's extension cache (keyed by ``name``, the source and the flags), into this
    process. None when ``op`` is loaded; else why not (no C++ compiler, no ninja: checked every time). A
    failed build raises."""
    from torch.utils import cpp_extension
    if not can_build_kernels():
        return "no C++ compiler or no ninja (pip install ninja)"
    if hasattr(torch.ops.attnlab, op):
        return None
    path = os.path.join(os.path.dirname(__file__), "csrc", source)
    # -fopenmp: at::parallel_for is PyTorch's OpenMP loop, serial in code built without it
    with package_ninja_first():
        cpp_extension.load(name=name, sources=[path], is_python_module=False,
                           build_directory=kernel_build_directory(name),
                           extra_cflags=["-O3", *cflags, "-fopenmp"], extra_ldflags=["-fopenmp"])
    return None


def kernel_build_directory(name: str) -> str:
    """The folder where attnlab's kernel library ``name`` is built and cached: in torch's extension cache
    (``TORCH_EXTENSIONS_DIR``, else its default), one per Python environment and PyTorch. Why: torch names its
    folder after the library alone, and the same source built with another environment's include paths is
    another ninja command, so two virtual environments (a clean clone's and a checkout's, say) rebuilt each
    other's kernels, 10-25 s of a core each, whenever they took turns."""
    folder = os.path.join(kernel_cache_root(), f"{name}-{environment_tag()}")
    os.makedirs(folder, exist_ok=True)
    return folder


def kernel_cache_root() -> str:
    """torch's extension cache: ``TORCH_EXTENSIONS_DIR``, else its default folder."""
    from torch.utils import cpp_extension
    return os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()


def environment_tag() -> str:
    """A short hash of this Python environment and its PyTorch (``sys.prefix``, PyTorch's folder and version): the
    suffix of :func:`kernel_build_directory`'s folders."""
    where = repr((sys.prefix, os.path.dirname(os.path.realpath(torch.__file__)), torch.__version__))
    return hashlib.sha256(where.encode()).hexdigest()[:12]


def can_compile(device: torch.device | str = "cpu") -> bool:
    """Whether ``torch.compile`` can generate code for ``device`` here."""
    if _env_off("ATTNLAB_COMPILE"):
        _once("compile-off", "torch.compile off (ATTNLAB_COMPILE=0): eager decoding")
        return False
    device = torch.device(device)
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            _once("compile-triton", "torch.compile on CUDA needs triton, which is not installed: eager decoding")
            return False
        return True
    if device.type == "cpu" and cxx_compiler() is None:
        _once("compile-cxx", "torch.compile on CPU needs a C++ compiler (none found): eager decoding")
        return False
    return device.type in ("cpu", "cuda")


# -- the compiled decode step ------------------------------------------------------------------------

_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def compiled_step(model: torch.nn.Module, fn):
    """``torch.compile`` of a one-token decoding step (``fn``: the model's forward or ``decode``).

    Why: a decode step of a small model is hundreds of tiny ops whose Python and dispatch cost
    rivals the matrix products. Inductor fuses them, and with ``freezing`` it treats the weights as
    constants and pre-packs them. Shapes are dynamic (the KV cache grows, finished rows leave the
    batch), so one compilation serves a whole generation and later ones. Compiling costs about a
    minute for a 30-layer model on 2 CPU cores: worth it for long or repeated generation. On CPU in
    fp32 inductor's own frozen linears would be MKL's, slower for one row than oneDNN's packed ones,
    so every ``PackedLinear`` first registers its oneDNN pack as a constant
    (:meth:`PackedLinear.prepare_for_compile`) and the traced step calls oneDNN's kernel on it: the
    small ops are fused, the products stay the eager step's. A step of one row (batch-1 decoding)
    multiplies by :func:`streamed_matvec` instead, which reads the weights near the memory's speed
    (SmolLM2 fp32: ~2× the eager step). A quantised model (``attnlab.quant``)
    has its int8/int4 products traced as constants and, with ``max_autotune``, inductor may generate
    its own GEMM for them, or, on AVX2, its int8/int4 products call attnlab's own kernels and inductor writes
    the step's wrapper in C++ (``cpp_wrapper``; see ``quant``'s docstring).
    Where ``accel.can_compile`` says no (no C++ compiler, no triton) or the build fails, the eager
    step runs, with the same results.

    Frozen weights are a snapshot, and dynamo's guards on the model's modules (hundreds of checks per
    call, ~10% of a quantised step) are skipped but for the frozen tensors' identities
    (``_frozen_tensor_guards_only``): instead the compiled step is keyed on every parameter and
    buffer (storage, version, dtype) and on the modules' ``training`` and ``record_weights`` flags,
    and compiled again when ``compiled_step`` is next asked for it (each ``generate`` call asks) after
    any of them changed. Guards on the step's own inputs (shapes, dtypes, the cache) stay.
    """
    from . import quant
    p0 = next(model.parameters())
    quantised = quant.quantized_kind(model) is not None
    if not can_compile(p0.device):  # no C++ compiler (CPU) or no triton (CUDA): eager, same results
        return fn
    entry = _COMPILED.get(model)
    if entry is None or entry[0] != _model_state(model):
        if entry is not None:
            torch._dynamo.reset()  # dynamo's cache would otherwise keep serving the old constants
        kernels = quantised and quant.prepare_for_compile(model, p0.dtype)
        accelerate_for_inference(model)
        packs = [m.prepare_for_compile() for m in model.modules() if isinstance(m, PackedLinear)]
        if p0.device.type == "cpu" and p0.dtype == torch.float32 and not any(packs) and not quantised:
            _once("compile-fp32-mkl", "compiled fp32 step without oneDNN packs (none here): inductor's frozen "
                  "linears are MKL's, which may decode slower than eager")
        compiled = torch.compile(fn, dynamic=True, options={"guard_filter_fn": _frozen_tensor_guards_only})
        # what inductor is told, best first: its GEMM templates for the quantised kernels may not build
        # (e.g. an AVX-512 kernel where PyTorch is capped at AVX2), then the aten kernels in a fused
        # graph, then eager
        tries = [{"freezing": True}]
        if kernels:
            tries.insert(0, {"freezing": True, "max_autotune": True, "autotune_num_choices_displayed": 0,
                             **_autotune_backends(quant.quantized_kind(model), p0.device)})
        if quant.uses_own_kernel(model):
            # with attnlab's own kernels the step's Python wrapper is a good part of each token (~1.9 ms
            # of ~9 for SmolLM2 int8 under the AVX2 cap); C++ wrapper code gave 121.0 against 104.0 tok/s
            # (ad-hoc, the int8 kernel's earlier fp32 form; not measured again since)
            tries.insert(0, {**tries[0], "cpp_wrapper": True})

        def step(*args, **kwargs):
            import torch._inductor.config as inductor_config
            global _IN_COMPILED_STEP
            while tries:
                try:
                    with inductor_config.patch(tries[0]):  # read when (re)compiling, i.e. inside the call
                        _IN_COMPILED_STEP = True
                        return compiled(*args, **kwargs)
                except Exception as e:  # a compiler that is present but cannot build this
                    if not _is_compile_failure(e):
                        raise
                    log.debug("compiled decode step failed to build with %s (%s)", tries.pop(0),
                              str(e).strip().splitlines()[:3])
                finally:
                    _IN_COMPILED_STEP = False
            return fn(*args, **kwargs)
        entry = (_model_state(model), step)  # taken again: prepare_for_compile added buffers
        _COMPILED[model] = entry
    return entry[1]


def _autotune_backends(kind: str | None, device: torch.device) -> dict:
    """Inductor's GEMM choices for a quantised step. On AVX2, int8 products take its C++
    template only. Autotuning times each choice on weights already in cache, where PyTorch's
    ``_weight_int8pack_mm`` wins for some of SmolLM2's shapes. Inside the step the weights stream from
    memory, and there the template is faster: under the AVX2 cap, 86–102 tok/s against 69–80 with
    aten allowed (SmolLM2 int8 batch 1, docs/results.md). With AVX-512 the two measured alike, so
    autotuning keeps both."""
    if kind == "int8" and device.type == "cpu" and torch.backends.cpu.get_cpu_capability() == "AVX2":
        return {"max_autotune_gemm_backends": "CPP"}
    return {}


def _frozen_tensor_guards_only(entries) -> list[bool]:
    """Which of dynamo's guards a compiled step keeps: none on the modules' attributes and hooks
    (``compiled_step``'s own key stands for them), and of the identity checks on frozen weights only
    the first and the last. Those matter: dynamo caches per code object, so two models of the same
    architecture share a cache, and without an identity check the second would run the first's frozen
    weights (tested). One model's tensors are its own, so two of them tell the models apart; a changed
    weight is ``_model_state``'s business. Checking all of them (~500 for SmolLM2 int8) cost a quarter
    of a quantised step under the AVX2 cap (90.6 against 121.8 tok/s, ad-hoc)."""
    keep = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    weights = [i for i, e in enumerate(entries) if e.guard_type == "ID_MATCH" and _names_a_tensor(e.name)]
    identity, checked = {weights[0], weights[-1]} if weights else set(), set(weights)
    return [i in identity if i in checked else (k or e.guard_type == "ID_MATCH")
            for i, (k, e) in enumerate(zip(keep, entries))]


def _names_a_tensor(source: str) -> bool:
    return "._parameters[" in source or "._buffers[" in source


def _model_state(model: torch.nn.Module) -> tuple:
    """What a compiled step of ``model`` depends on beyond its inputs (see ``compiled_step``)."""
    tensors = tuple((t.data_ptr(), -1 if t.is_inference() else t._version, t.dtype)  # inference tensors: no version
                    for t in (*model.parameters(), *model.buffers())
                    if t.layout == torch.strided)  # oneDNN packs (opaque) derive from the weights
    flags = tuple((m.training, getattr(m, "record_weights", False)) for m in model.modules())
    return tensors, flags


def _is_compile_failure(e: Exception) -> bool:
    """Errors of the compiler toolchain (inductor's C++ build, a missing backend), not of the model."""
    try:
        from torch._dynamo.exc import BackendCompilerFailed
    except ImportError:  # pragma: no cover - older torch
        BackendCompilerFailed = ()
    return isinstance(e, BackendCompilerFailed) or type(e).__module__.startswith(("torch._inductor", "torch._dynamo"))


__all__ = ["AVX2_ENVIRONMENT", "restart_capped_at_avx2", "PackedLinear", "accelerate_for_inference",
           "accelerate_for_training", "keep_freed_memory", "heap_setting_refused", "glibc_version", "TrainingLinear", "linear", "OneDNNLinear", "onednn_product",
           "onednn_training_gemm_ok", "cpu_vendor", "compiled_step", "pick_device", "cpu_flags", "cpu_name",
           "cpu_isa", "cpu_bf16_native", "bf16_native", "resolve_bf16", "packed_linear_ok", "onednn_linear_ops",
           "cxx_compiler", "can_compile"]
