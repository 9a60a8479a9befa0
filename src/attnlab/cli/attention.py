"""attnlab attention: every attention map of one sentence, drawn."""

from __future__ import annotations

from .common import add_device, add_model, load

HELP = "draw encoder, decoder and cross-attention maps for one sentence"
EXAMPLES = 'attnlab attention --model runs/enzh "I love coding." --out attn.png'


def arguments(p) -> None:
    add_model(p)
    p.add_argument("sentence")
    p.add_argument("--out", default="attention.png")
    add_device(p, "cpu")


def run(args) -> int:
    from ..inspect.attention import plot_attention
    maps = load(args).attention(args.sentence)
    plot_attention(maps, args.out, f"{args.sentence} → {maps['translation']}")
    print(f"{args.sentence} → {maps['translation']}\nattention maps written to {args.out}")
    return 0
