"""``batchtap demo``: a real training run with live metrics.

A small CNN learns scikit-learn's bundled 8x8 digits (no download) for a few epochs, on CUDA when
present and on the CPU otherwise. Metrics stream to the console and are stored in SQLite
(``runs/batchtap.db``) and JSONL (``runs/<name>/metrics.jsonl``).

``--inject-nan-at STEP`` poisons the loss at one step: the NaN rule stops the run at once.
``--inject-spike-at STEP`` blows up the weights at one step: the spike rule rolls back to the last
good snapshot, halves the learning rate, skips a few batches and training recovers.

The model and the loop live in :mod:`batchtap.demo.digits`, imported only when the demo runs, so the
other subcommands start without importing torch.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, default=5, help="epochs to train (default 5)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--device", default="auto", help="cuda, cpu or auto (default: cuda when present)")
    parser.add_argument("--out", default="runs", help="folder for the run's files (default runs/)")
    parser.add_argument("--name", default="demo", help="run name (default demo)")
    parser.add_argument("--inject-nan-at", type=int, metavar="STEP", help="make the loss NaN at this global step")
    parser.add_argument(
        "--inject-spike-at",
        type=int,
        metavar="STEP",
        help="scale the weights x30 after this global step (a loss spike; rolled back)",
    )
    parser.add_argument("--db", default=None, help="SQLite file or postgresql:// URL (default OUT/batchtap.db)")
    parser.add_argument("--flush-every", type=int, default=5, help="steps between host transfers (default 5)")
    parser.add_argument("--print-every", type=int, default=10, help="console line every N batches (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def main(args: argparse.Namespace) -> int:
    """Run the demo (imports torch and trains)."""
    from batchtap.demo import digits

    return digits.train(args)
