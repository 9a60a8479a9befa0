"""attnlab attention: every attention map of one sentence, drawn; for an image classifier (ViT), where
its [CLS] token looks over one image (each layer's attention and the attention rollout)."""

from __future__ import annotations

from pathlib import Path

from .common import UsageError, add_device, add_model, load

HELP = "draw encoder, decoder and cross-attention maps for one sentence, or where a ViT looks in an image ([CLS] or pooled)"
EXAMPLES = """attnlab attention --model runs/enzh "I love coding." --out attn.png
  attnlab attention --model runs/vit --image digit.png --out attn.png
  attnlab attention --model runs/vit --image 7 --data mnist10k/dev.npz --out attn.png   # the 8th image"""


def arguments(p) -> None:
    add_model(p)
    p.add_argument("sentence", nargs="?", help="the sentence to translate and draw (a translation model)")
    p.add_argument("--image", metavar="FILE_OR_INDEX",
                   help="an image classifier: an image file, or the index of an image in --data")
    p.add_argument("--data", metavar="NPZ_OR_FOLDER", help="the labelled images that --image INDEX counts in")
    p.add_argument("--out", default="attention.png")
    add_device(p, "cpu")


def run(args) -> int:
    model = load(args)
    if model.kind == "image-classify":
        return _image(args, model)
    if args.image is not None or args.data is not None:
        raise UsageError(f"--image and --data are for an image classifier; {args.model} is a {model.kind} model")
    if args.sentence is None:
        raise UsageError(f"give the sentence to draw, e.g. attnlab attention --model {args.model} \"I love coding.\"")
    from ..inspect.attention import plot_attention
    maps = model.attention(args.sentence)
    plot_attention(maps, args.out, f"{args.sentence} → {maps['translation']}")
    print(f"{args.sentence} → {maps['translation']}\nattention maps written to {args.out}")
    return 0


def _image(args, model) -> int:
    """One image (a file, or --data's image number --image), its prediction, and where [CLS] looks."""
    from ..data.images import read_image_files, read_images
    from ..data.readers import DataError
    from ..inspect.attention import image_attention_maps, plot_image_attention
    from ..train.tasks.image_classify import class_labels, model_inputs
    if args.sentence is not None:
        raise UsageError(f"{args.model} is an image classifier: give --image FILE_OR_INDEX, not a sentence")
    if args.image is None:
        raise UsageError(f"{args.model} is an image classifier: give --image FILE (or --image INDEX --data NPZ)")
    cfg = model.config
    gold = None
    if Path(args.image).is_file():
        if args.data is not None:
            raise UsageError(f"--image {args.image} is a file; --data is only for an --image INDEX")
        pixels, name = read_image_files([args.image], cfg.n_channels, cfg.image_size)[0], Path(args.image).name
    elif args.image.lstrip("-").isdigit():
        if args.data is None:
            raise UsageError(f"--image {args.image} is not a file: as an index it needs --data NPZ_OR_FOLDER "
                             "(the images it counts in)")
        data, i = read_images(args.data), int(args.image)
        if not -len(data) <= i < len(data):
            raise UsageError(f"--image {i}: {args.data} has {len(data)} images (indices 0–{len(data) - 1})")
        if (data.channels, data.size) != (cfg.n_channels, (cfg.image_size, cfg.image_size)):
            raise DataError(f"{args.data}: images are {data.size[1]}×{data.size[0]}×{data.channels}, but the model "
                            f"reads {cfg.image_size}×{cfg.image_size}×{cfg.n_channels}")
        pixels, gold, name = data.images[i], data.labels[i], f"{Path(args.data).name}[{i}]"
    else:
        raise FileNotFoundError(f"--image {args.image}: no such image file (nor an index into --data)")
    x = model_inputs(model.module, model.task, pixels.permute(1, 2, 0)[None]).to(model.device)
    maps = image_attention_maps(model.module, x)
    p = maps["logits"].softmax(-1)
    label, prob = class_labels(model.module, model.task)[int(p.argmax())], float(p.max())
    said = f"{name}: predicted {label} ({prob:.2f})" + (f", labelled {gold}" if gold is not None else "")
    plot_image_attention(maps, pixels, args.out, said)
    who = "[CLS]" if model.config.pooling == "cls" else "pooled (mean of patches)"
    print(f"{said}\n{who} attention (rollout and per layer) written to {args.out}")
    return 0
