"""``batchtap show RUN``: one run in detail: config, environment, metric summary, logged
(``Tap.log()``) values, events."""

from __future__ import annotations

import argparse
import json

from batchtap._units import format_value
from batchtap.cli._common import (
    CLIError,
    add_db_arguments,
    events_by_kind,
    fit_table,
    fmt_duration,
    fmt_rank,
    fmt_time,
    fmt_value,
    open_store,
    resolve_run,
    wrap,
)
from batchtap.cli._layers import layer_table, split_layer_metrics
from batchtap.cli.replay import add_spool_argument, describe, pending_spools, spool_only_runs
from batchtap.records import EventKind

__all__ = ["register", "main"]

EXAMPLE = """examples:
  batchtap show demo                 # the latest run named demo
  batchtap show 3f2a9c               # a unique id prefix
  batchtap show demo --events 100    # list up to 100 events"""

# Shown first, in this order, when present; the rest of the environment follows sorted.
_ENV_ORDER = ("host", "pid", "device", "python", "torch", "cuda", "cudnn", "git_commit", "cwd", "argv")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``show`` subcommand."""
    parser = commands.add_parser(
        "show",
        help="show one run: config, environment, metrics, logged values, events",
        description="Show one run: status, config, environment, each metric's last / min / max (on the kept "
        "trajectory: steps a rollback undid are left out), the "
        "values logged with tap.log() (evaluation, epoch-level: last value, its step, count), and the "
        "anomalies, actions, warnings, notes and skipped steps with their steps. RUN is an id, a unique id "
        "prefix, or a name (the latest run of that name).",
        epilog=EXAMPLE,
    )
    parser.add_argument("run", metavar="RUN", help="run id, unique id prefix, or name")
    add_db_arguments(parser)
    add_spool_argument(parser)
    parser.add_argument("--events", type=int, default=30, metavar="N", help="list at most N events (default 30)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Print one run; returns the exit status."""
    with open_store(args) as store:
        try:
            run = resolve_run(store, args.run)
        except CLIError:
            # a run whose start never reached the store is only in its spool: say where it is
            pending = pending_spools(args)
            spooled = {
                k: v for k, v in pending.items() if k.startswith(args.run) or any(i.names.get(k) == args.run for i in v)
            }
            if not spooled:
                raise
            for text in spool_only_runs(spooled, ()):
                print(text)
            return 1
        names = store.metric_names(run.id)
        sparse = set(store.sparse_names(run.id))
        points = {m: store.series(run.id, m) for m in names}
        undone = store.rolled_back(run.id)
        # last / min / max on the kept trajectory (a rollback's undone steps left out), as `runs`
        # and the browser view show them
        summaries = {m: store.summary(run.id, m, undone=undone) for m in names}
        events = store.events(run.id)
    spools = pending_spools(args).get(run.id, [])
    metrics, layers = split_layer_metrics([m for m in names if m not in sparse])
    logged = [m for m in names if m in sparse]
    series = {m: [p.value for p in pts] for m, pts in points.items()}
    out: list[str] = []
    out.extend(wrap(f"run {run.name}  (id {run.id})", indent="    "))
    status = run.status.value + (f" - {run.stop_reason}" if run.stop_reason else "")
    out.extend(wrap(f"  status       {status}", indent=" " * 15))
    for info in spools:
        out.extend(
            wrap(
                f"  spool        pending: {describe(info, run.id)}; `batchtap replay {info.path.parent}` delivers it",
                indent=" " * 15,
            )
        )
    out.append(f"  started      {fmt_time(run.started_at)}")
    out.append(f"  ended        {fmt_time(run.ended_at)}")
    out.append(f"  duration     {fmt_duration(run.duration)}")
    steps = f"{run.steps}" + (f" (steps {run.first_step}..{run.last_step})" if run.first_step is not None else "")
    out.append(f"  steps        {steps}")
    out.append(f"  world size   {run.world_size}")
    if undone:
        spans = ", ".join(f"{r.start}..{r.stop - 1}" for r in undone)
        out.extend(wrap(f"  rolled back  steps {spans} (left out of last / min / max)", indent=" " * 15))
    if run.tags:
        out.extend(wrap(f"  tags         {', '.join(run.tags)}", indent=" " * 15))
    if run.notes:
        out.extend(wrap(f"  notes        {run.notes}", indent=" " * 15))
    out.append("config")
    if run.config:
        for line in json.dumps(run.config, indent=2, sort_keys=True, default=str).splitlines():
            out.extend(wrap("  " + line, indent=" " * 6))
    else:
        out.append("  (none)")
    out.append("environment")
    env = run.environment
    keys = [k for k in _ENV_ORDER if k in env] + sorted(k for k in env if k not in _ENV_ORDER)
    for key in keys:
        value = env[key]
        if key in ("tags", "notes"):
            continue  # shown above
        text = " ".join(map(str, value)) if isinstance(value, list) else str(value)
        out.extend(wrap(f"  {key:<12} {text}", indent=" " * 15))
    if not keys:
        out.append("  (none recorded)")
    out.append("metrics")
    if metrics:
        rows = []
        for m in metrics:
            sm = summaries[m]
            rows.append(
                ["  " + m, *(format_value(m, v) for v in (sm.last, sm.min, sm.max)), str(sm.count), str(sm.nans)]
            )
        out.extend(_name_table(["last", "min", "max", "values", "nan"], rows, priority=[1, 1, 1, 2, 2]))
    else:
        out.append("  (no values stored)")
    if layers:
        out.extend(layer_table(layers, summaries))
    if logged:
        out.append("logged values (tap.log)")
        rows = []
        for m in logged:
            values = series[m]
            sm = summaries[m]
            rows.append(
                [
                    "  " + m,
                    str(points[m][-1].step),
                    format_value(m, values[-1]),
                    format_value(m, sm.min),
                    format_value(m, sm.max),
                    str(len(values)),
                ]
            )
        out.extend(_name_table(["at step", "last", "min", "max", "values"], rows, priority=[1, 1, 1, 1, 2]))
    counts = events_by_kind(events)
    out.extend(
        wrap(
            f"events: {counts[EventKind.ANOMALY]} anomalies, {counts[EventKind.ACTION]} actions, "
            f"{counts[EventKind.WARNING]} warnings, {counts[EventKind.INFO]} notes, "
            f"{counts[EventKind.SKIP]} skipped steps",
            indent="  ",
        )
    )
    limit = max(args.events, 0)
    if events and limit:
        # one event a paragraph: "step kind [rank] [metric=raw]" then the message, wrapped on words
        for e in events[:limit]:
            head = f"  {e.step:>6}  {e.kind.value}"
            if e.rank != 0:
                head += f" rank {fmt_rank(e.rank)}"
            if e.metric:
                head += f" {e.metric}" + ("" if e.raw_value is None else f"={fmt_value(e.raw_value)}")
            out.extend(wrap(f"{head}  {e.message}", indent=" " * 10))
        if len(events) > limit:
            out.append(f"  ... {len(events) - limit} more (--events N shows more)")
    print("\n".join(out))
    return 0


def _name_table(header: list[str], rows: list[list[str]], *, priority: list[int]) -> list[str]:
    """A table of named values: the name left-aligned and never dropped, the numbers right-aligned
    (``priority``: which numeric columns go first when the terminal is narrow, as ``fit_table``)."""
    return list(fit_table(["  name", *header], rows, right=[False] + [True] * len(header), priority=[1, *priority]))
