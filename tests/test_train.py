"""Training end to end on a small real sample: learning, checkpoints, exact resume, DDP."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from attnlab import accel
from attnlab.cli import main
from attnlab.demo import corpus_dir
from attnlab.modeldir import atomic_write_text, load
from attnlab.train import TrainArgs, average_checkpoints, learning_rate

TINY = ["--set", "d_model=32", "--set", "n_heads=4", "--set", "d_ff=64", "--set", "n_encoder_layers=1",
        "--set", "n_decoder_layers=1"]


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    lines = (corpus_dir() / "dev.tsv").read_text(encoding="utf-8").splitlines()
    (d / "train.tsv").write_text("\n".join(lines[:800]) + "\n", encoding="utf-8")
    (d / "dev.tsv").write_text("\n".join(lines[800:900]) + "\n", encoding="utf-8")
    return d


def run_cli(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "attnlab", *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, **kw)


def test_paper_schedule():
    args = TrainArgs(warmup=4000)
    # lr = d^-0.5 * min(step^-0.5, step * warmup^-1.5)
    for step in (1, 100, 3999, 4000, 10000, 100000):
        expected = 512 ** -0.5 * min(step ** -0.5, step * 4000 ** -1.5)
        assert math.isclose(learning_rate(step, args, 512), expected, rel_tol=1e-9)
    cos = TrainArgs(lr=1e-3, warmup=10, schedule="cosine", min_lr=1e-5)
    assert math.isclose(learning_rate(5, cos, 512, 0.0), 5e-4)
    assert math.isclose(learning_rate(100, cos, 512, 1.0), 1e-5)


def test_training_learns_and_saves_a_loadable_model(sample, tmp_path, capsys):
    out = tmp_path / "m"
    code = main(["train", "--train", str(sample / "train.tsv"), "--dev", str(sample / "dev.tsv"), "--out", str(out),
                 "--preset", "mt-tiny", "--vocab-size", "300", "--max-tokens", "600", "--max-steps", "120",
                 "--lr", "3e-3", "--warmup", "20", "--eval-every", "60", "--eval-sentences", "20",
                 "--save-every", "40", "--no-progress", "--seed", "1", *TINY])
    assert code == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tgt_tokenizer.json",
                 "training_args.json", "metrics.jsonl", "checkpoint_last.pt"):
        assert (out / name).exists(), name
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    vocab = json.loads((out / "config.json").read_text())["tgt_vocab_size"]
    assert losses[-1] < 0.75 * math.log(vocab)  # well below the uniform guess
    dev = [r for r in rows if "dev_loss" in r]
    assert dev[-1]["dev_loss"] < dev[0]["dev_loss"] + 1e-6 or len(dev) == 1
    model, src_tok, tgt_tok = load(out)
    assert model.config.family == "encoder-decoder" and tgt_tok is not src_tok
    # CLI round trip on the trained model
    assert main(["translate", "--model", str(out), "--text", "I am happy."]) == 0
    assert main(["evaluate", "--model", str(out), "--data", str(sample / "dev.tsv"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) >= {"bleu", "chrf", "n"} and result["n"] == 100 and result["tokenize"] == "zh"
    assert main(["attention", "--model", str(out), "I am happy.", "--out", str(tmp_path / "a.png")]) == 0
    assert (tmp_path / "a.png").stat().st_size > 10_000
    # averaging the kept checkpoints is the element-wise mean
    files = sorted((out / "checkpoints").glob("step_*.safetensors"))
    avg = load_file(str(average_checkpoints(out, last=2, out=tmp_path / "avg.safetensors")))
    a, b = load_file(str(files[-2])), load_file(str(files[-1]))
    for k in avg:
        assert torch.allclose(avg[k], (a[k] + b[k]) / 2, atol=1e-6)


def _train_args(sample, out, steps):
    return ["train", "--train", str(sample / "train.tsv"), "--out", str(out), "--preset", "mt-tiny",
            "--vocab-size", "300", "--max-tokens", "400", "--max-steps", str(steps), "--lr", "2e-3",
            "--warmup", "10", "--save-every", "15", "--eval-every", "0", "--no-progress", "--seed", "3",
            "--threads", "1", *TINY]


def test_killed_run_resumes_exactly(sample, tmp_path):
    steps = 150
    straight = tmp_path / "straight"
    assert run_cli(*_train_args(sample, straight, steps)).returncode == 0
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "attnlab", *_train_args(sample, killed, steps)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while time.time() < deadline and len(list((killed / "checkpoints").glob("step_*"))) < 2:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # no chance to clean up
    proc.wait()
    saved = torch.load(killed / "checkpoint_last.pt", weights_only=False)["step"]
    assert 0 < saved < steps
    res = run_cli("train", "--resume", str(killed))
    assert res.returncode == 0, res.stderr[-2000:]
    a = torch.load(straight / "checkpoint_last.pt", weights_only=False)
    b = torch.load(killed / "checkpoint_last.pt", weights_only=False)
    assert a["step"] == b["step"] == steps
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_two_processes_match_one_with_the_same_global_batch(sample, tmp_path):
    common = ["--train", str(sample / "train.tsv"), "--preset", "mt-tiny", "--vocab-size", "300",
              "--max-tokens", "400", "--max-steps", "12", "--lr", "2e-3", "--warmup", "5", "--save-every", "0",
              "--eval-every", "0", "--no-progress", "--seed", "5", "--threads", "1", "--set", "dropout=0.0", *TINY]
    one = run_cli("train", "--out", str(tmp_path / "one"), "--update-freq", "2", *common)
    assert one.returncode == 0, one.stderr[-2000:]
    # The tokenizer is trained once and shared, as a launcher script would do.
    (tmp_path / "two").mkdir()
    for f in ("tokenizer.json", "tgt_tokenizer.json"):
        (tmp_path / "two" / f).write_bytes((tmp_path / "one" / f).read_bytes())
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          "29517", "-m", "attnlab", "train", "--out", str(tmp_path / "two"), "--reuse-tokenizer", *common],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert two.returncode == 0, two.stderr[-3000:]
    a = load_file(str(tmp_path / "one" / "model.safetensors"))
    b = load_file(str(tmp_path / "two" / "model.safetensors"))
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    target = tmp_path / "config.json"
    atomic_write_text(target, "old")

    class Boom(Exception):
        pass

    from attnlab.modeldir import atomic_write

    def bad_writer(tmp):
        Path(tmp).write_text("half-writ")
        raise Boom
    with pytest.raises(Boom):
        atomic_write(target, bad_writer)
    assert target.read_text() == "old" and len(list(tmp_path.iterdir())) == 1


def test_empty_after_filtering_is_an_error(sample, tmp_path):
    res = run_cli("train", "--train", str(sample / "train.tsv"), "--out", str(tmp_path / "x"), "--max-len", "2",
                  "--vocab-size", "300", "--max-steps", "1", "--no-progress")
    assert res.returncode == 1 and "no training pairs left after filtering by --max-len 2" in res.stderr


def test_two_processes_stop_together_on_early_stopping_and_time_budget(sample, tmp_path):
    """Only the main process evaluates, and each process has its own clock: the stop is agreed (it used
    to leave the other process waiting in a collective for ever)."""
    common = ["--train", str(sample / "train.tsv"), "--dev", str(sample / "train.tsv"), "--preset", "mt-tiny",
              "--vocab-size", "300", "--max-tokens", "400", "--max-steps", "200", "--lr", "1e-9", "--warmup", "1",
              "--save-every", "0", "--eval-every", "1", "--eval-sentences", "2", "--patience", "1", "--minutes", "0.5",
              "--no-progress", "--seed", "5", "--threads", "1", *TINY]
    one = run_cli("train", "--out", str(tmp_path / "one"), *common, "--max-steps", "1")  # makes the tokenizers
    assert one.returncode == 0, one.stderr[-2000:]
    (tmp_path / "two").mkdir()
    for f in ("tokenizer.json", "tgt_tokenizer.json"):
        (tmp_path / "two" / f).write_bytes((tmp_path / "one" / f).read_bytes())
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          "29519", "-m", "attnlab", "train", "--out", str(tmp_path / "two"), "--reuse-tokenizer", *common],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=180)
    assert two.returncode == 0, two.stderr[-3000:]
    reports = [l for l in two.stdout.splitlines() if l.startswith("{")]
    assert len(reports) == 1 and two.stdout.count("model saved in") == 1, two.stdout  # the main process reports
    result = json.loads(reports[0])
    assert result["best"] is not None  # the main process's report: it evaluated
    assert result["stop"] in ("early stopping", "time budget") and result["steps"] < 200


def test_adamw_is_fused_where_the_device_has_it_and_computes_plain_adamw():
    """The trainer's optimizer: PyTorch's fused AdamW kernel (CPU, CUDA, MPS) — the same updates as the
    reference (single-tensor) AdamW, and state dicts that load across the two."""
    import copy

    from attnlab.train.trainer import make_adamw
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    b = copy.deepcopy(a)
    kw = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-9)
    groups = [{"params": [p for p in a.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in a.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    fused = make_adamw(groups, **kw)
    plain = torch.optim.AdamW([{"params": [p for p in b.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                               {"params": [p for p in b.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                              foreach=False, **kw)
    assert fused.defaults["fused"] is True  # this CPU has the kernel (every CPU build of torch >= 2.4 does)
    for _ in range(5):
        x = torch.randn(6, 8)
        for model, opt in ((a, fused), (b, plain)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=1e-5)
    plain.load_state_dict(fused.state_dict())  # checkpoints written with one load into the other


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_gradient_clipping_equals_torch_and_float64(path, monkeypatch):
    """train.clipping.clip_grad_norm, with attnlab's kernel (csrc/grad_norm.cpp; skipped where it cannot build) and
    without: the norm of all gradients together as float64 computes it and as torch.nn.utils.clip_grad_norm_
    returns it; gradients scaled as torch scales them where the norm exceeds max_norm (sizes ending inside a
    16,384-float chunk and inside a vector, a 2-D weight, a parameter without a gradient, more floats than one
    thread takes), untouched bit for bit where it does not; torch's very answer for a gradient holding inf, NaN or
    a value whose square float32 cannot hold, and for one gradient given twice; the same bits on one thread and two."""
    import platform

    from attnlab.train import clipping
    if path == "torch":
        monkeypatch.setenv("ATTNLAB_OWN_KERNELS", "0")
    else:
        monkeypatch.delenv("ATTNLAB_OWN_KERNELS", raising=False)
        if platform.system() != "Linux" or not accel.can_build_kernels():
            pytest.skip("attnlab's own kernels are built on Linux with a C++ compiler and ninja")
    assert clipping.fused_clip() == (path == "kernel")  # (where the tools are, a failed build fails here)
    g = torch.Generator().manual_seed(0)
    shapes = [(1,), (7,), (16391,), (40000,), (96, 130), (3,)]

    def params(scale=1.0):
        ps = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        for p in ps[:-1]:  # (the last has no gradient)
            p.grad = torch.randn(p.shape, generator=g) * scale
        return ps

    def copies(ps):
        out = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        for p, q in zip(out, ps):
            p.grad = None if q.grad is None else q.grad.clone()
        return out

    for max_norm, scale in ((1.0, 1.0), (3.0, 1.0), (1e6, 1.0), (0.5, 1e-3)):  # (norms ~262, ~262, ~262, ~0.26)
        ours = params(scale)
        theirs, before = copies(ours), [p.grad.clone() for p in ours[:-1]]
        norm = clipping.clip_grad_norm(iter(ours), max_norm)  # (an iterator, as model.parameters())
        want = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
        norm64 = torch.cat([b.double().flatten() for b in before]).norm()
        assert norm.dtype == torch.float32 and norm.dim() == 0
        assert torch.allclose(norm.double(), norm64, rtol=1e-6, atol=0) and torch.allclose(norm, want, rtol=1e-6, atol=0)
        assert ours[-1].grad is None
        if float(norm64) <= max_norm:
            assert all(torch.equal(p.grad, b) for p, b in zip(ours, before))
        for p, q, b in zip(ours[:-1], theirs[:-1], before):
            assert torch.allclose(p.grad, q.grad, rtol=2e-6, atol=0)
            assert torch.allclose(p.grad.double(), b.double() * min(1.0, max_norm / (float(norm64) + 1e-6)),
                                  rtol=2e-6, atol=0)
    for max_norm in (3.0, 0.3, 7.0, 10.0):  # integers, whose squares float32 sums exactly: the same norm as torch's,
        ours = [torch.nn.Parameter(torch.zeros(40000))]  # so the same coefficient, as torch rounds it, and the same bits
        ours[0].grad = torch.randint(-3, 4, (40000,), generator=g).float()
        theirs = copies(ours)
        assert torch.equal(clipping.clip_grad_norm(ours, max_norm), torch.nn.utils.clip_grad_norm_(theirs, max_norm))
        assert torch.equal(ours[0].grad, theirs[0].grad), max_norm
    for bad in (float("inf"), float("nan"), 1e30):
        ours = params()
        ours[2].grad[5] = bad
        theirs = copies(ours)
        torch.testing.assert_close(clipping.clip_grad_norm(ours, 1.0), torch.nn.utils.clip_grad_norm_(theirs, 1.0),
                                   equal_nan=True, rtol=0, atol=0)
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p.grad, q.grad, equal_nan=True, rtol=0, atol=0)
    p = params()[3]
    q = copies([p])[0]
    torch.testing.assert_close(clipping.clip_grad_norm([p, p], 1.0), torch.nn.utils.clip_grad_norm_([q, q], 1.0),
                               rtol=0, atol=0)
    assert torch.equal(p.grad, q.grad)
    source, threads, got = params(), torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            ours = copies(source)
            got.append((clipping.clip_grad_norm(ours, 3.0), [p.grad for p in ours[:-1]]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[0][0], got[1][0]) and all(torch.equal(a, b) for a, b in zip(got[0][1], got[1][1]))


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_training_takes_the_eager_steps(tmp_path):
    """`attnlab train --compile` (inductor): the same updates as eager training, and a model directory
    whose weights load without torch.compile's `_orig_mod.` prefix."""
    text = tmp_path / "text.txt"
    text.write_text((corpus_dir() / "dev.tsv").read_text(encoding="utf-8")[:20000], encoding="utf-8")
    runs = {}
    for compiled in (False, True):
        out = tmp_path / ("compiled" if compiled else "eager")
        code = main(["train", "--task", "lm", "--train", str(text), "--out", str(out), "--preset", "shakespeare-char",
                     "--tokenizer", "char", "--set", "d_model=32", "--set", "n_heads=2", "--set", "d_ff=64",
                     "--set", "n_decoder_layers=1", "--block-size", "16", "--batch-size", "4", "--max-steps", "4",
                     "--lr", "1e-2", "--warmup", "1", "--eval-every", "0", "--no-progress", "--seed", "0",
                     *(["--compile"] if compiled else [])])
        assert code == 0
        runs[compiled] = load_file(str(out / "model.safetensors"))
    assert set(runs[True]) == set(runs[False]) and not any(k.startswith("_orig_mod") for k in runs[True])
    for k, v in runs[False].items():
        assert torch.allclose(runs[True][k], v, atol=1e-5), k
    assert load(tmp_path / "compiled")[0].config.d_model == 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_equals_torch(dtype):
    """The trainer's loss (label smoothing, padding ignored, computed a few rows at a time — three
    chunks here) against F.cross_entropy on the fp32 logits: the same loss and the same gradient,
    returned in the logits' dtype; ignored rows get no gradient."""
    from attnlab.train.tasks.base import ChunkedCrossEntropy, label_smoothed_loss
    torch.manual_seed(0)
    logits = (torch.randn(4, 150, 5000) * 3).to(dtype).requires_grad_()
    labels = torch.randint(1, 5000, (4, 150))
    labels[:, 100:] = 0  # padding
    assert logits.numel() > 2 * ChunkedCrossEntropy.CPU_CHUNK
    loss, n = label_smoothed_loss(logits, labels, 0, 0.1)
    (got,) = torch.autograd.grad(loss * 3.0, logits)
    ref = F.cross_entropy(logits.float().reshape(-1, 5000), labels.reshape(-1), ignore_index=0, label_smoothing=0.1)
    (want,) = torch.autograd.grad(ref * 3.0, logits)
    assert n == 400 and torch.allclose(loss, ref, atol=1e-5, rtol=1e-6)
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), atol=1e-7 if dtype == torch.float32 else 1e-4)
    assert not got[:, 100:].any()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("gemm", ["onednn", "mkl"])
