"""``Tap.run_metrics``: the open run's metrics, for integrations that measure one of their own.

A callable attribute of the Tap, not a method (the Tap's size limits, tests/test_architecture.py):
an integration asks for what it needs, the open run's metrics and a way to add to them, instead of
reaching into the Tap's private run. It holds the Tap weakly (no reference cycle).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from batchtap._run import ActiveRun
from batchtap.metrics.base import Metric

__all__ = ["RunMetrics"]


class RunMetrics:
    """``tap.run_metrics()``: the open run's metrics (None: no run is open). ``tap.run_metrics(add)``
    first adds ``add`` to that run alone (its own copy of the frozen settings: the Tap's later runs
    start from the Tap's own list), unless a step already fixed the run's columns.

    Args:
        tap: the Tap whose open run this reads.
        open_run: ``tap``'s open run (the Tap passes a function of its own).
    """

    def __init__(self, tap: Any, open_run: Callable[[Any], ActiveRun | None]) -> None:
        self._tap = weakref.ref(tap)
        self._open_run = open_run

    def __call__(self, add: Sequence[Metric] = ()) -> tuple[Metric, ...] | None:
        tap = self._tap()
        run = None if tap is None else self._open_run(tap)
        if run is None:
            return None
        if add and run.capture is None:
            run.settings = dataclasses.replace(run.settings, metrics=(*run.settings.metrics, *add))
        return run.settings.metrics
