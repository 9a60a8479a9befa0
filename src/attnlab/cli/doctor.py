"""attnlab doctor: what this machine supports and which fast paths attnlab takes."""

from __future__ import annotations

HELP = "what this machine supports and which fast paths attnlab takes here"
EXAMPLES = "attnlab doctor\n  attnlab doctor --json\n  python -m attnlab.doctor"


def arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args) -> int:
    from ..doctor import main
    return main(["--json"] if args.json else [])
