"""``TensorBoard(log_dir)``: scalars and events for TensorBoard, through ``SummaryWriter``."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from batchtap.errors import SinkError
from batchtap.records import ALL_RANKS, Event, Record, RunInfo
from batchtap.sinks.base import Sink, require

__all__ = ["TensorBoard"]

# the names of batchtap.metrics.Histograms' values: hist/<kind>/<layer>/<min|max|i> (the metric's
# module is not imported: sinks never load torch)
_HIST = "hist/"
_HIST_KINDS = ("weight", "grad")


class TensorBoard(Sink):
    """Write metric values as TensorBoard scalars and events as TensorBoard text.

    * Each value becomes scalar ``<prefix>/<metric>`` (``train/loss``) at the record's own step and
      wall time, so the time axis shows when the step ran, not when the dispatcher wrote it. All
      values of one record travel in one TensorBoard event (one ``Summary`` with a value per
      metric): a tenth of the events, and of the writer's work, that one ``add_scalar`` per value
      costs. A record of rank ``k >= 1`` goes to ``<prefix>/<metric>/rank<k>``;
      reduced records (all ranks) and rank 0 share the plain name.
    * A sparse record (``Tap.log()``: evaluation, epoch-level values) has its values as scalars
      named as logged, without the prefix (``val_loss``, what ``add_scalar("val_loss", ...)``
      writes), at the step and wall time it names; rank ``k >= 1``: ``<name>/rank<k>``.
    * The per-layer histograms of :class:`~batchtap.metrics.Histograms` (values
      ``hist/<weight|grad>/<layer>/min``, ``.../max``, ``.../<i>``) become one TensorBoard
      histogram each, ``<prefix>/hist/<kind>/<layer>`` at the record's step (the Histograms and
      Distributions dashboards), not ``bins + 2`` scalars: bucket ``i`` spans the ``i``-th of the
      equal bins between the stored min and max, with the stored count. ``sum`` and
      ``sum_squares``, which batchtap does not keep, are those of the bin centres (the
      dashboards draw from the buckets).
    * Events become text under ``events/<kind>`` (``events/anomaly``, ``events/action``,
      ``events/warning``) at their step; the run's config and final status under ``run/...``.
    * TensorBoard stores scalars as float32; NaN stays NaN.

    Args:
        log_dir: directory for the event files (created when missing).
        prefix: first part of every scalar name.
        max_queue: events ``SummaryWriter`` buffers before writing; batchtap flushes every block anyway.

    Raises:
        SinkError: ``log_dir`` cannot be created or written.
        ImportError: the ``tensorboard`` package is missing (``pip install 'batchtap[tensorboard]'``).

    Example:
        >>> import tempfile
        >>> tb = TensorBoard(tempfile.mkdtemp())
        >>> tb.write([Record("r", step=0, epoch=0, batch=0, rank=0, wall_time=1.0, values={"loss": 0.7})])
        >>> tb.close()
    """

    _live = ("_writer",)

    def __init__(self, log_dir: str | os.PathLike[str], *, prefix: str = "train", max_queue: int = 1000) -> None:
        require("tensorboard", extra="tensorboard", purpose="bt.sinks.TensorBoard")
        summary_mod = require("torch.utils.tensorboard.summary", extra="tensorboard", purpose="bt.sinks.TensorBoard")
        proto = require("tensorboard.compat.proto.summary_pb2", extra="tensorboard", purpose="bt.sinks.TensorBoard")
        self._Summary: Any = proto.Summary
        self._Histogram: Any = proto.HistogramProto
        self._text: Any = summary_mod.text
        self.log_dir = os.fspath(log_dir)
        self.prefix = prefix.rstrip("/")
        self._max_queue = max_queue
        self._writer: Any = None
        self._open_live()
        self._tags: dict[tuple[str, int, bool], str] = {}

    def _open_live(self) -> None:
        """Check that ``log_dir`` can be written. The event file itself is made at the first
        write, by the process that writes (under ``pipeline="process"`` the pipeline process; a
        copy unpickled after the original wrote adds a file of its own next to the original's,
        and TensorBoard reads a directory's files as one log)."""
        try:
            os.makedirs(self.log_dir, exist_ok=True)
            if not os.access(self.log_dir, os.W_OK | os.X_OK):
                raise PermissionError(13, "Permission denied", self.log_dir)
        except OSError as exc:
            raise _unwritable(self.log_dir, exc) from exc

    def _events_file(self) -> Any:
        """The event file's writer, made on first use."""
        if self._writer is None:
            writer_mod = require("torch.utils.tensorboard.writer", extra="tensorboard", purpose="bt.sinks.TensorBoard")
            try:
                # FileWriter, not SummaryWriter: it takes whole Summary protos, so a record is one event.
                self._writer = writer_mod.FileWriter(self.log_dir, max_queue=self._max_queue, flush_secs=3600)
            except OSError as exc:
                raise _unwritable(self.log_dir, exc) from exc
        return self._writer

    def _tag(self, metric: str, rank: int, sparse: bool = False) -> str:
        key = (metric, rank, sparse)
        tag = self._tags.get(key)
        if tag is None:
            base = metric if sparse else f"{self.prefix}/{metric}"
            tag = base if rank in (0, ALL_RANKS) else f"{base}/rank{rank}"
            self._tags[key] = tag
        return tag

    def start_run(self, run: RunInfo) -> None:
        """Record the run's id, name and config as text (``run/config``)."""
        text = json.dumps({"id": run.id, "name": run.name, "config": run.config}, indent=2, default=str)
        self._add_text("run/config", f"```\n{text}\n```", 0, run.started_at)

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        """Add every value as a scalar and every event as text, then flush the event file."""
        writer = self._events_file()
        add_summary, summary, value = writer.add_summary, self._Summary, self._Summary.Value
        try:
            for r in records:
                if r.values:
                    scalars, histograms = _split_histograms(r.values)
                    values = [
                        value(tag=self._tag(name, r.rank, r.sparse), simple_value=float(v))
                        for name, v in scalars.items()
                    ]
                    values += [
                        value(tag=self._tag(name, r.rank, r.sparse), histo=self._histogram(*parts))
                        for name, parts in histograms.items()
                    ]
                    add_summary(summary(value=values), global_step=r.step, walltime=r.wall_time)
            for e in events:
                self._add_text(f"events/{e.kind.value}", _event_text(e), e.step, e.wall_time)
            # One flush per block (not per value): followers see the block, the file stays appended.
            writer.flush()
        except OSError as exc:
            raise SinkError(f"cannot write TensorBoard logs to {self.log_dir}: {exc.strerror or exc}") from exc

    def _histogram(self, low: float, high: float, counts: list[float]) -> Any:
        """A ``HistogramProto`` of equal bins over ``[low, high]``: ``bucket_limit[i]`` is bucket
        ``i``'s right edge (TensorBoard takes ``min`` as the first bucket's left edge)."""
        edges = np.linspace(low, high, len(counts) + 1)
        centres = (edges[:-1] + edges[1:]) / 2
        weights = np.asarray(counts, dtype=np.float64)
        return self._Histogram(
            min=low,
            max=high,
            num=float(weights.sum()),
            sum=float((weights * centres).sum()),
            sum_squares=float((weights * centres * centres).sum()),
            bucket_limit=edges[1:].tolist(),
            bucket=weights.tolist(),
        )

    def end_run(self, run: RunInfo) -> None:
        """Record the run's final status and stop reason as text (``run/status``)."""
        text = run.status.value + (f": {run.stop_reason}" if run.stop_reason else "")
        self._add_text("run/status", text, 0, run.ended_at)
        self._events_file().flush()

    def _add_text(self, tag: str, text: str, step: int, walltime: float | None) -> None:
        self._events_file().add_summary(self._text(tag, text), global_step=step, walltime=walltime)

    def flush(self) -> None:
        """Write buffered events to the event file."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _split_histograms(
    values: Mapping[str, float],
) -> tuple[dict[str, float], dict[str, tuple[float, float, list[float]]]]:
    """A record's values as (scalars, histograms): ``hist/<kind>/<layer>/{min,max,0..n-1}``, all
    parts present and finite, become ``{"hist/<kind>/<layer>": (min, max, counts)}``; anything
    else (a partial or non-finite set, another name) stays a scalar."""
    if not any(name.startswith(_HIST) for name in values):
        return dict(values), {}
    parts: dict[str, dict[str, float]] = {}
    scalars: dict[str, float] = {}
    for name, v in values.items():
        head, _, part = name.rpartition("/")
        if name.startswith(_HIST) and head.count("/") >= 2 and head.split("/")[1] in _HIST_KINDS:
            parts.setdefault(head, {})[part] = v
        else:
            scalars[name] = v
    histograms: dict[str, tuple[float, float, list[float]]] = {}
    for head, found in parts.items():
        bins = len(found) - 2
        keys = ("min", "max", *map(str, range(bins)))
        if bins >= 1 and all(k in found for k in keys) and all(math.isfinite(found[k]) for k in keys):
            histograms[head] = (found["min"], found["max"], [found[str(i)] for i in range(bins)])
        else:
            scalars.update({f"{head}/{k}": v for k, v in found.items()})
    return scalars, histograms


def _unwritable(log_dir: str, exc: OSError) -> SinkError:
    return SinkError(
        f"cannot write TensorBoard logs to {log_dir}: {exc.strerror or exc}; expected a "
        "writable directory; fix: choose another log_dir or fix its permissions"
    )


def _event_text(e: Event) -> str:
    parts = [f"**{e.kind.value}** at step {e.step}"]
    if e.metric is not None:
        parts.append(f"metric `{e.metric}`")
    if e.raw_value is not None:
        parts.append(f"raw value {e.raw_value!r}")
    if e.rank not in (0, ALL_RANKS):
        parts.append(f"rank {e.rank}")
    return ", ".join(parts) + f": {e.message}"
