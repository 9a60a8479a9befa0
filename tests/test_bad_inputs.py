"""A table of bad inputs (issue #10): every row runs the ``attnlab`` console script's ``main`` in a
process of its own (forked from a server that imported it once; see ``forked_cli``) on one
broken file, flag or model directory and checks that the message names what is wrong and where,
the exit status (1 for a user error, 2 for a usage error), that stderr holds one line and no
traceback or "internal error", and that nothing already on disk was changed.

The rows run two at a time; the shared tiny
models are trained once per module. Ctrl-C during ``attnlab train`` and its exact resume are the
last test."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnlab.demo import corpus_dir

from forked_cli import ATTNLAB, run as run_forked  # the table's rows: main() in a forked process (see there)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
TIMEOUT = 180
QUIET = ["--no-progress", "--threads", "1", "--eval-every", "0", "--save-every", "0"]
FAST = [*QUIET, "--max-steps", "1"]


def run(argv, timeout=TIMEOUT, **kw):
    return subprocess.run([ATTNLAB, *map(str, argv)], capture_output=True, text=True, env=ENV, timeout=timeout,
                          stdin=subprocess.DEVNULL, **kw)


# -- the shared tiny models ---------------------------------------------------------------------------


@dataclass
class Models:
    data: Path  # good inputs: tr.tsv (translation pairs), text.txt (lm), cls.tsv (labelled)
    mt: Path    # encoder-decoder, separate source/target vocabularies
    lm: Path    # decoder-only, learned positions, a context of 32 tokens, char tokenizer
    cls: Path   # encoder-only classifier, labels neg/pos


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    root = tmp_path_factory.mktemp("models")
    data = root / "data"
    data.mkdir()
    lines = (corpus_dir() / "dev.tsv").read_text(encoding="utf-8").splitlines()[:200]
    (data / "tr.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    english = [l.split("\t")[0] for l in lines]
    (data / "text.txt").write_text("\n".join(english) + "\n", encoding="utf-8")
    (data / "cls.tsv").write_text("".join(f"{'pos' if len(s) % 2 else 'neg'}\t{s}\n" for s in english[:120]),
                                  encoding="utf-8")
    m = Models(data, root / "mt", root / "lm", root / "cls")
    tiny = ["--set", "d_model=32", "--set", "n_heads=4", "--set", "d_ff=64"]
    jobs = [
        ["train", "--train", data / "tr.tsv", "--out", m.mt, "--preset", "mt-tiny", "--vocab-size", "200",
         "--max-tokens", "300", *tiny, "--set", "n_encoder_layers=1", "--set", "n_decoder_layers=1"],
        ["train", "--task", "lm", "--train", data / "text.txt", "--out", m.lm, "--preset", "gpt-mini",
         "--tokenizer", "char", "--block-size", "16", "--batch-size", "4", *tiny, "--set", "n_decoder_layers=1",
         "--set", "max_len=32"],
        ["train", "--task", "classify", "--train", data / "cls.tsv", "--out", m.cls, "--preset", "bert-mini",
         "--vocab-size", "200", "--max-len", "32", *tiny, "--set", "n_encoder_layers=1"],
    ]
    procs = [subprocess.Popen([ATTNLAB, *map(str, j), *QUIET, "--max-steps", "2"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=ENV) for j in jobs]
    for p, j in zip(procs, jobs):
        out = p.communicate(timeout=TIMEOUT)[0]
        assert p.returncode == 0, f"{j}: {out[-2000:]}"
    return m


# -- helpers for the rows ------------------------------------------------------------------------------


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


BINARY = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10" + bytes(range(256)) * 4  # has NUL bytes
BAD_UTF8 = "Good morning.\tfine\nHello.\tok\n".encode() + b"Caf\xe9 au lait.\tLatin-1, not UTF-8\n"  # line 3


def copy(src: Path, dst: Path, drop: tuple[str, ...] = ()) -> Path:
    shutil.copytree(src, dst)
    for name in drop:
        (dst / name).unlink()
    return dst


def gguf_of_architecture(path: Path, arch: str, embedding: bool = True) -> Path:
    """A tiny real GGUF file (one tensor); without ``embedding`` its metadata lacks the model width."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(32)
    if embedding:
        w.add_embedding_length(4)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- the table: each row builds its bad input in its own folder and returns (argv, message fragments) --

