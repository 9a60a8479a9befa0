"""The pre-packed CPU inference path (accel.PackedLinear) against F.linear (the oracle)."""

import os

import pytest
import torch
import torch.nn.functional as F

from attnlab import accel as linear_mod
from attnlab.accel import PackedLinear as Linear

pytestmark = pytest.mark.skipif(not linear_mod.onednn_linear_ops(), reason="oneDNN not in this PyTorch build")


@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (2, 5, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_equals_f_linear(shape, bias):
    torch.manual_seed(0)
    lin = Linear(48, 80, bias=bias)
    if bias:
        torch.nn.init.normal_(lin.bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        out = lin(x)
        # the packed path was taken where this CPU (and the switches) allow it, F.linear otherwise
        assert (linear_mod._packed.get(lin) is not None) == linear_mod.packed_linear_ok(torch.float32)
        torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
        lin_bf16, xb = lin.to(torch.bfloat16), x.bfloat16()  # packed where this CPU can, F.linear otherwise
        torch.testing.assert_close(lin_bf16(xb).float(), F.linear(xb, lin_bf16.weight, lin_bf16.bias).float(),
                                   atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("optimizer", ["fused AdamW", "attnlab's make_adamw"])
def test_packed_weight_follows_fused_optimizer_steps(optimizer):
    """PyTorch's fused AdamW writes the weights without bumping their version counter: the pack must not
    outlive the step (a training forward drops it; the trainer's make_adamw bumps the versions itself),
    or an evaluation after training reads the weights of before it."""
    from attnlab.train.trainer import make_adamw
    torch.manual_seed(0)
    lin = Linear(16, 8)
    x = torch.randn(3, 16)
    opt = (torch.optim.AdamW(lin.parameters(), lr=0.1, fused=True) if optimizer == "fused AdamW"
           else make_adamw(lin.parameters(), lr=0.1))
    for _ in range(2):
        with torch.no_grad():
            lin(x)  # packs (where this CPU can)
        version = lin.weight._version
        lin(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        if optimizer != "fused AdamW":
            assert lin.weight._version > version
        with torch.no_grad():
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)


def test_packed_weight_follows_in_place_updates():
    torch.manual_seed(0)
    lin = Linear(16, 8)
    x = torch.randn(3, 16)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    with torch.no_grad():
        before = lin(x)
    lin(x).square().sum().backward()  # grad enabled: the plain path, gradients flow
    assert lin.weight.grad is not None
    opt.step()  # in-place update: the packed copy must be renewed
    with torch.no_grad():
        after = lin(x)
        assert not torch.allclose(before, after)
        torch.testing.assert_close(after, F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
        lin.weight.copy_(torch.zeros_like(lin.weight))
        torch.testing.assert_close(lin(x), lin.bias.expand(3, 8))


def test_autocast_still_chooses_the_dtype():
    lin = Linear(16, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin(torch.randn(2, 16)).dtype == torch.bfloat16


def test_model_logits_with_and_without_packing(monkeypatch):
    from attnlab.config import get_preset
    from attnlab.model import build_model
    torch.manual_seed(0)
    model = build_model(get_preset("llama-mini", vocab_size=300, n_decoder_layers=2)).eval()
    assert not any(isinstance(m, Linear) for m in model.modules())  # the model files are plain nn.Linear
    linear_mod.accelerate_for_inference(model)
    assert sum(isinstance(m, Linear) for m in model.modules()) >= 2 * 4 + 1
    ids = torch.randint(0, 300, (2, 9))
    with torch.no_grad():
        packed = model(ids)
        assert any(linear_mod._packed.get(m) is not None for m in model.modules()) == \
            linear_mod.packed_linear_ok(torch.float32)
        monkeypatch.setattr(linear_mod, "PACKED", False)
        plain = model(ids)
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)


def test_dtype_round_trip_never_reuses_a_stale_pack():
    torch.manual_seed(0)
    lin = Linear(32, 32)
    x = torch.randn(4, 32)
    with torch.no_grad():
        lin(x)
        for _ in range(3):  # fp32 → bf16 → fp32 without a call in between: the weights were rounded
            lin.to(torch.bfloat16).to(torch.float32)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)


# -- capabilities: the same results on a CPU that cannot pack (AVX2-only for bf16) ------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fallback_path_when_the_cpu_cannot_pack(monkeypatch, dtype):
    """ATTNLAB_NO_BF16 stands in for an AVX2-only CPU (bf16 packing raises there); ATTNLAB_PACKED_LINEAR=0
    for any CPU. Both give F.linear's results, with no packed weight made."""
    from attnlab import accel
    if dtype == torch.bfloat16:
        monkeypatch.setenv("ATTNLAB_NO_BF16", "1")
    else:
        monkeypatch.setenv("ATTNLAB_PACKED_LINEAR", "0")
    assert not accel.packed_linear_ok(dtype)
    lin = Linear(48, 80).to(dtype)
    x = torch.randn(5, 48).to(dtype)
    with torch.no_grad():
        out = lin(x)
    assert linear_mod._packed.get(lin) is None
    torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias))


def test_probe_failure_means_plain_path(monkeypatch):
    """A oneDNN that raises (as on AVX2 for bf16) is found by the probe, never at the user's call."""
    from attnlab import accel

    def refuse(*a, **k):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw")
    monkeypatch.setattr(accel, "_packed_probe", {})
    monkeypatch.setattr(accel, "_packed_ok", {})
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse, raising=False)
    assert accel._probe_packed(torch.bfloat16) is False
    assert accel.packed_linear_ok(torch.bfloat16) is False
    lin = Linear(16, 8).to(torch.bfloat16)
    with torch.no_grad():
        x = torch.randn(2, 16, dtype=torch.bfloat16)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))


