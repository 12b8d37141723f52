"""``batchtap tail RUN``: follow a run live from the store until it ends.

Polls the store (SQLite or PostgreSQL) while another process writes it. Each poll reads the run's
row first — its status and largest stored step in one statement — and then only the values up to
that step. A block of records is committed whole, so every step at or below that step is complete
when it is read, and a run seen as ended has all of its values stored: the last poll prints them
and ``tail`` exits.

On a terminal the view is a live table redrawn in place; otherwise (a pipe, a file, ``--plain``)
it is one line per step, ``step=12 epoch=0 batch=12 loss=0.4127 step_time=1.63ms ...`` (values
with the units the console shows), one ``eval`` line per
``Tap.log()`` call, ``eval step=200 epoch=1 val_loss=0.31 val_acc=0.9``, and one ``!`` line per
event.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol, TextIO

from batchtap._units import format_value
from batchtap.cli._common import (
    CLIError,
    add_db_arguments,
    add_metrics_option,
    db_url,
    fit_table,
    fmt_duration,
    fmt_rank,
    fmt_value,
    open_store,
    resolve_run,
    short_id,
    wrap,
)
from batchtap.records import Event, Record, RunStatus
from batchtap.store import redact_dsn

if TYPE_CHECKING:
    from batchtap.store import RunRow, Store

__all__ = ["register", "main", "Row", "Poll", "Follower"]

EXAMPLE = """examples:
  batchtap tail demo                            # follow the latest run named demo
  batchtap tail demo --wait 120 &               # start before training; waits for the run to begin
  batchtap tail 3f2a9c -m loss -m lr --plain    # chosen columns, one line per step
  batchtap tail demo --db postgresql://postgres@db/train

Values logged with tap.log() (val_loss, ...) are shown as they arrive: 'eval step=N ...' lines,
or the latest of each under the live table; -m selects among them too.

