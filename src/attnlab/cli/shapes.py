"""attnlab shapes: the tensor shape after every stage of a forward pass."""

from __future__ import annotations

HELP = "tensor shape after every stage of a forward pass on a sample batch"
EXAMPLES = "attnlab shapes mt-tiny\n  attnlab shapes llama-mini"


def arguments(p) -> None:
    p.add_argument("config", help="preset name, config.json, or model directory")


def run(args) -> int:
    from ..config import load_config
    from ..inspect.shapes import shapes_report
    from ..model import build_model
    print(shapes_report(build_model(load_config(args.config)).eval()))
    return 0