def test_bf16_resolves_to_fp32_where_not_native(monkeypatch):
    from attnlab import accel
    said = []
    monkeypatch.setenv("ATTNLAB_NO_BF16", "1")
    assert accel.resolve_bf16(True, "cpu", said.append) is False
    assert len(said) == 1 and "running in fp32" in said[0]
    assert accel.resolve_bf16(False, "cpu", said.append) is False and len(said) == 1
    monkeypatch.delenv("ATTNLAB_NO_BF16")
    assert accel.resolve_bf16(True, "cpu", said.append) is accel.cpu_bf16_native()


def test_bf16_on_a_gpu_that_only_emulates_it_is_not_native(monkeypatch):
    """PyTorch's ``is_bf16_supported()`` says yes on pre-Ampere GPUs (V100, T4) by counting its emulation; that is
    the several-times-slower bf16 ``--bf16`` refuses, so a GPU counts as native only without the emulation."""
    import torch
    from attnlab import accel
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)  # a T4
    said = []
    assert accel.bf16_native("cuda") is False
    assert accel.resolve_bf16(True, "cuda", said.append) is False and "running in fp32" in said[0]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # an A100
    assert accel.bf16_native("cuda") is True


def test_the_avx2_cap_is_named_and_really_caps_the_kernels():
    """``--as-avx2`` (``accel.AVX2_ENVIRONMENT``): a child Python with those variables reports the capped
    ISA, no native bf16, and PyTorch's own dispatch at AVX2 — and packed linears still equal F.linear."""
    import json
    import os
    import subprocess
    import sys

    from attnlab import accel
    code = ("import json, torch, torch.nn.functional as F; from attnlab import accel; "
            "l = accel.PackedLinear(64, 32); x = torch.randn(3, 64); "
            "print(json.dumps([accel.cpu_isa(), accel.cpu_bf16_native(), torch.backends.cpu.get_cpu_capability(), "
            "(l(x) - F.linear(x, l.weight, l.bias)).abs().max().item()]))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **accel.AVX2_ENVIRONMENT},
                         capture_output=True, text=True, timeout=120)
    isa, bf16, capability, diff = json.loads(out.stdout.strip().splitlines()[-1])
    assert isa.startswith("AVX2") and bf16 is False and diff < 1e-5
    if "avx2" in accel.cpu_flags():
        assert capability == "AVX2"
    if accel.cpu_isa() != "AVX2":  # a wider CPU says what it was capped from
        assert "capped on" in isa


