"""``BatchtapTracker``: batchtap as an Accelerate tracker (``Accelerator(log_with=BatchtapTracker(tap))``).

Accelerate's trackers receive what the script hands to ``accelerator.log(...)``: those values become
batchtap sparse values (:meth:`Tap.log`), stored beside the per-step records that the loop captures
with the same Tap (``tracker.tap.accumulate(...)`` per micro-batch inside ``accelerator.accumulate``,
``tracker.tap.step(...)`` when ``accelerator.sync_gradients``). ``accelerator.init_trackers(name,
config=...)`` stores the config with the run; ``tracker.finish()`` ends it. ``accelerator.end_training()``
also calls ``finish()``, but on the main process only and then destroys the process group: in a process
group call ``tracker.finish()`` on every rank before it, so the ranks' last exchange can complete.

The run starts at the first use of :attr:`BatchtapTracker.tap` (or the first ``accelerator.log``),
not inside ``init_trackers``: Accelerate calls ``init_trackers`` on the main process only, while in a
process group every rank's Tap must start its run at the same point of the script.

Needs ``pip install 'batchtap[accelerate]'``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

import torch

from batchtap._optional import require
from batchtap.records import RunStatus
from batchtap.tap import Tap

_tracking: Any = require("accelerate.tracking", extra="accelerate", purpose="batchtap.integrations.accelerate")

__all__ = ["BatchtapTracker"]

log = logging.getLogger("batchtap")


class BatchtapTracker(_tracking.GeneralTracker):  # type: ignore[misc]
    """An Accelerate ``GeneralTracker`` backed by a :class:`~batchtap.Tap`.

    Args:
        tap: the Tap that stores the run (metrics, sinks, rules as you configure them). Default: a
            Tap with the default metrics storing to the default SQLite store and the console,
            closed by ``finish()``.
        run_name: the run's name (default: the Tap's default, a timestamp).

    Example (not run here: it trains; tests/integrations/test_accelerate.py runs the README's)::

        tracker = BatchtapTracker(bt.Tap(sinks=[bt.sinks.SQLite("runs/batchtap.db")]), run_name="exp1")
        accelerator = Accelerator(gradient_accumulation_steps=4, log_with=tracker)
        accelerator.init_trackers("exp1", config={"lr": 1e-3})
        ...
        accelerator.log({"val_loss": val_loss}, step=step)   # a sparse value, no sync
        tracker.finish()                                     # every rank; the run is stored as finished
        accelerator.end_training()
    """

    name = "batchtap"
    requires_logging_directory = False
    #: Every rank drives its own Tap (they agree on stops and reduce over ranks; rank 0 stores).
    main_process_only = False

    def __init__(self, tap: Tap | None = None, *, run_name: str | None = None) -> None:
        super().__init__()
        self._tap = tap
        self._own_tap = tap is None
        self.run_name = run_name
        self.config: dict[str, Any] | None = None
        self._running = False

    @property
    def tap(self) -> Tap:
        """The Tap, with its run started at the first use: call ``tap.accumulate``/``tap.step`` on it."""
        if self._tap is None:
            self._tap = Tap()
        if not self._running:
            self._tap.start(name=self.run_name, config=self.config)
            self._running = True
        return self._tap

    @property
    def tracker(self) -> Tap:
        """Accelerate's name for the object behind a tracker (``get_tracker("batchtap", unwrap=True)``)."""
        return self.tap

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Keep ``init_trackers(config=...)`` for the run; it is stored when the run starts."""
        if self._running:
            log.warning(
                "batchtap: the run already started, so init_trackers(config=...) is not stored with it; "
                "call accelerator.init_trackers before the first use of tracker.tap"
            )
            return
        self.config = dict(values)

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Store ``accelerator.log(values, step=)`` as sparse values (numbers and 0-dim tensors;
        strings, which Accelerate also allows, are not metrics and are left out)."""
        numbers = {
            k: v for k, v in values.items() if isinstance(v, (int, float, torch.Tensor)) and not isinstance(v, bool)
        }
        if numbers:
            self.tap.log(numbers, step=step)

    def finish(
        self,
        status: RunStatus | Literal["finished", "failed", "stopped"] = RunStatus.FINISHED,
        *,
        reason: str | None = None,
    ) -> None:
        """End the run; every captured step is stored. Call it on every rank before
        ``accelerator.end_training()`` (which calls it on the main process only); a second call does nothing.

        Call it yourself with ``status="failed"`` from an ``except`` block to store a failure; a run
        left open is stored as ``failed`` at interpreter exit.
        """
        tap = self._tap
        if tap is not None and self._running:
            self._running = False
            tap.finish(status, reason=reason)
        if self._own_tap and tap is not None:
            tap.close()
            self._tap = None
