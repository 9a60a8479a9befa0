"""The ``attnlab`` command line: one module per command, each holding its flags (``arguments``), its
handler (``run``: parse, call the library, print) and its examples; this file registers them and
turns errors into one line each.

Exit status: 0 done, 1 a user error or a failure (one line on stderr, no traceback), 2 a usage error
(a bad flag value, as argparse's own), 130 interrupted. ``--debug`` shows tracebacks and attnlab's
debug log (which fast paths ran); ``--dry-run`` checks a command's arguments without running it.
"""

from __future__ import annotations

import argparse
import sys

from ..config import PRESETS, ConfigError
from . import (attention, average, classify, demo, doctor, embed, evaluate, generate, params, serve, shapes, train,
               translate)
from .common import UsageError

COMMANDS = {"demo": demo, "train": train, "translate": translate, "evaluate": evaluate, "attention": attention,
            "classify": classify, "average": average, "generate": generate, "embed": embed, "params": params,
            "shapes": shapes, "doctor": doctor, "serve": serve}

# Errors a person can act on: bad files, values, formats, missing packages. One line, exit status 1.
USER_ERRORS = (ConfigError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
               ImportError, UnicodeError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnlab", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The Transformer of 'Attention Is All You Need': build, train, run, inspect.",
        epilog="presets: " + ", ".join(PRESETS))
    parser.add_argument("--debug", action="store_true", help="show tracebacks and which fast paths run")
    parser.add_argument("--dry-run", action="store_true", help="check the command's arguments and exit without running it")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        p = sub.add_parser(name, help=module.HELP, description=module.HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="examples:\n  " + module.EXAMPLES)
        p.set_defaults(run=module.run, subparser=p)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks and which fast paths run")
        module.arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    import logging
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    if args.debug:
        logging.basicConfig(format="attnlab: %(message)s")
        logging.getLogger("attnlab").setLevel(logging.DEBUG)
    where = f"attnlab {args.command}"
    if args.dry_run:
        print(f"{where}: arguments accepted (dry run, nothing was run)")
        return 0
    try:
        return args.run(args)
    except UsageError as e:
        if args.debug:
            raise
        args.subparser.print_usage(sys.stderr)
        print(f"{where}: error: {e}", file=sys.stderr)
        return 2
    except USER_ERRORS as e:
        if args.debug:
            raise
        print(f"{where}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `attnlab translate ... | head -1`
        sys.stderr.close()
        return 0
    except Exception as e:  # a bug, or a failure we did not foresee: one line, the traceback on request
        if args.debug:
            raise
        print(f"{where}: internal error: {type(e).__name__}: {_one_line(e)}\n"
              f"rerun with --debug for the traceback", file=sys.stderr)
        return 1


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)) and e.filename:
        text = f"{e.filename}: {e.strerror or text}"
    return " ".join(text.split())[:2000]


__all__ = ["main", "build_parser", "COMMANDS", "UsageError"]
