"""Timing metrics: step time, data-loader wait and throughput, finalized on the host from the step clocks."""

from __future__ import annotations

import numpy as np

from batchtap.metrics.base import (
    BlockTiming,
    Metric,
)
from batchtap.metrics.decoding import measured
from batchtap.metrics.domain import NONNEGATIVE, Output, Reduce


class StepTime(Metric):
    """Seconds of compute per step: device events on CUDA, a host clock on CPU.

    Measured from the moment the watched loader handed over the batch (or from the previous step
    when no loader is watched) to the ``Tap.step()`` call.
    """

    def outputs(self) -> tuple[Output, ...]:
        return (Output("step_time", NONNEGATIVE, Reduce.MAX, unit="s"),)

    def finalize_block(self, raw: np.ndarray, timing: BlockTiming) -> tuple[np.ndarray, np.ndarray]:
        return measured(timing.step_time)


class DataTime(Metric):
    """Seconds the loop waited for the batch (host clock around the loader); needs ``tap.watch()``."""

    def outputs(self) -> tuple[Output, ...]:
        return (Output("data_time", NONNEGATIVE, Reduce.MAX, unit="s"),)

    def finalize_block(self, raw: np.ndarray, timing: BlockTiming) -> tuple[np.ndarray, np.ndarray]:
        return measured(timing.data_time)


class Throughput(Metric):
    """Samples per second of step time (summed over ranks in a process group), or tokens per
    second when the loop passes ``tap.step(tokens=...)``.

    Left out of a step's record when the count is unknown (no batch size, no tokens) or the step
    time is: a loss-only loop gets no throughput rather than NaN values.

    Example:
        >>> import math
        >>> from batchtap.metrics import StepTiming
        >>> Throughput().finalize([], StepTiming(samples=8.0, step_time=0.5, data_time=math.nan, tokens=8192.0))
        [16384.0]
        >>> Throughput().finalize([], StepTiming(samples=math.nan, step_time=0.5, data_time=math.nan))
        [None]
    """

    def outputs(self) -> tuple[Output, ...]:
        return (Output("throughput", NONNEGATIVE, Reduce.SUM),)

    def finalize_block(self, raw: np.ndarray, timing: BlockTiming) -> tuple[np.ndarray, np.ndarray]:
        count = np.where(np.isfinite(timing.tokens), timing.tokens, timing.samples)
        seconds = timing.step_time
        with np.errstate(invalid="ignore", divide="ignore"):
            present = np.isfinite(count) & (seconds > 0) & np.isfinite(seconds)
            values = count / seconds
        return values.reshape(-1, 1), present.reshape(-1, 1)
