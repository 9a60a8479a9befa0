"""The documentation is executable: what README.md and docs/*.md show is what this file runs.

Every command line in a fenced block of the docs runs here, as the installed ``attnlab`` console
script's ``main`` in a process of its own (forked from a server that imported attnlab once:
``forked_cli``; ``test_a_forked_command_is_the_console_script`` holds the two equal), in a scratch
folder that holds small files under the names the docs use (train.tsv.gz, sst2/train.tsv, input.txt,
…). Long runs get small budgets appended (``--max-steps 2``, ``--max-len 6``, the demo's
``--minutes 0.1 --test-sentences 10``); the documented flags themselves are passed unchanged, so a
renamed or removed flag fails here. Model directories
(runs/enzh, runs/sst2, …) are made by the documented train command that writes them. Every Python
block of the README runs through the interpreter; a ``>>>`` block must print what it shows. A command
that cannot run here (it needs the network, a GPU, or hours) is checked with ``attnlab --dry-run`` or
``--help`` and listed in NOT_RUN with the reason. A documented command that no rule below covers fails
the test: adding a command to the docs means adding its check here.
"""

from __future__ import annotations

import gzip
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import forked_cli
from forked_cli import ATTNLAB

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CORPUS = ROOT / "src" / "attnlab" / "data" / "corpora" / "tatoeba_cmn_eng"
BIN = Path(sys.executable).parent
PROGRAMS = ("attnlab", "make", "pip", "python", "torchrun", "echo")

# The threads conftest.py gave this process (1 where `make test` runs two test processes on 2 cores):
# a command with more would fight the other test process's OpenMP workers for the cores.
THREADS = str(torch.get_num_threads())
# Small budgets appended per sub-command (later flags win in argparse, so documented values are overridden).
BUDGET = {
    "train": ["--max-steps", "2", "--no-progress", "--threads", THREADS],
    "generate": ["--max-len", "6"],
    "translate": ["--max-len", "8"],
    "evaluate": ["--max-len", "8"],
}
# Strings of the docs that name things this machine cannot fetch, and the local stand-ins used here.
STAND_INS = {"Helsinki-NLP/opus-mt-en-de": "{ws}/opus-mt-tiny"}
# Documented commands checked without running them in full, and why.
NOT_RUN = {
    "make demo": "the 10-minute demo itself; `attnlab demo` runs here with a small budget; `make -n demo` is checked",
    "make test": "this suite; `make -n test` is checked",
    "torchrun": "tests/test_train.py runs 2 torchrun processes against 1; here `python -m attnlab train` is dry-run",
    "pip install": "installs from an index; the extras it names are checked against pyproject.toml",
    "python benchmarks/": "benchmarks take minutes to hours; each script's --help must accept the documented arguments",
    "attnlab serve": "a server runs until stopped; tests/test_serve.py serves live on a loopback port; here --dry-run",
}


@dataclass(frozen=True)
class Doc:
    file: str
    line: int
    text: str  # the command (continuations joined) or the code block
    shown: str = ""  # in a "$ " transcript: the output the docs show under the command

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text.splitlines()[0][:90]}"


