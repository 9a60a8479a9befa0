"""Each benchmark script that needs nothing outside this repository runs for one step (the benchmarks
themselves are not tests: they take minutes and measure speed; this keeps them from rotting)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_train_speed_runs_one_step():
    pytest.importorskip("transformers")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_speed.py"), "--steps", "1", "--shapes",
                          "tiny", "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    row = r["tiny_fp32"]
    assert {"attnlab", "hf_marian", "torch_nn_transformer"} <= set(row)
    assert row["attnlab"]["ms_per_step"] > 0 and row["attnlab_vs_hf"] > 0 and r["matmul_peak_GFLOPs_fp32"] > 0
