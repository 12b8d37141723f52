"""Where each metric's raw columns sit in a ring row, and the names of the values it reports."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from batchtap.metrics.base import Metric
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
        (11, 2, 0)
        >>> layout.names
        ('loss', 'accuracy', 'accuracy_top5', 'step_time')
    """

    def __init__(self, metrics: Sequence[Metric]) -> None:
        # Device columns of per-micro-batch metrics (loss, accuracy, ...) come first, so an
        # accumulated optimizer step writes them as one contiguous block; value order is unchanged.
        offsets: dict[int, int] = {}
        device = 0
        for i, metric in sorted(enumerate(metrics), key=lambda im: not im[1].per_micro_batch):
            offsets[i] = device
            device += metric.device_width
        spans, host = [], 0
        guard: int | None = None
        for i, metric in enumerate(metrics):
            if metric.watched_by_nan_guard and guard is None:
                guard = offsets[i]
            spans.append(Span(metric, offsets[i], host, metric.outputs()))
            host += metric.host_width
        self.spans: tuple[Span, ...] = tuple(spans)
        self.device_width = device
        self.host_width = host
        #: device columns ``[0, micro_width)`` belong to the per-micro-batch metrics
        self.micro_width = sum(m.device_width for m in metrics if m.per_micro_batch)
        #: spans in device-column order: the order ``compute`` results are stacked into a row
        self.device_order: tuple[Span, ...] = tuple(sorted(spans, key=lambda sp: sp.device_offset))
        #: device column holding the loss, copied to the host every step for the NaN guard
        self.guard_column = guard
        self.names: tuple[str, ...] = tuple(o.name for s in spans for o in s.outputs)
