"""``batchtap runs``: a table of the runs in a store."""

from __future__ import annotations

import argparse
import math

from batchtap.cli._common import (
    add_db_arguments,
    events_by_kind,
    fmt_duration,
    fmt_time,
    fmt_value,
    open_store,
    short_id,
    table,
)
from batchtap.cli.replay import add_spool_argument, describe, pending_spools
from batchtap.records import EventKind

__all__ = ["register", "main"]

EXAMPLE = """examples:
  batchtap runs
  batchtap runs --db postgresql://postgres@127.0.0.1/train --limit 50
  BATCHTAP_DB=exp/batchtap.db batchtap runs --all"""


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``runs`` subcommand."""
    parser = commands.add_parser(
        "runs",
        help="list the runs in a store",
        description="List the runs in a store, newest last: name, id, status, steps, duration, "
        "last loss and accuracy, anomaly count. A run killed with its process group reads 'killed'; a run "
        "with blocks still waiting in a spool (Tap(spool_dir=...)) is marked '+spool' and the spools are "
        "listed below the table (batchtap replay SPOOL_DIR delivers them).",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_db_arguments(parser)
    add_spool_argument(parser)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--limit", type=int, default=20, metavar="N", help="show the N most recent runs (default 20)")
    group.add_argument("--all", action="store_true", help="show every run")
    parser.set_defaults(func=main)


def _last(points: list[float]) -> float | None:
    # The last finite value: a run that ended on a NaN still shows where it was.
    for v in reversed(points):
        if not math.isnan(v):
            return v
    return None if not points else math.nan


def main(args: argparse.Namespace) -> int:
    """List the runs; returns the exit status."""
    with open_store(args) as store:
        runs = store.runs()
        shown = runs if args.all else runs[-max(args.limit, 0) :] if args.limit > 0 else []
        rows = []
        spools = pending_spools(args)
        for run in shown:
            names = set(store.metric_names(run.id))
            loss = _last([p.value for p in store.series(run.id, "loss")]) if "loss" in names else None
            acc = _last([p.value for p in store.series(run.id, "accuracy")]) if "accuracy" in names else None
            anomalies = events_by_kind(store.events(run.id))[EventKind.ANOMALY]
            rows.append(
                [
                    run.name,
                    short_id(run.id),
                    run.status.value + ("+spool" if run.id in spools else ""),
                    fmt_time(run.started_at),
                    str(run.steps),
                    fmt_duration(run.duration),
                    fmt_value(loss),
                    fmt_value(acc),
                    str(anomalies),
                ]
            )
        where = store.where
    if not runs:
        print(f"no runs in {where}")
        return 0
    header = ["name", "id", "status", "started", "steps", "duration", "loss", "accuracy", "anomalies"]
    right = [False, False, False, False, True, True, True, True, True]
    for line in table(header, rows, right=right):
        print(line)
    if len(shown) < len(runs):
        print(f"({len(runs) - len(shown)} older runs not shown; --all shows them)")
    listed = {info.path: info for run in shown for info in spools.get(run.id, [])}
    if listed:
        print("pending spools (the store does not hold these blocks yet; `batchtap replay DIR` delivers them):")
        for info in listed.values():
            print(f"  {describe(info)}")
    return 0