def test_fused_output_loss_equals_the_projection_and_torch(bias, gemm, monkeypatch):
    """The trainer's output projection + loss in one function (``LinearCrossEntropy``, four chunks
    here) against F.linear and F.cross_entropy: the same loss and the same gradients of the hidden
    states, the weight and the bias, with label smoothing, padding ignored and an upstream gradient;
    its products on oneDNN's GEMM (where the op exists) and on MKL's."""
    from attnlab import accel
    from attnlab.train.tasks import base
    from attnlab.train.tasks.base import LinearCrossEntropy
    if gemm == "onednn" and not accel.onednn_linear_ops():
        pytest.skip("oneDNN not in this PyTorch build")
    monkeypatch.setattr(base, "onednn_training_gemm_ok", lambda: gemm == "onednn")
    monkeypatch.setattr(LinearCrossEntropy, "MIN_ROWS", 1)
    monkeypatch.setattr(LinearCrossEntropy, "CHUNK", 50 * 999)  # 50 rows a chunk, a short tail
    torch.manual_seed(0)
    h = torch.randn(170, 48, requires_grad=True)
    w = (torch.randn(999, 48) * 0.3).requires_grad_()
    b = (torch.randn(999) if bias else torch.zeros(0)).requires_grad_()
    labels = torch.randint(1, 999, (170,))
    labels[::7] = 0  # padding
    loss = LinearCrossEntropy.apply(h, w, b if bias else None, labels, 0, 0.1)
    got = torch.autograd.grad(loss * 3.0, [h, w, b] if bias else [h, w])
    ref = F.cross_entropy(F.linear(h, w, b if bias else None), labels, ignore_index=0, label_smoothing=0.1)
    want = torch.autograd.grad(ref * 3.0, [h, w, b] if bias else [h, w])
    assert torch.allclose(loss, ref, atol=1e-5, rtol=1e-6)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype and torch.allclose(g, r, atol=1e-6, rtol=1e-4)
    assert not got[0][::7].any()  # padded rows: no gradient


