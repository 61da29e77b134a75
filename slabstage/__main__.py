"""`python -m slabstage demo`: see slabstage/demo.py."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m slabstage demo [--help] [options]")
        return 0
    if argv[0] == "demo":
        from .demo import main as demo_main

        return demo_main(argv[1:])
    print(f"unknown command {argv[0]!r}; try: python -m slabstage demo --help", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
