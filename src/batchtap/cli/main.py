"""The ``batchtap`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from batchtap.cli import demo

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchtap",
        description="Per-batch training metrics for PyTorch: capture, validate, store, act.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo_parser = commands.add_parser(
        "demo",
        help="train a small CNN on the digits data set with live metrics",
        description=demo.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: batchtap demo --epochs 3 --inject-nan-at 40",
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=demo.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