def _blocks(path: Path):
    """(language, first line number, lines) of every fenced block."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if m:
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            yield m.group(1), i + 2, lines[i + 1: j]
            i = j
        i += 1


def documented_commands() -> list[Doc]:
    out = []
    for path in DOCS:
        for lang, first, lines in _blocks(path):
            if lang == "python" or any(l.startswith(">>>") for l in lines):
                continue
            prompt = any(l.startswith("$ ") for l in lines)  # a transcript: only "$ " lines are commands
            cur, start = "", 0
            for k, line in enumerate(lines):
                if not cur:
                    start = first + k
                    if prompt and not line.startswith("$ "):
                        continue
                    line = line[2:] if line.startswith("$ ") else line
                cur += (" " if cur else "") + line.strip()
                if cur.endswith("\\"):
                    cur = cur[:-1].rstrip()
                    continue
                words = shlex.split(cur.split(" | ")[-1], comments=True) if cur.strip() else []
                if words and words[0] in PROGRAMS:
                    shown = []
                    if prompt:
                        for later in lines[k + 1:]:
                            if later.startswith("$ "):
                                break
                            shown.append(later)
                    out.append(Doc(str(path.relative_to(ROOT)), start, cur, "\n".join(shown)))
                cur = ""
    return out


def python_blocks() -> list[Doc]:
    out = []
    for path in DOCS:
        for lang, first, lines in _blocks(path):
            if lang == "python" or any(l.startswith(">>>") for l in lines):
                out.append(Doc(str(path.relative_to(ROOT)), first, "\n".join(lines)))
    return out


# -- the scratch folder: small files under the documented names ---------------------------------------------


def _corpus_rows(name: str, n: int) -> list[tuple[str, str]]:
    path = CORPUS / name
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        rows = [l.rstrip("\n").split("\t")[:2] for _, l in zip(range(n), f)]
    return [(a, b) for a, b in rows]


def _write(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = ("\n".join(lines) + "\n").encode("utf-8")
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def make_workspace(ws: Path) -> None:
    train, dev, test = _corpus_rows("train.tsv.gz", 3000), _corpus_rows("dev.tsv", 30), _corpus_rows("test.tsv", 8)
    _write(ws / "train.tsv.gz", ["\t".join(r) for r in train])
    _write(ws / "dev.tsv", ["\t".join(r) for r in dev])
    _write(ws / "test.tsv", ["\t".join(r) for r in test])
    _write(ws / "test.en", [a for a, _ in test])
    _write(ws / "test.zh", [b for _, b in test])
    for split, rows in (("train", train[:600]), ("val", dev)):  # stand-ins for Multi30k's aligned files
        _write(ws / "multi30k" / f"{split}.de.gz", [a for a, _ in rows])
        _write(ws / "multi30k" / f"{split}.en.gz", [b for _, b in rows])
    english = [a for a, _ in train]
    _write(ws / "input.txt", english[:2500])
    _write(ws / "val.txt", english[2500:2700])
    _write(ws / "sentences.txt", english[:800])
    _write(ws / "held_out.txt", english[2700:2800])
    labelled = [f"{'positive' if ('love' in s or 'like' in s or 'good' in s) else 'negative'}\t{s}" for s in english]
    _write(ws / "sst2" / "train.tsv", labelled[:400])
    _write(ws / "sst2" / "dev.tsv", labelled[400:440])
    _write(ws / "test.tsv", labelled[440:480])  # classification rows; the translation commands use test.en/.zh
    _write_digits(ws / "mnist10k")
    (ws / "notes.txt").write_bytes("hello\nworld\n".encode() + b"caf\xe9 au lait\n")  # not UTF-8 on line 3
    # A tiny random MarianMT folder stands in for Helsinki-NLP/opus-mt-en-de (no network here).
    from transformers import MarianConfig, MarianMTModel
    cfg = MarianConfig(vocab_size=300, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                       decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                       pad_token_id=299, decoder_start_token_id=299, eos_token_id=0)
    MarianMTModel(cfg).save_pretrained(ws / "opus-mt-tiny")


def _write_digits(folder: Path) -> None:
    """mnist10k/train.npz and dev.npz: the first real digits of ../shared/data/mnist10k where it exists,
    else random 28×28 images (the commands run the same either way)."""
    import numpy as np
    folder.mkdir(parents=True, exist_ok=True)
    real = ROOT.parent / "shared" / "data" / "mnist10k"
    for split, n in (("train", 400), ("dev", 100)):
        if (real / f"{split}.npz").exists():
            d = np.load(real / f"{split}.npz")
            images, labels = d["images"][:n], d["labels"][:n]
        else:
            rng = np.random.default_rng(0)
            images, labels = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), np.arange(n) % 10
        np.savez(folder / f"{split}.npz", images=images, labels=labels)


class Runner:
    """Runs documented commands in the scratch folder, each at most once, producers first."""

    def __init__(self, ws: Path):
        self.ws, self.done = ws, {}
        self.helps = {}  # benchmark script → its --help run: one process per script, not per documented variant
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": THREADS, "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}

    def producer(self, run_dir: str) -> Doc | None:
        return next((d for d in documented_commands() if re.search(rf"--out {re.escape(run_dir)}(\s|$)", d.text)
                     and " train " in f" {d.text} " and "--resume" not in d.text), None)

    def needs(self, text: str) -> None:
        for run_dir in re.findall(r"(?:--model|--resume|--init|load\(\")\s*\"?(runs/[\w-]+)", text):
            doc = self.producer(run_dir)
            assert doc is not None, f"{run_dir} is used in the docs but no documented train command writes it"
            self.run(doc)

    def run(self, doc: Doc) -> subprocess.CompletedProcess:
        key = tuple(shlex.split(doc.text, comments=True))  # the same command documented twice runs once
        if key[:2] == ("attnlab", "demo"):  # a demo runs here with a fixed budget: once per preset
            key = ("attnlab", "demo", *(key[key.index("--preset"):key.index("--preset") + 2] if "--preset" in key else ()))
        if key not in self.done:
            self.needs(doc.text)
            self.done[key] = check_command(doc, self)
        return self.done[key]

    def attnlab(self, args: list[str], stdin: str | None = None, env: dict | None = None,
                timeout: int = 300) -> subprocess.CompletedProcess:
        """``attnlab ARGS`` in the scratch folder (forked: see ``forked_cli``)."""
        return forked_cli.run(args, cwd=self.ws, stdin=stdin, env={**self.env, **(env or {})}, timeout=timeout)

    def python(self, argv: list[str], stdin: str | None = None, env: dict | None = None,
               timeout: int = 300) -> subprocess.CompletedProcess:
        """``python ARGS`` (``-c CODE`` or a script) in the scratch folder (forked: ``forked_cli.run_python``)."""
        return forked_cli.run_python(argv, cwd=self.ws, stdin=stdin, env={**self.env, **(env or {})}, timeout=timeout)

    def call(self, argv: list[str], stdin: str | None = None, env: dict | None = None,
             timeout: int = 300) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=self.ws, input=stdin, capture_output=True, text=True, timeout=timeout,
                              env={**self.env, **(env or {})})


def _ok(res: subprocess.CompletedProcess, doc: Doc) -> subprocess.CompletedProcess:
    assert res.returncode == 0, f"{doc}\n$ {' '.join(res.args)}\nexit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr, res.stderr
    return res


def check_command(doc: Doc, runner: Runner) -> subprocess.CompletedProcess | None:
    text = doc.text
    stdin = None
    if " | " in text:
        left, text = text.split(" | ", 1)
        echo = shlex.split(left)
        assert echo[0] == "echo", doc
        stdin = " ".join(echo[1:]) + "\n"
    words = shlex.split(text, comments=True)
    prog, args = words[0], [w for w in words[1:] if w != "..."]
    if prog == "make":
        return _ok(subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True), doc)
    if prog == "pip":
        extras = re.findall(r"\.\[([\w,]+)\]", text)
        pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
        for extra in ",".join(extras).split(","):
            assert not extra or re.search(rf"^{extra} = \[", pyproject, re.M), f"{doc}: no extra [{extra}] in pyproject"
        return None
    if prog == "torchrun":
        m = args.index("-m")
        assert args[m + 1] == "attnlab", doc
        return _ok(runner.call([sys.executable, "-m", "attnlab", "--dry-run", *args[m + 2:]]), doc)
    if prog == "python":
        script = ROOT / args[0]
        assert script.exists(), f"{doc}: {args[0]} does not exist"
        if script not in runner.helps:
            runner.helps[script] = _ok(runner.python([str(script), "--help"], timeout=120), doc)
        res = runner.helps[script]
        for prev, a in zip(args, args[1:]):
            if a.startswith("--"):
                assert a in res.stdout, f"{doc}: {script.name} --help does not list {a}"
            elif not prev.startswith("--"):  # a positional (a recipe name): one of the listed choices
                assert a in res.stdout, f"{doc}: {script.name} --help does not accept {a!r}"
        return res
    assert prog == "attnlab", doc
    command = args[0]
    if command == "serve":
        return _ok(runner.attnlab(["--dry-run", *args]), doc)
    env = {}
    if command == "demo":
        preset = args[args.index("--preset"):args.index("--preset") + 2] if "--preset" in args else []
        out = args[args.index("--out") + 1] if "--out" in args else "runs/demo"
        args = ["demo", "--minutes", "0.1", "--test-sentences", "10", "--out", out, *preset]
    else:
        args = args + BUDGET.get(command, [])
        if command == "train" and "--task" not in args and "--resume" not in args:
            args += ["--eval-sentences", "4"]  # translation: dev BLEU on 4 sentences
    if "--compile" in args:
        env["ATTNLAB_COMPILE"] = "0"  # compiling SmolLM2 takes a minute; the switch keeps the same path eager
    if command == "train" and "--resume" in args:
        args += ["--max-steps", "4"]
    errors = [l for l in doc.shown.splitlines() if ": error: " in l]
    if errors:  # the docs show this command failing: it must fail with the line shown, and no traceback
        res = runner.attnlab(args, stdin=stdin, env=env)
        assert res.returncode in (1, 2) and "Traceback" not in res.stderr, f"{doc}\n{res.stderr}"
        for line in errors:
            assert line in res.stderr.splitlines(), f"{doc}\nthe docs show: {line}\nattnlab prints: {res.stderr}"
        return res
    res = _ok(runner.attnlab(args, stdin=stdin, env=env), doc)
    if command == "demo":
        assert "sacreBLEU" in res.stdout and (runner.ws / out / "attention.png").exists()
    if command == "train":
        out = args[args.index("--out") + 1] if "--out" in args else args[args.index("--resume") + 1]
        assert (runner.ws / out / "model.safetensors").exists() and (runner.ws / out / "checkpoint_last.pt").exists()
    if "--out" in args and command in ("attention", "embed"):
        assert (runner.ws / args[args.index("--out") + 1]).stat().st_size > 0
    return res


# -- the tests ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    ws = tmp_path_factory.mktemp("docs")
    make_workspace(ws)
    return Runner(ws)


def test_docs_have_commands_and_blocks():
    """The parser sees the docs (a silently empty list would make the tests below pass vacuously)."""
    cmds = documented_commands()
    assert len(cmds) >= 30 and len(python_blocks()) >= 5
    for name in ("demo", "train", "translate", "evaluate", "attention", "average", "classify", "generate",
                 "embed", "params"):
        assert any(re.match(rf"(echo .* \| )?attnlab {name}\b", d.text) for d in cmds), name
    assert any("--task mlm" in d.text and "evaluate" in d.text for d in cmds)


@pytest.mark.parametrize("doc", documented_commands(), ids=str)
def test_documented_command_runs(doc, runner):
    runner.run(doc)


@pytest.mark.parametrize("doc", python_blocks(), ids=str)
def test_documented_python_runs(doc, runner):
    code = doc.text
    for name, local in STAND_INS.items():
        code = code.replace(name, local.format(ws=runner.ws))
    runner.needs(code)
    if code.lstrip().startswith(">>>"):  # a REPL transcript: each >>> line must print what follows it
        lines = code.splitlines()
        for i, line in enumerate(lines):
            if line.startswith(">>> "):
                expected = "\n".join(l for l in lines[i + 1:] if not l.startswith(">>>")).strip()
                probe = ("from attnlab import *\ntry:\n    r = " + line[4:] +
                         "\n    print(repr(r))\nexcept Exception as e:\n    print(f'{type(e).__name__}: {e}')\n")
                res = _ok(runner.python(["-c", probe]), doc)
                assert res.stdout.strip() == expected, f"{doc}\nshows:  {expected}\nprints: {res.stdout.strip()}"
        return
    _ok(runner.python(["-c", code], timeout=600), doc)


def test_shown_output_is_what_the_command_prints(runner):
    """A transcript in the README (``$ attnlab params paper-base`` and its table) matches the real output
    line by line ("..." stands for lines left out)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"```\n\$ (attnlab params paper-base)\n(.*?)```", text, re.S)
    assert m, "the params transcript is gone from the README"
    shown = [l.rstrip() for l in m.group(2).splitlines() if l.strip() and l.strip() != "..."]
    res = _ok(runner.call([ATTNLAB, *shlex.split(m.group(1))[1:]]), Doc("README.md", 0, m.group(1)))
    printed = [l.rstrip() for l in res.stdout.splitlines()]
    for line in shown:
        assert line in printed, f"README shows {line!r}, attnlab prints:\n" + "\n".join(printed)


