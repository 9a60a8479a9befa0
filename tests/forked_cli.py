"""The ``attnlab`` console script (``run``) and ``python -c CODE`` or ``python SCRIPT`` (``run_python``), run in
processes forked from a server that imported attnlab once.

Why: a new interpreter per command spends ~1.5 of its ~2 s importing torch, and the bad-input table and
the executable docs run ~150 commands. A forked command is still a process of its own, given its own
working directory, environment, threads, stdin, stdout and stderr files and ``sys.argv``: its exit
status (an uncaught exception prints its traceback on stderr and exits 1, as Python does), what it
prints and what it writes are the console script's (``test_a_forked_command_is_the_console_script`` in
test_docs.py compares the two on a success, a user error, a usage error, a generation and a piped
stdin). The server runs no torch op, so no OpenMP threads exist when it forks. Used by tests/test_bad_inputs.py and tests/test_docs.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from multiprocessing.connection import wait
from pathlib import Path

ATTNLAB = str(Path(sys.executable).with_name("attnlab"))
if not Path(ATTNLAB).exists():  # pragma: no cover - a non-venv install
    ATTNLAB = shutil.which("attnlab") or ATTNLAB

_ctx = None
# Process.start() polls every live child of this process: from two threads at once, two polls can read
# one child's exit status from its pipe, and the loser sees EOF (exit 255). Starts and polls take turns.
_LOCK = threading.Lock()


def _server():
    """multiprocessing's fork server (one per pytest process), attnlab.cli imported in it."""
    global _ctx
    with _LOCK:
        if _ctx is None:
            import multiprocessing.forkserver
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["attnlab.cli"])
            multiprocessing.forkserver.ensure_running()
            _ctx = ctx
    return _ctx


def _fresh(cwd: str | None, env: dict, stdin: str | None, out: str, err: str) -> None:
    """In the forked process: what a fresh process would have (environment, threads, directory, standard files)."""
    import warnings

    import torch
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS", "").isdigit():  # the server's OpenMP was set up with its own environment
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if env.get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    if cwd:
        os.chdir(cwd)
    os.dup2(os.open(stdin or os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", closefd=False)


def _command(argv: list[str], cwd: str | None, env: dict, stdin: str | None, out: str, err: str) -> None:
    """In the forked process: the console script's main."""
    _fresh(cwd, env, stdin, out, err)
    sys.argv = [ATTNLAB, *argv]
    from attnlab.cli import main
    try:
        code = main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def _python(argv: list[str], cwd: str | None, env: dict, stdin: str | None, out: str, err: str) -> None:
    """In the forked process: ``python -c CODE [ARGS]`` or ``python SCRIPT [ARGS]`` as the interpreter runs them:
    ``__main__``, ``sys.argv``, and ``sys.path[0]`` the current folder (``-c``) or the script's; the server's own
    additions to the path (the tests' folder) gone."""
    import runpy
    import types
    _fresh(cwd, env, stdin, out, err)
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        if argv[0] == "-c":
            sys.argv, sys.path[:] = ["-c", *argv[2:]], ["", *rest]
            main = types.ModuleType("__main__")  # (a module of its own, as the interpreter's: pickling sees it)
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            script = os.path.abspath(argv[0])
            sys.argv, sys.path[:] = list(argv), [os.path.dirname(script), *rest]
            runpy.run_path(script, run_name="__main__")
    except Exception:  # as the interpreter does: the traceback on stderr, exit 1 (multiprocessing would add a line)
        import traceback
        traceback.print_exc()
        sys.exit(1)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def run(argv, *, env: dict | None = None, cwd=None, stdin: str | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """``subprocess.run([ATTNLAB, *argv], capture_output=True, text=True, ...)``, forked."""
    return _forked(_command, [ATTNLAB], argv, env, cwd, stdin, timeout)


def run_python(argv, *, env: dict | None = None, cwd=None, stdin: str | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)``, forked: ``argv`` is
    ``["-c", CODE, ...]`` or ``[SCRIPT, ...]``."""
    return _forked(_python, [sys.executable], argv, env, cwd, stdin, timeout)


def _forked(target, program: list[str], argv, env, cwd, stdin, timeout) -> subprocess.CompletedProcess:
    argv = [str(a) for a in argv]
    with tempfile.TemporaryDirectory() as d:
        out, err, inp = (os.path.join(d, n) for n in ("out", "err", "in"))
        if stdin is not None:
            Path(inp).write_text(stdin, encoding="utf-8")
        p = _server().Process(target=target, args=(argv, None if cwd is None else str(cwd),
                                                   dict(os.environ if env is None else env),
                                                   None if stdin is None else inp, out, err))
        with _LOCK:
            p.start()
        wait([p.sentinel], timeout)
        with _LOCK:
            code = p.exitcode
            if code is None:
                p.kill()
                p.join()
        if code is None:
            raise subprocess.TimeoutExpired([*program, *argv], timeout)
        read = lambda f: Path(f).read_text(encoding="utf-8", errors="replace") if os.path.exists(f) else ""
        return subprocess.CompletedProcess([*program, *argv], code, read(out), read(err))