# -- training: oneDNN's fp32 GEMM (accel.OneDNNLinear) against F.linear in float64 ----------------------


def _float64_reference(x, w, b, dy, wanted):
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if b is not None else None
    y = F.linear(x64, w64, b64)
    grads = torch.autograd.grad(y, [{"x": x64, "w": w64, "b": b64}[k] for k in wanted], dy.double())
    return y, grads


def _own_kernels_build() -> bool:
    import platform
    import shutil
    return platform.system() == "Linux" and bool(shutil.which("g++") or shutil.which("c++"))


def _kernel_linear(onednn_weight_grad):
    if not _own_kernels_build():
        pytest.skip("attnlab's own kernels are built on Linux with a C++ compiler")
    from unittest import mock
    with mock.patch.dict(os.environ, {"ATTNLAB_OWN_KERNELS": "1"}):  # (CI runs this file with the switch off too)
        assert linear_mod.linear_kernel_serves()  # (built, and right on its own check)
    return lambda x, w, b: torch.ops.attnlab.onednn_linear(x, w, b, onednn_weight_grad)


# the three implementations of the fp32 training linear on oneDNN: the Python autograd.Function (where attnlab's
# kernel does not build), the C++ one of csrc/linear.cpp with the weight gradient on oneDNN (the default) or on MKL
IMPLEMENTATIONS = {"python": lambda: linear_mod.OneDNNLinear.apply, "kernel": lambda: _kernel_linear(True),
                   "kernel, MKL weight gradient": lambda: _kernel_linear(False)}


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("features", [(40, 48), (48, 40)])  # (out, in): dy or x is the narrower, turned
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layout", ["2d", "3d", "strided", "broadcast grad"])
@pytest.mark.parametrize("wanted", ["xwb", "x", "w", "xb"])
def test_onednn_training_linear_equals_float64(impl, features, bias, layout, wanted):
    """Forward and the wanted gradients of the oneDNN training linear, for 2-D, 3-D and non-contiguous inputs and a
    stride-0 upstream gradient (``y.sum()``), with frozen weights or inputs, against F.linear in float64
    (run wherever oneDNN's linear op exists, whichever path this CPU picks)."""
    fn = IMPLEMENTATIONS[impl]()
    wanted = [k for k in wanted if k != "b" or bias]
    out_f, in_f = features
    torch.manual_seed(0)
    w = torch.randn(out_f, in_f, requires_grad="w" in wanted)
    b = torch.randn(out_f, requires_grad="b" in wanted) if bias else None
    x = {"2d": torch.randn(30, in_f), "3d": torch.randn(3, 10, in_f), "broadcast grad": torch.randn(3, 10, in_f),
         "strided": torch.randn(10, 3, in_f).transpose(0, 1)}[layout].requires_grad_("x" in wanted)
    y = fn(x, w, b)
    dy = torch.ones(()).expand_as(y) if layout == "broadcast grad" else torch.randn_like(y)
    got = torch.autograd.grad(y, [{"x": x, "w": w, "b": b}[k] for k in wanted], dy)
    ref, want = _float64_reference(x, w, b, dy, wanted)
    assert y.shape == ref.shape and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)
    for g, r, k in zip(got, want, wanted):
        assert g.shape == {"x": x, "w": w, "b": b}[k].shape
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_onednn_training_linear_second_order(impl):
    """create_graph (double backward) gives F.linear's second derivatives."""
    fn = IMPLEMENTATIONS[impl]()
    torch.manual_seed(0)
    x, w, b = torch.randn(6, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True), torch.randn(5)
    sides = []
    for f in (fn, F.linear):
        (gx,) = torch.autograd.grad((f(x, w, b) ** 2).sum(), x, create_graph=True)
        (ggw,) = torch.autograd.grad(gx.sum(), w)  # d/dw of (dL/dx): zero unless the graph was kept
        sides.append(ggw)
    assert sides[1].abs().sum() > 0
    torch.testing.assert_close(sides[0], sides[1], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_onednn_training_linear_odd_biases_and_empty_shapes(impl):
    """A bias that is a strided view or an expanded scalar (oneDNN reads a bias as contiguous: it must be copied
    first, or the output is silently wrong), and no rows, no inputs or no outputs: the output and the gradients
    F.linear gives."""
    fn = IMPLEMENTATIONS[impl]()
    torch.manual_seed(0)
    base, scalar = torch.randn(10, requires_grad=True), torch.randn(1, requires_grad=True)
    for b in (base[::2], scalar.expand(5)):
        x, w = torch.randn(4, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True)
        sides = []
        for f in (fn, F.linear):
            y = f(x, w, b)
            sides.append((y, *torch.autograd.grad((y * torch.arange(20.0).view(4, 5)).sum(), [x, w, base, scalar],
                                                  allow_unused=True, materialize_grads=True)))
        for got, want in zip(*sides):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for x_shape, w_shape in (((0, 8), (5, 8)), ((2, 0, 8), (5, 8)), ((3, 0), (5, 0)), ((3, 8), (0, 8))):
        x, w = torch.randn(x_shape, requires_grad=True), torch.randn(w_shape, requires_grad=True)
        b = torch.randn(w_shape[0], requires_grad=True)
        sides = []
        for f in (fn, F.linear):
            y = f(x, w, b)
            sides.append((y, *torch.autograd.grad(y.sum(), [x, w, b], allow_unused=True, materialize_grads=True)))
        for got, want in zip(*sides):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("shape", [(37, 45), (64, 8), (8, 64), (1, 9), (9, 1), (0, 5), (768, 128)])
def test_transpose_kernel_equals_torch_copy(shape):
    """attnlab::transposed (csrc/linear.cpp) is x.t().contiguous() exactly: odd sizes (the 8 × 8 blocks' and the
    32 × 32 tiles' edges), one row or column, no rows; rows further apart than their length (a column slice) and
    a tensor whose columns are not contiguous (copied first)."""
    _kernel_linear(True)
    torch.manual_seed(0)
    x = torch.randn(*shape)
    wide = torch.randn(shape[0], shape[1] + 7)[:, 3:3 + shape[1]]  # rows shape[1] + 7 floats apart
    for t in (x, wide, x.t().contiguous().t()):
        got = torch.ops.attnlab.transposed(t)
        assert got.is_contiguous() and torch.equal(got, t.t().contiguous())
    with pytest.raises(RuntimeError, match="2-D float32"):
        torch.ops.attnlab.transposed(x.double())


def test_linear_takes_the_kernel_where_it_serves(monkeypatch):
    """accel.linear's oneDNN products take attnlab's C++ autograd function where the kernel serves, the weight
    gradient on oneDNN (one operand turned by attnlab::transposed) unless ONEDNN_WEIGHT_GRAD is off, and the Python
    OneDNNLinear with ATTNLAB_OWN_KERNELS=0; each gives F.linear's gradients."""
    _kernel_linear(True)
    from attnlab import accel
    monkeypatch.setattr(accel, "_training_gemm_ok", {})
    monkeypatch.setattr(accel, "_decide_training_gemm", lambda: True)  # (any CPU: the choice of function is checked)
    monkeypatch.setattr(accel, "ONEDNN_TRAINING_MIN_MACS", 0)
    torch.manual_seed(0)
    x, w, b, dy = torch.randn(30, 12, requires_grad=True), torch.randn(20, 12, requires_grad=True), torch.randn(20), \
        torch.randn(30, 20)
    want = torch.autograd.grad(F.linear(x, w, b), (x, w), dy)
    for own, weight_grad, node, turns in (("1", True, "OneDNNLinearFunction", True),
                                          ("1", False, "OneDNNLinearFunction", False),
                                          ("0", True, "OneDNNLinearBackward", False)):
        monkeypatch.setenv("ATTNLAB_OWN_KERNELS", own)
        monkeypatch.setattr(accel, "ONEDNN_WEIGHT_GRAD", weight_grad)
        y = linear_mod.linear(x, w, b)
        assert node in y.grad_fn.name()
        with torch.profiler.profile() as prof:
            got = torch.autograd.grad(y, (x, w), dy)
        assert any(e.name == "attnlab::transposed" for e in prof.events()) == turns
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-5)