@pytest.mark.parametrize("argv, stdin", [
    (["params", "paper-base"], None),                         # a success: the table
    (["train", "--train", "missing.tsv", "--out", "runs/x"], None),  # a user error: exit 1, one line
    (["translate", "--beam", "many"], None),                  # a usage error: exit 2, argparse's lines
    (["generate", "--model", "runs/shakespeare", "--prompt", "ROMEO:", "--max-len", "4"], None),
    (["classify", "--model", "runs/sst2"], "a gorgeous, witty, seductive movie\n"),  # stdin
])
def test_a_forked_command_is_the_console_script(argv, stdin, runner):
    """What the rows above run (main() in a forked process) prints and exits as the console script does."""
    runner.needs(" ".join(argv))  # the model directories it reads, made by their documented train commands
    forked = runner.attnlab(argv, stdin=stdin)
    script = runner.call([ATTNLAB, *argv], stdin=stdin)
    assert (forked.returncode, forked.stdout, forked.stderr) == (script.returncode, script.stdout, script.stderr)
    assert forked.returncode == (0 if argv[0] in ("params", "generate", "classify") else 1 if argv[0] == "train" else 2)


@pytest.mark.parametrize("argv", [
    ["-c", "import os, sys\nprint(__name__, sys.argv, repr(sys.path[0]), os.getcwd(), "
           f"{str(ROOT / 'tests')!r} in map(os.path.abspath, sys.path))\nimport attnlab\nraise ValueError('x')",
     "an-argument"],  # __main__, argv, the path's head (the tests' folder not on it), the folder; an exception
    [str(ROOT / "benchmarks" / "loss_memory.py"), "--help"],  # a benchmark script: its own folder on the path
])
def test_a_forked_python_is_the_interpreter(argv, runner):
    """What the Python blocks and the benchmarks' --help above run (``python ARGS`` in a forked process) prints
    and exits as a new interpreter does."""
    forked = runner.python(argv)
    fresh = runner.call([sys.executable, *argv])
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout)
    assert forked.stderr.strip().splitlines()[-1:] == fresh.stderr.strip().splitlines()[-1:]
    assert forked.returncode == (1 if argv[0] == "-c" else 0)


