"""attnlab translate: sentences in (stdin, --input, --text), translations out."""

from __future__ import annotations

from .common import add_device, add_generation, add_inputs, add_model, add_quantize, generation_config, load, \
    nonneg_int, positive_int, read_inputs

HELP = "translate sentences (stdin, --input file or --text) with a trained model"
EXAMPLES = """echo "I love coding." | attnlab translate --model runs/enzh
  attnlab translate --model runs/enzh --input sentences.txt --beam 4 --lenpen 0.6
  attnlab translate --model runs/enzh --text 'How are you?' --beam 4 --nbest 4"""


def arguments(p) -> None:
    add_model(p)
    add_inputs(p, "sentence")
    p.add_argument("--nbest", type=nonneg_int, default=0, help="print the N best hypotheses with scores (beam)")
    p.add_argument("--batch-size", type=positive_int, default=64)
    add_device(p)
    add_quantize(p)
    add_generation(p)


def run(args) -> int:
    lines = read_inputs(args, "sentences to translate")
    model = load(args)
    out = model.translate(lines, generation_config(args), batch_size=args.batch_size, nbest=bool(args.nbest))
    for item in out:
        if args.nbest:
            for text, score in item:
                print(f"{score:.4f}\t{text}")
            print()
        else:
            print(item)
    return 0
