"""attnlab embed: sentence embeddings as JSON lines or a .npy matrix."""

from __future__ import annotations

import json
import sys

from .common import add_device, add_inputs, add_model, add_quantize, load, positive_int, read_inputs

HELP = "sentence embeddings (mean-pooled, L2-normalised for minilm) as .npy or JSON lines"
EXAMPLES = """echo "A man is eating food." | attnlab embed --model minilm
  attnlab embed --model minilm --input sentences.txt --out vectors.npy"""


def arguments(p) -> None:
    add_model(p, "minilm, an HF sentence-transformers folder, or a model dir")
    add_inputs(p, "sentence")
    p.add_argument("--out", help="output .npy (matrix) or .jsonl (default: JSON lines on stdout)")
    p.add_argument("--batch-size", type=positive_int, default=32)
    add_device(p)
    add_quantize(p)


def run(args) -> int:
    import numpy as np

    from ..modeldir import atomic_write
    lines = read_inputs(args, "sentences to embed")
    vectors = load(args).embed(lines, batch_size=args.batch_size)
    if args.out and args.out.endswith(".npy"):
        def write(tmp):
            with open(tmp, "wb") as f:  # a file object: np.save would add ".npy" to a path
                np.save(f, vectors)
        atomic_write(args.out, write)
        print(f"{len(lines)} embeddings of dimension {vectors.shape[1]} written to {args.out}")
        return 0
    rows = "".join(json.dumps({"text": t, "embedding": [round(float(x), 7) for x in v]}) + "\n"
                   for t, v in zip(lines, vectors))
    if args.out:
        from ..modeldir import atomic_write_text
        atomic_write_text(args.out, rows)
    else:
        sys.stdout.write(rows)
    return 0
