"""Weight-only int8 / int4 quantisation of any attnlab model, for inference.

    from attnlab.quant import quantize_model
    quantize_model(model, "int8")            # every nn.Linear → Int8Linear (in place)
    quantize_model(model, "int4", group_size=32)
    attnlab.load("smollm2", quantize="int4")  # the same, at load; CLI: --quantize int4

Why weight-only: decoding one token at batch 1 reads every weight once and does two flops per weight,
so it is limited by memory bandwidth, not arithmetic. int8 weights are 4× fewer bytes than fp32 (2×
fewer than bf16), int4 8× (4×): up to that much less time per token where a kernel streams them at
bandwidth. The activations stay floating point, so nothing needs calibration data.

* **int8**, one symmetric scale per output channel (row of W): ``scale[n] = max_k |W[n, k]| / 127``,
  ``q = round(W / scale)``. Each weight is off by at most ``scale / 2``: 1/254 ≈ 0.4% of its row's
  largest |weight|. A scale per row (not one per matrix) keeps a row of small weights from being rounded away
  by another row's outlier.
* **int4**, per group of ``group_size`` consecutive inputs of a row, ``W ≈ (q - 8) · scale + zero``
  with ``q`` in 0…15 (the layout of PyTorch's int4 kernel). Each group takes the better of two grids
  (the smaller largest error): 16 levels from its minimum to its maximum (llama.cpp's Q4_1 for groups
  of 32), or symmetric, ``zero = 0`` and ``scale`` = −(its value of largest magnitude)/8 (llama.cpp's
  Q4_0). So a GGUF's Q4_1 or Q4_0 weights come back exactly (in fp32), not quantised a second time. Error ≤
  (max - min) / 30 per weight; the small groups are what keep it usable.

Every ``nn.Linear`` is replaced, including the output projection (``lm_head``), which int4 keeps at
int8: the logits are the most sensitive product (llama.cpp's Q4 files keep their output matrix at 6-8
bits too); on SmolLM2 an int4 head costs +4.9% perplexity, an int8 one nothing measurable, for 14 MB.
A tied ``lm_head`` shares its (V × d) Parameter with the token embedding: the quantised head keeps its
own int8/int4 copy and the embedding keeps the float Parameter, so the embedding lookup is exactly
what it was.

Kernels, and when they are used (everything else is the *eager* path: dequantise the weight, then
``F.linear`` — correct on any device, dtype and shape, and the path ``ATTNLAB_QUANT_KERNELS=0``
forces):

* PyTorch's CPU kernels ``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu`` (what torchao
  and gpt-fast use). Whether each works here is *probed* once per (kind, dtype): a small matmul
  against the eager result; a missing op (older PyTorch) or a wrong answer means eager, with one
  debug line (``logging.getLogger("attnlab")``).
* On x86 they are vectorised (AVX2 / AVX-512) for **bf16 activations only**; fp32 and fp16 take a
  scalar loop, measured 10-60× slower than ``F.linear``. So fp32 activations reach the kernel as bf16
  and come back fp32: inputs and outputs rounded to bf16 (≤ 2^-8 relative each, the order of int8's
  own weight error; the eager path stays fp32). Elsewhere (ARM's NEON covers all three dtypes) the
  activations' own dtype is used.
* Only for a few rows at a time (decoding: one row per sequence and beam). A prompt or a
  perplexity block is compute-bound: there, dequantising once and one dense matmul are faster
  (``KERNEL_MAX_ROWS``; int8, SmolLM2's products, 2 threads, ``benchmarks/linear_kernels.py
  --quantized-rows`` with ``ATTNLAB_OWN_KERNELS=0``: the kernel 1.70× faster at 64 rows on AVX-512,
  level (0.99×) under the AVX2 cap; 1.29× and 0.76× at 128. int4's still wins at 128).
* The int8 kernel loads 16 inputs at a time with *aligned* loads: it runs only for
  ``in_features % 16 == 0`` and 32-byte-aligned inputs (a misaligned input is copied first); other
  shapes would read past the row or crash, which no probe can catch. The int4 kernel needs
  ``out_features % 16 == 0``, ``in_features % group_size == 0`` and a group size of 32/64/128/256.
* Not where gradients are needed, not on GPU.
* **attnlab's own int8 and int4 products** (``csrc/quant_matvec.cpp``, AVX2 code, the ops
  ``attnlab::int8_matvec`` and ``attnlab::int4_matvec``): where PyTorch's CPU capability is AVX2, the
  kernels above are slow (bf16 activations emulated, ~7 and ~20 GB/s on SmolLM2's int8 weights under the
  AVX2 cap), so the int8 and int4 products of a few rows are these small kernels instead: eager, up to
  :func:`own_kernel_max_rows`; in the compiled step, any number (the C++ takes the dense product past
  64). The eager products of a few rows are theirs on AVX-512 CPUs too (SmolLM2's eager decoding there:
  1.49× int8, 1.29× int4 over PyTorch's kernels). Each weight row is read once (with a software
  prefetch a few rows ahead) and summed exactly in int32, rows split over PyTorch's threads. int8
  widens its weights to int16 in registers against the activations rounded to int16 with one scale per
  row (``max |x| ↦ 32767``: finer than bf16 for every element within 128× of its row's largest). int4
  multiplies its 4-bit values as bytes against the activations rounded to int8 with a scale per 16
  inputs (``max |x| ↦ 127``, as llama.cpp's Q8_1 meets its Q4_1, with half its block), twice the products
  per instruction: int16 activations left it arithmetic-bound at ~14-15 GB/s of SmolLM2's weights on an
  AVX2 EPYC, this reads them at 18-19 GB/s, near the memory's speed (1.23-1.30x). The minimums meet the
  sums of the rounded activations, as Q8_1's do. The price is precision: ~0.6% error on SmolLM2's products
  (int16: 0.01%); perplexity +0.20% against +0.07% (docs/results.md, thirty-sixth session). int8 widens each
  weight once for up to 4 rows of activations (a prompt, a batch, beams: SmolLM2's products 1.23–1.25×
  faster at 4 rows, 1.28–1.32× at 8, than a widening per row; two runs, docs/results.md). int4 has a layout of
  its own, made from the portable one (:meth:`Int4Linear._own_tensors`): per 64 inputs 32 bytes, input
  i in byte i's low nibble and input 32 + i in its high one, so that a mask (and a shift) make 32 of them
  bytes in order, and an fp16 scale and minimum per 32 inputs (as llama.cpp's
  Q4_1: 0.625 bytes per weight, against int8's 1). They are built with ``torch.utils.cpp_extension`` (a
  C++ compiler and ninja) on first use, cached on disk, and probed against the exact product; they need
  no particular shape (int4: groups that are a multiple of 32). Where they cannot build or
  ``ATTNLAB_OWN_KERNELS=0``, PyTorch's kernels serve as before (``ATTNLAB_QUANT_KERNELS=0`` turns
  everything off). In the compiled step on AVX-512, inductor's GEMM template is faster and stays
  (:func:`own_kernels_in_compiled_step`; docs/results.md).

The int4 kernel wants its own packed weight layout; it is made on first use and kept next to the
portable one (0.5 byte per weight each), like ``accel.PackedLinear``'s cache.

**Under ``torch.compile``** (``generate(..., compile=True)``, ``--compile``; ``accel.compiled_step``)
the kernel-ready tensors are made beforehand as non-persistent buffers (:func:`prepare_for_compile`),
so that inductor, with frozen weights and ``max_autotune``, sees constant int8/int4 weights and may
replace the two aten kernels by its own generated GEMM for them (``CppGemmTemplate``, vectorised
dequantisation inside the product). That and the fused small ops between them is what makes a compiled
quantised decode step much faster than the eager one (docs/results.md). Where no kernel may run
(shape, ``ATTNLAB_QUANT_KERNELS=0``, a failed probe), the eager dequantise-and-multiply is traced.
"""

