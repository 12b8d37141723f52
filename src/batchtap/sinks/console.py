"""``Console``: live metrics on a terminal (a tqdm bar), plain lines everywhere else."""

from __future__ import annotations

import collections
import math
import sys
from collections.abc import Sequence
from typing import IO, Any

from batchtap.records import ALL_RANKS, Event, EventKind, Record, RunInfo
from batchtap.sinks._terminal import SCREEN, flush_script_stdout, guard_stdout, real_stream, unguard_stdout
from batchtap.sinks.base import Sink

__all__ = ["Console", "format_values", "format_sparse"]

_LABELS = {"accuracy": "acc", "step_time": "step", "data_time": "data", "grad_norm": "gnorm", "throughput": "tput"}


def _format_one(name: str, value: float) -> str:
    if math.isnan(value):
        return "nan"
    if name.startswith("accuracy"):
        return f"{value * 100:.2f}%"
    if name.endswith("_time"):
        return f"{value * 1e3:.2f}ms"
    if name.startswith("memory"):
        return f"{value / 2**20:.0f}MiB"
    if name == "throughput":
        return f"{value:.0f}/s"
    if name == "loss":
        return f"{value:.4f}"
    return f"{value:.4g}"


def format_values(values: dict[str, float] | Any) -> str:
    """Values as ``name=value`` pairs with short labels and units.

    Example:
        >>> format_values({"loss": 0.42131, "accuracy": 0.9125, "accuracy_top5": 1.0, "step_time": 0.0032})
        'loss=0.4213 acc=91.25% acc5=100.00% step=3.20ms'
    """
    parts = []
    for name, value in values.items():
        label = _LABELS.get(name) or name.replace("accuracy_top", "acc")
        parts.append(f"{label}={_format_one(name, value)}")
    return " ".join(parts)


def _looks_like_accuracy(name: str) -> bool:
    last = name.replace("/", "_").rsplit("_", 1)[-1]
    return name.startswith("accuracy") or last in ("acc", "accuracy")