def test_not_run_reasons_are_used():
    """Each NOT_RUN entry matches a documented command (stale reasons go)."""
    texts = [d.text for d in documented_commands()]
    for key in NOT_RUN:
        assert any(t.startswith(key) for t in texts), key


def test_concept_table_points_at_real_names():
    """Every row of README's "Where each concept lives" names files that exist and names defined there."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text[text.index("## Where each concept lives"):]
    table = table[: table.index("\n\n", table.index("| concept"))]
    rows = [l for l in table.splitlines() if l.startswith("| ") and not l.startswith("| concept")]
    assert len(rows) >= 30
    for row in rows:
        _, concept, files, names, _ = row.split("|")
        paths = []
        for f in re.findall(r"`([^`]+)`", files):
            f = f if f.startswith("src/") else "src/attnlab/" + f
            path = ROOT / f
            assert path.exists(), f"{concept.strip()}: {f} does not exist"
            paths += sorted(path.rglob("*.py")) if path.is_dir() else [path]
        source = "\n".join(p.read_text(encoding="utf-8") for p in paths)
        for name in re.findall(r"`([^`]+)`", names):
            leaf = name.split(".")[-1].split(" ")[0].strip("()")
            assert re.search(rf"(def|class) {re.escape(leaf)}\b|^{re.escape(leaf)}\b\s*[:=]|\b{re.escape(leaf)} = ",
                             source, re.M), f"{concept.strip()}: {name} is not defined in {files.strip()}"
