"""attnlab classify: texts in, label and probability out."""

from __future__ import annotations

from .common import add_device, add_inputs, add_model, load, read_inputs

HELP = "label texts (stdin, --input file or --text) with a trained classifier"
EXAMPLES = """echo "a gorgeous, witty film" | attnlab classify --model runs/sst2
  attnlab classify --model runs/sst2 --input reviews.txt"""


def arguments(p) -> None:
    add_model(p)
    add_inputs(p, "text")
    add_device(p)


def run(args) -> int:
    lines = read_inputs(args, "texts to classify")
    for label, prob in load(args).classify(lines):
        print(f"{label}\t{prob:.4f}")
    return 0
