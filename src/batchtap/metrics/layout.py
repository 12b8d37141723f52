"""Where each metric's raw columns sit in a ring row, and the names of the values it reports.

:attr:`Layout.columns` is the torch-free half that travels to the pipeline with a run's blocks."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from batchtap.errors import ConfigError
from batchtap.metrics.base import Metric
from batchtap.metrics.decoding import ColumnLayout, ColumnSpan, MetricDecoder, overrides
from batchtap.metrics.domain import Output

__all__ = ["Layout", "Span", "ColumnLayout", "ColumnSpan"]


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
        #: the block's columns as the pipeline decodes them: each metric's decoder and outputs
        self.columns = ColumnLayout(
            tuple(
                ColumnSpan(
                    _decoder(s.metric, s.outputs),
                    s.device_offset,
                    s.metric.device_width,
                    s.host_offset,
                    s.metric.host_width,
                    s.outputs,
                    s.metric.gradient_based,
                    type(s.metric).__name__,
                )
                for s in spans
            ),
            device,
            host,
        )


def _decoder(metric: Metric, outputs: tuple[Output, ...]) -> MetricDecoder:
    """The metric's decoder, its weight hook and its outputs' weight declarations agreeing."""
    decoder = metric.decoder()
    declared = [o.name for o in outputs if o.weight == "metric"]
    weighs = overrides(decoder, "weight") or overrides(decoder, "weight_block")
    if declared and not weighs:
        raise ConfigError(
            f"{type(metric).__name__}: outputs {declared} declare weight='metric', but the metric gives no "
            "weight (expected a weight or weight_block hook); define one, or drop weight='metric'"
        )
    if weighs and not declared:
        raise ConfigError(
            f"{type(metric).__name__} gives a weight (a weight hook), but none of its outputs "
            f"{[o.name for o in outputs]} declares weight='metric'; declare it on the MEAN outputs it weighs"
        )
    return decoder