from __future__ import annotations

import os
import platform
import threading

import torch
import torch.nn.functional as F
from torch import nn

from .accel import _env_off, _env_on, _once, built_once

KINDS = ("int8", "int4")
INT4_KERNEL_GROUP_SIZES = (32, 64, 128, 256)
# More rows than this: dequantise once + dense matmul beats the kernel (see the module docstring).
KERNEL_MAX_ROWS = {"int8": 64, "int4": 64}


# attnlab's kernels read each weight row once per row of x: they win for a few rows (decoding). Timed on
# SmolLM2's products, 2 threads (`benchmarks/linear_kernels.py --quantized-rows`, docs/results.md,
# "thirteenth session"): int8 up to 64 rows, 1.4-5.1x, on AVX-512 and under the AVX2 cap (the layer's
# path without them leaves PyTorch's int8 kernel past KERNEL_MAX_ROWS["int8"] and dequantises per call);
# int4 on bytes (thirty-sixth session, native AVX2 EPYC) up to 64 rows, 1.34-2.01x (its int16 form was
# level at 8 under the AVX2 cap); where PyTorch's int4 kernel runs AVX-512 it was faster from 3 rows on
# (timed against the int16 form; not re-timed).
OWN_KERNEL_MAX_ROWS = {"AVX2": {"int8": 64, "int4": 64}, "AVX512": {"int8": 64, "int4": 2}}  # by PyTorch's capability


