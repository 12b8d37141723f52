"""``Console``: live metrics on a terminal (a progress area redrawn in place), plain lines everywhere else."""

from __future__ import annotations

import collections
import dataclasses
import math
import sys
import textwrap
import time
from collections.abc import Iterable, Sequence
from typing import IO, Any, ClassVar

from batchtap._units import format_value, format_values
from batchtap.records import ALL_RANKS, Event, Record, RunInfo
from batchtap.sinks._story import Story
from batchtap.sinks._terminal import (
    SCREEN,
    drop_broken,
    flush_script_stdout,
    guard_stdout,
    hold_script_stdout,
    is_closed_error,
    real_stream,
    release_script_stdout,
    reported_width,
    same_file,
    terminal_width,
    unguard_stdout,
    unhold_script_stdout,
)
from batchtap.sinks.base import Sink

__all__ = ["Console", "format_value", "format_values", "format_sparse"]


def format_sparse(record: Record) -> str:
    """One line for a sparse record (``Tap.log()``): its step and each value, name as logged.

    Each value with its unit, as everywhere (:func:`batchtap._units.format_value`): a name ending in
    ``acc``/``accuracy`` with a value in [0, 1] shows as a percentage, one with ``loss`` in it with 4
    decimals.

    Example:
        >>> r = Record("r", step=200, epoch=1, batch=-1, rank=0, wall_time=0.0,
        ...            values={"val_loss": 0.31, "val_acc": 0.9, "bleu": 27.25}, sparse=True)
        >>> format_sparse(r)
        'eval  step 200  val_loss 0.3100  val_acc 90.00%  bleu 27.25'
    """
    parts = [f"eval  step {record.step}"]
    if record.rank not in (0, ALL_RANKS):
        parts.append(f"rank {record.rank}")
    for name, value in record.values.items():
        parts.append(f"{name} {format_value(name, value)}")
    return "  ".join(parts)


@dataclasses.dataclass
class _Bar:
    """The live area's state for one epoch."""

    epoch: int
    total: int | None
    start_t: float  #: wall time of the epoch's first captured step
    n: int = 0
    rate: float | None = None  #: batches per second of training (steps' wall times)
    fields: str = ""