ROWS: list = []


def row(name: str, status: int = 1):
    def register(build):
        ROWS.append(pytest.param(build, status, id=name))
        return build
    return register


def previous_run(t: Path, m: Models) -> Path:
    """An earlier run's model directory that a failing ``attnlab train --out`` must leave as it was."""
    return copy(m.mt, t / "previous_run")


# train: data files

@row("train-missing-file")
def _(t, m):
    return ["train", "--train", t / "nope.tsv", "--out", previous_run(t, m), *FAST], [f"{t}/nope.tsv: no such file"]


@row("train-empty-file")
def _(t, m):
    f = write(t / "empty.tsv", "")
    return ["train", "--train", f, "--out", previous_run(t, m), *FAST], [f"{f}: no sentence pairs found", "empty"]


@row("train-binary-file")
def _(t, m):
    f = write(t / "photo.tsv", BINARY)
    return ["train", "--train", f, "--out", previous_run(t, m), *FAST], [f"{f}:3: binary data", "NUL"]


@row("train-invalid-utf8")
def _(t, m):
    f = write(t / "latin1.tsv", BAD_UTF8)
    return ["train", "--train", f, "--out", previous_run(t, m), *FAST], [f"{f}:3: invalid UTF-8 at byte 3"]


@row("train-misaligned-parallel-files")
def _(t, m):
    a = write(t / "a.src", "one\ntwo\nthree\n")
    b = write(t / "b.tgt", "un\ndeux\n")
    return (["train", "--train", f"{a},{b}", "--out", previous_run(t, m), *FAST],
            ["misaligned", f"{b} ends before line 3 of {a}"])


@row("train-tsv-missing-column")
def _(t, m):
    f = write(t / "pairs.tsv", "Hello.\tBonjour.\nGood night.\nThanks.\tMerci.\n")
    return (["train", "--train", f, "--out", previous_run(t, m), *FAST],
            [f"{f}:2: expected at least 2 TAB-separated fields", "found 1"])