def own_kernel_max_rows(kind: str) -> int:
    """The most rows of x that attnlab's ``kind`` kernel takes in the eager layer."""
    capability = "AVX512" if torch.backends.cpu.get_cpu_capability() == "AVX512" else "AVX2"
    return OWN_KERNEL_MAX_ROWS[capability][kind]


_OWN: dict = {}  # "ok" → whether attnlab's kernels are built, registered and right (once per process)
_OWN_LOCK = threading.Lock()  # two serving engines' threads may ask first at once: one builds


def own_kernels() -> bool:
    """Whether the eager int8 and int4 products of a few rows are attnlab's own AVX2 kernels
    (``csrc/quant_matvec.cpp``): on an x86 CPU with AVX2, FMA and F16C (AVX-512 ones included: there too
    they beat PyTorch's kernels, which take bf16 activations), not ``ATTNLAB_OWN_KERNELS=0`` (nor
    ``ATTNLAB_QUANT_KERNELS=0``), and where they build and agree with the exact product (tried once per
    process; a failure is one debug line, and PyTorch's kernels)."""
    if _env_off("ATTNLAB_OWN_KERNELS") or _env_off("ATTNLAB_QUANT_KERNELS"):
        _once("own-off", "attnlab's AVX2 int8/int4 kernels off (ATTNLAB_OWN_KERNELS=0 or ATTNLAB_QUANT_KERNELS=0)")
        return False
    if not _x86():
        return False
    return built_once(_OWN, _OWN_LOCK, _build_own_kernels)


def own_kernels_in_compiled_step() -> bool:
    """Whether a compiled step's quantised products are attnlab's kernels: where :func:`own_kernels` and
    PyTorch's CPU capability is AVX2. On AVX-512 inductor's own GEMM template for the frozen weights is
    faster in the step (docs/results.md); ``ATTNLAB_OWN_KERNELS=1`` takes attnlab's there too."""
    return ((torch.backends.cpu.get_cpu_capability() == "AVX2" or _env_on("ATTNLAB_OWN_KERNELS"))
            and own_kernels())


def _build_own_kernels() -> bool:
    """Build (or load from torch's extension cache) and register ``attnlab::int8_matvec`` and
    ``attnlab::int4_matvec``, register their shape functions for tracing, and check both against the
    exact product on awkward shapes (inputs that are no multiple of 16 or of a group)."""
    from . import accel
    if not {"avx2", "fma", "f16c"} <= accel.cpu_flags():
        _once("own-isa", "attnlab's quantised kernels need AVX2, FMA and F16C: not on this CPU")
        return False
    try:
        loaded = hasattr(torch.ops.attnlab, "int4_matvec")
        why_not = accel.build_torch_ops("attnlab_quant_matvec", "quant_matvec.cpp", ["-mavx2", "-mfma", "-mf16c"],
                                        "int4_matvec")
        if why_not:
            _once("own-tools", f"attnlab's quantised kernels: {why_not}; PyTorch's kernels instead")
            return False
        if not loaded:
            @torch.library.register_fake("attnlab::int8_matvec")
            def _(x, w, scales):  # (M, K), (N, K), (N,) → (M, N)
                return x.new_empty(x.shape[0], w.shape[0])

            @torch.library.register_fake("attnlab::int4_matvec")
            def _(x, w, scales, mins):  # (M, K), (N, Kp/2), (N, Kp/32), (N, Kp/32) → (M, N)
                return x.new_empty(x.shape[0], w.shape[0])
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(3, 77, generator=g), torch.randint(-127, 128, (40, 77), dtype=torch.int8, generator=g)
        scales = torch.rand(40, generator=g)
        ref = F.linear(x.double(), w.double()) * scales.double()
        err = (torch.ops.attnlab.int8_matvec(x, w, scales).double() - ref).abs()
        ok = bool((err <= int16_rounding_bound(x, w, scales) + 1e-5 * ref.abs()).all())
        lin = nn.Linear(77, 40, bias=False)
        with torch.no_grad():
            lin.weight.normal_(generator=g)
        layer = Int4Linear.from_linear(lin, 32)
        t = layer._own_tensors()
        scaled, rest = (p[:, :77] for p in own_int4_parts(t["kernel_weight"], t["kernel_scales"], t["kernel_mins"]))
        err = (layer._own_product(x, **t).double() - F.linear(x.double(), scaled + rest)).abs()
        ok = ok and bool((err <= int4_kernel_error_bound(x, scaled, rest)).all())
        if not ok:
            _once("own-wrong", "attnlab's quantised kernels give wrong results here: PyTorch's kernels instead")
        return ok
    except Exception as e:  # a compiler that cannot build it, a failed load: PyTorch's kernels serve
        _once("own-build", f"attnlab's quantised kernels did not build ({str(e).strip().splitlines()[:2]}): "
              "PyTorch's kernels instead")
        return False


