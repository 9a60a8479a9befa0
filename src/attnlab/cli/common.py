"""What the commands share: range-checked argument types, flags declared once, reading inputs."""

from __future__ import annotations

import argparse
import sys


class UsageError(ValueError):
    """A wrong or missing command-line argument found after parsing: exit status 2, as argparse's own."""


def ranged(kind, text: str, ok):
    """An argparse type: ``kind`` (int/float) whose value must satisfy ``ok``; a bad value is a usage
    error naming the flag (exit 2)."""
    def parse(raw: str):
        try:
            v = kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not {'an integer' if kind is int else 'a number'}") from None
        if v != v or not ok(v):
            raise argparse.ArgumentTypeError(f"{raw} is out of range: must be {text}")
        return v
    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


positive_int = ranged(int, ">= 1", lambda v: v >= 1)
nonneg_int = ranged(int, ">= 0", lambda v: v >= 0)
positive_float = ranged(float, "> 0", lambda v: v > 0)
nonneg_float = ranged(float, ">= 0", lambda v: v >= 0)
probability = ranged(float, "in (0, 1]", lambda v: 0 < v <= 1)


# -- flags declared once ------------------------------------------------------------------------------


def add_model(p, help: str = "model directory") -> None:
    p.add_argument("--model", required=True, help=help)


def add_device(p, default: str = "auto") -> None:
    p.add_argument("--device", default=default, help=f"auto (CUDA, else MPS, else CPU), cpu, cuda, cuda:N, mps "
                                                     f"(default {default})")


def add_quantize(p) -> None:
    from ..quant import KINDS
    p.add_argument("--quantize", choices=KINDS, default=None,
                   help="store the linear layers' weights in 8 bits (int8: per-channel scales, ~0.4%% weight "
                        "error) or 4 bits (int4: groups of 32, the output layer at int8): less memory and "
                        "faster batch-1 decoding on CPU, at some loss of quality (default: the weights as loaded)")


def add_inputs(p, what: str) -> None:
    p.add_argument("--input", help=f"file with one {what} per line (default: stdin)")
    p.add_argument("--text", help=f"just this one {what}")


def add_generation(p, sampling: bool = False) -> None:
    g = p.add_argument_group("decoding")
    g.add_argument("--beam", type=positive_int, default=1, help="beam size (1 = greedy)")
    g.add_argument("--lenpen", type=nonneg_float, default=0.6, help="GNMT length penalty alpha for beam search")
    g.add_argument("--max-len", type=positive_int, default=None,
                   help="max new tokens (default: source length + 50 for translation, 128 for LMs)")
    g.add_argument("--min-len", type=nonneg_int, default=0, help="min new tokens before EOS is allowed")
    g.add_argument("--no-repeat-ngram", type=nonneg_int, default=0, help="forbid repeating n-grams of this size")
    g.add_argument("--repetition-penalty", type=positive_float, default=1.0)
    g.add_argument("--compile", dest="compile_step", action="store_true",
                   help="torch.compile the decode step (about a minute to compile a 30-layer model on "
                        "2 CPU cores, then the fastest decoding in fp32, bf16 or --quantize; for long or "
                        "repeated generation)")
    if sampling:
        g.add_argument("--sample", action="store_true", help="sample instead of greedy/beam")
        g.add_argument("--temperature", type=positive_float, default=1.0,
                       help="sampling temperature (at least 1e-5; for deterministic output drop --sample)")
        g.add_argument("--top-k", type=nonneg_int, default=0)
        g.add_argument("--top-p", type=probability, default=1.0)
        g.add_argument("--seed", type=int, default=None)


def generation_config(args):
    """The GenerationConfig the decoding flags describe."""
    from ..generate import GenerationConfig
    return GenerationConfig(
        max_new_tokens=args.max_len, min_new_tokens=args.min_len, num_beams=args.beam,
        length_penalty=args.lenpen, do_sample=getattr(args, "sample", False),
        temperature=getattr(args, "temperature", 1.0), top_k=getattr(args, "top_k", 0),
        top_p=getattr(args, "top_p", 1.0), repetition_penalty=args.repetition_penalty,
        no_repeat_ngram_size=args.no_repeat_ngram, seed=getattr(args, "seed", None),
        num_return_sequences=args.nbest if getattr(args, "nbest", 0) else 1, compile=args.compile_step)


# -- inputs -------------------------------------------------------------------------------------------


def read_inputs(args, what: str) -> list[str]:
    """``--text``, else the lines of ``--input`` (an empty file is an error naming it), else stdin."""
    if args.text is not None:
        return [args.text]
    return read_lines(args.input, what)


def read_lines(path: str | None, what: str) -> list[str]:
    if path in (None, "-"):
        return [l.rstrip("\n") for l in sys.stdin]
    from ..data.readers import read_lines as read_file_lines
    return read_file_lines(path, what)


def load(args, bf16: bool = False):
    """``attnlab.load`` of ``--model`` on ``--device`` (``--quantize``d where the command has the flag)."""
    from ..api import load
    return load(args.model, getattr(args, "device", "auto") or "auto", bf16=bf16,
                quantize=getattr(args, "quantize", None))
