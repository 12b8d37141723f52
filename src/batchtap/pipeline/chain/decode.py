"""Decode ring rows into records and validate every value against its metric's domain.

A value outside its domain is stored as NaN and reported as an anomaly event that keeps the raw
value; nothing is dropped silently. Raw columns that reveal invalid inputs (class indices out of
range) make the metric's values NaN and produce an input error the training thread raises.

A block is decoded column by column: each metric finalizes the whole block at once where it can
(:meth:`~batchtap.metrics.decoding.MetricDecoder.finalize_block`, the built-in metrics do), every value is checked
against its domain with one array compare per output, and only the few values that fail, or rows a
metric flags, are looked at one by one. The pipeline shares the training process's GIL, so its
time per row is time the training thread may wait for.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Callable

import numpy as np

from batchtap.metrics.decoding import BlockData, BlockTiming, ColumnLayout, MetricDecoder, StepTiming, overrides
from batchtap.pipeline.chain.rows import DecodedBlock
from batchtap.records import Event, EventKind

__all__ = ["Decoder"]


class _Columns:
    """One metric's values over a block: ``[n, outputs]`` values and presence, filled in place."""

    __slots__ = ("values", "present")

    def __init__(self, values: np.ndarray, present: np.ndarray) -> None:
        self.values = values
        self.present = present