def own_int4_parts(weight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor):
    """``attnlab::int4_matvec``'s layout (csrc/quant_matvec.cpp) as two (N, Kp) float64 matrices,
    ``q · scale`` and ``min``: their sum is the weight the kernel multiplies by (its oracle)."""
    N = weight.shape[0]
    b = weight.view(N, -1, 1, 32).int()  # (N, Kp/64, 1, 32): byte i of 64 inputs holds inputs i and 32 + i
    q = torch.cat([b & 15, b >> 4], dim=2).reshape(N, -1).double()  # (N, Kp)
    return q * scales.double().repeat_interleave(32, dim=1), mins.double().repeat_interleave(32, dim=1)


def int4_kernel_error_bound(x: torch.Tensor, scaled: torch.Tensor, rest: torch.Tensor | None = None) -> torch.Tensor:
    """How far ``attnlab::int4_matvec`` may be from the exact product ``x @ (scaled + rest)ᵀ`` (M, N): the
    int8 rounding of the activations, half a step of each 16 inputs' grid (max |x| / 254), on the weight
    they meet (``scaled + rest``: the minimums meet the rounded sums), and fp32's rounding (1e-5) of every
    product's size, cancellations included."""
    M, K = x.shape
    Kp = -(-K // 16) * 16
    blocks = F.pad(x.abs().double(), (0, Kp - K)).view(M, -1, 16)  # (M, Kp/16, 16)
    step = (blocks.amax(dim=2, keepdim=True) / 254).expand_as(blocks).reshape(M, Kp)[:, :K]  # (M, K)
    size = x.abs().double() @ (scaled.abs() + (0 if rest is None else rest.abs())).t()
    return step @ (scaled + (0 if rest is None else rest)).abs().t() + 1e-5 * size


def int16_rounding_bound(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """How far ``attnlab::int8_matvec`` may be from the exact product (M, N) (``int4_matvec``:
    :func:`int4_kernel_error_bound`): each activation moves by at most half a step of its row's int16 grid
    (max |x| / 65534), each product by that times |w|·scale."""
    step = x.abs().double().amax(dim=1, keepdim=True) / 65534  # (M, 1)
    return step * (w.abs().double().sum(dim=1) * scales.abs().double())  # (M, N)


def check_kind(kind) -> str | None:
    """``None`` (no quantisation) or one of KINDS; anything else is a ValueError naming the choices."""
    if kind is None or kind in KINDS:
        return kind
    raise ValueError(f"quantize={kind!r}: expected one of {', '.join(KINDS)} (or None for no quantisation)")


# -- which kernel runs ----------------------------------------------------------------------------------


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activation dtype the CPU kernels get for activations of ``dtype``: bf16 on x86 (their only
    vectorised path there), the dtype itself elsewhere."""
    return torch.bfloat16 if _x86() else dtype


_probed: dict = {}


def quant_kernels_ok(kind: str, dtype: torch.dtype) -> bool:
    """Whether the ``kind`` kernel may run with ``dtype`` activations on this CPU (probed once per
    process; ``ATTNLAB_QUANT_KERNELS=0`` says no). One dict look-up per call once known."""
    key = (kind, dtype, os.environ.get("ATTNLAB_QUANT_KERNELS"))
    ok = _probed.get(key)
    if ok is None:
        if _env_off("ATTNLAB_QUANT_KERNELS"):
            _once("quant-off", "quantised linears: kernels off (ATTNLAB_QUANT_KERNELS=0): dequantise + F.linear")
            ok = False
        else:
            ok = _probe(kind, dtype)
        _probed[key] = ok
    return ok


def _probe(kind: str, dtype: torch.dtype) -> bool:
    """A (3 × 64) @ (64 × 32) product through the kernel against the eager path in fp32."""
    try:
        g = torch.Generator().manual_seed(0)
        lin = nn.Linear(64, 32, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(32, 64, generator=g))
        layer = Int8Linear.from_linear(lin) if kind == "int8" else Int4Linear.from_linear(lin, 32)
        x = torch.randn(3, 64, generator=g).to(dtype)
        out = layer._kernel(x).float()
        ref = layer._eager(x.float())
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        ok = bool(torch.allclose(out, ref, atol=tol * ref.abs().max().item(), rtol=tol))
        if not ok:
            _once(f"quant-probe-{kind}-{dtype}", f"the {kind} kernel gives wrong {dtype} results here: dequantise + F.linear")
        return ok
    except (RuntimeError, TypeError, NotImplementedError, AttributeError) as e:  # AttributeError: no such op
        _once(f"quant-probe-{kind}-{dtype}",
              f"no {kind} {dtype} kernel here ({str(e).splitlines()[0] if str(e) else type(e).__name__}): "
              "dequantise + F.linear")
        return False


# -- the layers -----------------------------------------------------------------------------------------------


class _QuantLinear(nn.Module):
    """What both layers share: the bias, the choice of path, and a cache of kernel-ready tensors."""

    kind = ""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self._derived: dict = {}  # key → (stamp of the buffers it came from, tensor)
        self.compile_dtype: torch.dtype | None = None  # set by prepare_for_compile: the kernel runs traced
        self.own_kernel = False  # set by prepare_for_compile: the traced kernel is attnlab's own

    def prepare_for_compile(self, dtype: torch.dtype) -> None:
        """Before ``torch.compile`` traces this layer with ``dtype`` activations: register the kernel's
        tensors as (non-persistent) buffers — traced code cannot use the data-pointer cache — or, where
        no kernel may run, let the eager path be traced."""
        on_cpu = self._portable()[0].device.type == "cpu"
        own = self._own_tensors() if on_cpu and own_kernels_in_compiled_step() else None
        self.own_kernel = own is not None
        if own is not None:  # attnlab's kernels take fp32 activations and any shape (see the module docstring)
            self.compile_dtype, tensors = torch.float32, own
        else:
            self.compile_dtype = self._kernel_dtype_for(dtype) if on_cpu and self.kernel_shape_ok else None
            tensors = {} if self.compile_dtype is None else self._kernel_tensors(self.compile_dtype)
        for name, t in tensors.items():
            self.register_buffer(name, t, persistent=False)

    def _portable(self) -> list[torch.Tensor]:
        """The buffers that define the layer (what a state dict holds)."""
        return [t for n, t in self._buffers.items() if n not in self._non_persistent_buffers_set]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._eager(x) if self.compile_dtype is None else self._compiled(x)
        out_dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
        if self._own_may_run(x):
            tensors = self._cached("own", self._own_tensors)
            if tensors is not None:
                out = self._own_product(x.reshape(-1, self.in_features).float(), **tensors)  # (M, N)
                return self._add_bias(out.reshape(*x.shape[:-1], self.out_features).to(out_dtype))
        dtype = self._kernel_dtype(x)
        if dtype is None:
            return self._eager(x)
        return self._kernel(x.to(dtype)).to(out_dtype)

    def _own_may_run(self, x: torch.Tensor) -> bool:
        """Whether attnlab's own kernel may take ``x`` (eager): a few rows on the CPU, no gradient."""
        return (x.device.type == "cpu" and 0 < x.numel() and x.numel() // x.shape[-1] <= own_kernel_max_rows(self.kind)
                and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and not (torch.is_grad_enabled() and x.requires_grad) and own_kernels())

    def _kernel_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """The dtype to run the kernel in, or None for the eager path."""
        if not self.kernel_shape_ok or x.device.type != "cpu" or x.numel() == 0:
            return None
        if x.numel() // x.shape[-1] > KERNEL_MAX_ROWS[self.kind] or (torch.is_grad_enabled() and x.requires_grad):
            return None
        return self._kernel_dtype_for(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype)

    def _kernel_dtype_for(self, dtype: torch.dtype) -> torch.dtype | None:
        """The kernel's activation dtype for ``dtype`` activations, or None where it may not run."""
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return None
        dtype = kernel_dtype(dtype)
        return dtype if quant_kernels_ok(self.kind, dtype) else None

    def _compiled(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel as torch.compile traces it: on the buffers ``prepare_for_compile`` registered."""
        x2 = x.reshape(-1, self.in_features).to(self.compile_dtype)  # (M, K)
        if self.own_kernel:
            out = self._own_product(x2, self.kernel_weight, self.kernel_scales, getattr(self, "kernel_mins", None))
        else:
            out = self._product(x2, self.kernel_weight, self.kernel_scales)  # (M, N)
        return self._add_bias(out.reshape(*x.shape[:-1], self.out_features).to(x.dtype))

    def _add_bias(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def _cached(self, key, make):
        """A tensor derived from the buffers (a dtype copy, a packed layout), made once and made again
        whenever a buffer changes (``.to()``, ``load_state_dict``: new storage or a new version)."""
        try:
            stamp = tuple((t.data_ptr(), t._version, t.dtype) for t in self._portable())
        except RuntimeError:  # inference-mode tensors have no version counter: no cache
            return make()
        hit = self._derived.get(key)
        if hit is None or hit[0] != stamp:
            hit = self._derived[key] = (stamp, make())
        return hit[1]


class Int8Linear(_QuantLinear):
    """``y = x Wᵀ + b`` with W stored as int8 and one scale per output channel: ``W ≈ weight_int8 ·
    scales[:, None]``. Buffers: ``weight_int8`` (N, K) int8, ``scales`` (N,) in the model's float dtype."""

    kind = "int8"

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__(in_features, out_features, bias)
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8))  # (N, K)
        self.register_buffer("scales", torch.ones(out_features, dtype=dtype))  # (N,)
        self.kernel_shape_ok = in_features % 16 == 0  # the kernel reads 16 inputs per aligned load

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        w = linear.weight.detach().float()  # (N, K)
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # (N,): the row's largest weight → ±127
        layer = cls(linear.in_features, linear.out_features, linear.bias, linear.weight.dtype).to(w.device)
        layer.weight_int8.copy_(torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        layer.scales.copy_(scales.to(linear.weight.dtype))
        return layer

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight (N, K) these int8 values and scales stand for."""
        return self.weight_int8.to(dtype) * self.scales.to(dtype)[:, None]

    def _eager(self, x: torch.Tensor) -> torch.Tensor:
        # x Wᵀ = (x qᵀ) · scales: the scales apply to the (…, N) output, cheaper than scaling the (N, K)
        # weight; int8 values are exact in bf16 and fp16, so the cast loses nothing.
        out = F.linear(x, self.weight_int8.to(x.dtype))  # (…, N); autocast may make it bf16
        return self._add_bias(out * self.scales.to(out.dtype))

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # (M, K): the kernel takes 2-D inputs
        if not x2.is_contiguous() or x2.data_ptr() % 32:  # e.g. a view into the middle of a tensor
            x2 = x2.clone(memory_format=torch.contiguous_format)  # new storage: dense, 64-byte aligned
        scales = self.scales if self.scales.dtype == x.dtype else self._cached(("scales", x.dtype),
                                                                                lambda: self.scales.to(x.dtype))
        out = self._product(x2, self._aligned_weight(), scales)  # (M, N)
        return self._add_bias(out.reshape(*x.shape[:-1], self.out_features))

    def _aligned_weight(self) -> torch.Tensor:
        """weight_int8 (N, K), whose rows the kernel reads with aligned loads too (e.g. not from an mmap)."""
        w = self.weight_int8
        if w.data_ptr() % 32 or not w.is_contiguous():
            w = self._cached("aligned", lambda: self.weight_int8.clone(memory_format=torch.contiguous_format))
        return w

    def _kernel_tensors(self, dtype):
        return {"kernel_weight": self._aligned_weight(), "kernel_scales": self.scales.to(dtype)}

    def _product(self, x2, weight, scales):
        return torch.ops.aten._weight_int8pack_mm(x2, weight, scales)

    def _own_tensors(self) -> dict:
        return {"kernel_weight": self.weight_int8.contiguous(), "kernel_scales": self.scales.float()}

    def _own_product(self, x2, kernel_weight, kernel_scales, kernel_mins=None):
        return torch.ops.attnlab.int8_matvec(x2, kernel_weight, kernel_scales)


class Int4Linear(_QuantLinear):
    """``y = x Wᵀ + b`` with W stored as 4-bit values, a scale and a zero per group of ``group_size`` inputs
    (the min-max grid, or the symmetric one with zero 0: see ``from_linear``):
    ``W[n, k] ≈ (q[n, k] - 8) · scale[g, n] + zero[g, n]``, ``g = k // group_size``.

    Buffers: ``weight_int4`` (N, Kp/2) uint8, two values per byte (input 2j in the low nibble, 2j+1 in
    the high one); ``scales_and_zeros`` (Kp/group_size, N, 2) float, [..., 0] the scale and [..., 1]
    the zero, the layout ``_weight_int4pack_mm_for_cpu`` takes. Kp is K rounded up to whole groups
    (the padding weights are 0)."""

    kind = "int4"

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None = None,
                 group_size: int = 32, dtype: torch.dtype = torch.float32):
        super().__init__(in_features, out_features, bias)
        if group_size < 2 or group_size % 2:
            raise ValueError(f"group_size={group_size}: must be an even number >= 2 (32 is usual)")
        self.group_size = group_size
        groups = -(-in_features // group_size)
        self.register_buffer("weight_int4", torch.zeros(out_features, groups * group_size // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros", torch.zeros(groups, out_features, 2, dtype=dtype))
        self.kernel_shape_ok = (out_features % 16 == 0 and in_features % group_size == 0
                                and group_size in INT4_KERNEL_GROUP_SIZES)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group_size={self.group_size}"

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, group_size: int = 32) -> "Int4Linear":
        layer = cls(linear.in_features, linear.out_features, linear.bias, group_size, linear.weight.dtype)
        layer = layer.to(linear.weight.device)
        w = linear.weight.detach().float()  # (N, K)
        N, K = w.shape
        w = F.pad(w, (0, layer.weight_int4.shape[1] * 2 - K))  # (N, Kp): whole groups
        g = w.view(N, -1, group_size)  # (N, G, gs)
        # Two grids per group, and the one whose largest error is smaller (the min-max one on a tie):
        # min-max, 16 levels from the group's min to its max (llama.cpp's Q4_1 rule), and symmetric,
        # (q - 8)·d with d = −(the value of largest magnitude)/8 (its Q4_0 rule). Weights dequantised from a
        # GGUF's Q4_1 or Q4_0 blocks thus come back exactly (not quantised twice), and no group is worse
        # than on the min-max grid alone.
        lo, hi = g.amin(-1), g.amax(-1)  # (N, G)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)  # (N, G, gs)
        zero = lo + 8 * scale  # the kernel computes (q - 8)·scale + zero; q = 0 ↔ lo
        err = ((q - 8) * scale[..., None] + zero[..., None] - g).abs().amax(-1)  # (N, G)
        extreme = torch.where(-lo > hi, lo, hi)  # the value of largest magnitude (signed)
        d = extreme / -8
        q_sym = torch.round(g / torch.where(d == 0, 1.0, d)[..., None]).add_(8).clamp_(0, 15)
        err_sym = ((q_sym - 8) * d[..., None] - g).abs().amax(-1)
        sym = err_sym < err
        q = torch.where(sym[..., None], q_sym, q).to(torch.uint8).view(N, -1)
        scale, zero = torch.where(sym, d, scale), torch.where(sym, 0.0, zero)
        layer.set_int4(q, scale.t(), zero.t())
        return layer

    @torch.no_grad()
    def set_int4(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """Fill the layer from 4-bit values ``q`` (N, Kp) in 0…15 and per-group ``scale``, ``zero``
        (G, N), meaning ``W ≈ (q - 8) · scale + zero`` (also how a GGUF Q4_1 block is brought in)."""
        self.weight_int4.copy_(q[:, 0::2] | (q[:, 1::2] << 4))
        self.scales_and_zeros.copy_(torch.stack([scale, zero], dim=-1))

    def unpacked(self) -> torch.Tensor:
        """The 4-bit values as (N, Kp) uint8 in 0…15."""
        p = self.weight_int4
        return torch.stack([p & 15, p >> 4], dim=-1).view(p.shape[0], -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight (N, K) these values, scales and zeros stand for."""
        N, gs = self.out_features, self.group_size
        scale, zero = self.scales_and_zeros.to(dtype).unbind(-1)  # (G, N) each
        q = self.unpacked().view(N, -1, gs).to(dtype)  # (N, G, gs)
        w = (q - 8) * scale.t()[..., None] + zero.t()[..., None]
        return w.view(N, -1)[:, : self.in_features]

    def _eager(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).contiguous()  # (M, K)
        packed = self._packed()
        sz = self.scales_and_zeros
        if sz.dtype != x.dtype:
            sz = self._cached(("sz", x.dtype), lambda: self.scales_and_zeros.to(x.dtype))
        out = self._product(x2, packed, sz)  # (M, N)
        return self._add_bias(out.reshape(*x.shape[:-1], self.out_features))

    def _packed(self) -> torch.Tensor:
        """The kernel's own blocked layout, (N, K/2) uint8 (made once; the compiled step shares it)."""
        return self._cached("packed", lambda: torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            self.unpacked().to(torch.int32), 1))

    def _kernel_tensors(self, dtype):
        return {"kernel_weight": self._packed(), "kernel_scales": self.scales_and_zeros.to(dtype)}

    def _product(self, x2, weight, scales_and_zeros):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, weight, self.group_size, scales_and_zeros)

    def _own_tensors(self) -> dict | None:
        """attnlab::int4_matvec's layout (csrc/quant_matvec.cpp): per 64 inputs 32 bytes, byte i holding
        input i (low nibble) and input 32 + i (high), an fp16 scale and minimum per 32 inputs,
        ``W = q · scale + min``. None where that kernel cannot take this layer: groups that are no multiple
        of 32, or a scale or minimum beyond fp16's range."""
        if self.group_size % 32:
            return None
        N, K = self.out_features, self.in_features
        Kp = -(-K // 64) * 64
        q = F.pad(self.unpacked()[:, :K], (0, Kp - K)).view(N, -1, 2, 32)  # (N, Kp/64, 2, 32)
        weight = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(N, Kp // 2)
        scale, zero = self.scales_and_zeros.float().unbind(-1)  # (G, N) each
        per32 = lambda t: F.pad(t.t().repeat_interleave(self.group_size // 32, dim=1)[:, : -(-K // 32)],
                                (0, Kp // 32 - -(-K // 32)))  # (N, Kp/32): padding 0
        scales, mins = per32(scale).half(), per32(zero - 8 * scale).half()  # W = q·scale + min
        if not (scales.isfinite().all() and mins.isfinite().all()):
            return None
        return {"kernel_weight": weight.contiguous(), "kernel_scales": scales.contiguous(), "kernel_mins": mins.contiguous()}

    def _own_product(self, x2, kernel_weight, kernel_scales, kernel_mins):
        return torch.ops.attnlab.int4_matvec(x2, kernel_weight, kernel_scales, kernel_mins)


# -- the model ------------------------------------------------------------------------------------------------


@torch.no_grad()
def quantize_model(model: nn.Module, kind: str = "int8", group_size: int = 32, head: str | None = None) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (``accel.PackedLinear`` included) by an
    :class:`Int8Linear` or :class:`Int4Linear` (``group_size`` inputs per int4 scale), in place;
    returns ``model``. ``head`` is the kind of the output projection (``model.lm_head``); by default
    int8 for both kinds (see the module docstring), ``head="int4"`` for an all-int4 model.

    For inference: the quantised layers have no trainable weight. The scales take the dtype of the
    weights they come from; ``model.to(torch.bfloat16)`` afterwards converts them (and every float
    parameter) while the integer weights stay as they are."""
    if check_kind(kind) is None:
        return model
    head_module = getattr(model, "lm_head", None)
    done: dict[int, nn.Module] = {}  # a Linear reachable by two names stays one (shared) layer
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):  # every name (named_children skips repeats)
            if isinstance(child, nn.Linear):
                if id(child) not in done:
                    k = (check_kind(head) or "int8") if child is head_module else kind
                    done[id(child)] = (Int8Linear.from_linear(child) if k == "int8"
                                       else Int4Linear.from_linear(child, group_size))
                setattr(parent, name, done[id(child)])
    return model


def prepare_for_compile(model: nn.Module, dtype: torch.dtype) -> bool:
    """Ready every quantised layer of ``model`` to be traced by ``torch.compile`` with ``dtype``
    activations (see the module docstring); whether any of them will trace a kernel."""
    layers = [m for m in model.modules() if isinstance(m, _QuantLinear)]
    for layer in layers:
        layer.prepare_for_compile(dtype)
    return any(layer.compile_dtype is not None for layer in layers)


def warm_own_kernels(model: nn.Module) -> bool:
    """Build attnlab's kernels (15-30 s the first time on a machine) and every quantised layer's tensors
    for them now: a server calls this as a model loads, so that no request waits for either. Returns
    whether they serve ``model`` (quantised, on the CPU, where :func:`own_kernels`)."""
    layers = [m for m in model.modules() if isinstance(m, _QuantLinear)]
    if not layers or layers[0]._portable()[0].device.type != "cpu" or not own_kernels():
        return False
    for layer in layers:
        layer._cached("own", layer._own_tensors)
    return True


def uses_own_kernel(model: nn.Module) -> bool:
    """Whether :func:`prepare_for_compile` gave any layer of ``model`` attnlab's own kernel."""
    return any(m.own_kernel for m in model.modules() if isinstance(m, _QuantLinear))


def quantized_kind(model: nn.Module) -> str | None:
    """"int8", "int4", "int8+int4" or None: what :func:`quantize_model` made of ``model``."""
    kinds = sorted({m.kind for m in model.modules() if isinstance(m, _QuantLinear)}, reverse=True)
    return "+".join(kinds) or None


__all__ = ["quantize_model", "quantized_kind", "prepare_for_compile", "uses_own_kernel", "own_kernels",
           "warm_own_kernels", "own_kernel_max_rows", "Int8Linear", "Int4Linear", "quant_kernels_ok", "kernel_dtype",
           "check_kind", "KINDS"]