@row("train-truncated-gzip")
def _(t, m):
    import gzip
    full = gzip.compress((m.data / "tr.tsv").read_bytes())
    f = write(t / "train.tsv.gz", full[: len(full) // 2])
    return ["train", "--train", f, "--out", previous_run(t, m), *FAST], [f"{f}:", "corrupt or truncated gzip"]


# train: --config files and options

@row("train-config-unknown-field")
def _(t, m):
    c = write(t / "opts.json", f'{{"train": "{m.data / "tr.tsv"}", "preset": "mt-tiny", "max_steps": 1, '
                               '"max_stepz": 3}')
    return ["train", "--config", c, "--out", previous_run(t, m)], [f"{c}: unknown training option(s) max_stepz"]


@row("train-config-wrong-type")
def _(t, m):
    c = write(t / "opts.json", f'{{"train": "{m.data / "tr.tsv"}", "max_steps": "three"}}')
    return ["train", "--config", c, "--out", previous_run(t, m)], [f"{c}: option 'max_steps' must be int, got 'three'"]


@row("train-config-not-json")
def _(t, m):
    c = write(t / "opts.json", f'{{"train": "{m.data / "tr.tsv"}",\n "max_steps": 3,,\n}}\n')
    return ["train", "--config", c, "--out", previous_run(t, m)], [f"{c}:2: not valid JSON"]


@row("train-unknown-preset")
def _(t, m):
    return (["train", "--train", m.data / "tr.tsv", "--out", previous_run(t, m), "--preset", "mt-huge", *FAST],
            ["--preset mt-huge: unknown preset 'mt-huge'", "mt-tiny"])


@row("train-unknown-set-field")
def _(t, m):
    return (["train", "--train", m.data / "tr.tsv", "--out", previous_run(t, m), "--set", "d_modle=64", *FAST],
            ["--set: unknown model config field(s) d_modle", "d_model"])


@row("train-out-under-a-file")
def _(t, m):
    f = write(t / "afile", "not a directory\n")
    return (["train", "--train", m.data / "tr.tsv", "--out", f / "run", *FAST],
            [f"--out {f}/run: {f} is a file, not a directory"])


@row("train-resume-other-task")
def _(t, m):
    d = copy(m.cls, t / "classifier_run")
    return (["train", "--resume", d, "--task", "lm", "--train", m.data / "text.txt"],
            [f"--resume {d}: that run is --task classify, not --task lm"])


@row("train-resume-changing-the-model")
def _(t, m):
    d = copy(m.mt, t / "run")
    return (["train", "--resume", d, "--set", "d_model=64"],
            [f"--resume {d}: the saved run's model has d_model=32, not 64"])


@row("train-resume-truncated-checkpoint")
def _(t, m):
    d = copy(m.mt, t / "run")
    ckpt = d / "checkpoint_last.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:5000])
    return ["train", "--resume", d], [f"{ckpt}: not a readable checkpoint (truncated or corrupt)"]


@row("train-device-nonsense")
def _(t, m):
    return (["train", "--train", m.data / "tr.tsv", "--out", previous_run(t, m), "--device", "nonsense", *FAST],
            ["--device 'nonsense': not a device name"])


@row("train-minutes-0", status=2)
def _(t, m):
    return ["train", "--train", m.data / "tr.tsv", "--out", t / "new", "--minutes", "0"], ["argument --minutes: 0"]


# translate

@row("translate-missing-input")
def _(t, m):
    return ["translate", "--model", m.mt, "--input", t / "nope.txt"], [f"{t}/nope.txt: no such file"]


@row("translate-empty-input")
def _(t, m):
    f = write(t / "empty.txt", "")
    return ["translate", "--model", m.mt, "--input", f], [f"{f}: empty file, no sentences to translate"]


@row("translate-binary-input")
def _(t, m):
    f = write(t / "photo.png", BINARY)
    return ["translate", "--model", m.mt, "--input", f], [f"{f}:3: binary data"]


@row("translate-invalid-utf8")
def _(t, m):
    f = write(t / "latin1.txt", BAD_UTF8)
    return ["translate", "--model", m.mt, "--input", f], [f"{f}:3: invalid UTF-8"]


@row("translate-beam-0", status=2)
def _(t, m):
    return ["translate", "--model", m.mt, "--text", "Hi.", "--beam", "0"], ["argument --beam: 0 is out of range"]


@row("translate-max-len-negative", status=2)
def _(t, m):
    return (["translate", "--model", m.mt, "--text", "Hi.", "--max-len", "-1"],
            ["argument --max-len: -1 is out of range"])


@row("translate-truncated-safetensors")
def _(t, m):
    d = copy(m.mt, t / "model")
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size * 9 // 10])
    return ["translate", "--model", d, "--text", "Hi."], [f"{w}: not a readable safetensors file", "truncated"]


@row("translate-model-without-tokenizer")
def _(t, m):
    d = copy(m.mt, t / "model", drop=("tokenizer.json",))
    return ["translate", "--model", d, "--text", "Hi."], [f"{d}: no tokenizer.json"]


@row("translate-model-without-target-tokenizer")
def _(t, m):
    d = copy(m.mt, t / "model", drop=("tgt_tokenizer.json",))
    return ["translate", "--model", d, "--text", "Hi."], [f"{d}: no tgt_tokenizer.json"]


@row("translate-decoder-only-model")
def _(t, m):
    return ["translate", "--model", m.lm, "--text", "Hi."], [f"{m.lm} is decoder-only", "attnlab generate"]


# evaluate

@row("evaluate-missing-data")
def _(t, m):
    return ["evaluate", "--model", m.mt, "--data", t / "nope.tsv"], [f"{t}/nope.tsv: no such file"]


@row("evaluate-empty-data")
def _(t, m):
    f = write(t / "empty.tsv", "")
    return ["evaluate", "--model", m.mt, "--data", f], [f"{f}: no sentence pairs found"]


@row("evaluate-binary-data")
def _(t, m):
    f = write(t / "photo.tsv", BINARY)
    return ["evaluate", "--model", m.mt, "--data", f], [f"{f}:3: binary data"]


@row("evaluate-invalid-utf8")
def _(t, m):
    f = write(t / "latin1.tsv", BAD_UTF8)
    return ["evaluate", "--model", m.mt, "--data", f], [f"{f}:3: invalid UTF-8"]


@row("evaluate-classify-unknown-label")
def _(t, m):
    f = write(t / "test.tsv", "pos\tA gorgeous film.\nneg\tDull.\nmeh\tSo so.\n")
    return ["evaluate", "--model", m.cls, "--data", f], [f"{f}:3: unknown label 'meh'", "neg", "pos"]


@row("evaluate-task-of-another-model")
def _(t, m):
    return (["evaluate", "--model", m.lm, "--task", "classify", "--data", m.data / "cls.tsv"],
            [f"--task classify: {m.lm} was trained for --task lm"])


# classify

@row("classify-missing-input")
def _(t, m):
    return ["classify", "--model", m.cls, "--input", t / "nope.txt"], [f"{t}/nope.txt: no such file"]


@row("classify-empty-input")
def _(t, m):
    f = write(t / "empty.txt", "\n")
    return ["classify", "--model", m.cls, "--input", f], [f"{f}: only blank lines, no texts to classify"]


@row("classify-binary-input")
def _(t, m):
    f = write(t / "photo.png", BINARY)
    return ["classify", "--model", m.cls, "--input", f], [f"{f}:3: binary data"]


@row("classify-invalid-utf8")
def _(t, m):
    f = write(t / "latin1.txt", BAD_UTF8)
    return ["classify", "--model", m.cls, "--input", f], [f"{f}:3: invalid UTF-8"]


# embed (an existing --out file must survive a bad input)

def _embed(t, m, f):
    out = write(t / "vectors.jsonl", '{"text": "kept", "embedding": [1.0]}\n')
    return ["embed", "--model", m.cls, "--input", f, "--out", out]


@row("embed-missing-input")
def _(t, m):
    return _embed(t, m, t / "nope.txt"), [f"{t}/nope.txt: no such file"]


@row("embed-empty-input")
def _(t, m):
    f = write(t / "empty.txt", "")
    return _embed(t, m, f), [f"{f}: empty file, no sentences to embed"]


@row("embed-binary-input")
def _(t, m):
    f = write(t / "photo.png", BINARY)
    return _embed(t, m, f), [f"{f}:3: binary data"]


@row("embed-invalid-utf8")
def _(t, m):
    f = write(t / "latin1.txt", BAD_UTF8)
    return _embed(t, m, f), [f"{f}:3: invalid UTF-8"]


# generate

@row("generate-not-gguf")
def _(t, m):
    f = write(t / "fake.gguf", "this is not a GGUF file\n")
    return ["generate", "--model", f, "--prompt", "Hi"], [f"{f}: not a readable GGUF file"]


@row("generate-gguf-unsupported-architecture")
def _(t, m):
    f = gguf_of_architecture(t / "mamba.gguf", "mamba")
    return ["generate", "--model", f, "--prompt", "Hi"], [f"{f}: GGUF architecture 'mamba' is not supported"]


@row("generate-gguf-incomplete-llama")
def _(t, m):
    f = gguf_of_architecture(t / "llama.gguf", "llama", embedding=False)
    return ["generate", "--model", f, "--prompt", "Hi"], [f"{f}: the GGUF metadata has no llama.embedding_length"]


@row("generate-top-p-1.5", status=2)
def _(t, m):
    return ["generate", "--model", m.lm, "--prompt", "Hi", "--sample", "--top-p", "1.5"], ["argument --top-p: 1.5"]


@row("generate-temperature-negative", status=2)
def _(t, m):
    return (["generate", "--model", m.lm, "--prompt", "Hi", "--sample", "--temperature", "-1"],
            ["argument --temperature: -1 is out of range"])


@row("generate-prompt-longer-than-context")
def _(t, m):
    # 100 characters + <s> = 101 tokens (char tokenizer) for a model with 32 learned positions
    return (["generate", "--model", m.lm, "--prompt", "ab" * 50, "--max-len", "5"],
            ["--prompt: the prompt is 101 tokens", "context of 32 positions", "at most 31 tokens"])


@row("generate-model-without-tokenizer")
def _(t, m):
    d = copy(m.lm, t / "model", drop=("tokenizer.json",))
    return ["generate", "--model", d, "--prompt", "Hi"], [f"{d}: no tokenizer.json"]


# -- running the table ----------------------------------------------------------------------------------


def snapshot(*roots: Path) -> dict:
    """Every file and folder under the roots: kind, size, mtime and content hash."""
    seen = {}
    for root in roots:
        for p in [root, *sorted(root.rglob("*"))]:
            st = p.stat()
            seen[str(p)] = "dir" if p.is_dir() else (st.st_size, st.st_mtime_ns,
                                                      hashlib.sha256(p.read_bytes()).hexdigest())
    return seen


@dataclass
class Outcome:
    argv: list
    expect: list
    result: subprocess.CompletedProcess
    before: dict
    after: dict


@pytest.fixture(scope="module")
def outcomes(request, models, tmp_path_factory):
    """Runs the selected rows two at a time (each is mostly torch's import); a row's result is
    looked up by its build function."""
    selected = {item.callspec.params["build"]: item.callspec.id for item in request.session.items
                if getattr(item, "originalname", "") == "test_bad_input"}
    shared = [models.data, models.mt, models.lm, models.cls]

    def one(build, name):
        try:
            t = tmp_path_factory.mktemp(name)
            argv, expect = build(t, models)
            before = snapshot(t, *shared)
            result = run_forked(argv, env=ENV, timeout=TIMEOUT)
            return Outcome(argv, expect, result, before, snapshot(t, *shared))
        except BaseException as e:  # e.g. pytest.skip from a builder: raised again by that row alone
            return e

    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        futures = {b: pool.submit(one, b, name) for b, name in selected.items()}
    return {b: f.result() for b, f in futures.items()}


@pytest.mark.parametrize("build, status", ROWS)
def test_bad_input(build, status, outcomes):
    o = outcomes[build]
    if isinstance(o, BaseException):
        raise o
    res, cmd = o.result, o.argv[0]
    shown = f"argv: {' '.join(map(str, o.argv))}\nexit {res.returncode}\nstderr:\n{res.stderr[-3000:]}"
    assert res.returncode == status, shown
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr, shown
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    if status == 2:  # argparse: usage lines, then one error line
        lines = [l for l in lines if not (l.startswith("usage:") or l.startswith(" "))]
    assert len(lines) == 1, shown
    assert lines[0].startswith(f"attnlab {cmd}: error: "), shown
    for fragment in o.expect:
        assert str(fragment) in lines[0], f"{fragment!r} not in the message\n{shown}"
    assert o.after == o.before, f"files changed on disk\n{shown}"


def test_the_table_is_wide_enough():
    assert len(ROWS) >= 30
    assert len({p.id for p in ROWS}) == len(ROWS)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root writes through chmod; the --out-under-a-file row covers root")
def test_out_in_a_read_only_directory(tmp_path, models):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        res = run(["train", "--train", models.data / "tr.tsv", "--out", ro / "run", *FAST])
    finally:
        ro.chmod(0o755)
    assert res.returncode == 1 and f"--out {ro}/run: {ro} is not writable" in res.stderr, res.stderr
    assert not (ro / "run").exists()


# -- Ctrl-C during training, then --resume: the same weights as a run never interrupted ------------------


def test_ctrl_c_saves_a_checkpoint_and_resume_matches_an_uninterrupted_run(tmp_path):
    steps = 40
    common = ["train", "--train", corpus_dir() / "dev.tsv", "--preset", "mt-tiny", "--vocab-size", "200",
              "--max-tokens", "500", "--save-every", "1000", "--eval-every", "0", "--max-steps", str(steps),
              "--no-progress", "--threads", "1", "--seed", "7"]
    straight, cut = tmp_path / "straight", tmp_path / "interrupted"
    whole = subprocess.Popen([ATTNLAB, *map(str, common), "--out", str(straight)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=ENV)
    proc = subprocess.Popen([ATTNLAB, *map(str, common), "--out", str(cut)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=ENV)
    deadline = time.time() + TIMEOUT
    while not (cut / "task.json").exists():  # written at the end of setup, just before the first step
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.02)
    time.sleep(0.25)  # a few steps
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and "internal error" not in err, err
    m = re.search(r"interrupted at step (\d+): checkpoint saved in (\S+);", err)
    assert m and m[2] == str(cut), err
    n = int(m[1])
    assert 0 < n < steps, f"SIGINT landed at step {n} of {steps}"
    assert torch.load(cut / "checkpoint_last.pt", weights_only=False)["step"] == n

    res = run(["train", "--resume", cut])
    assert res.returncode == 0, res.stderr[-3000:]
    assert whole.wait(timeout=TIMEOUT) == 0, whole.stdout.read()[-3000:]
    whole.stdout.close()
    assert torch.load(cut / "checkpoint_last.pt", weights_only=False)["step"] == steps
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(cut / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