class Console(Sink):
    """Show metrics while training runs.

    On a terminal: a live area at the bottom, redrawn in place: a progress bar per epoch, and
    under it the latest values wrapped to the terminal's width (at 80 columns nothing is cut off;
    a wide terminal gets one line). When the epoch comes from ``tap.watch(loader)`` and the loader
    has a ``len()``, the bar shows the total, the percentage and the time left; its rate is the
    training speed, batches per second from the steps' own wall times over the last
    ``rate_window`` seconds (not from when the records reached the console, which is every
    flush). Otherwise (a pipe, a log file, CI, a dumb terminal or one that reports 0 columns): a
    plain line every ``every`` batches, e.g. ``epoch 0 batch 10: loss=0.4213 acc=91.25%``.

    Every value carries its unit (``step=1.63ms``, ``acc=91.25%``, ``tput=5496/s``, memory in
    MiB) and is formatted for its size (``loss=7.5e+29``, never 30 digits); ``batchtap tail``
    prints the same (:func:`format_value`).

    Values logged with ``Tap.log()`` (sparse records) get a line of their own, e.g.
    ``eval  step 200  val_loss 0.3100  val_acc 90.00%`` (:func:`format_sparse`), above the bar;
    the same names logged again within ``every`` steps (a per-step ``self.log`` in Lightning) print
    once per ``every`` steps. Every value is stored either way.
    Anomalies, actions and warnings are printed in step order, one line per step and kind (a NaN
    that poisons five values is one line); at most ``max_anomaly_lines`` anomaly lines per run,
    then only counted. Steps the AMP GradScaler skipped are expected, not anomalies: they are
    summed up in one line per ``every`` steps. The final line gives every count.

    One rollback is one story: the anomaly that asked for it is held until the rollback's own line
    (which names the divergence, the snapshot restored, the steps undone, the learning rate and
    the batches it will skip) and printed inside it; what follows from it (anomalies of the
    abandoned trajectory still arriving, the decisions about them it ignored, the batches it
    skipped) is counted, never printed after it: ``batchtap show RUN`` lists every event. An
    anomaly is never printed after the action that followed it. The same warning (or note) is
    printed once per run.

    The script's own ``print()`` s never share a line with the live area or with batchtap's
    lines: while a run is shown, ``sys.stdout`` is wrapped so that the area is hidden before the
    script's text and drawn again below it once its line is complete, and batchtap never draws
    while the script's line is unfinished (see :mod:`batchtap.sinks._terminal`;
    ``guard_stdout=False`` leaves ``sys.stdout`` alone). Where the plain lines go into the file
    the script prints to (``2>&1 | tee log``), the script's text is held back (at most 2 s) until
    the lines of the steps before it are out, so an epoch's ``print`` comes after its batch lines.

    A terminal shows what happens now: the console is never spooled nor replayed by a later
    run (:attr:`Sink.wrap_in_spool` is False), and a closed stream (``batchtap demo | head``) is
    dropped silently: it never fails training nor changes the run's status.

    Args:
        every: print a plain line for batches whose index is a multiple of this.
        stream: where to print (default ``sys.stderr``).
        live: force the live area on or off (default: on when ``stream`` is a terminal with a
            known width, and ``TERM`` is not ``dumb``).
        max_anomaly_lines: anomaly lines (and skip lines) printed per run before they are only counted.
        rate_window: seconds of recent steps the bar's rate (and so its time left) is computed over.
        guard_stdout: keep the script's prints off the console's lines (see above).

    Under ``bt.Tap(pipeline="process")`` the console runs in the pipeline process: ``sys.stdout``
    and ``sys.stderr`` travel there as their names and print to that process's own (the same
    terminal), and the stdout it guards is that process's. Another ``stream`` cannot travel.
    """

    _live = ("stream",)
    wrap_in_spool: ClassVar[bool] = False

    def __init__(
        self,
        every: int = 10,
        *,
        stream: IO[str] | None = None,
        live: bool | None = None,
        max_anomaly_lines: int = 20,
        rate_window: float = 10.0,
        guard_stdout: bool = True,
    ) -> None:
        from batchtap.errors import ConfigError

        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"Console every must be an integer >= 1, got {every!r}")
        if not (isinstance(rate_window, (int, float)) and rate_window > 0):
            raise ConfigError(f"Console rate_window must be > 0 seconds, got {rate_window!r}")
        self.every = every
        self._sparse_printed: dict[frozenset[str], int] = {}  # logged names -> step of their last line
        self.stream = real_stream(stream if stream is not None else sys.stderr)
        self._stream_name = _std_name(self.stream)  # how the stream travels to another process
        self._live_arg = live
        self.live = _can_draw(self.stream) if live is None else live
        self.max_anomaly_lines = max_anomaly_lines
        self.rate_window = float(rate_window)
        self.guard_stdout = guard_stdout
        self._guarding = False
        self._holding = False  # the script's stdout is held back to keep step order (plain lines)
        self._bar: _Bar | None = None
        self._drawn = 0  # lines of the live area on screen now (0: hidden)
        self._closed_stream = False  # the stream's reader is gone: nothing more is written
        self._story = Story(every, max_anomaly_lines)  # which events get a line, and the counts
        self._last: Record | None = None
        self._run: RunInfo | None = None
        self._totals: dict[tuple[str, int], int | None] = {}
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (wall time, batch) this epoch

    def __getstate__(self) -> dict[str, Any]:
        if self._stream_name is None:
            raise TypeError(
                f"bt.sinks.Console cannot be pickled into another process (pipeline='process') with "
                f"stream={self.stream!r}: expected sys.stdout or sys.stderr, which that process has "
                "too, got another stream; fix: leave stream= unset (sys.stderr) or pass sys.stdout, or "
                "use pipeline='thread'"
            )
        return super().__getstate__()

    def _open_live(self) -> None:
        """In a copy unpickled in another process: print to that process's own stdout/stderr,
        with no live area drawn and its stdout not guarded yet."""
        assert self._stream_name is not None
        self.stream = real_stream(getattr(sys, self._stream_name))
        if self._live_arg is None:
            self.live = _can_draw(self.stream)
        self._guarding = self._holding = False
        self._drawn = 0
        self._bar = None

    # -- the sink calls ----------------------------------------------------------------------
    def start_run(self, run: RunInfo) -> None:
        self._run, self._last = run, None
        self._story = Story(self.every, self.max_anomaly_lines)
        self._sparse_printed.clear()
        if self.guard_stdout and not self._guarding:
            guard_stdout()
            self._guarding = True
            if not self.live and same_file(self.stream, real_stream(sys.stdout)):
                hold_script_stdout()  # plain lines a flush late, in the script's own file
                self._holding = True
        self._print([f"batchtap: run {run.name!r} ({run.id[:8]}) started"])

    def start_epoch(self, run_id: str, epoch: int, total: int | None) -> None:
        """Note the length of an epoch's loader: its bar shows total, percentage and time left."""
        self._totals[(run_id, epoch)] = total

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        # One list of lines in step order: a step's events come before its own line, logged
        # values after the steps they follow; each with the wall time of its step.
        lines = self._story.lines(events, max((r.step for r in records if not r.sparse), default=-1))
        steps: list[Record] = []
        for r in records:
            if r.sparse:
                if self._sparse_due(r):
                    lines.append((r.step, 2, r.wall_time, format_sparse(r)))
                continue
            self._last = r
            if self.live:
                steps.append(r)
            elif r.batch % self.every == 0:
                lines.append((r.step, 1, r.wall_time, f"epoch {r.epoch} batch {r.batch}: {format_values(r.values)}"))
        if self._holding:
            # The script's prints held since before each step come out above that step's line.
            lines.sort(key=lambda t: t[:2])
            with SCREEN.lock:
                for _, _, wall, line in lines:
                    release_script_stdout(before=wall)
                    self._print([line])
                if records:
                    release_script_stdout(before=max(r.wall_time for r in records))
        elif lines:
            lines.sort(key=lambda t: t[:2])
            self._print([line for _, _, _, line in lines])
        if steps:
            self._update_bar(steps)

    def _sparse_due(self, record: Record) -> bool:
        """Whether a ``Tap.log()`` line is printed: the same names logged again within ``every``
        steps (Lightning's ``self.log(..., on_step=True)`` logs at every step) print once per
        ``every`` steps, like the step lines; evaluation values, logged far apart, always print."""
        names = frozenset(record.values)
        last = self._sparse_printed.get(names)
        if last is not None and 0 <= record.step - last < self.every:
            return False
        self._sparse_printed[names] = record.step
        return True

    def end_run(self, run: RunInfo) -> None:
        due = self._story.lines((), None)  # what still waits: a rollback's anomaly, the last skips
        if due:
            self._print([line for *_, line in sorted(due)])
        with SCREEN.lock:
            self._close_bar()
            if self._holding:
                release_script_stdout(before=math.inf)  # printed while the run ran: above its last line
        last = f", last: {format_values(self._last.values)}" if self._last else ""
        reason = f" ({run.stop_reason})" if run.stop_reason else ""
        steps = f"{self._last.step + 1} steps" if self._last else "no steps"
        self._print(
            [f"batchtap: run {run.name!r} {run.status.value}{reason}: {steps}{last}; {self._story.counts(run.id)}"]
        )
        self._totals = {k: v for k, v in self._totals.items() if k[0] != run.id}
        self._unguard()

    def close(self) -> None:
        with SCREEN.lock:
            self._close_bar()
        self._unguard()

    # -- the live area -----------------------------------------------------------------------
    def _note_speed(self, records: Sequence[Record]) -> None:
        bar, recent = self._bar, self._recent
        assert bar is not None
        for r in records:
            if r.epoch != bar.epoch:
                continue
            if recent and r.batch <= recent[-1][1]:
                continue  # another rank's row of the same batch
            recent.append((r.wall_time, r.batch))
            while len(recent) > 2 and recent[-1][0] - recent[1][0] >= self.rate_window:
                recent.popleft()
        if len(recent) >= 2 and recent[-1][0] > recent[0][0]:
            bar.rate = (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])

    def _update_bar(self, records: Sequence[Record]) -> None:
        # A block may end one epoch and begin the next: each epoch's bar gets its own last record.
        start = 0
        for i in range(1, len(records) + 1):
            if i == len(records) or records[i].epoch != records[start].epoch:
                self._update_epoch_bar(records[start:i])
                start = i

    def _update_epoch_bar(self, records: Sequence[Record]) -> None:
        last = records[-1]
        with SCREEN.lock:
            if self._bar is None or self._bar.epoch != last.epoch:
                if SCREEN.mid_line:
                    return  # a new bar draws at once: wait for the script's line to end (next block)
                self._new_bar(last, records[0])
            bar = self._bar
            assert bar is not None
            self._note_speed(records)
            bar.n = last.batch + 1
            bar.fields = format_values(last.values)
            if not SCREEN.mid_line:
                self._hide()
                self._show()

    def _new_bar(self, last: Record, first: Record) -> None:
        if self._bar is not None:
            self._close_bar()
        total = (
            self._totals.get((last.run_id, last.epoch)) if self._run is None or self._run.id == last.run_id else None
        )
        # The epoch's time starts with its first step as captured, not when the console heard of it.
        self._bar = _Bar(epoch=last.epoch, total=total, start_t=min(time.time(), first.wall_time))
        self._recent = collections.deque()
        SCREEN.bars[id(self)] = (self._hide, self._show)

    def _area(self) -> list[str]:
        """The live area's lines, each shorter than the terminal is wide (a full line would wrap
        and the redraw would lose count of the lines it drew)."""
        from tqdm import tqdm

        bar = self._bar
        assert bar is not None
        width = max(terminal_width(self.stream) - 1, 20)
        elapsed = max(time.time() - bar.start_t, 0.0)
        meter = {"n": bar.n, "total": bar.total, "elapsed": elapsed, "prefix": f"epoch {bar.epoch}", "unit": "batch"}
        if bar.rate is not None:
            meter["rate"] = bar.rate
        one_line = width - len(bar.fields) - 2
        if bar.fields and one_line >= 60:  # a wide terminal: bar and values on one line
            return [f"{tqdm.format_meter(ncols=min(one_line, 100), **meter)}  {bar.fields}"]
        lines = [tqdm.format_meter(ncols=min(width, 100), **meter)]
        if bar.fields:  # the values wrap between fields, never inside one, and are never cut off
            lines += _wrap(bar.fields, width, first="  ")
        return [line[:width] for line in lines]

    def _hide(self) -> None:
        if self._drawn:
            up = f"\x1b[{self._drawn - 1}A" if self._drawn > 1 else ""
            self._emit(f"\r{up}\x1b[J")
            self._drawn = 0

    def _show(self) -> None:
        if self._bar is not None and not self._drawn:
            lines = self._area()
            self._emit("\r" + "\n".join(lines))
            self._drawn = len(lines)

    def _close_bar(self) -> None:
        SCREEN.bars.pop(id(self), None)
        if self._bar is not None:
            if not SCREEN.mid_line:  # the final state stays on screen, ended by a newline
                self._hide()
                self._emit("\r" + "\n".join(self._area()) + "\n")
            # else its lines would land on the script's unfinished line: left out
            self._bar = None
            self._drawn = 0

    # -- writing -----------------------------------------------------------------------------
    def _emit(self, text: str) -> None:
        """Write and flush; a closed stream (its reader went away) is dropped, never raised."""
        if self._closed_stream:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError) as e:  # ValueError: the file object itself was closed
            if not is_closed_error(e):
                raise
            self._closed_stream = True
            drop_broken(self.stream)

    def _print(self, lines: Iterable[str]) -> None:
        """Whole lines, never on the script's unfinished line nor on the live area's."""
        with SCREEN.lock:
            self._hide()
            flush_script_stdout()  # what the script printed so far comes first, and whole
            if self.live:  # long lines wrap between fields, never inside one
                width = max(terminal_width(self.stream) - 1, 20)
                lines = [part for line in lines for part in _wrap(line, width)]
            text = "".join(line + "\n" for line in lines)
            if SCREEN.mid_line:
                text = "\n" + text  # end the script's unfinished line first
                SCREEN.mid_line = False
            self._emit(text)
            if not SCREEN.mid_line:
                self._show()

    def _unguard(self) -> None:
        if self._holding:
            unhold_script_stdout()
            self._holding = False
        if self._guarding:
            unguard_stdout()
            self._guarding = False


def _wrap(line: str, width: int, first: str = "") -> list[str]:
    """``line`` in lines shorter than ``width``, broken at spaces (between ``name=value`` fields)."""
    if len(first) + len(line) < width:
        return [first + line]
    return textwrap.wrap(line, width=width, initial_indent=first, subsequent_indent="  ", break_on_hyphens=False)


def _can_draw(stream: IO[str]) -> bool:
    """A terminal a live area can be drawn on: a tty, not ``TERM=dumb``, not 0 columns wide."""
    import os

    try:
        tty = stream.isatty()
    except (ValueError, AttributeError):
        return False
    # A terminal that reports 0 columns (some containers and CI runners) gets plain lines.
    return tty and os.environ.get("TERM") != "dumb" and reported_width(stream) != 0


def _std_name(stream: IO[str]) -> str | None:
    """``"stdout"`` or ``"stderr"`` when ``stream`` is this process's, else None."""
    for name in ("stdout", "stderr"):
        if stream is real_stream(getattr(sys, name)) or stream is getattr(sys, f"__{name}__"):
            return name
    return None
