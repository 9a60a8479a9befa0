"""attnlab demo: the main job on the shipped corpus."""

from __future__ import annotations

from ..config import PRESETS
from .common import add_device, positive_float, positive_int

ENCODER_DECODER = [name for name, p in PRESETS.items() if p["family"] == "encoder-decoder"]

HELP = "the main job: train English→Chinese on the shipped corpus, evaluate, translate, draw"
EXAMPLES = ("attnlab demo                 # ~10 minutes on 2 CPU cores\n  attnlab demo --minutes 3\n"
            "  attnlab demo --preset t5-mini --out runs/demo-t5   # the same recipe with T5")


def arguments(p) -> None:
    p.add_argument("--minutes", type=positive_float, default=10.0, help="training time budget (default 10)")
    p.add_argument("--out", default="runs/demo", help="model directory (default runs/demo)")
    p.add_argument("--preset", default="mt-small", choices=ENCODER_DECODER,
                   help="the encoder-decoder to train with the demo's recipe (default mt-small)")
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--test-sentences", type=positive_int, default=None, metavar="N",
                   help="score only the first N test sentences, and at most N dev sentences at training's "
                        "evaluations (a small budget, e.g. for tests)")
    add_device(p)


def run(args) -> int:
    from ..demo import run_demo
    from .train import check_writable
    check_writable(args.out)
    return run_demo(minutes=args.minutes, out=args.out, threads=args.threads, test_sentences=args.test_sentences,
                    device=args.device, preset=args.preset)