def test_fused_output_loss_is_exact_where_the_target_probability_underflows(monkeypatch):
    """``LinearCrossEntropy`` recovers the log-sum-exp from the largest probability (lse = max −
    log p_max), never from the target's: rows whose target's softmax underflows to 0 in fp32, or whose
    logits are in the thousands, still give the float64 loss and gradients."""
    from attnlab.train.tasks.base import LinearCrossEntropy
    monkeypatch.setattr(LinearCrossEntropy, "MIN_ROWS", 1)
    monkeypatch.setattr(LinearCrossEntropy, "CHUNK", 4 * 300)  # 4 rows a chunk
    torch.manual_seed(0)
    h = torch.randn(10, 16)
    h[:3] *= 400  # logits of ±2,000: exp overflows without the max subtracted
    w = torch.randn(300, 16)
    logits = h @ w.t()
    labels = logits.argmin(dim=1)  # the least likely token: softmax 0 in fp32 on the scaled rows
    labels[8] = 0  # padding
    assert (torch.softmax(logits, 1).gather(1, labels[:, None]) == 0).sum() >= 3
    h, w = h.requires_grad_(), w.requires_grad_()
    loss = LinearCrossEntropy.apply(h, w, None, labels, 0, 0.1)
    got = torch.autograd.grad(loss, [h, w])
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.cross_entropy(h64 @ w64.t(), labels, ignore_index=0, label_smoothing=0.1)
    want = torch.autograd.grad(ref, [h64, w64])
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) <= 1e-6 * ref.item()
    for g, r in zip(got, want):
        assert torch.allclose(g.double(), r, rtol=1e-4, atol=1e-4 * r.abs().max().item())


