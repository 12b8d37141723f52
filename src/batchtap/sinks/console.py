"""``Console``: live metrics on a terminal (a tqdm bar), plain lines everywhere else."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import IO, Any

from batchtap.records import ALL_RANKS, Event, EventKind, Record, RunInfo
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

    On a terminal: a progress bar per epoch with the latest values. Otherwise (a log file, CI):
    a plain line every ``every`` batches, e.g. ``epoch 0 batch 10: loss=0.4213 acc=91.25%``.
    Values logged with ``Tap.log()`` (sparse records) always get a line of their own, e.g.
    ``eval  step 200  val_loss 0.3100  val_acc 90.00%`` (:func:`format_sparse`), above the bar.
    Anomalies, actions, warnings and skipped steps (AMP) are printed as they arrive (at most
    ``max_anomaly_lines`` anomaly lines and as many skip lines per run, then only counted; the
    final line gives both counts — a skipped step is expected with a GradScaler, not an anomaly).

    Args:
        every: print a plain line for batches whose index is a multiple of this.
        stream: where to print (default ``sys.stderr``).
        live: force the progress bar on or off (default: on when ``stream`` is a terminal).
        max_anomaly_lines: anomaly lines (and skip lines) printed per run before they are only counted.
    """

    def __init__(
        self, every: int = 10, *, stream: IO[str] | None = None, live: bool | None = None, max_anomaly_lines: int = 20
    ) -> None:
        if every < 1:
            from batchtap.errors import ConfigError

            raise ConfigError(f"Console every must be >= 1, got {every}")
        self.every = every
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.max_anomaly_lines = max_anomaly_lines
        self._bar: Any = None
        self._bar_epoch: int | None = None
        self._anomalies = 0
        self._skips = 0
        self._last: Record | None = None
        self._run: RunInfo | None = None

    def start_run(self, run: RunInfo) -> None:
        self._run, self._anomalies, self._skips, self._last = run, 0, 0, None
        self._print(f"batchtap: run {run.name!r} ({run.id[:8]}) started")

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

    def _update_bar(self, records: Sequence[Record]) -> None:
        from tqdm import tqdm

        last = records[-1]
        if self._bar is None or self._bar_epoch != last.epoch:
            if self._bar is not None:
                self._bar.close()
            self._bar = tqdm(desc=f"epoch {last.epoch}", unit="batch", file=self.stream, dynamic_ncols=True)
            self._bar_epoch = last.epoch
            self._bar.n = 0
        self._bar.update(max(0, last.batch + 1 - self._bar.n))
        self._bar.set_postfix_str(format_values(last.values), refresh=True)

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
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        last = f", last: {format_values(self._last.values)}" if self._last else ""
        reason = f" ({run.stop_reason})" if run.stop_reason else ""
        steps = f"{self._last.step + 1} steps" if self._last else "no steps"
        skips = f"; skipped steps: {self._skips}" if self._skips else ""
        self._print(
            f"batchtap: run {run.name!r} {run.status.value}{reason}: {steps}{last}; anomalies: {self._anomalies}{skips}"
        )

    def _print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
