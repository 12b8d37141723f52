"""The ``batchtap`` command."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from batchtap.cli import audit, compare, demo, export, plot, replay, run, runs, show, tag, tail, tensorboard, ui
from batchtap.cli._common import CLIError, HelpFormatter, wrap

__all__ = ["main", "build_parser"]

EXAMPLES = """examples:
  batchtap demo --epochs 3                    # train, store runs/batchtap.db
  batchtap runs                               # list the stored runs
  batchtap tail demo                          # follow a run live until it ends
  batchtap plot demo -m loss -m accuracy -o loss.png
  batchtap audit train.py                     # find hidden .item() / if loss > x: syncs
  batchtap run train.py --epochs 3            # record an unmodified script (bt.autolog)
  batchtap ui                                 # browse the runs live in a browser (batchtap[ui])

Store: --db URL on each subcommand, else $BATCHTAP_DB, else runs/batchtap.db.
Exit status: 0 ok, 1 user error (unknown run, not a batchtap store, ...), 2 usage error."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchtap",
        description="Per-batch training metrics for PyTorch: capture, validate, store, act.",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo_parser = commands.add_parser(
        "demo",
        help="train a small CNN on the digits data set with live metrics",
        description=demo.__doc__,
        epilog="example: batchtap demo --epochs 3 --inject-nan-at 40",
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=demo.main)
    for module in (runs, show, tail, plot, compare, export, replay, tensorboard, audit, run, ui, tag):
        module.register(commands)
    # every subcommand's help fits the terminal and shows no reST markup
    for sub in commands.choices.values():
        sub.formatter_class = HelpFormatter
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except CLIError as exc:
        if exc.code == 2:
            parser.error(str(exc))  # exits 2 with the usage line, as argparse does
        said = f"batchtap: error: {exc}"
        # on a terminal, wrapped on words; a pipe or a log gets one line per error (easy to grep)
        print("\n".join(wrap(said, indent="  ")) if sys.stderr.isatty() else said, file=sys.stderr)
        return exc.code
    except BrokenPipeError:
        # `batchtap export ... | head`: the reader left; that is not an error of ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
