"""Decode ring rows into records and validate every value against its metric's domain.

A value outside its domain is stored as NaN and reported as an anomaly event that keeps the raw
value; nothing is dropped silently. Raw columns that reveal invalid inputs (class indices out of
range) make the metric's values NaN and produce an input error the training thread raises.
"""

from __future__ import annotations

import collections
import math
from batchtap.capture.flush import BlockData
from batchtap.metrics.base import StepTiming
from batchtap.metrics.layout import Layout
from batchtap.records import Event, EventKind, Record

__all__ = ["Decoder", "Decoded"]


class Decoded:
    """Result of decoding one block."""

    __slots__ = ("records", "events", "input_errors")

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.events: list[Event] = []
        self.input_errors: list[str] = []


class Decoder:
    """Turns :class:`BlockData` into validated :class:`Record` objects for one run and rank.

    Attributes:
        anomaly_counts: anomalies seen so far per value name.
    """

    def __init__(self, layout: Layout, *, run_id: str, rank: int) -> None:
        self.layout = layout
        self.run_id = run_id
        self.rank = rank
        self.anomaly_counts: collections.Counter[str] = collections.Counter()

    def decode(self, data: BlockData) -> Decoded:
        out = Decoded()
        dev, host = data.device_values.tolist(), data.host_values.tolist()  # numpy, host memory
        for i in range(len(data)):
            step = int(data.step[i])
            wall = float(data.wall_time[i])
            timing = StepTiming(float(data.samples[i]), float(data.step_time[i]), float(data.data_time[i]))
            values: dict[str, float] = {}
            for span in self.layout.spans:
                metric = span.metric
                raw = [
                    *dev[i][span.device_offset : span.device_offset + metric.device_width],
                    *host[i][span.host_offset : span.host_offset + metric.host_width],
                ]
                problem = metric.input_error(raw)
                if problem is not None:
                    message = f"step {step}: {problem}"
                    out.input_errors.append(message)
                    for output in span.outputs:
                        values[output.name] = math.nan
                        self.anomaly_counts[output.name] += 1
                        out.events.append(self._event(step, wall, output.name, None, message))
                    continue
                for output, value in zip(span.outputs, metric.finalize(raw, timing), strict=True):
                    if value is None:
                        continue  # not measured at this step (e.g. no watched loader)
                    why = output.domain.violation(value)
                    if why is None:
                        values[output.name] = value
                        continue
                    values[output.name] = math.nan
                    self.anomaly_counts[output.name] += 1
                    message = (
                        f"{output.name}={value!r} at step {step} is {why} "
                        f"(expected {output.domain.describe()}); stored as NaN"
                    )
                    out.events.append(self._event(step, wall, output.name, value, message))
            out.records.append(
                Record(self.run_id, step, int(data.epoch[i]), int(data.batch[i]), self.rank, wall, values)
            )
        return out

    def _event(self, step: int, wall: float, metric: str, raw: float | None, message: str) -> Event:
        return Event(self.run_id, step, EventKind.ANOMALY, message, wall, metric=metric, raw_value=raw, rank=self.rank)