@pytest.mark.parametrize("vocab", [65, 256, 257])
def test_output_loss_takes_the_plain_loss_below_the_fused_vocabulary(vocab, monkeypatch):
    """Below 257 classes (``FUSED_LOSS_MIN_VOCAB``, as shipped: nanoGPT's 65 characters, bytes) the trainer's loss
    is the plain projection and PyTorch's loss, from 257 up the fused one; each path's loss and gradients equal a
    float64 oracle (F.linear + F.cross_entropy), the padding rows ignored."""
    import torch.nn.functional as F
    from attnlab.config import TransformerConfig
    from attnlab.model import build_model
    from attnlab.train.tasks import base
    calls = []
    fused_apply = base.LinearCrossEntropy.apply
    monkeypatch.setattr(base.LinearCrossEntropy, "apply", lambda *a: calls.append(1) or fused_apply(*a))
    torch.manual_seed(0)
    cfg = TransformerConfig(family="decoder-only", vocab_size=vocab, d_model=32, n_heads=4, n_decoder_layers=1,
                            d_ff=64, max_len=16, dropout=0.0)
    model = build_model(cfg).train()
    ids = torch.randint(4, vocab, (3, 12))
    labels = ids[:, 1:].clone()
    labels[1, 6:] = 0  # padding
    hidden = model(ids[:, :-1], hidden_only=True).detach().requires_grad_()  # (the tied weight: the head's use only)
    h = hidden.detach().double().requires_grad_()
    w = model.lm_head.weight.detach().double().requires_grad_()
    b = model.lm_head.bias.detach().double().requires_grad_() if model.lm_head.bias is not None else None
    want = F.cross_entropy(F.linear(h, w, b).reshape(-1, vocab), labels.reshape(-1), ignore_index=0, label_smoothing=0.1)
    want.backward()
    loss, n = base.output_loss(model, hidden, labels, 0, 0.1)
    d_hidden, d_w = torch.autograd.grad(loss, (hidden, model.lm_head.weight))
    assert bool(calls) == (vocab >= 257) and n == int((labels != 0).sum())
    assert abs(loss.item() - want.item()) < 1e-5
    assert torch.allclose(d_hidden.double(), h.grad, atol=1e-7, rtol=1e-4)
    assert torch.allclose(d_w.double(), w.grad, atol=1e-7, rtol=1e-4)


