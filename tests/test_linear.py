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


def _float64_reference(x, w, b, dy):
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if b is not None else None
    y = F.linear(x64, w64, b64)
    grads = torch.autograd.grad(y, [t for t in (x64, w64, b64) if t is not None], dy.double())
    return y, grads


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layout", ["2d", "3d", "strided"])
def test_onednn_training_linear_equals_float64(bias, layout):
    """Forward and all three gradients of OneDNNLinear, for 2-D, 3-D and non-contiguous inputs, against
    F.linear in float64 (run wherever oneDNN's linear op exists, whichever path this CPU picks)."""
    torch.manual_seed(0)
    w = torch.randn(40, 48, requires_grad=True)
    b = torch.randn(40, requires_grad=True) if bias else None
    x = {"2d": torch.randn(30, 48), "3d": torch.randn(3, 10, 48),
         "strided": torch.randn(10, 3, 48).transpose(0, 1)}[layout].requires_grad_()
    y = linear_mod.OneDNNLinear.apply(x, w, b)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], dy)
    ref, want = _float64_reference(x, w, b, dy)
    assert y.shape == ref.shape and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)
    for g, r, t in zip(got, want, (x, w, b)):
        assert g.shape == t.shape
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-5)


def test_onednn_training_linear_second_order_and_forward_mode():
    """create_graph (double backward) and forward-mode AD give F.linear's derivatives."""
    import torch.autograd.forward_ad as fwAD
    torch.manual_seed(0)
    x, w, b = torch.randn(6, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True), torch.randn(5)
    tx, tw = torch.randn(6, 8), torch.randn(5, 8)
    sides = []
    for fn in (linear_mod.OneDNNLinear.apply, F.linear):
        (gx,) = torch.autograd.grad((fn(x, w, b) ** 2).sum(), x, create_graph=True)
        (ggw,) = torch.autograd.grad(gx.sum(), w)  # d/dw of (dL/dx): zero unless the graph was kept
        with fwAD.dual_level():
            tangent = fwAD.unpack_dual(fn(fwAD.make_dual(x.detach(), tx), fwAD.make_dual(w.detach(), tw), b)).tangent
        sides.append((ggw, tangent))
    assert sides[1][0].abs().sum() > 0
    for got, want in zip(*sides):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_linear_takes_onednn_only_for_fp32_training_where_it_is_faster(monkeypatch):
    """accel.linear: OneDNNLinear for an fp32 product that needs gradients where the CPU check says so;
    F.linear under no_grad, autocast, the switch off, oneDNN capped below AVX-512 and for bf16."""
    from attnlab import accel
    lin = Linear(16, 8)
    x = torch.randn(4, 16)

    def path():
        return type(accel.linear(x, lin.weight, lin.bias).grad_fn).__name__

    expected = "OneDNNLinearBackward" if accel.onednn_training_gemm_ok() else "AddmmBackward0"
    assert path() == expected
    if "ONEDNN_MAX_CPU_ISA" not in os.environ:  # every CPU with avx512_core takes it (the probe passes)
        assert accel.onednn_training_gemm_ok() == ({"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= accel.cpu_flags())
    with torch.no_grad():
        assert accel.linear(x, lin.weight, lin.bias).grad_fn is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert path() != "OneDNNLinearBackward"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not accel.onednn_training_gemm_ok() and path() == "AddmmBackward0"
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("ATTNLAB_PACKED_LINEAR", "0")
    assert not accel.onednn_training_gemm_ok() and path() == "AddmmBackward0"
    monkeypatch.delenv("ATTNLAB_PACKED_LINEAR")
    xb, wb = x.bfloat16(), lin.weight.detach().bfloat16().requires_grad_()
    assert type(accel.linear(xb, wb).grad_fn).__name__ != "OneDNNLinearBackward"


def test_a_training_step_is_the_same_on_either_gemm(monkeypatch):
    """One update of a small encoder-decoder set up as the trainer does (accelerate_for_training, the fused
    loss) on oneDNN's GEMMs and on MKL's: the same loss and parameters within fp32 rounding."""
    from attnlab import accel
    from attnlab.config import get_preset
    from attnlab.model import build_model
    from attnlab.train.tasks.base import output_loss
    results = []
    for on in (True, False):
        monkeypatch.setattr(accel, "_training_gemm_ok", {})
        monkeypatch.setattr(accel, "_decide_training_gemm", lambda on=on: on)
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
        assert any(type(f).__name__ == "OneDNNLinearBackward" for f in seen) == on
        loss = output_loss(model, hidden, tgt, 0, 0.1)[0]
        loss.backward()
        opt.step()
        results.append((loss.detach(), [p.detach().clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
