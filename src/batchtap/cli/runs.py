"""``batchtap runs``: a table of the runs in a store."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from batchtap._units import format_value
from batchtap.cli._common import (
    CLIError,
    add_db_arguments,
    events_by_kind,
    fit_table,
    fmt_duration,
    open_store,
    short_id,
    wrap,
)
from batchtap.cli.replay import add_spool_argument, describe, pending_spools, spool_only_runs
from batchtap.records import EventKind

if TYPE_CHECKING:
    from batchtap.store import RunRow, Store
    from batchtap.store.rows import MetricSummary

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
    )
    add_db_arguments(parser)
    add_spool_argument(parser)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--limit", type=int, default=20, metavar="N", help="show the N most recent runs (default 20)")
    group.add_argument("--all", action="store_true", help="show every run")
    parser.add_argument(
        "--where",
        metavar="QUERY",
        default=None,
        help="only runs matching QUERY, e.g. 'lr<0.01 and status=finished' or 'tag=baseline' "
        "(fields: id name status steps best last duration anomalies tag notes, else config keys)",
    )
    parser.set_defaults(func=main)


def _started(t: float) -> str:
    """``MM-DD HH:MM`` (local time): a runs table needs no seconds or year."""
    return time.strftime("%m-%d %H:%M", time.localtime(t))


def _figures(store: Store, run: RunRow) -> tuple[str | None, MetricSummary | None, int]:
    """The metric a run is judged by, its summary on the kept trajectory (the steps a rollback
    undid left out, as the browser view shows it) and the run's anomaly count."""
    main_metric = store.main_metric(run)
    summary = None if main_metric is None else store.summary(run.id, main_metric)
    return main_metric, summary, events_by_kind(store.events(run.id))[EventKind.ANOMALY]


def _as_dict(run: RunRow, main_metric: str | None, summary: MetricSummary | None, anomalies: int) -> dict[str, Any]:
    """A run with the fields ``--where`` names (as the browser view's runs table has them)."""
    return {
        "id": run.id,
        "name": run.name,
        "status": run.status.value,
        "steps": run.steps,
        "best_value": None if summary is None else summary.best,
        "last_value": None if summary is None else summary.last,
        "duration": run.duration,
        "anomalies": anomalies,
        "tags": list(run.tags),
        "notes": run.notes,
        "config": run.config,
    }


def main(args: argparse.Namespace) -> int:
    """List the runs; returns the exit status."""
    with open_store(args) as store:
        runs = store.runs()
        figures: dict[str, tuple[str | None, MetricSummary | None, int]] = {}
        if args.where:
            # every run's figures, then the filter (the browser view's query language, in Python)
            from batchtap.store import runquery

            try:
                query = runquery.parse(args.where)
            except runquery.QueryError as exc:
                raise CLIError(str(exc), code=2) from None
            figures = {run.id: _figures(store, run) for run in runs}
            try:
                kept = {d["id"] for d in query.filter([_as_dict(run, *figures[run.id]) for run in runs])}
            except runquery.QueryError as exc:
                raise CLIError(str(exc)) from None
            runs = [run for run in runs if run.id in kept]
        shown = runs if args.all else runs[-max(args.limit, 0) :] if args.limit > 0 else []
        rows = []
        spools = pending_spools(args)
        for run in shown:
            main_metric, summary, anomalies = figures.get(run.id) or _figures(store, run)
            rows.append(
                [
                    run.name,
                    short_id(run.id),
                    run.status.value + ("+spool" if run.id in spools else ""),
                    str(run.steps),
                    main_metric or "-",
                    format_value(main_metric or "", None if summary is None else summary.last),
                    format_value(main_metric or "", None if summary is None else summary.best),
                    fmt_duration(run.duration),
                    str(anomalies),
                    _started(run.started_at),
                ]
            )
        where = store.where
    # a run whose start never reached the store (locked or down from its first call) is only in its spool
    only_spooled = spool_only_runs(spools, (run.id for run in runs))
    if not runs:
        print(f"no run matches {args.where!r} in {where}" if args.where else f"no runs in {where}")
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
