"""Where each metric's raw columns sit in a ring row, and the names of the values it reports."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from batchtap.metrics.base import Metric
from batchtap.metrics.builtin import Loss
from batchtap.metrics.domain import Output

__all__ = ["Layout", "Span"]


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    """One metric's columns: ``device_width`` from ``device_offset``, ``host_width`` from ``host_offset``."""

    metric: Metric
    device_offset: int
    host_offset: int
    outputs: tuple[Output, ...]


class Layout:
    """Column layout of a ring row for an ordered list of metrics.

    Example:
        >>> from batchtap.metrics import Loss, Accuracy, StepTime
        >>> layout = Layout([Loss(), Accuracy(topk=(1, 5)), StepTime()])
        >>> layout.device_width, layout.host_width, layout.guard_column
        (5, 2, 0)
        >>> layout.names
        ('loss', 'accuracy', 'accuracy_top5', 'step_time')
    """

    def __init__(self, metrics: Sequence[Metric]) -> None:
        spans, device, host = [], 0, 0
        guard: int | None = None
        for metric in metrics:
            if isinstance(metric, Loss) and guard is None:
                guard = device
            spans.append(Span(metric, device, host, metric.outputs()))
            device += metric.device_width
            host += metric.host_width
        self.spans: tuple[Span, ...] = tuple(spans)
        self.device_width = device
        self.host_width = host
        #: device column holding the loss, copied to the host every step for the NaN guard
        self.guard_column = guard
        self.names: tuple[str, ...] = tuple(o.name for s in spans for o in s.outputs)
