"""The ``attnlab`` command line. Each sub-command is a small function over the library."""

from __future__ import annotations

import argparse
import sys

from .config import PRESETS, ConfigError, load_config


def _model_from_spec(spec: str):
    from .model import build_model
    return build_model(load_config(spec))


def cmd_params(args) -> int:
    from .inspect.params import parameter_table
    model = _model_from_spec(args.config)
    cfg = model.config
    print(f"{args.config}: {cfg.family}, d_model={cfg.d_model}, heads={cfg.n_heads}"
          f" (kv {cfg.kv_heads}), layers={cfg.n_encoder_layers if cfg.has_encoder else 0}"
          f"+{cfg.n_decoder_layers if cfg.has_decoder else 0}, d_ff={cfg.d_ff}, vocab={cfg.vocab_size}")
    print(parameter_table(model))
    return 0


def cmd_shapes(args) -> int:
    from .inspect.shapes import shapes_report
    model = _model_from_spec(args.config).eval()
    print(shapes_report(model))
    return 0


def cmd_demo(args) -> int:
    import torch

    from .inspect.params import parameter_table
    from .inspect.shapes import sample_batch
    model = _model_from_spec(args.preset).eval()
    print(f"== {args.preset}: parameters")
    print(parameter_table(model))
    src, tgt, src_mask = sample_batch(model)
    with torch.no_grad():
        logits = model(src, tgt, src_mask)
    print(f"\n== forward pass: src {tuple(src.shape)} + tgt {tuple(tgt.shape)} → logits {tuple(logits.shape)}")
    print(f"next-token distribution of sentence 0, position 0: max p = "
          f"{logits[0, 0].softmax(-1).max().item():.5f} (untrained: close to uniform 1/V = "
          f"{1 / logits.shape[-1]:.5f})")
    return 0


EXAMPLES = {
    "params": "attnlab params paper-base\n  attnlab params my_config.json",
    "shapes": "attnlab shapes mt-tiny\n  attnlab shapes llama-mini",
    "demo": "attnlab demo",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnlab", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The Transformer of 'Attention Is All You Need': build, train, run, inspect.",
        epilog="presets: " + ", ".join(PRESETS))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, help: str, fn):
        p = sub.add_parser(name, help=help, description=help,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="examples:\n  " + EXAMPLES.get(name, ""))
        p.set_defaults(fn=fn)
        return p

    p = add("params", "per-module parameter table and total (vs the 12·L·d² rule of thumb)", cmd_params)
    p.add_argument("config", help="preset name, config.json, or model directory")
    p = add("shapes", "tensor shape after every stage of a forward pass on a sample batch", cmd_shapes)
    p.add_argument("config", help="preset name, config.json, or model directory")
    p = add("demo", "the main job (see README)", cmd_demo)
    p.add_argument("--preset", default="paper-base")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    try:
        return args.fn(args)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"attnlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


__all__ = ["main", "build_parser"]