def test_linear_kernel_check_keeps_out_of_the_callers_autograd_state(monkeypatch):
    """The linear kernel's check (on its first use) runs autograd, on a thread of its own: asked first under no_grad
    or inside saved-tensor hooks (torch.utils.checkpoint's), it still passes, and the caller's hooks see none of its
    tensors."""
    _kernel_linear(True)
    monkeypatch.setenv("ATTNLAB_OWN_KERNELS", "1")
    packed = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t)
    for context in (torch.no_grad(), hooks):
        monkeypatch.setattr(linear_mod, "_LINEAR_KERNEL", {})  # (asked afresh: built already, checked again)
        with context:
            assert linear_mod.linear_kernel_serves()
    assert packed == []


def _path(x, w, b=None):
    fn = linear_mod.linear(x, w, b).grad_fn
    return "OneDNNLinearBackward" if fn is not None and "OneDNNLinear" in fn.name() else type(fn).__name__


def test_linear_takes_onednn_only_for_eager_fp32_training_on_amd_avx512(monkeypatch):
    """accel.linear: OneDNNLinear for an fp32 product that needs gradients where the CPU check says so
    (an AMD CPU with AVX-512); F.linear under no_grad, autocast, for bf16, with the switch off, with oneDNN
    capped below AVX-512, on another vendor, and under torch.func, forward-mode AD and jit.trace."""
    import torch.autograd.forward_ad as fwAD
    from attnlab import accel
    lin = Linear(16, 8)
    x = torch.randn(4, 16)
    # a product this small stays on F.linear (the threshold's own test is below); here every size may go
    monkeypatch.setattr(accel, "ONEDNN_TRAINING_MIN_MACS", 0)
    amd_avx512 = (accel.cpu_vendor() == "AuthenticAMD" and accel._ONEDNN_ISA_CAP == "ALL"
                  and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= accel.cpu_flags()
                  and not accel._env_off("ATTNLAB_PACKED_LINEAR"))  # (CI runs this file with the switch off too)
    assert accel.onednn_training_gemm_ok() == amd_avx512  # (the probe passes wherever the op runs)
    assert _path(x, lin.weight, lin.bias) == ("OneDNNLinearBackward" if amd_avx512 else "AddmmBackward0")
    decide = accel._decide_training_gemm
    if not amd_avx512:
        monkeypatch.setattr(accel, "_decide_training_gemm", lambda: True)  # the gate's other conditions, here too
        monkeypatch.setattr(accel, "_training_gemm_ok", {})
        assert _path(x, lin.weight, lin.bias) == "OneDNNLinearBackward"
    with torch.no_grad():
        assert linear_mod.linear(x, lin.weight, lin.bias).grad_fn is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _path(x, lin.weight, lin.bias) != "OneDNNLinearBackward"
    assert _path(x.bfloat16(), lin.weight.detach().bfloat16().requires_grad_()) != "OneDNNLinearBackward"
    assert _path(torch.randn(4, 0), torch.randn(8, 0, requires_grad=True)) == "MmBackward0"  # (no features)
    # torch.func, forward-mode AD and tracing see F.linear, and get its results
    g = torch.func.grad(lambda w: linear_mod.linear(x, w).sum())(lin.weight.detach())
    torch.testing.assert_close(g, x.sum(0).expand(8, 16))
    tangent = torch.randn(4, 16)
    with fwAD.dual_level():
        out = linear_mod.linear(fwAD.make_dual(x, tangent), lin.weight, lin.bias)
        torch.testing.assert_close(fwAD.unpack_dual(out).tangent, F.linear(tangent, lin.weight.detach()))
    traced = torch.jit.trace(accel.accelerate_for_training(torch.nn.Sequential(torch.nn.Linear(16, 8))), x)
    assert "PythonOp" not in str(traced.inlined_graph) and "aten::linear" in str(traced.inlined_graph)
    # the switches (the real decision again)
    monkeypatch.setattr(accel, "_decide_training_gemm", decide)
    monkeypatch.setattr(accel, "_training_gemm_ok", {})
    monkeypatch.setattr(accel, "_ONEDNN_ISA_CAP", "AVX2")
    assert not accel.onednn_training_gemm_ok() and _path(x, lin.weight, lin.bias) == "AddmmBackward0"
    monkeypatch.setattr(accel, "_ONEDNN_ISA_CAP", "ALL")
    monkeypatch.setenv("ATTNLAB_PACKED_LINEAR", "0")
    assert not accel.onednn_training_gemm_ok() and _path(x, lin.weight, lin.bias) == "AddmmBackward0"