def format_sparse(record: Record) -> str:
    """One line for a sparse record (``Tap.log()``): its step and each value, name as logged.

    A name ending in ``acc``/``accuracy`` with a value in [0, 1] shows as a percentage, one with
    ``loss`` in it with 4 decimals.

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
        if math.isnan(value):
            text = "nan"
        elif _looks_like_accuracy(name) and 0.0 <= value <= 1.0:
            text = f"{value * 100:.2f}%"
        elif "loss" in name:
            text = f"{value:.4f}"
        else:
            text = f"{value:.4g}"
        parts.append(f"{name} {text}")
    return "  ".join(parts)


class Console(Sink):
    """Show metrics while training runs.

    On a terminal: a progress bar per epoch with the latest values. When the epoch comes from
    ``tap.watch(loader)`` and the loader has a ``len()``, the bar shows the total, the percentage
    and the time left; its rate is the training speed, batches per second from the steps' own wall
    times over the last ``rate_window`` seconds (not from when the records reached the console,
    which is every flush). Otherwise (a log file, CI): a plain line every ``every`` batches, e.g.
    ``epoch 0 batch 10: loss=0.4213 acc=91.25%``.

    Values logged with ``Tap.log()`` (sparse records) always get a line of their own, e.g.
    ``eval  step 200  val_loss 0.3100  val_acc 90.00%`` (:func:`format_sparse`), above the bar.
    Anomalies, actions, warnings and skipped steps (AMP) are printed as they arrive (at most
    ``max_anomaly_lines`` anomaly lines and as many skip lines per run, then only counted; the
    final line gives both counts — a skipped step is expected with a GradScaler, not an anomaly).

    The script's own ``print()`` s never share a line with the bar or with batchtap's lines: while
    a run is shown, ``sys.stdout`` is wrapped so that the bar is hidden before the script's text and
    drawn again below it once its line is complete, and batchtap never draws while the script's
    line is unfinished (see :mod:`batchtap.sinks._terminal`; ``guard_stdout=False`` leaves
    ``sys.stdout`` alone).

    Args:
        every: print a plain line for batches whose index is a multiple of this.
        stream: where to print (default ``sys.stderr``).
        live: force the progress bar on or off (default: on when ``stream`` is a terminal).
        max_anomaly_lines: anomaly lines (and skip lines) printed per run before they are only counted.
        rate_window: seconds of recent steps the bar's rate (and so its time left) is computed over.
        guard_stdout: keep the script's prints off the console's lines (see above).

    Under ``bt.Tap(pipeline="process")`` the console runs in the pipeline process: ``sys.stdout``
    and ``sys.stderr`` travel there as their names and print to that process's own (the same
    terminal), and the stdout it guards is that process's. Another ``stream`` cannot travel.
    """

    _live = ("stream", "_bar")

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

        if every < 1:
            raise ConfigError(f"Console every must be >= 1, got {every}")
        if not (isinstance(rate_window, (int, float)) and rate_window > 0):
            raise ConfigError(f"Console rate_window must be > 0 seconds, got {rate_window!r}")
        self.every = every
        self.stream = real_stream(stream if stream is not None else sys.stderr)
        self._stream_name = _std_name(self.stream)  # how the stream travels to another process
        self.live = self.stream.isatty() if live is None else live
        self.max_anomaly_lines = max_anomaly_lines
        self.rate_window = float(rate_window)
        self.guard_stdout = guard_stdout
        self._guarding = False
        self._bar: Any = None
        self._bar_epoch: int | None = None
        self._shown = False  # the bar is drawn on screen now
        self._anomalies = 0
        self._skips = 0
        self._last: Record | None = None
        self._run: RunInfo | None = None
        self._totals: dict[tuple[str, int], int | None] = {}
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (wall time, batch) this epoch
        self._rate: float | None = None

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
        with no bar drawn and its stdout not guarded yet."""
        assert self._stream_name is not None
        self.stream = real_stream(getattr(sys, self._stream_name))
        self._guarding = self._shown = False
        self._bar_epoch = None

    def start_run(self, run: RunInfo) -> None:
        self._run, self._anomalies, self._skips, self._last = run, 0, 0, None
        if self.guard_stdout and not self._guarding:
            guard_stdout()
            self._guarding = True
        self._print(f"batchtap: run {run.name!r} ({run.id[:8]}) started")

    def start_epoch(self, run_id: str, epoch: int, total: int | None) -> None:
        """Note the length of an epoch's loader: its bar shows total, percentage and time left."""
        self._totals[(run_id, epoch)] = total

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        for event in events:
            self._event(event)
        steps: list[Record] = []
        for r in records:
            if r.sparse:
                self._print(format_sparse(r))
            elif self.live:
                steps.append(r)
            elif r.batch % self.every == 0:
                self._print(f"epoch {r.epoch} batch {r.batch}: {format_values(r.values)}")
            if not r.sparse:
                self._last = r
        if steps:
            self._update_bar(steps)

    def _note_speed(self, records: Sequence[Record]) -> None:
        recent = self._recent
        for r in records:
            if r.epoch != self._bar_epoch:
                continue
            if recent and r.batch <= recent[-1][1]:
                continue  # another rank's row of the same batch
            recent.append((r.wall_time, r.batch))
            while len(recent) > 2 and recent[-1][0] - recent[1][0] >= self.rate_window:
                recent.popleft()
        if len(recent) >= 2 and recent[-1][0] > recent[0][0]:
            self._rate = (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])

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
            if self._bar is None or self._bar_epoch != last.epoch:
                if SCREEN.mid_line:
                    return  # a new bar draws at once: wait for the script's line to end (next block)
                self._new_bar(last, records[0])
            self._note_speed(records)
            bar = self._bar
            bar.training_rate = self._rate
            bar.n = last.batch + 1
            bar.set_postfix_str(format_values(last.values), refresh=False)
            if not SCREEN.mid_line:
                bar.refresh()
                self._shown = True

    def _new_bar(self, last: Record, first: Record) -> None:
        if self._bar is not None:
            self._close_bar()
        total = (
            self._totals.get((last.run_id, last.epoch)) if self._run is None or self._run.id == last.run_id else None
        )
        bar = _bar_class()(
            desc=f"epoch {last.epoch}", total=total, unit="batch", file=self.stream, dynamic_ncols=True,
            leave=True, delay=0, mininterval=0,
        )  # fmt: skip
        # The epoch's time starts with its first step as captured, not when the console heard of it.
        bar.start_t = min(bar.start_t, first.wall_time)
        self._bar, self._bar_epoch, self._recent = bar, last.epoch, collections.deque()
        SCREEN.bars[id(self)] = (self._hide, self._show)

    def _hide(self) -> None:
        if self._bar is not None and self._shown:
            self._bar.clear()
            self._shown = False

    def _show(self) -> None:
        if self._bar is not None and not self._shown:
            self._bar.refresh()
            self._shown = True

    def _close_bar(self) -> None:
        SCREEN.bars.pop(id(self), None)
        if self._bar is not None:
            if not SCREEN.mid_line:
                self._bar.refresh()  # the final state stays on screen with its newline
                self._bar.close()
            else:
                self._bar.disable = True  # its line would land on the script's unfinished line
            self._bar = None
            self._shown = False

    def _event(self, event: Event) -> None:
        if event.kind is EventKind.ANOMALY:
            self._anomalies += 1
            if self._anomalies > self.max_anomaly_lines:
                return
        elif event.kind is EventKind.SKIP:
            self._skips += 1
            if self._skips > self.max_anomaly_lines:
                return
        self._print(f"batchtap {event.kind.value} at step {event.step}: {event.message}")

    def end_run(self, run: RunInfo) -> None:
        with SCREEN.lock:
            self._close_bar()
        last = f", last: {format_values(self._last.values)}" if self._last else ""
        reason = f" ({run.stop_reason})" if run.stop_reason else ""
        steps = f"{self._last.step + 1} steps" if self._last else "no steps"
        skips = f"; skipped steps: {self._skips}" if self._skips else ""
        self._print(
            f"batchtap: run {run.name!r} {run.status.value}{reason}: {steps}{last}; anomalies: {self._anomalies}{skips}"
        )
        self._totals = {k: v for k, v in self._totals.items() if k[0] != run.id}
        self._unguard()

    def _print(self, line: str) -> None:
        """One whole line, never on the script's unfinished line nor on the bar's."""
        with SCREEN.lock:
            self._hide()
            flush_script_stdout()  # what the script printed so far comes first, and whole
            text = line + "\n"
            if SCREEN.mid_line:
                text = "\n" + text  # end the script's unfinished line first
                SCREEN.mid_line = False
            self.stream.write(text)
            self.stream.flush()
            self._show()

    def _unguard(self) -> None:
        if self._guarding:
            unguard_stdout()
            self._guarding = False

    def close(self) -> None:
        with SCREEN.lock:
            self._close_bar()
        self._unguard()


def _std_name(stream: IO[str]) -> str | None:
    """``"stdout"`` or ``"stderr"`` when ``stream`` is this process's, else None."""
    for name in ("stdout", "stderr"):
        if stream is real_stream(getattr(sys, name)) or stream is getattr(sys, f"__{name}__"):
            return name
    return None


_BAR_CLASS: Any = None


def _bar_class() -> Any:
    """tqdm whose rate (and so its time left) is the training speed the console measured."""
    global _BAR_CLASS
    if _BAR_CLASS is None:
        from tqdm import tqdm

        class TrainingBar(tqdm):  # type: ignore[misc]
            monitor_interval = 0  # no tqdm monitor thread: only the console draws, under SCREEN.lock
            training_rate: float | None = None

            @property
            def format_dict(self) -> dict[str, Any]:
                d: dict[str, Any] = super().format_dict
                if self.training_rate is not None:
                    d["rate"] = self.training_rate
                return d

        _BAR_CLASS = TrainingBar
    return _BAR_CLASS
