"""Why a default metric is left out of a run, said once.

The default metrics drop a metric whose inputs the first step lacks (``Metric.applies``). Most such
drops are meant (no outputs in a loss-only loop, floating-point targets in a regression); some are a
mistake the user would want to hear about: class scores passed without ``targets=``, outputs of
shape ``[B]``, one-hot targets in floating point. A metric says which with
:meth:`~batchtap.metrics.Metric.left_out_reason` (accuracy does); the run stores each such reason as one warning
event at its first step and logs it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from typing import Protocol

from batchtap.metrics.base import Metric, StepInputs
from batchtap.records import Event, EventKind

__all__ = ["left_out_reasons", "warn_left_out"]

log = logging.getLogger("batchtap")


class _Run(Protocol):
    """What :func:`warn_left_out` needs of the open run."""

    @property
    def step(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def info(self) -> object: ...
    def send(self, events: Sequence[Event]) -> None: ...


def left_out_reasons(metrics: Sequence[Metric], chosen: Collection[int], inputs: StepInputs) -> list[str]:
    """The reasons of the metrics not in ``chosen`` (their ids) that say why they were left out."""
    out = []
    for metric in metrics:
        if id(metric) in chosen:
            continue
        reason = metric.left_out_reason(inputs)
        if reason:
            out.append(reason)
    return out


def warn_left_out(run: _Run, metrics: Sequence[Metric], chosen: Collection[int], inputs: StepInputs) -> None:
    """One warning event per reason at the run's first step, and a log line (metadata only)."""
    reasons = left_out_reasons(metrics, chosen, inputs)
    if not reasons:
        return
    run_id = getattr(run.info, "id", "")
    events = []
    for reason in reasons:
        log.warning("batchtap: %s", reason)
        events.append(Event(run_id, run.step, EventKind.WARNING, reason, time.time(), rank=run.rank))
    run.send(events)
