"""The few domain exceptions batchtap raises.

Each subclasses the built-in a caller would naturally catch, so ``except ValueError`` around a
misconfigured ``Tap`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "BatchtapError",
    "ConfigError",
    "InputError",
    "RunStateError",
    "TrainingDiverged",
    "SinkError",
    "DistributedError",
]


class BatchtapError(Exception):
    """Base class of every exception batchtap raises on purpose."""


class ConfigError(BatchtapError, ValueError):
    """A constructor argument is invalid (raised at construction, before any step runs)."""


class InputError(BatchtapError, ValueError):
    """A value handed to ``Tap.step()`` cannot be measured (wrong shape, dtype, device, range)."""


class RunStateError(BatchtapError, RuntimeError):
    """A call arrived at the wrong point of the run life cycle (e.g. ``step()`` outside ``run()``)."""


class SinkError(BatchtapError, RuntimeError):
    """A sink cannot be opened or written (bad path, unreachable server, unknown schema)."""


class DistributedError(BatchtapError, RuntimeError):
    """Ranks could not exchange metrics or agree on a decision within the collective timeout."""


class TrainingDiverged(BatchtapError, RuntimeError):
    """Raised by the ``raise`` action when a rule decides training has diverged.

    Attributes:
        step: the global step at which the rule fired.
        metric: the metric the rule watched.
        recent: the most recent values of that metric, oldest first.
    """

    def __init__(self, message: str, *, step: int, metric: str, recent: tuple[float, ...] = ()) -> None:
        super().__init__(message)
        self.step = step
        self.metric = metric
        self.recent = recent
