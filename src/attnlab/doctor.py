"""``python -m attnlab.doctor`` (= ``attnlab doctor``): what this machine supports and which paths
attnlab will take (CPU flags, bf16 native or emulated, packed linears, compiler, threads, torch)."""

from __future__ import annotations

import json
import sys


def main(argv: list[str] | None = None) -> int:
    from .accel import doctor_text, report
    argv = sys.argv[1:] if argv is None else argv
    print(json.dumps(report(), indent=2) if "--json" in argv else doctor_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
