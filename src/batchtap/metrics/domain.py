"""Metric domains: the values a metric can legitimately take, and how values combine across ranks."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Literal

__all__ = ["Domain", "Reduce", "Output", "Weight", "ANY_FINITE", "NONNEGATIVE", "UNIT_INTERVAL"]

#: what a ``MEAN`` output averages over (see :class:`Output`)
Weight = Literal["samples", "metric"]


@dataclasses.dataclass(frozen=True, slots=True)
class Domain:
    """The closed interval ``[low, high]`` a metric value must lie in.

    NaN is never inside a domain; infinities are inside only when ``finite`` is False and the
    interval reaches them.

    Example:
        >>> UNIT_INTERVAL.violation(1.25)
        'above its maximum 1'
        >>> UNIT_INTERVAL.violation(0.5) is None
        True
    """

    low: float = -math.inf
    high: float = math.inf
    finite: bool = True

    def __post_init__(self) -> None:
        if not self.low <= self.high:
            raise ValueError(f"Domain needs low <= high, got low={self.low} high={self.high}")

    def violation(self, value: float) -> str | None:
        """Why ``value`` lies outside the domain, or None when it is inside."""
        if math.isnan(value):
            return "not a number"
        if self.finite and math.isinf(value):
            return "not finite"
        if value < self.low:
            return f"below its minimum {self.low:g}"
        if value > self.high:
            return f"above its maximum {self.high:g}"
        return None

    def describe(self) -> str:
        """The domain as an interval, e.g. ``[0, 1]``."""
        low = "-inf" if math.isinf(self.low) else f"{self.low:g}"
        high = "inf" if math.isinf(self.high) else f"{self.high:g}"
        return f"[{low}, {high}]" + (" (finite)" if self.finite else "")


ANY_FINITE = Domain()
NONNEGATIVE = Domain(low=0.0)
UNIT_INTERVAL = Domain(low=0.0, high=1.0)


class Reduce(str, enum.Enum):
    """How one metric value combines over ranks (and over steps when aggregating).

    ``MEAN`` is a sample-weighted mean: it is reduced as a sum of ``value * samples`` and a sum of
    ``samples``, never as a mean of means, so uneven per-rank batches combine exactly.
    """

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"
    #: root of the summed squares: a norm whose parts live on different ranks (sharded gradients,
    #: each rank's value the norm of its own shard)
    L2 = "l2"
    ROOT_SUM_SQUARE = "l2"  # the same kind, by what it does
    #: already global: every rank holds the same value (a gradient norm summed over the shards on
    #: the device, a learning rate), so it must never be combined again; the maximum of equal
    #: values is that value (an alias of ``MAX``: the reducer needs no kind of its own)
    GLOBAL = "max"


@dataclasses.dataclass(frozen=True, slots=True)
class Output:
    """One value a metric reports per step.

    Attributes:
        name: name in records, sinks and rules (``"loss"``, ``"accuracy"``...).
        domain: legal values; anything else becomes NaN plus an anomaly event.
        reduce: how the value combines across ranks.
        unit: display hint for consoles (``"%"`` shows fractions as percentages, ``"s"`` seconds).
        weight: what a ``MEAN`` averages over, across ranks and steps: ``"samples"`` (the step's
            samples) or ``"metric"`` (a count the metric's decoder gives per row,
            :meth:`~batchtap.metrics.decoding.MetricDecoder.weight_block`: accuracy's kept targets).
        higher_is_better: whether a larger value is better (accuracy), worse (loss), or neither
            (None: a learning rate); views and "best value" summaries read it instead of guessing
            from the name.
    """

    name: str
    domain: Domain = ANY_FINITE
    reduce: Reduce = Reduce.MEAN
    unit: str = ""
    weight: Weight = "samples"
    higher_is_better: bool | None = None

    def __post_init__(self) -> None:
        if self.weight not in ("samples", "metric"):
            raise ValueError(f"Output {self.name!r}: weight must be 'samples' or 'metric', got {self.weight!r}")
        if self.weight == "metric" and self.reduce is not Reduce.MEAN:
            raise ValueError(
                f"Output {self.name!r}: weight='metric' weights a MEAN, got reduce={self.reduce.value!r}; "
                "drop weight= or use Reduce.MEAN"
            )