@pytest.mark.parametrize("bf16", [False, True])
def test_training_loss_through_the_hidden_states_equals_the_logits_loss(bf16, monkeypatch):
    """``output_loss`` on a model's hidden states (tied embedding, T5's output rescaling, bf16
    autocast) against ``label_smoothed_loss`` on the same model's logits: the same loss and the same
    gradient for every parameter (the reference: PyTorch's own cross-entropy, the logits being small).
    The fused loss takes its 24 rows 7 at a time here."""
    from attnlab.config import TransformerConfig
    from attnlab.model import build_model
    from attnlab.train.tasks.base import LinearCrossEntropy, label_smoothed_loss, output_loss
    monkeypatch.setattr(LinearCrossEntropy, "MIN_ROWS", 1)
    monkeypatch.setattr(LinearCrossEntropy, "CHUNK", 7 * 500)
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=500, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1, n_decoder_layers=1,
                            dropout=0.0, tie_output=True, share_embeddings=True, tied_output_scale=True)
    model = build_model(cfg)
    src, tgt = torch.randint(4, 500, (3, 9)), torch.randint(4, 500, (3, 8))
    labels = torch.randint(4, 500, (3, 8))
    labels[2, 5:] = 0
    grads = []
    for fused in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, n = (output_loss(model, model(src, tgt, hidden_only=True), labels, 0, 0.1) if fused
                       else label_smoothed_loss(model(src, tgt), labels, 0, 0.1))
        loss.backward()
        grads.append((loss.detach(), n, {k: p.grad.clone() for k, p in model.named_parameters()}))
    (ref, n_ref, want), (got, n_got, have) = grads
    assert n_got == n_ref == 21 and torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    for k in want:  # bf16: the same products, but the head's gradient is summed over chunks in fp32
        if bf16:
            assert (have[k] - want[k]).abs().max() <= 1e-2 * want[k].abs().max(), k
        else:
            assert torch.allclose(have[k], want[k], atol=1e-6, rtol=1e-4), k