class Decoder:
    """Turns :class:`BlockData` into validated :class:`Record` objects for one run and rank.

    Args:
        layout: the run's columns: each metric's decoder and outputs (numpy only, no torch).
        run_id: the run the records belong to.
        rank: the process rank they come from.
        weights: also give each record's MEAN weights (``Decoded.weights``); only a reducer
            averaging over ranks reads them.

    Attributes:
        anomaly_counts: anomalies seen so far per value name.
    """

    def __init__(self, layout: ColumnLayout, *, run_id: str, rank: int, weights: bool = True) -> None:
        self.layout = layout
        self.run_id = run_id
        self.rank = rank
        self.anomaly_counts: collections.Counter[str] = collections.Counter()
        # Per metric, made once: its outputs and the column ranges of its raw values.
        self._spans = [
            (
                span.decoder,
                span.outputs,
                slice(span.device_offset, span.device_offset + span.device_width),
                slice(span.host_offset, span.host_offset + span.host_width),
            )
            for span in layout.spans
        ]
        self._kinds = [span.name for span in layout.spans]
        # Only decoders that override the optional hooks are asked.
        self._skips = [overrides(span.decoder, "skipped") for span in layout.spans]
        self._warns = [overrides(span.decoder, "warning") for span in layout.spans]
        # per metric, its outputs averaging over the metric's own weight (declared on the output);
        # weights only matter to a reducer averaging over ranks (``weights=False``: none is made)
        self._weighed = [
            np.array([o.weight == "metric" for o in span.outputs], dtype=bool) if weights else None
            for span in layout.spans
        ]
        self._weighs = [w is not None and bool(w.any()) for w in self._weighed]
        self._checks_inputs = [overrides(span.decoder, "input_error") for span in layout.spans]
        self._names = [o.name for span in layout.spans for o in span.outputs]
        self._warned: set[int] = set()  # metrics whose warning was reported (once per run)
        # Per output column of a block (metrics in order): its metric's index, its place among the
        # metric's outputs, the output, and its domain as arrays (one compare checks every column)
        self._owners = [
            (index, place, output, span.gradient_based)
            for index, span in enumerate(layout.spans)
            for place, output in enumerate(span.outputs)
        ]
        domains = [output.domain for _, _, output, _ in self._owners]
        self._low = np.array([d.low for d in domains], dtype=np.float64)
        self._high = np.array([d.high for d in domains], dtype=np.float64)
        self._infinite_ok = np.array([not d.finite for d in domains], dtype=bool)

    def decode(self, data: BlockData) -> DecodedBlock:
        n = len(data.step)
        if n == 0:
            return DecodedBlock.empty(self.run_id, self.rank, self._names)
        steps, walls = data.step.tolist(), data.wall_time.tolist()
        timing = BlockTiming(data.samples, data.step_time, data.data_time, data.tokens)
        raws = [
            np.concatenate((data.device_values[:, device_cols], data.host_values[:, host_cols]), axis=1)
            for _, _, device_cols, host_cols in self._spans
        ]
        rows: list[list[list[float]] | None] = [None] * len(raws)  # raws[i].tolist(), made when needed

        def raw_rows(index: int) -> list[list[float]]:
            made = rows[index]
            if made is None:
                made = rows[index] = raws[index].tolist()
            return made

        timings: list[StepTiming] = []  # per row, made when a metric finalizes row by row

        def step_timings() -> list[StepTiming]:
            if not timings:
                fields = (data.samples, data.step_time, data.data_time, data.tokens)
                timings.extend(map(StepTiming, *(f.tolist() for f in fields)))
            return timings

        # events keyed by (row, metric, place) so they come out in the order a row-by-row decode
        # gives: a row's skip event, then per metric its input error, warning and anomalies
        events: list[tuple[tuple[int, int, int], Event]] = []
        input_errors: list[tuple[tuple[int, int], str]] = []

        skipped = np.zeros(n, dtype=bool)
        for index, (metric, *_rest) in enumerate(self._spans):
            if self._skips[index]:
                table = raw_rows(index)
                for i in range(n):
                    if not skipped[i] and metric.skipped(table[i]):
                        skipped[i] = True
        for i in np.flatnonzero(skipped).tolist():
            step = steps[i]
            message = (
                f"step {step}: the AMP GradScaler skipped the optimizer step (inf/NaN gradients; "
                "the loss scale is lowered); gradient values of this step are left out"
            )
            events.append(((i, -1, 0), Event(self.run_id, step, EventKind.SKIP, message, walls[i], rank=self.rank)))

        columns: list[_Columns] = []
        problems_of: list[dict[int, str]] = []  # per metric: rows whose inputs it found invalid
        weights = np.full((n, len(self._names)), math.nan) if any(self._weighs) else None
        first_column = 0
        for index, (metric, outputs, _, _) in enumerate(self._spans):
            raw = raws[index]
            if self._weighs[index] and weights is not None:
                block = metric.weight_block(raw)
                if block is None:
                    block = np.array([math.nan if (w := metric.weight(r)) is None else w for r in raw_rows(index)])
                weighed = self._weighed[index]
                assert weighed is not None
                columns_of = np.flatnonzero(weighed) + first_column
                weights[:, columns_of] = np.asarray(block, dtype=np.float64)[:, None]
            first_column += len(outputs)
            problems: dict[int, str] = {}
            if self._checks_inputs[index]:
                suspects = metric.input_suspects(raw)
                asked = range(n) if suspects is None else np.flatnonzero(suspects).tolist()
                for i in asked:
                    problem = metric.input_error(raw_rows(index)[i])
                    if problem is not None:
                        problems[i] = f"step {steps[i]}: {problem}"
            if self._warns[index] and index not in self._warned and _may_warn(metric, raw):
                for i, row in enumerate(raw_rows(index)):
                    if i in problems:
                        continue
                    warning = metric.warning(row)
                    if warning is not None:
                        self._warned.add(index)
                        event = Event(
                            self.run_id,
                            steps[i],
                            EventKind(getattr(metric, "notice_kind", "warning")),
                            f"step {steps[i]}: {warning}",
                            walls[i],
                            rank=self.rank,
                        )
                        events.append(((i, index, -1), event))
                        break
            values = self._finalize(
                metric,
                self._kinds[index],
                len(outputs),
                raw,
                timing,
                functools.partial(raw_rows, index),
                step_timings,
                problems,
            )
            for i, message in problems.items():
                input_errors.append(((i, index), message))
                for place, output in enumerate(outputs):
                    self.anomaly_counts[output.name] += 1
                    events.append(((i, index, place), self._event(steps[i], walls[i], output.name, None, message)))
            columns.append(values)
            problems_of.append(problems)

        if columns:
            block_values = np.concatenate([c.values for c in columns], axis=1)
            present = np.concatenate([c.present for c in columns], axis=1)
        else:
            block_values, present = np.zeros((n, 0)), np.zeros((n, 0), dtype=bool)
        self._validate(block_values, present, problems_of, skipped, steps, walls, events)
        events.sort(key=lambda keyed: keyed[0])
        input_errors.sort(key=lambda keyed: keyed[0])
        return DecodedBlock(
            self.run_id,
            self.rank,
            self._names,
            block_values,
            present,
            steps,
            data.epoch.tolist(),
            data.batch.tolist(),
            walls,
            weights=weights,
            events=[event for _, event in events],
            input_errors=[message for _, message in input_errors],
        )

    def _finalize(
        self,
        metric: MetricDecoder,
        kind: str,
        width: int,
        raw: np.ndarray,
        timing: BlockTiming,
        raw_rows: Callable[[], list[list[float]]],
        step_timings: Callable[[], list[StepTiming]],
        problems: dict[int, str],
    ) -> _Columns:
        """The metric's values over the block; rows with an input problem are NaN (present)."""
        block = metric.finalize_block(raw, timing) if width else None
        n = raw.shape[0]
        if block is not None:
            values, present = block
            values = np.array(values, dtype=np.float64).reshape(n, width)  # a copy: written below
            present = np.array(present, dtype=bool).reshape(n, width)
        else:
            values = np.full((n, width), math.nan)
            present = np.zeros((n, width), dtype=bool)
            if width:
                rows, row_timings = raw_rows(), step_timings()
                for i in range(n):
                    if i in problems:
                        continue
                    finalized = list(metric.finalize(rows[i], row_timings[i]))
                    if len(finalized) != width:
                        raise ValueError(
                            f"{kind}.finalize returned {len(finalized)} values for {width} outputs; expected one "
                            "value (or None) per output it declares"
                        )
                    for j, value in enumerate(finalized):
                        if value is not None:
                            values[i, j] = value
                            present[i, j] = True
        for i in problems:
            values[i] = math.nan
            present[i] = True
        return _Columns(values, present)

    def _validate(
        self,
        values: np.ndarray,
        present: np.ndarray,
        problems_of: list[dict[int, str]],
        skipped: np.ndarray,
        steps: list[int],
        walls: list[float],
        events: list[tuple[tuple[int, int, int], Event]],
    ) -> None:
        """Check every present value of the block against its output's domain, all outputs in one
        array compare; a value outside becomes NaN with an anomaly event, except a non-finite
        gradient value on a step the scaler skipped (left out: the skip event reports it)."""
        with np.errstate(invalid="ignore"):
            inside = (self._low <= values) & (values <= self._high)  # NaN fails the compare
        inside &= self._infinite_ok | np.isfinite(values)
        rows, cols = np.nonzero(present & ~inside)
        for i, c in zip(rows.tolist(), cols.tolist()):
            index, place, output, gradient_based = self._owners[c]
            if i in problems_of[index]:
                continue  # reported as the input error
            value = float(values[i, c])
            domain = output.domain
            why = domain.violation(value)
            if why is None:
                continue
            if skipped[i] and gradient_based and not math.isfinite(value):
                present[i, c] = False
                continue
            values[i, c] = math.nan
            self.anomaly_counts[output.name] += 1
            message = (
                f"{output.name}={value!r} at step {steps[i]} is {why} (expected {domain.describe()}); stored as NaN"
            )
            events.append(((i, index, place), self._event(steps[i], walls[i], output.name, value, message)))

    def _event(self, step: int, wall: float, metric: str, raw: float | None, message: str) -> Event:
        return Event(self.run_id, step, EventKind.ANOMALY, message, wall, metric=metric, raw_value=raw, rank=self.rank)


def _may_warn(decoder: MetricDecoder, raw: np.ndarray) -> bool:
    """Whether any row of the block may warn: a block none of whose rows the decoder flags is not
    asked row by row (the common case: warnings are rare, asking is per row)."""
    flagged = decoder.warning_suspects(raw)
    return flagged is None or bool(flagged.any())
