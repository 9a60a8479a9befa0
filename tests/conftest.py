import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

# `make test` runs the files in 2 processes (pytest-xdist, `-n 2 --dist loadfile`): on 2 cores each
# takes one thread, so that neither waits for the other's spinning OpenMP workers
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def shakespeare_stand_in():
    """``write(folder, repeats)``: a stand-in for Tiny Shakespeare's input.txt in ``folder`` (made if missing), two
    lines of its opening ``repeats`` times (the benchmarks' smoke runs read a text there, not the real one); the file."""
    def write(folder, repeats: int):
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "input.txt"
        path.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * repeats, encoding="utf-8")
        return path
    return write


@pytest.fixture(scope="session")
def benchmark_module():
    """``load(name)``: the module ``name`` of benchmarks/ (train_speed, peers, ...), imported as its scripts import
    each other, with benchmarks/ on sys.path, for the import only."""
    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")

    def load(name: str):
        sys.path.insert(0, folder)
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(folder)
    return load