_FAULTS_OF_FREED_BLOCKS = """
import resource, torch
from attnlab import accel
kept = accel.keep_freed_memory()
faults = []
for _ in range(8):  # a "step": blocks of 64, 32, 16, 8 and 4 MiB, all freed at its end
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.ones(n << 20) for n in (16, 8, 4, 2, 1)]
    del blocks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(kept, accel._kept_mmap_threshold(), sum(faults[3:]))  # the steps after the heap has grown to the step's peak
"""


@pytest.mark.skipif(accel.heap_setting_refused() not in (None, "ATTNLAB_KEEP_FREED_MEMORY=0"),
                    reason="the C heap setting needs glibc and no preloaded allocator")
def test_cpu_training_keeps_freed_memory_for_the_next_step(sample, tmp_path, monkeypatch):
    """A step frees its activations and the next allocates the same sizes again. With the trainer's heap setting
    (accel.keep_freed_memory) the blocks come back from the heap once it has grown to the step's peak, almost
    without a page fault (glibc now and then maps a fresh region for one block: 0 in most runs here, 1,024-4,096
    in some steps of some, measured over 16 steps); glibc's default (ATTNLAB_KEEP_FREED_MEMORY=0) unmaps or trims
    them and faults the pages in again (4 KiB pages: ~24,600 a step here; one per 2 MiB where transparent huge
    pages are always on), so the setting must save at least nine faults in ten. And the
    trainer on CPU asks for the setting. The subprocesses run with ATTNLAB_KEEP_FREED_MEMORY set either way,
    so the check also runs when the suite runs with the setting switched off."""
    faults, threshold = {}, None
    for keep in ("1", "0"):
        res = subprocess.run([sys.executable, "-c", _FAULTS_OF_FREED_BLOCKS], capture_output=True, text=True,
                             env={**os.environ, "ATTNLAB_KEEP_FREED_MEMORY": keep}, check=True)
        kept, mmap_threshold, n = res.stdout.split()
        assert kept == ("True" if keep == "1" else "False")
        faults[keep], threshold = int(n), threshold or int(mmap_threshold)
    if threshold >= 1 << 30:  # (glibc before 2.35 caps the threshold at 32 MiB: the 64 MiB block is mmapped still)
        # without the setting at least one fault per 2 MiB page (4 KiB pages here: ~24,600 a step); with it, a
        # tenth of that at most (an occasional fresh region: asserting fewer than 64 failed 5 runs of 16 here)
        assert faults["1"] * 10 <= faults["0"] and faults["0"] >= 5 * 32, faults
    from attnlab.train import trainer as trainer_mod
    calls = []
    monkeypatch.setattr(trainer_mod, "keep_freed_memory", lambda: calls.append(1) or True)
    assert main(_train_args(sample, tmp_path / "m", 1) + ["--device", "cpu"]) == 0
    assert calls == [1]
