"""attnlab average: the mean of the last N step checkpoints (the paper averages the last 5)."""

from __future__ import annotations

from .common import add_model, positive_int

HELP = "average the last N checkpoints (as the paper does)"
EXAMPLES = "attnlab average --model runs/enzh --last 5"


def arguments(p) -> None:
    add_model(p)
    p.add_argument("--last", type=positive_int, default=5)
    p.add_argument("--out", default=None, help="output file (default: MODEL/model.safetensors)")


def run(args) -> int:
    from ..train import average_checkpoints
    out = average_checkpoints(args.model, args.last, args.out)
    print(f"averaged the last {args.last} checkpoints of {args.model} into {out}")
    return 0
