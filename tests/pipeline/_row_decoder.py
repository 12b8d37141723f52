"""The row-by-row decoder that batchtap used before the block decoder (pipeline/decode.py), kept
as the reference the block decoder is checked against (tests/pipeline/test_decode_blocks.py)."""

# ruff: noqa
from __future__ import annotations

import math
from math import isfinite

from batchtap.capture.flush import BlockData
from batchtap.metrics.decoding import ColumnLayout, StepTiming
from batchtap.pipeline.chain.decode import Decoder
from batchtap.records import Event, EventKind, Record
from tests.pipeline import _row_reference as reference

__all__ = ["RowDecoder", "Decoded"]


class Decoded:
    """What the row decoder returns: records, events, input errors, and per record the MEAN weights."""

    def __init__(self) -> None:
        self.weights: list[dict[str, float]] = []
        self.records: list[Record] = []
        self.events: list[Event] = []
        self.input_errors: list[str] = []


class RowDecoder(Decoder):
    """The block decoder's setup (spans, hooks, names), with the row-by-row ``decode`` it replaced."""

    def __init__(self, layout: ColumnLayout, *, run_id: str, rank: int) -> None:
        super().__init__(layout, run_id=run_id, rank=rank)
        self._gradient_based = [span.gradient_based for span in layout.spans]
        self._skip_metrics_mask = self._skips
        self._skip_metrics = any(self._skips)
        self._warns_any = any(self._warns)
        # per metric, its outputs with their domain's bounds: a value inside passes on one compare
        self._bounds = [
            [(o, o.domain.low, o.domain.high, o.domain.finite) for o in span.outputs] for span in layout.spans
        ]

    def decode(self, data: BlockData) -> Decoded:  # type: ignore[override]
        out = Decoded()
        dev, host = data.device_values.tolist(), data.host_values.tolist()  # numpy, host memory
        steps, epochs, batches = data.step.tolist(), data.epoch.tolist(), data.batch.tolist()
        walls, samples = data.wall_time.tolist(), data.samples.tolist()
        step_times, data_times = data.step_time.tolist(), data.data_time.tolist()
        tokens = data.tokens.tolist()
        for i in range(len(steps)):
            step, wall, dev_row, host_row = steps[i], walls[i], dev[i], host[i]
            timing = StepTiming(samples[i], step_times[i], data_times[i], tokens[i])
            raws = [dev_row[device_cols] + host_row[host_cols] for _, _, device_cols, host_cols in self._spans]
            skipped = self._skip_metrics and any(
                span[0].skipped(raw) for span, asks, raw in zip(self._spans, self._skip_metrics_mask, raws) if asks
            )
            if skipped:
                out.events.append(
                    Event(
                        self.run_id,
                        step,
                        EventKind.SKIP,
                        f"step {step}: the AMP GradScaler skipped the optimizer step (inf/NaN gradients; "
                        "the loss scale is lowered); gradient values of this step are left out",
                        wall,
                        rank=self.rank,
                    )
                )
            values: dict[str, float] = {}
            weights: dict[str, float] = {}
            for index, ((metric, outputs, _, _), raw, weighs, checks, bounds) in enumerate(
                zip(self._spans, raws, self._weighs, self._checks_inputs, self._bounds)
            ):
                if weighs:
                    w = reference.weight(metric, raw)
                    if w is not None:
                        weights.update((o.name, w) for o in outputs if o.weight == "metric")
                problem = metric.input_error(raw) if checks else None
                if problem is not None:
                    message = f"step {step}: {problem}"
                    out.input_errors.append(message)
                    for output in outputs:
                        values[output.name] = math.nan
                        self.anomaly_counts[output.name] += 1
                        out.events.append(self._event(step, wall, output.name, None, message))
                    continue
                if self._warns_any:
                    warning = metric.warning(raw)
                    if warning is not None and index not in self._warned:
                        self._warned.add(index)
                        out.events.append(
                            Event(
                                self.run_id,
                                step,
                                EventKind(getattr(metric, "notice_kind", "warning")),
                                f"step {step}: {warning}",
                                wall,
                                rank=self.rank,
                            )
                        )
                for (output, low, high, finite), value in zip(
                    bounds, reference.finalize(metric, raw, timing), strict=True
                ):
                    if value is None:
                        continue  # not measured at this step (e.g. no watched loader)
                    if low <= value <= high and (not finite or isfinite(value)):  # NaN fails the compare
                        values[output.name] = value
                        continue
                    why = output.domain.violation(value)
                    if why is None:
                        values[output.name] = value
                        continue
                    if skipped and self._gradient_based[index] and not math.isfinite(value):
                        continue  # expected on a step the scaler skipped: reported by the skip event
                    values[output.name] = math.nan
                    self.anomaly_counts[output.name] += 1
                    message = (
                        f"{output.name}={value!r} at step {step} is {why} "
                        f"(expected {output.domain.describe()}); stored as NaN"
                    )
                    out.events.append(self._event(step, wall, output.name, value, message))
            out.records.append(Record(self.run_id, step, epochs[i], batches[i], self.rank, wall, values))
            out.weights.append(weights)
        return out
