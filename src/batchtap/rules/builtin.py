"""The built-in rules: non-finite values, thresholds, spikes, plateaus, step-time regressions, a GPU
starved by its data loader.

Shared conventions:

* ``patience=K`` means the condition must hold on K consecutive records carrying the metric; the rule
  fires on the K-th and its count starts again, so a condition that persists fires every K records.
* A ``nan`` value (the pipeline stores an out-of-domain value as ``nan``, keeping the raw value in an
  anomaly event) is ignored by every rule except :class:`NonFinite`: it neither counts towards nor
  breaks a streak, and never enters a baseline.
* Values that meet a rule's condition do not enter its baseline, so a spike or a slowdown cannot
  raise the level it is judged against before patience runs out.
* :class:`NonFinite`, :class:`Threshold` and :class:`Spike` take a glob of metric names
  (``Spike("grad_norm/*", ratio=5)``): one copy of the rule per matched name, each with its own
  state (:class:`~batchtap.rules.base.MetricGlob`); the decision names the metric that fired.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Literal

from batchtap._validate import require_int, require_number, value_of
from batchtap.errors import ConfigError
from batchtap.records import Record
from batchtap.rules.base import Action, ActionsArg, AlertHook, Anomaly, GlobbedRule, History, Rule

__all__ = ["GpuStarved", "NonFinite", "Plateau", "Spike", "StepTimeRegression", "Threshold"]


class NonFinite(GlobbedRule):
    """Fires when the metric is ``nan`` or infinite (by default: stop).

    Args:
        metric: the metric to watch.
        action: what to do when it fires.
        patience: consecutive non-finite values needed.
        warmup: no firing on steps before this.
        on_alert: hook for the ``alert`` action.

    Example:
        >>> rule = NonFinite()
        >>> r = Record("r", step=7, epoch=0, batch=7, rank=0, wall_time=0.0, values={"loss": float("nan")})
        >>> rule.check(r, History()).message
        'loss is nan at step 7 (expected a finite value)'
    """

    def __init__(
        self,
        metric: str = "loss",
        *,
        action: ActionsArg = Action.STOP,
        patience: int = 1,
        warmup: int = 0,
        on_alert: AlertHook | None = None,
        name: str | None = None,
    ) -> None:
        label = name or f"nonfinite({metric})"
        super().__init__(name=label, metric=metric, action=action, warmup=warmup, on_alert=on_alert)
        require_int(label, "patience", patience, minimum=1)
        self.patience = patience
        self._streak = 0

    @property
    def handles_nonfinite_loss(self) -> bool:
        return self.metric == "loss"

    def check(self, record: Record, history: History) -> Anomaly | None:
        v = value_of(record, self.metric)
        if math.isfinite(v) or self._streak + 1 < self.patience:
            return None
        return Anomaly(self.metric, f"{self.metric} is {v} at step {record.step} (expected a finite value)", v)

    def update(self, record: Record, *, fired: bool) -> None:
        v = value_of(record, self.metric)
        self._streak = 0 if fired or math.isfinite(v) else self._streak + 1

    def reset(self) -> None:
        self._streak = 0


class Threshold(GlobbedRule):
    """Fires when the metric stays below ``below`` or above ``above`` for ``patience`` records.

    Give one bound, or both for a band (fires outside ``[below, above]``).

    Args:
        metric: the metric to watch.
        below: fire when the value is strictly below this.
        above: fire when the value is strictly above this.
        patience: consecutive out-of-bound values needed.
        action: what to do when it fires.
        warmup: no firing on steps before this.
        on_alert: hook for the ``alert`` action.

    Raises:
        ConfigError: neither bound given, ``below > above``, or ``patience < 1``.

    Example:
        >>> rule = Threshold("accuracy", below=0.5, patience=10)
        >>> rule.name
        'threshold(accuracy<0.5)'
    """

    def __init__(
        self,
        metric: str,
        *,
        below: float | None = None,
        above: float | None = None,
        patience: int = 1,
        action: ActionsArg = Action.ALERT,
        warmup: int = 0,
        on_alert: AlertHook | None = None,
        name: str | None = None,
    ) -> None:
        bounds = ([f"<{below}"] if below is not None else []) + ([f">{above}"] if above is not None else [])
        label = name or f"threshold({metric}{'|'.join(bounds)})"
        super().__init__(name=label, metric=metric, action=action, warmup=warmup, on_alert=on_alert)
        if below is None and above is None:
            raise ConfigError(
                f"{label}: expected below= or above= (or both), got neither. "
                f"Fix: e.g. Threshold({metric!r}, below=0.5, patience=10)."
            )
        self.below = None if below is None else require_number(label, "below", below)
        self.above = None if above is None else require_number(label, "above", above)
        if self.below is not None and self.above is not None and self.below > self.above:
            raise ConfigError(
                f"{label}: below={below} is greater than above={above}; every value would be out of bounds. "
                "Fix: below <= above (the rule fires outside [below, above])."
            )
        require_int(label, "patience", patience, minimum=1)
        self.patience = patience
        self._streak = 0

    def _outside(self, v: float) -> str | None:
        if self.below is not None and v < self.below:
            return f"< {self.below}"
        if self.above is not None and v > self.above:
            return f"> {self.above}"
        return None

    def check(self, record: Record, history: History) -> Anomaly | None:
        v = value_of(record, self.metric)
        if math.isnan(v):
            return None
        side = self._outside(v)
        if side is None or self._streak + 1 < self.patience:
            return None
        run = f" for {self.patience} consecutive records" if self.patience > 1 else ""
        return Anomaly(self.metric, f"{self.metric} {v:.6g} {side}{run} at step {record.step}", v)

    def update(self, record: Record, *, fired: bool) -> None:
        v = value_of(record, self.metric)
        if math.isnan(v):
            return  # neither counts nor breaks the streak
        self._streak = 0 if fired or self._outside(v) is None else self._streak + 1

    def reset(self) -> None:
        self._streak = 0


class Spike(GlobbedRule):
    """Fires when the metric jumps far above its recent level (loss spikes in large-model training).

    Two ways to define "far above", pick one:

    * ``ratio=r``: the value exceeds ``r`` times an exponential moving average (span ``window``). This
      assumes a positive metric (a loss); it never fires while the average is <= 0.
    * ``zscore=z``: the value exceeds the mean of the last ``window`` values by ``z`` standard
      deviations (the deviation is floored at ``1e-6 * |mean|`` so a flat history does not make every
      rise infinite).

    With neither given, ``ratio=3.0``. The rule needs ``min_samples`` baseline values before it fires.
    ``min_excess`` adds an absolute margin: a value must also exceed the baseline by that much. Use it
    for losses that approach 0, where ordinary batch noise is many times a tiny average (late in
    training a batch loss of 0.33 against an EMA of 0.08 is 4x, and not a divergence).

    Args:
        metric: the metric to watch.
        ratio: fire above ``ratio * EMA`` (> 1).
        zscore: fire above ``mean + zscore * std`` (> 0).
        window: EMA span, or the z-score window.
        patience: consecutive spiking values needed.
        min_samples: baseline values needed before the rule may fire.
        min_excess: also require ``value - baseline >= min_excess`` (>= 0; default 0: no margin).
        action: what to do when it fires.
        warmup: no firing on steps before this.
        on_alert: hook for the ``alert`` action.

    Example:
        >>> rule = Spike("loss", ratio=2.0, min_samples=3)
        >>> rec = lambda s, v: Record("r", step=s, epoch=0, batch=s, rank=0, wall_time=0.0, values={"loss": v})
        >>> for s, v in enumerate([1.0, 1.1, 0.9]):
        ...     rule.update(rec(s, v), fired=False)
        >>> rule.check(rec(3, 5.0), History()).message
        'loss 5 > 2 x EMA 0.9998 at step 3'
    """

    def __init__(
        self,
        metric: str = "loss",
        *,
        ratio: float | None = None,
        zscore: float | None = None,
        window: int = 50,
        patience: int = 1,
        min_samples: int = 10,
        min_excess: float = 0.0,
        action: ActionsArg = Action.ALERT,
        warmup: int = 0,
        on_alert: AlertHook | None = None,
        name: str | None = None,
    ) -> None:
        label = name or f"spike({metric})"
        super().__init__(name=label, metric=metric, action=action, warmup=warmup, on_alert=on_alert)
        if ratio is not None and zscore is not None:
            raise ConfigError(
                f"{label}: got both ratio={ratio} and zscore={zscore}; expected one. Fix: drop one of them."
            )
        self.mode: Literal["ratio", "zscore"] = "zscore" if zscore is not None else "ratio"
        self.ratio = require_number(label, "ratio", 3.0 if ratio is None else ratio, above=1.0)
        self.zscore = None if zscore is None else require_number(label, "zscore", zscore, above=0.0)
        require_int(label, "window", window, minimum=2)
        require_int(label, "patience", patience, minimum=1)
        require_int(label, "min_samples", min_samples, minimum=1)
        self.window = window
        self.patience = patience
        self.min_samples = min_samples
        self.min_excess = require_number(label, "min_excess", min_excess)
        if self.min_excess < 0:
            raise ConfigError(
                f"{label}: min_excess must be >= 0, got {min_excess!r}. Fix: pass 0 (no margin) or a positive margin."
            )
        self._alpha = 2.0 / (window + 1)
        self._ema: float | None = None
        self._recent: deque[float] = deque(maxlen=window)
        self._count = 0
        self._streak = 0

    def _limit(self) -> tuple[float, str] | None:
        """The level above which a value spikes, and how to describe it; ``None`` while warming up."""
        if self._count < self.min_samples:
            return None
        if self.mode == "ratio":
            assert self._ema is not None
            if self._ema <= 0:
                return None
            return self._with_margin(self.ratio * self._ema, self._ema, f"{self.ratio:g} x EMA {self._ema:.4g}")
        assert self.zscore is not None
        mean = statistics.fmean(self._recent)
        std = max(statistics.pstdev(self._recent, mean), 1e-6 * abs(mean), 1e-12)
        return self._with_margin(mean + self.zscore * std, mean, f"mean {mean:.6g} + {self.zscore:g} x std {std:.3g}")

    def _with_margin(self, limit: float, baseline: float, how: str) -> tuple[float, str]:
        if self.min_excess and baseline + self.min_excess > limit:
            return baseline + self.min_excess, f"{how} and by at least {self.min_excess:g}"
        return limit, how

    def _spikes(self, v: float) -> tuple[float, str] | None:
        limit = self._limit()
        return limit if limit is not None and v > limit[0] else None

    def check(self, record: Record, history: History) -> Anomaly | None:
        v = value_of(record, self.metric)
        if not math.isfinite(v):
            return None
        hit = self._spikes(v)
        if hit is None or self._streak + 1 < self.patience:
            return None
        return Anomaly(self.metric, f"{self.metric} {v:.6g} > {hit[1]} at step {record.step}", v)

    def update(self, record: Record, *, fired: bool) -> None:
        v = value_of(record, self.metric)
        if not math.isfinite(v):
            return
        if self._spikes(v) is not None:
            self._streak = 0 if fired else self._streak + 1
            return  # a spike never raises the baseline it is judged against
        self._streak = 0
        self._ema = v if self._ema is None else self._ema + self._alpha * (v - self._ema)
        self._recent.append(v)
        self._count += 1

    def reset(self) -> None:
        self._ema = None
        self._recent.clear()
        self._count = 0
        self._streak = 0


class Plateau(Rule):
    """Fires when the metric stops improving: the mean of the last ``window`` values is not better than
    the mean of the ``window`` before them by more than ``min_delta``.

    Means over windows, not a best-so-far value, because per-batch metrics are noisy: one lucky batch
    must not count as progress. After firing the rule starts over and needs ``2 * window`` new values.

    Args:
        metric: the metric to watch.
        window: values per compared window.
        min_delta: smallest improvement of the window mean that counts.
        mode: ``"min"`` when lower is better (a loss), ``"max"`` when higher is (accuracy).
        action: what to do when it fires.
        warmup: no firing on steps before this.
        on_alert: hook for the ``alert`` action.

    Example:
        >>> rule = Plateau("loss", window=2)
        >>> rec = lambda s, v: Record("r", step=s, epoch=0, batch=s, rank=0, wall_time=0.0, values={"loss": v})
        >>> for s, v in enumerate([1.0, 1.0, 1.0]):
        ...     rule.update(rec(s, v), fired=False)
        >>> rule.check(rec(3, 1.0), History()).message
        'loss plateaued at step 3: mean of last 2 is 1, previous 2 was 1 (improvement 0 <= min_delta 0)'
    """

    def __init__(
        self,
        metric: str = "loss",
        *,
        window: int = 100,
        min_delta: float = 0.0,
        mode: Literal["min", "max"] = "min",
        action: ActionsArg = Action.ALERT,
        warmup: int = 0,
        on_alert: AlertHook | None = None,
        name: str | None = None,
    ) -> None:
        label = name or f"plateau({metric})"
        super().__init__(name=label, metric=metric, action=action, warmup=warmup, on_alert=on_alert)
        require_int(label, "window", window, minimum=1)
        self.min_delta = require_number(label, "min_delta", min_delta)
        if self.min_delta < 0:
            raise ConfigError(
                f"{label}: min_delta must be >= 0, got {min_delta}. Fix: pass the smallest gain that counts."
            )
        if mode not in ("min", "max"):
            raise ConfigError(f"{label}: mode must be 'min' or 'max', got {mode!r}.")
        self.window = window
        self.mode = mode
        self._buf: deque[float] = deque(maxlen=2 * window)

    def check(self, record: Record, history: History) -> Anomaly | None:
        v = value_of(record, self.metric)
        if math.isnan(v) or len(self._buf) + 1 < 2 * self.window:
            return None
        values = [*self._buf, v][-2 * self.window :]
        prev = statistics.fmean(values[: self.window])
        last = statistics.fmean(values[self.window :])
        gain = prev - last if self.mode == "min" else last - prev
        if gain > self.min_delta:
            return None
        return Anomaly(
            self.metric,
            f"{self.metric} plateaued at step {record.step}: mean of last {self.window} is {last:.6g}, "
            f"previous {self.window} was {prev:.6g} (improvement {gain:.3g} <= min_delta {self.min_delta:g})",
            v,
        )

    def update(self, record: Record, *, fired: bool) -> None:
        v = value_of(record, self.metric)
        if math.isnan(v):
            return
        if fired:
            self._buf.clear()
        else:
            self._buf.append(v)

    def reset(self) -> None:
        self._buf.clear()


class StepTimeRegression(Rule):
    """Fires when step time (or data-loader wait) jumps above ``factor`` times its recent median.

    Catches a stalled loader (``metric="data_time"``), a throttled or shared GPU, a host-sync that
    crept into the loop. After firing the rule forgets its baseline and learns the new level, so a
    lasting slowdown is reported once, not on every step.

    Args:
        metric: ``"step_time"`` or ``"data_time"`` (or any timing metric, in seconds).
        factor: fire above ``factor * median`` (> 1).
        window: values in the median.
        patience: consecutive slow values needed (one slow step is normal: a checkpoint, a GC pause).
        min_samples: baseline values needed before the rule may fire.
        action: what to do when it fires.
        warmup: no firing on steps before this (the first steps compile, warm caches, fill queues).
        on_alert: hook for the ``alert`` action.

    Example:
        >>> StepTimeRegression("data_time", factor=3.0).name
        'regression(data_time)'
    """

    def __init__(
        self,
        metric: str = "step_time",
        *,
        factor: float = 2.0,
        window: int = 50,
        patience: int = 3,
        min_samples: int = 10,
        action: ActionsArg = Action.ALERT,
        warmup: int = 0,
        on_alert: AlertHook | None = None,
        name: str | None = None,
    ) -> None:
        label = name or f"regression({metric})"
        super().__init__(name=label, metric=metric, action=action, warmup=warmup, on_alert=on_alert)
        self.factor = require_number(label, "factor", factor, above=1.0)
        require_int(label, "window", window, minimum=1)
        require_int(label, "patience", patience, minimum=1)
        require_int(label, "min_samples", min_samples, minimum=1)
        if min_samples > window:
            raise ConfigError(
                f"{label}: min_samples={min_samples} exceeds window={window}; the baseline could never fill. "
                "Fix: min_samples <= window."
            )
        self.window = window
        self.patience = patience
        self.min_samples = min_samples
        self._recent: deque[float] = deque(maxlen=window)
        self._streak = 0

    def _limit(self) -> float | None:
        if len(self._recent) < self.min_samples:
            return None
        return self.factor * statistics.median(self._recent)

    def check(self, record: Record, history: History) -> Anomaly | None:
        v = value_of(record, self.metric)
        limit = self._limit()
        if not math.isfinite(v) or limit is None or v <= limit or self._streak + 1 < self.patience:
            return None
        median = limit / self.factor
        return Anomaly(
            self.metric,
            f"{self.metric} {v:.4g}s > {self.factor:g} x recent median {median:.4g}s "
            f"for {self.patience} consecutive records at step {record.step}",
            v,
        )

    def update(self, record: Record, *, fired: bool) -> None:
        v = value_of(record, self.metric)
        if not math.isfinite(v):
            return
        if fired:
            self._recent.clear()  # re-learn the new level instead of reporting it on every step
            self._streak = 0
            return
        limit = self._limit()
        if limit is not None and v > limit:
            self._streak += 1
        else:
            self._streak = 0
            self._recent.append(v)

    def reset(self) -> None:
        self._recent.clear()
        self._streak = 0


class GpuStarved(Rule):
    """Fires when the GPU idles waiting for data: its utilisation stays below ``util_below`` percent
    while the data loader's wait is at least ``data_share`` of each step, for ``patience``
    consecutive records. The event names the data loader as the bottleneck and what to change.

    Needs ``gpu{device}_util`` (from :class:`~batchtap.metrics.System`, on by default where NVML
    sees a GPU) and ``data_time`` / ``step_time`` (``tap.watch(loader)``); records without them
    neither count nor break a streak.

    Args:
        device: the NVML index of the GPU to watch (its values are ``gpu{device}_*``).
        util_below: utilisation in percent under which the GPU counts as starved.
        data_share: the share of the step (``data_time / (data_time + step_time)``) spent waiting
            for the batch from which the wait counts as the cause.
        patience: consecutive starved records needed.
        action: what to do when it fires (default: an alert event).
        warmup: no firing on steps before this (the first batches wait for the workers to start).
        on_alert: hook for the ``alert`` action.

    Example:
        >>> rule = GpuStarved(patience=1)
        >>> values = {"gpu0_util": 12.0, "data_time": 0.035, "step_time": 0.015}
        >>> r = Record("r", step=120, epoch=0, batch=120, rank=0, wall_time=0.0, values=values)
        >>> rule.check(r, History()).message.split(":")[0]
        'GPU 0 utilisation 12% while the data loader wait is 70% of the step (data_time 35.00ms, step_time 15.00ms) at step 120'
    """

    def __init__(
        self,
        *,
        device: int = 0,
        util_below: float = 50.0,
        data_share: float = 0.3,
        patience: int = 5,
        action: ActionsArg = Action.ALERT,
        warmup: int = 10,
        on_alert: AlertHook | None = None,
        name: str | None = None,
    ) -> None:
        label = name or f"gpu_starved(gpu{device})"
        super().__init__(name=label, metric=f"gpu{device}_util", action=action, warmup=warmup, on_alert=on_alert)
        require_int(label, "device", device, minimum=0)
        self.device = device
        self.util_below = require_number(label, "util_below", util_below)
        self.data_share = require_number(label, "data_share", data_share)
        if not 0.0 < self.data_share < 1.0:
            raise ConfigError(
                f"{label}: data_share must be a share of the step in (0, 1), got {data_share}. "
                "Fix: e.g. data_share=0.3 (the loader's wait is 30% of the step or more)."
            )
        require_int(label, "patience", patience, minimum=1)
        self.patience = patience
        self._streak = 0

    def _starved(self, record: Record) -> tuple[float, float, float, float] | None:
        """(utilisation, share, data_time, step_time) when the record shows a starved GPU."""
        values = record.values
        util, data, step = values.get(self.metric), values.get("data_time"), values.get("step_time")
        if util is None or data is None or step is None or not (data + step > 0):
            return None
        share = data / (data + step)
        # a share at the threshold counts (it reads "at least"): the division may land one ulp under it
        short = share < self.data_share and not math.isclose(share, self.data_share, rel_tol=1e-12)
        if math.isnan(util) or math.isnan(share) or util >= self.util_below or short:
            return None
        return util, share, data, step

    def check(self, record: Record, history: History) -> Anomaly | None:
        starved = self._starved(record)
        if starved is None or self._streak + 1 < self.patience:
            return None
        util, share, data, step = starved
        run = f" for {self.patience} consecutive records" if self.patience > 1 else ""
        return Anomaly(
            self.metric,
            f"GPU {self.device} utilisation {util:.0f}% while the data loader wait is {share:.0%} of the step "
            f"(data_time {data * 1e3:.2f}ms, step_time {step * 1e3:.2f}ms){run} at step {record.step}: the data "
            "loader is the bottleneck; fix: more DataLoader workers (num_workers=), pin_memory=True, "
            "persistent_workers=True, prefetch_factor=, or lighter per-batch transforms",
            util,
        )

    def update(self, record: Record, *, fired: bool) -> None:
        values = record.values
        if "data_time" not in values or "step_time" not in values or math.isnan(values[self.metric]):
            return  # neither counts nor breaks the streak
        self._streak = 0 if fired or self._starved(record) is None else self._streak + 1

    def reset(self) -> None:
        self._streak = 0
