import os

import pytest
import torch

# `make test` runs the files in 2 processes (pytest-xdist, `-n 2 --dist loadfile`): on 2 cores each
# takes one thread, so that neither waits for the other's spinning OpenMP workers
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