def test_small_training_products_stay_on_f_linear(monkeypatch):
    """accel.linear sends a training product to oneDNN only from ONEDNN_TRAINING_MIN_MACS multiply-adds (rows × in
    × out): below, oneDNN's fixed cost a call outweighs its faster GEMM. Both sides give F.linear's numbers."""
    from attnlab import accel
    monkeypatch.setattr(accel, "_training_gemm_ok", {})
    monkeypatch.setattr(accel, "_decide_training_gemm", lambda: True)  # (any CPU: the size is what is checked)
    w = torch.randn(64, 128, requires_grad=True)  # 8,192 multiply-adds a row
    at = accel.ONEDNN_TRAINING_MIN_MACS // (64 * 128)  # rows at the threshold
    assert at * 64 * 128 == accel.ONEDNN_TRAINING_MIN_MACS == 1 << 23
    for rows, path in ((1, "AddmmBackward0"), (at - 1, "AddmmBackward0"), (at, "OneDNNLinearBackward"),
                       (2 * at, "OneDNNLinearBackward")):
        x = torch.randn(rows, 128, requires_grad=True)
        b = torch.randn(64)
        if path == "OneDNNLinearBackward" and not linear_mod.onednn_linear_ops():
            continue
        assert _path(x, w, b) == path, rows
        y, dy = linear_mod.linear(x, w, b), torch.randn(rows, 64)
        got = torch.autograd.grad(y, (x, w), dy)
        want = torch.autograd.grad(F.linear(x, w, b), (x, w), dy)
        torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
        for g, r in zip(got, want):
            torch.testing.assert_close(g, r, atol=1e-3, rtol=1e-4)
    x3 = torch.randn(4, at // 4, 128, requires_grad=True)  # rows counted over every leading axis
    if linear_mod.onednn_linear_ops():
        assert _path(x3, w) == "OneDNNLinearBackward"


def test_the_gemm_decision_names_the_vendor_and_the_cap(monkeypatch):
    """_decide_training_gemm: only an AMD CPU with avx512_core whose oneDNN is not capped below it."""
    from attnlab import accel
    monkeypatch.delenv("ATTNLAB_PACKED_LINEAR", raising=False)
    avx512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2"})
    for vendor, flags, cap, want in [("AuthenticAMD", avx512, "ALL", True), ("GenuineIntel", avx512, "ALL", False),
                                     ("AuthenticAMD", frozenset({"avx2"}), "ALL", False),
                                     ("AuthenticAMD", avx512, "AVX2", False), ("AuthenticAMD", avx512, "AVX512_CORE", True),
                                     ("AuthenticAMD", avx512, "AVX10_1_512", True), ("AuthenticAMD", avx512, "DEFAULT", True)]:
        monkeypatch.setattr(accel, "cpu_vendor", lambda vendor=vendor: vendor)
        monkeypatch.setattr(accel, "cpu_flags", lambda flags=flags: flags)
        monkeypatch.setattr(accel, "_ONEDNN_ISA_CAP", cap)
        assert accel._decide_training_gemm() == want, (vendor, sorted(flags), cap)


def test_training_linear_swap_and_back_to_inference():
    """accelerate_for_training makes every nn.Linear a TrainingLinear (no packs, F.linear's results under
    no_grad); accelerate_for_inference then makes it a PackedLinear; state-dict keys never change."""
    from attnlab import accel
    from attnlab.config import get_preset
    from attnlab.model import build_model
    torch.manual_seed(0)
    model = build_model(get_preset("mt-tiny", vocab_size=120, dropout=0.0)).eval()
    keys = list(model.state_dict())
    src, tgt = torch.randint(4, 120, (2, 5)), torch.randint(4, 120, (2, 4))
    with torch.no_grad():
        plain = model(src, tgt)
        accel.accelerate_for_training(model)
        assert sum(type(m) is accel.TrainingLinear for m in model.modules()) >= 8
        assert not any(type(m) is torch.nn.Linear for m in model.modules())
        torch.testing.assert_close(model(src, tgt), plain, atol=0, rtol=0)  # no_grad: F.linear itself
        assert not any(linear_mod._packed.get(m) is not None for m in model.modules())
        accel.accelerate_for_inference(model)
        assert not any(type(m) is accel.TrainingLinear for m in model.modules())
        torch.testing.assert_close(model(src, tgt), plain, atol=1e-5, rtol=1e-5)
    assert list(model.state_dict()) == keys


@pytest.mark.skipif(not linear_mod.onednn_linear_ops(), reason="oneDNN not in this PyTorch build")
def test_a_training_step_is_the_same_on_either_gemm(monkeypatch):
    """One update of a small encoder-decoder set up as the trainer does (accelerate_for_training, the fused
    loss) on oneDNN's GEMMs and on MKL's: the same loss, parameters and evaluation after it, within fp32
    rounding; the linears and the fused loss took the GEMM asked for."""
    from attnlab import accel
    from attnlab.config import get_preset
    from attnlab.model import build_model
    from attnlab.train.tasks import base
    from attnlab.train.tasks.base import output_loss
    monkeypatch.setattr(base, "FUSED_LOSS_MIN_VOCAB", 0)  # (the vocabulary of 120 on the fused loss too)
    onednn_op = torch.ops.mkldnn._linear_pointwise
    results = []
    monkeypatch.setattr(accel, "ONEDNN_TRAINING_MIN_MACS", 0)  # (the tiny model's products, on oneDNN too)
    for on in (True, False):
        monkeypatch.setattr(accel, "_training_gemm_ok", {})
        monkeypatch.setattr(accel, "_decide_training_gemm", lambda on=on: on)
        rows = []
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                            lambda x, w, *a: rows.append(w.shape[0]) or onednn_op(x, w, *a), raising=False)
        torch.manual_seed(0)
        model = accel.accelerate_for_training(build_model(get_preset("mt-tiny", vocab_size=120, dropout=0.0)).train())
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        src, tgt = torch.randint(4, 120, (3, 7)), torch.randint(4, 120, (3, 6))
        hidden = model(src, tgt, hidden_only=True)
        seen, fn = set(), [hidden.grad_fn]
        while fn:  # the graph's node types: which GEMM the linears took
            f = fn.pop()
            if f is not None and f not in seen:
                seen.add(f)
                fn.extend(n for n, _ in f.next_functions)
        assert any("OneDNNLinear" in f.name() for f in seen) == on  # (Python's OneDNNLinearBackward or C++'s node)
        loss = output_loss(model, hidden, tgt, 0, 0.1)[0]
        assert (120 in rows) == on  # the fused loss's logits: a (V=120, d) weight on oneDNN
        loss.backward()
        opt.step()
        with torch.no_grad():
            evaluated = model.eval()(src, tgt)
        results.append((loss.detach(), [p.detach().clone() for p in model.parameters()], evaluated))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[0][2], results[1][2], atol=1e-4, rtol=1e-4)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
