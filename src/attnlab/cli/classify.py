"""attnlab classify: texts (or images) in, label and probability out."""

from __future__ import annotations

from .common import UsageError, add_device, add_inputs, add_model, load, read_inputs

HELP = "label texts (stdin, --input file or --text) with a trained classifier, or images (--image) with a ViT"
EXAMPLES = """echo "a gorgeous, witty film" | attnlab classify --model runs/sst2
  attnlab classify --model runs/sst2 --input reviews.txt
  attnlab classify --model runs/vit --image digit1.png digit2.png"""


def arguments(p) -> None:
    add_model(p)
    add_inputs(p, "text")
    p.add_argument("--image", nargs="+", metavar="FILE", help="image files, for an image classifier (ViT)")
    add_device(p)


def run(args) -> int:
    if args.image:
        if args.input is not None or args.text is not None:
            raise UsageError("give images (--image) or texts (--text, --input), not both")
        for path, (label, prob) in zip(args.image, _image_classifier(args).classify(args.image)):
            print(f"{path}\t{label}\t{prob:.4f}")
        return 0
    model = load(args)
    if model.kind == "image-classify":
        raise UsageError(f"{args.model} is an image classifier: give image files with --image FILE ...")
    for label, prob in model.classify(read_inputs(args, "texts to classify")):
        print(f"{label}\t{prob:.4f}")
    return 0


def _image_classifier(args):
    model = load(args)
    if model.kind != "image-classify":
        raise UsageError(f"--image: {args.model} is a {model.kind} model, not an image classifier")
    return model
