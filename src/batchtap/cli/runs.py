"""``batchtap runs``: a table of the runs in a store."""

from __future__ import annotations

import argparse
import time

from batchtap.cli._common import (
    add_db_arguments,
    events_by_kind,
    fit_table,
    fmt_duration,
    fmt_value,
    open_store,
    short_id,
    wrap,
)
from batchtap.cli.replay import add_spool_argument, describe, pending_spools, spool_only_runs
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
        description="List the runs in a store, newest last: name, id, status, steps, the metric each run "
        "is judged by (loss when it has one) with its last and best value (best on the kept trajectory: "
        "steps a rollback undid are left out), duration, anomaly count and start; on a narrow terminal the "
        "last columns are left out first. A run killed with its process group reads 'killed'; a run "
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


def _started(t: float) -> str:
    """``MM-DD HH:MM`` (local time): a runs table needs no seconds or year."""
    return time.strftime("%m-%d %H:%M", time.localtime(t))


def main(args: argparse.Namespace) -> int:
    """List the runs; returns the exit status."""
    with open_store(args) as store:
        runs = store.runs()
        shown = runs if args.all else runs[-max(args.limit, 0) :] if args.limit > 0 else []
        rows = []
        spools = pending_spools(args)
        for run in shown:
            main_metric = store.main_metric(run)
            undone = store.rolled_back(run.id)
            # last and best of the metric the run is judged by, on its kept trajectory (the steps a
            # rollback undid are left out), as the browser view shows them
            summary = None if main_metric is None else store.summary(run.id, main_metric, undone=undone)
            anomalies = events_by_kind(store.events(run.id))[EventKind.ANOMALY]
            rows.append(
                [
                    run.name,
                    short_id(run.id),
                    run.status.value + ("+spool" if run.id in spools else ""),
                    str(run.steps),
                    main_metric or "-",
                    fmt_value(None if summary is None else summary.last),
                    fmt_value(None if summary is None else summary.best),
                    fmt_duration(run.duration),
                    str(anomalies),
                    _started(run.started_at),
                ]
            )
        where = store.where
    # a run whose start never reached the store (locked or down from its first call) is only in its spool
    only_spooled = spool_only_runs(spools, (run.id for run in runs))
    if not runs:
        print(f"no runs in {where}")
        for text in only_spooled:
            for line in wrap(text, indent="    "):
                print(line)
        return 0
    header = ["name", "id", "status", "steps", "metric", "last", "best", "duration", "anom", "started"]
    right = [False, False, False, True, False, True, True, True, True, False]
    # what goes first on a narrow terminal: when it started, then anomalies, duration, the metric's name
    priority = [1, 1, 1, 1, 4, 1, 2, 3, 3, 5]
    for line in fit_table(header, rows, right=right, priority=priority):
        print(line)
    if len(shown) < len(runs):
        print(f"({len(runs) - len(shown)} older runs not shown; --all shows them)")
    for text in only_spooled:
        for line in wrap(text, indent="    "):
            print(line)
    listed = {info.path: info for run in shown for info in spools.get(run.id, [])}
    if listed:
        for line in wrap(
            "pending spools (the store does not hold these blocks yet; `batchtap replay DIR` delivers them):"
        ):
            print(line)
        for info in listed.values():
            for line in wrap(f"  {describe(info)}", indent="    "):
                print(line)
    return 0
