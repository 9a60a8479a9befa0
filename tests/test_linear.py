"""The pre-packed CPU inference path (accel.PackedLinear) against F.linear (the oracle)."""

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
