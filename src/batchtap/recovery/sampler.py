"""Adaptive batch size: a batch sampler whose size can change between batches, and the rule that sets it.

:class:`AdaptiveBatchSampler` goes to a ``DataLoader`` as ``batch_sampler=``. Its size can be set from
any thread; the change applies to the next batch the sampler *builds*. Every index of the underlying
sampler is yielded exactly once per epoch, whatever the size changes (with ``drop_last=True`` the
final short batch is dropped, as in ``torch.utils.data.BatchSampler``).

**Prefetch delay.** A ``DataLoader`` asks its batch sampler for indices ahead of the training loop:
with ``num_workers=0`` none (the change applies to the very next batch the loop receives); with
``num_workers=W`` it keeps ``prefetch_factor * W`` batches (default ``2 * W``) in flight, so up to that
many batches of the old size still arrive after a change. Rules already act a flush or two after the
step they judged, so give :class:`BatchSizeRule` a ``cooldown`` longer than both delays together.
The sampler runs in the main process even with workers (only index lists are sent to them), so
setting the size from the training or pipeline thread reaches it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Sized
from typing import Any, ClassVar

from torch.utils.data import Sampler

from batchtap._validate import require_int, require_number, value_of
from batchtap.errors import ConfigError
from batchtap.records import Record
from batchtap.rules.base import Action, ActionsArg, AlertHook, Anomaly, History, Rule, parse_actions

__all__ = ["AdaptiveBatchSampler", "BatchSizeRule"]


class AdaptiveBatchSampler(Sampler[list[int]]):
    """A batch sampler whose batch size can change while it is being iterated.

    Args:
        source: a dataset (``len`` + ``__getitem__``: indices ``0..len-1`` in order) or a sampler /
            iterable of indices (e.g. ``RandomSampler(ds, generator=g)``).
        batch_size: the initial size; must lie in ``[min_size, max_size]``.
        min_size: the smallest size :meth:`set_batch_size` allows.
        max_size: the largest size it allows (``None``: no upper bound).
        drop_last: drop the final batch of an epoch when it is shorter than the size in force.

    Raises:
        ConfigError: a size below 1, ``min_size > max_size``, or ``batch_size`` out of bounds.

    Example:
        >>> s = AdaptiveBatchSampler(range(10), 2, min_size=1, max_size=8)
        >>> it = iter(s)
        >>> next(it)
        [0, 1]
        >>> s.set_batch_size(100)  # clamped to max_size
        8
        >>> list(it)
        [[2, 3, 4, 5, 6, 7, 8, 9]]
    """

    def __init__(
        self,
        source: Iterable[int] | Sized,
        batch_size: int,
        *,
        min_size: int = 1,
        max_size: int | None = None,
        drop_last: bool = False,
    ) -> None:
        name = "AdaptiveBatchSampler"
        require_int(name, "batch_size", batch_size, minimum=1)
        require_int(name, "min_size", min_size, minimum=1)
        if max_size is not None:
            require_int(name, "max_size", max_size, minimum=1)
            if min_size > max_size:
                raise ConfigError(
                    f"{name}: min_size={min_size} > max_size={max_size}; no size fits. Fix: min_size <= max_size."
                )
        if batch_size < min_size or (max_size is not None and batch_size > max_size):
            raise ConfigError(
                f"{name}: batch_size={batch_size} is outside [min_size={min_size}, max_size={max_size}]. "
                "Fix: start inside the bounds."
            )
        self._indices: Iterable[int] = _as_index_source(source)
        self.min_size = min_size
        self.max_size = max_size
        self.drop_last = drop_last
        self._size = batch_size
        self._lock = threading.Lock()  # set_batch_size may come from another thread than iteration

    @property
    def batch_size(self) -> int:
        """The size the next batch will have."""
        with self._lock:
            return self._size

    def clamp(self, n: int) -> int:
        """``n`` clamped to ``[min_size, max_size]``."""
        n = max(self.min_size, n)
        return n if self.max_size is None else min(self.max_size, n)

    def set_batch_size(self, n: int) -> int:
        """Set the size of the next batch built, clamped to the bounds. Thread-safe.

        Returns:
            The size applied.
        """
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"batch size must be an int, got {type(n).__name__}")
        size = self.clamp(n)
        with self._lock:
            self._size = size
        return size

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        target = self.batch_size  # read once per batch, so a batch never changes size while built
        for idx in self._indices:
            batch.append(int(idx))
            if len(batch) >= target:
                yield batch
                batch = []
                target = self.batch_size
        if batch and not self.drop_last:
            yield batch

    def __len__(self) -> int:
        """Batches per epoch *at the current size* (an estimate once the size changes mid-epoch)."""
        if not isinstance(self._indices, Sized):
            raise TypeError("AdaptiveBatchSampler has no length: its source has none")
        n, size = len(self._indices), self.batch_size
        return n // size if self.drop_last else math.ceil(n / size)

    def __repr__(self) -> str:
        return f"AdaptiveBatchSampler(batch_size={self.batch_size}, min_size={self.min_size}, max_size={self.max_size})"


def _as_index_source(source: Any) -> Iterable[int]:
    """A sampler/iterable of indices stays as is; a dataset becomes ``range(len(dataset))``."""
    if isinstance(source, (Sampler, range)):
        return source  # type: ignore[no-any-return]
    if hasattr(source, "__getitem__") and hasattr(source, "__len__"):
        return range(len(source))
    if hasattr(source, "__iter__"):
        return source  # type: ignore[no-any-return]
    raise ConfigError(
        f"AdaptiveBatchSampler: expected a dataset (len + indexing) or a sampler of indices, "
        f"got {type(source).__name__}."
    )


class BatchSizeRule(Rule):
    """Grows or shrinks an adaptive sampler's batch size from a metric, with patience, cool-down and bounds.

    Fires the ``batch_size`` action with the new size: ``size * factor`` when the metric is above
    ``grow_above``, ``size / factor`` when below ``shrink_below`` (each for ``patience`` records),
    clamped to the sampler's bounds. It stays quiet at a bound and for ``cooldown`` records after a
    change, so the metric can reflect the new size (see the module note on delays).

    Args:
        sampler: the sampler to resize (read for its current size, resized by the training thread).
        metric: the metric to watch.
        grow_above: grow when the value is above this.
        shrink_below: shrink when the value is below this.
        factor: multiplier for growing, divisor for shrinking (> 1).
        cooldown: records to ignore after a change.
        patience: consecutive records needed.
        action: the actions; must include ``batch_size`` (add ``alert`` to be told too).
        warmup: no change on steps before this.
        on_alert: hook for the ``alert`` action.

    Raises:
        ConfigError: neither threshold, ``grow_above <= shrink_below``, ``factor <= 1``, no ``batch_size``
            action.

    Example:
        >>> sampler = AdaptiveBatchSampler(range(1000), 32, min_size=8, max_size=256)
        >>> rule = BatchSizeRule(sampler, "accuracy", grow_above=0.9, shrink_below=0.7, cooldown=100)
        >>> r = Record("r", step=0, epoch=0, batch=0, rank=0, wall_time=0.0, values={"accuracy": 0.95})
        >>> rule.check(r, History()).batch_size
        64
    """

    runs_in_pipeline_process: ClassVar[bool] = False  # it reads the sampler's size as it decides

    def __init__(
        self,
        sampler: AdaptiveBatchSampler,
        metric: str = "accuracy",
        *,
        grow_above: float | None = None,
        shrink_below: float | None = None,
        factor: float = 2.0,
        cooldown: int = 50,
        patience: int = 1,
        action: ActionsArg = Action.BATCH_SIZE,
        warmup: int = 0,
        on_alert: AlertHook | None = None,
        name: str | None = None,
    ) -> None:
        label = name or f"batch_size({metric})"
        super().__init__(name=label, metric=metric, action=action, warmup=warmup, on_alert=on_alert)
        if Action.BATCH_SIZE not in parse_actions(action, rule=label):
            raise ConfigError(f"{label}: action= must include 'batch_size', got {action!r}.")
        if not isinstance(sampler, AdaptiveBatchSampler):
            raise ConfigError(f"{label}: expected an AdaptiveBatchSampler, got {type(sampler).__name__}.")
        if grow_above is None and shrink_below is None:
            raise ConfigError(
                f"{label}: expected grow_above= or shrink_below= (or both), got neither. "
                "Fix: e.g. grow_above=0.9, shrink_below=0.7."
            )
        self.grow_above = None if grow_above is None else require_number(label, "grow_above", grow_above)
        self.shrink_below = None if shrink_below is None else require_number(label, "shrink_below", shrink_below)
        if self.grow_above is not None and self.shrink_below is not None and self.grow_above <= self.shrink_below:
            raise ConfigError(
                f"{label}: grow_above={grow_above} must be greater than shrink_below={shrink_below}, "
                "or the size would flip every cool-down. Fix: leave a dead band between them."
            )
        self.factor = require_number(label, "factor", factor, above=1.0)
        require_int(label, "cooldown", cooldown, minimum=0)
        require_int(label, "patience", patience, minimum=1)
        self.sampler = sampler
        self.cooldown = cooldown
        self.patience = patience
        self._quiet = 0  # records left in the cool-down
        self._grow = 0  # streaks
        self._shrink = 0

    def _proposal(self, v: float) -> tuple[int, str] | None:
        """The new size the value alone asks for (ignoring patience and cool-down), and why."""
        size = self.sampler.batch_size
        if self.grow_above is not None and v > self.grow_above:
            new, why = self.sampler.clamp(max(size + 1, round(size * self.factor))), f"> {self.grow_above}"
        elif self.shrink_below is not None and v < self.shrink_below:
            new, why = self.sampler.clamp(max(1, round(size / self.factor))), f"< {self.shrink_below}"
        else:
            return None
        return None if new == size else (new, why)

    def check(self, record: Record, history: History) -> Anomaly | None:
        v = value_of(record, self.metric)
        if math.isnan(v) or self._quiet > 0:
            return None
        prop = self._proposal(v)
        if prop is None:
            return None
        streak = self._grow if prop[0] > self.sampler.batch_size else self._shrink
        if streak + 1 < self.patience:
            return None
        new, why = prop
        return Anomaly(
            self.metric,
            f"{self.metric} {v:.4g} {why} at step {record.step}: batch size {self.sampler.batch_size} -> {new}",
            v,
            batch_size=new,
            sampler=self.sampler,
        )

    def update(self, record: Record, *, fired: bool) -> None:
        v = value_of(record, self.metric)
        if math.isnan(v):
            return
        if fired:
            self._quiet, self._grow, self._shrink = self.cooldown, 0, 0
            return
        if self._quiet > 0:
            self._quiet -= 1
            return
        grow = self.grow_above is not None and v > self.grow_above
        shrink = self.shrink_below is not None and v < self.shrink_below
        self._grow = self._grow + 1 if grow else 0
        self._shrink = self._shrink + 1 if shrink else 0

    def reset(self) -> None:
        self._quiet = self._grow = self._shrink = 0
