"""Row-by-row finalize and weight of the built-in metrics whose decoders work on whole blocks: the
reference the block decoder is held to (tests/pipeline/test_decode_blocks.py). In ``src`` each of
these metrics has its block hooks only (their row hooks are derived from them), so the reference
lives here, written the plain way, once."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from batchtap.metrics import DataTime, StepTime, Throughput
from batchtap.metrics.decoders import EXACT_FLOAT32, AccuracyDecoding, LearningRateDecoding
from batchtap.metrics.decoding import MetricDecoder, StepTiming

Row = Sequence[float]


def _accuracy_totals(decoder: AccuracyDecoding, raw: Row) -> list[float]:
    """Correct per k, ignored, positions: each count's low and high part joined."""
    n = decoder._counts
    return [hi * EXACT_FLOAT32 + lo for lo, hi in zip(raw[:n], raw[n : 2 * n])]


def _accuracy(decoder: AccuracyDecoding, raw: Row, timing: StepTiming) -> list[float | None]:
    totals = _accuracy_totals(decoder, raw)
    kept = totals[-1] - totals[-2]
    if not kept > 0:  # every target ignored: no accuracy at this step
        return [None] * len(decoder.topk)
    return [c / kept for c in totals[:-2]]


def _accuracy_weight(decoder: AccuracyDecoding, raw: Row) -> float | None:
    totals = _accuracy_totals(decoder, raw)
    return totals[-1] - totals[-2]


def _learning_rate(decoder: LearningRateDecoding, raw: Row, timing: StepTiming) -> list[float | None]:
    first = raw[0]
    if math.isnan(first):  # a skipped step's lr that could not be told
        return [None] * len(raw)
    return [first, *(None if v == first else v for v in raw[1:])]


def _step_time(decoder: object, raw: Row, timing: StepTiming) -> list[float | None]:
    return [None if math.isnan(timing.step_time) else timing.step_time]


def _data_time(decoder: object, raw: Row, timing: StepTiming) -> list[float | None]:
    return [None if math.isnan(timing.data_time) else timing.data_time]


def _throughput(decoder: object, raw: Row, timing: StepTiming) -> list[float | None]:
    count = timing.tokens if math.isfinite(timing.tokens) else timing.samples
    if not math.isfinite(count) or not timing.step_time > 0 or not math.isfinite(timing.step_time):
        return [None]
    return [count / timing.step_time]


FINALIZE: dict[type, Callable[..., list[float | None]]] = {
    AccuracyDecoding: _accuracy,
    LearningRateDecoding: _learning_rate,
    StepTime: _step_time,
    DataTime: _data_time,
    Throughput: _throughput,
}
WEIGHT: dict[type, Callable[..., float | None]] = {AccuracyDecoding: _accuracy_weight}


def _find(table: dict[type, Callable[..., object]], decoder: MetricDecoder) -> Callable[..., object] | None:
    for klass in type(decoder).__mro__:
        if klass in table:
            return table[klass]
    return None


def finalize(decoder: MetricDecoder, raw: Row, timing: StepTiming) -> Sequence[float | None]:
    """The reference's values of one row (the decoder's own row hook where it has no reference)."""
    reference = _find(FINALIZE, decoder)
    return decoder.finalize(raw, timing) if reference is None else reference(decoder, raw, timing)  # type: ignore[return-value]


def weight(decoder: MetricDecoder, raw: Row) -> float | None:
    reference = _find(WEIGHT, decoder)
    return decoder.weight(raw) if reference is None else reference(decoder, raw)  # type: ignore[return-value]
