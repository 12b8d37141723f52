"""``batchtap tensorboard RUN --logdir DIR``: a stored run written out as TensorBoard event files.

The stored records go through :class:`batchtap.sinks.TensorBoard`, the same writer a live run
uses, so tags, steps and wall times are what the run would have logged itself.
"""

from __future__ import annotations

import argparse
import os

from batchtap.cli._common import CLIError, add_db_arguments, open_store, resolve_run, run_info, run_records
from batchtap.errors import SinkError
from batchtap.records import RunStatus

__all__ = ["register", "main"]

EXAMPLE = """examples:
  batchtap tensorboard demo --logdir tb/demo && tensorboard --logdir tb
  batchtap tensorboard 3f2a9c --logdir tb/3f2a9c --prefix train

Scalars are <prefix>/<metric> (rank k >= 1: <prefix>/<metric>/rank<k>); values logged with
tap.log() keep their own name (val_loss) at the step they name; events are text under
events/<kind>, config and final status under run/config and run/status."""

_BLOCK = 1000  # records per write: the sink flushes its event file once per block


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``tensorboard`` subcommand."""
    parser = commands.add_parser(
        "tensorboard",
        help="write a stored run as TensorBoard event files",
        description="Write a stored run as TensorBoard event files (scalars at their own steps and wall times, events as text).",
        epilog=EXAMPLE,
    )
    parser.add_argument("run", metavar="RUN", help="run id, unique id prefix, or name")
    parser.add_argument("--logdir", required=True, metavar="DIR", help="directory for the event files")
    parser.add_argument("--prefix", default="train", help="first part of every scalar tag (default train)")
    add_db_arguments(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Write one run as TensorBoard logs; returns the exit status."""
    with open_store(args) as store:
        run = resolve_run(store, args.run)
        records = run_records(store, run)
        events = store.events(run.id)
    try:
        from batchtap.sinks.tensorboard import TensorBoard

        sink = TensorBoard(args.logdir, prefix=args.prefix)
    except (ImportError, SinkError) as exc:  # a missing extra or an unwritable directory, with the fix
        raise CLIError(str(exc)) from None
    info = run_info(run)
    try:
        sink.start_run(info)
        for i in range(0, max(len(records), 1), _BLOCK):
            sink.write(records[i : i + _BLOCK], events if i == 0 else ())
        if run.status is not RunStatus.RUNNING:
            sink.end_run(info)
    finally:
        sink.close()
    print(f"wrote {len(records)} records and {len(events)} events of run {run.name!r} to {os.fspath(args.logdir)}")
    return 0
