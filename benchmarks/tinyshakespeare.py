"""Tiny Shakespeare for the benchmarks that read it (train_speed.py, quant_quality.py, shakespeare_nanogpt.py):
one reader, one default place (../shared/data/tinyshakespeare beside the checkout), so that each takes the same
``--data``: input.txt or input.txt.gz, or the folder holding one."""
from __future__ import annotations

import gzip
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare"
HELP = "Tiny Shakespeare: its input.txt or input.txt.gz, or the folder holding one"


def tiny_shakespeare(path: Path | str) -> str | None:
    """Tiny Shakespeare's whole text from ``path``: its input.txt or input.txt.gz, or the folder holding one
    (input.txt first); None where there is neither."""
    path = Path(path)
    if path.is_dir():
        path = next((path / name for name in ("input.txt", "input.txt.gz") if (path / name).is_file()), path / "input.txt")
    if not path.is_file():
        return None
    return gzip.open(path, "rt", encoding="utf-8").read() if path.suffix == ".gz" else path.read_text(encoding="utf-8")


def required(path: Path | str) -> str:
    """:func:`tiny_shakespeare`, or a usage error naming ``--data`` where ``path`` has neither file."""
    text = tiny_shakespeare(path)
    if text is None:
        raise SystemExit(f"--data {path}: no input.txt or input.txt.gz of Tiny Shakespeare there")
    return text