Exits 0 when the run's status is no longer 'running'; 1 when the run is not found, or when the
process that writes it (on this host) is gone while the run still says 'running'."""

#: Columns shown when -m is not given, those the run has, in this order.
DEFAULT_COLUMNS = ("loss", "accuracy", "lr", "grad_norm", "step_time", "throughput")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``tail`` subcommand."""
    parser = commands.add_parser(
        "tail",
        help="follow a running run live until it ends",
        description="Follow a run live from the store while training writes it (SQLite or PostgreSQL): "
        "a live table on a terminal, one line per step otherwise. Exits when the run ends.",
        epilog=EXAMPLE,
    )
    parser.add_argument("run", metavar="RUN", help="run id, unique id prefix, or name (the latest run of that name)")
    add_db_arguments(parser)
    add_metrics_option(
        parser,
        "column to show, or tap.log() value (repeatable; default: "
        + ", ".join(DEFAULT_COLUMNS)
        + " where present, and every tap.log() value)",
    )
    parser.add_argument(
        "-n", "--lines", type=int, default=10, metavar="N", help="steps already stored to print first (default 10)"
    )
    parser.add_argument(
        "--rank", type=int, default=None, help="rank to follow (default: the all-ranks rows, else the lowest rank)"
    )
    parser.add_argument("--interval", type=float, default=0.5, metavar="S", help="seconds between polls (default 0.5)")
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help="wait up to S seconds for the store and a running (or new) run RUN to appear (default 0)",
    )
    # Kept so that scripts passing it still run: a run whose writer is gone now reads 'killed' at
    # once (the reader's one owner-gone rule), so there is nothing left to wait S seconds for.
    parser.add_argument("--stale", type=float, default=30.0, help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true", help="plain lines even on a terminal")
    parser.set_defaults(func=main)


class Row(NamedTuple):
    """One step as ``tail`` shows it: position and the chosen metrics' values."""

    step: int
    epoch: int
    batch: int
    wall_time: float
    values: dict[str, float]


class Poll(NamedTuple):
    """What one poll found: the run's row and what is new since the previous poll."""

    run: RunRow
    columns: list[str] | None  #: step columns shown (``None``: no step values stored yet)
    rows: list[Row]
    logged: list[Record]  #: new ``Tap.log()`` records (``sparse=True``), step order
    events: list[Event]


class Follower:
    """Reads what a run stored since the last poll.

    Args:
        store: an open store.
        run_id: the run.
        wanted: columns asked for (``None``: :data:`DEFAULT_COLUMNS` present in the run).
        rank: rank to read (``None``: the store's default series).
        after: only steps above this (``-1``: from the start).
    """

    def __init__(
        self, store: Store, run_id: str, wanted: Sequence[str] | None, rank: int | None, after: int = -1
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.wanted = list(wanted) if wanted else None
        self.rank = rank
        self.last_step = after
        self.columns: list[str] | None = None
        #: events of the run by kind, those skipped by ``-n`` included
        self.counts: collections.Counter[str] = collections.Counter()
        self._seen_events: set[tuple[object, ...]] = set()
        self._seen_logged: set[tuple[str, int, int, float]] = set()

    def _choose_columns(self, sparse: set[str]) -> list[str] | None:
        present = [m for m in self.store.metric_names(self.run_id) if m not in sparse]
        if not present:
            return None  # no step value stored yet: decide at a later poll
        if self.wanted:
            return self.wanted
        return [m for m in DEFAULT_COLUMNS if m in present] or present[:6]

    def _new_logged(self, cap: int | None, ended: bool) -> list[Record]:
        """``Tap.log()`` records not shown yet, each as one record of the values not seen yet
        (a value logged again at its step counts as new). Up to the step values' ``cap`` so that
        they come after the steps before them, unless the run ended (then all of them)."""
        out = []
        for rec in self.store.sparse_records(self.run_id, rank=self.rank):
            if not ended and cap is not None and rec.step > cap:
                continue
            values = {}
            for name, value in rec.values.items():
                key = (name, rec.step, rec.rank, rec.wall_time)
                if key not in self._seen_logged and (self.wanted is None or name in self.wanted):
                    self._seen_logged.add(key)
                    values[name] = value
            if values:
                out.append(
                    Record(rec.run_id, rec.step, rec.epoch, rec.batch, rec.rank, rec.wall_time, values, sparse=True)
                )
        return out

    def poll(self) -> Poll:
        """The run's row (status read before the data) and the rows, logged values and events new
        since the last poll."""
        run = self.store.run(self.run_id)
        cap = run.last_step
        sparse = set(self.store.sparse_names(self.run_id))
        rows: list[Row] = []
        if self.columns is None:
            self.columns = self._choose_columns(sparse)
        # -m may name tap.log() values: they are shown as logged values, not as columns.
        columns = None if self.columns is None else [m for m in self.columns if m not in sparse]
        if columns is not None and cap is not None and cap > self.last_step:
            # Only steps <= cap: a later step may be committed between our per-metric reads, and
            # printing it now could show it with some metrics missing.
            found: dict[int, Row] = {}
            for metric in columns:
                for p in self.store.series(self.run_id, metric, rank=self.rank):
                    if self.last_step < p.step <= cap:
                        row = found.get(p.step)
                        if row is None:
                            row = found[p.step] = Row(p.step, p.epoch, p.batch, p.wall_time, {})
                        row.values[metric] = p.value
            rows = [found[s] for s in sorted(found)]
            self.last_step = cap
        logged = self._new_logged(cap, run.status is not RunStatus.RUNNING) if sparse else []
        events = []
        for e in self.store.events(self.run_id):
            key = (e.step, e.kind, e.metric, e.message, e.wall_time, e.rank)
            if key not in self._seen_events:
                self._seen_events.add(key)
                self.counts[e.kind.value] += 1
                events.append(e)
        return Poll(run, columns, rows, logged, events)

    def skip_logged(self, upto: int) -> None:
        """Mark the ``Tap.log()`` values of steps up to ``upto`` as seen (used with ``-n``: only
        those within the last N steps are shown)."""
        for rec in self.store.sparse_records(self.run_id, rank=self.rank):
            if rec.step <= upto:
                self._seen_logged.update((name, rec.step, rec.rank, rec.wall_time) for name in rec.values)

    def skip_events(self) -> None:
        """Mark the events stored so far as seen (used with ``-n``: old events are not replayed)."""
        for e in self.store.events(self.run_id):
            key = (e.step, e.kind, e.metric, e.message, e.wall_time, e.rank)
            if key not in self._seen_events:
                self._seen_events.add(key)
                self.counts[e.kind.value] += 1


class View(Protocol):
    """Where ``tail`` shows what it reads."""

    def update(self, poll: Poll, counts: Mapping[str, int]) -> None: ...

    def close(self, run: RunRow) -> None: ...


def _event_line(e: Event) -> str:
    where = f" {e.metric}" if e.metric else ""
    rank = "" if e.rank == 0 else f" rank {fmt_rank(e.rank)}"
    return f"! step {e.step} {e.kind.value}{where}{rank}: {e.message}"


def _logged_line(r: Record) -> str:
    rank = "" if r.rank == 0 else f" rank={fmt_rank(r.rank)}"
    values = " ".join(f"{m}={fmt_value(v)}" for m, v in r.values.items())
    return f"eval step={r.step} epoch={r.epoch}{rank} {values}"


def _counts_line(counts: Mapping[str, int]) -> str:
    return (
        f"anomalies {counts.get('anomaly', 0)}  actions {counts.get('action', 0)}  "
        f"warnings {counts.get('warning', 0)}  notes {counts.get('info', 0)}  skipped steps {counts.get('skip', 0)}"
    )


def _end_line(run: RunRow) -> str:
    last = "no steps" if run.last_step is None else f"step {run.last_step}"
    reason = f": {run.stop_reason}" if run.stop_reason else ""
    return (
        f"# run {run.name} ({short_id(run.id)}) {run.status.value} at {last} after {fmt_duration(run.duration)}{reason}"
    )


class PlainView:
    """One line per step and per event; flushed per poll so a pipe reader sees them at once."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self._started = False
        # wrapped on words on a terminal; a pipe keeps one line per step or event (for grep)
        self._wrap = out.isatty()

    def _fit(self, line: str, indent: str) -> list[str]:
        return wrap(line, indent=indent) if self._wrap else [line]

    def update(self, poll: Poll, counts: Mapping[str, int]) -> None:
        run = poll.run
        lines = []
        if not self._started:
            lines.extend(self._fit(f"# run {run.name} ({run.id}) {run.status.value}", "#   "))
            self._started = True
        # A logged value comes after the step it names (it was logged after that step ran).
        steps: list[tuple[int, int, str]] = []
        for r in poll.rows:
            values = " ".join(f"{m}={format_value(m, r.values.get(m))}" for m in poll.columns or ())
            steps.append((r.step, 0, f"step={r.step} epoch={r.epoch} batch={r.batch} {values}".rstrip()))
        steps.extend((r.step, 1, _logged_line(r)) for r in poll.logged)
        for _, _, line in sorted(steps, key=lambda t: t[:2]):
            lines.extend(self._fit(line, "    "))
        for e in poll.events:
            lines.extend(self._fit(_event_line(e), "    "))
        if lines:
            self.out.write("\n".join(lines) + "\n")
            self.out.flush()

    def close(self, run: RunRow) -> None:
        self.out.write("\n".join(self._fit(_end_line(run), "#   ")) + "\n")
        self.out.flush()


class LiveView:
    """A table of the latest steps, redrawn in place with ANSI cursor moves (no curses needed)."""

    def __init__(self, out: TextIO, keep: int) -> None:
        self.out = out
        self.keep = keep
        self.rows: collections.deque[Row] = collections.deque(maxlen=max(keep, 1))
        self.events: collections.deque[Event] = collections.deque(maxlen=3)
        #: the latest value of each tap.log() name: (step, value)
        self.logged: dict[str, tuple[int, float]] = {}
        self.counts: dict[str, int] = {}
        self._drawn = 0
        self._t_rate: tuple[float, int] | None = None
        self._rate: float | None = None

    def update(self, poll: Poll, counts: Mapping[str, int]) -> None:
        rows = poll.rows
        self.rows.extend(rows)
        self.events.extend(poll.events)
        for r in poll.logged:
            for name, value in r.values.items():
                self.logged[name] = (r.step, value)
        self.counts = dict(counts)
        if rows:
            now, step = time.monotonic(), rows[-1].step
            if self._t_rate is not None and now > self._t_rate[0]:
                self._rate = (step - self._t_rate[1]) / (now - self._t_rate[0])
            self._t_rate = (now, step)
        self._draw(poll.run, poll.columns or [])

    def _draw(self, run: RunRow, columns: list[str]) -> None:
        width = shutil.get_terminal_size((100, 24)).columns
        rate = f"  {self._rate:.1f} steps/s" if self._rate is not None else ""
        step = "-" if run.last_step is None else str(run.last_step)
        lines = [
            f"{run.name} ({short_id(run.id)})  {run.status.value}  step {step}{rate}  elapsed {fmt_duration(run.duration)}"
        ]
        body = [
            [str(r.step), str(r.epoch), str(r.batch), *(format_value(m, r.values.get(m)) for m in columns)]
            for r in self.rows
        ]
        # too wide for the terminal: epoch and batch go first, then the later metric columns
        priority = [1, 4, 4, *(1 + i // 2 for i in range(len(columns)))]
        lines.extend(
            fit_table(
                ["step", "epoch", "batch", *columns],
                body,
                right=[True] * (3 + len(columns)),
                priority=priority,
                width=width,
                shrink=None,
            )
        )
        if self.logged:
            # Below the table, never a column of it: logged values have steps of their own.
            lines.append("logged  " + "  ".join(f"{m} {fmt_value(v)} (step {s})" for m, (s, v) in self.logged.items()))
        lines.append(_counts_line(self.counts))
        for e in self.events:
            lines.extend(wrap(_event_line(e), indent="    ", width=width))
        text = "".join(line[:width] + "\x1b[K\n" for line in lines)
        # Back to the top of what we drew last time, then clear below: a redraw without flicker.
        prefix = f"\x1b[{self._drawn}F\x1b[J" if self._drawn else ""
        self.out.write(prefix + text)
        self.out.flush()
        self._drawn = len(lines)

    def close(self, run: RunRow) -> None:
        self.out.write("\n".join(wrap(_end_line(run), indent="#   ")) + "\n")
        self.out.flush()


def _find(args: argparse.Namespace, started: float) -> tuple[Store, RunRow, bool]:
    """Open the store and resolve RUN, waiting up to ``--wait`` seconds; returns (store, run, is_new)."""
    deadline = time.monotonic() + max(args.wait, 0.0)
    store: Store | None = None
    told = False
    while True:
        try:
            if store is None:
                store = open_store(args)
            run = resolve_run(store, args.run)
            # With --wait, a run that began after we did is the one we were started to watch, even
            # if it is already over (printed from its first step); an older run of the same name
            # that has ended is not, while we may wait. Without --wait, like tail(1): last N steps.
            is_new = args.wait > 0 and run.started_at >= started - 1.0
            if run.status is RunStatus.RUNNING or is_new or time.monotonic() >= deadline:
                return store, run, is_new
        except CLIError as exc:
            if time.monotonic() >= deadline:
                if store is not None:
                    store.close()
                if args.wait <= 0:
                    # the usual case: tail started before the training script made its run
                    raise CLIError(
                        f"{exc}; if the run is about to start, wait for it: batchtap tail {args.run} --wait 60"
                    ) from None
                raise
        if not told:
            print(
                f"batchtap: waiting up to {args.wait:g}s for run {args.run!r} to start in {redact_dsn(db_url(args))}",
                file=sys.stderr,
                flush=True,
            )
            told = True
        time.sleep(max(args.interval, 0.05))


def main(args: argparse.Namespace) -> int:
    """Follow one run until it ends; returns the exit status."""
    if args.interval <= 0:
        raise CLIError(f"--interval must be > 0 seconds, got {args.interval}", code=2)
    store, run, is_new = _find(args, time.time())
    with store:
        live = sys.stdout.isatty() and not args.plain and os.environ.get("TERM") != "dumb"
        view: View = (
            LiveView(sys.stdout, keep=max(args.lines, shutil.get_terminal_size().lines - 8, 5))
            if live
            else PlainView(sys.stdout)
        )
        present = store.metric_names(run.id)
        missing = [m for m in args.metrics or () if present and m not in present]
        if missing:
            raise CLIError(
                f"run {run.name!r} ({short_id(run.id)}) has no values for {', '.join(map(repr, missing))}; "
                f"it has {', '.join(present)}; fix: pick one of those with -m"
            )
        follower = Follower(store, run.id, args.metrics, args.rank)
        if not is_new and run.last_step is not None:
            # Like tail(1): the last N stored steps, then what comes.
            follower.last_step = run.last_step - max(args.lines, 0)
            follower.skip_events()
            follower.skip_logged(follower.last_step)
        while True:
            poll = follower.poll()
            run = poll.run
            view.update(poll, follower.counts)
            if run.status is RunStatus.KILLED:  # derived by the reader: its process is gone
                view.close(run)
                print(
                    f"batchtap: error: run {run.name!r} ({short_id(run.id)}) was killed: its process "
                    f"(pid {run.environment.get('pid')} on this host) is gone and never ended it; "
                    "fix: resume it with tap.run(resume=ID) or ignore it",
                    file=sys.stderr,
                )
                return 1
            if run.status is not RunStatus.RUNNING:
                view.close(run)
                return 0
            time.sleep(args.interval)
