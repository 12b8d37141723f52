"""batchtap: per-batch training metrics for PyTorch, captured on the device with zero host syncs,
validated, stored and acted on while training runs.

Example:
    >>> import batchtap as bt
    >>> tap = bt.Tap(sinks=[])
    >>> tap.close()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchtap._lazy import lazy_exports

# Errors and records are plain Python and cheap: imported now.
from batchtap.errors import (
    BatchtapError,
    ConfigError,
    DistributedError,
    InputError,
    RunStateError,
    SinkError,
    TrainingDiverged,
)
from batchtap.records import ALL_RANKS, Event, EventKind, Record, RunInfo, RunStatus

if TYPE_CHECKING:
    from batchtap import metrics, recovery, rules, sinks
    from batchtap.autolog import autolog
    from batchtap.integrations.callback import MetricsCallback
    from batchtap.recovery import AdaptiveBatchSampler, BatchSizeRule, Rollback, debug_mode, split_on_oom
    from batchtap.rules import GpuStarved, NonFinite, Plateau, Spike, StepTimeRegression, Threshold
    from batchtap.tap import Tap

# Everything that needs torch is imported on first use (PEP 562), so `batchtap runs` and the other
# reading commands start in a fraction of a second instead of waiting for `import torch`.
_LAZY = {
    "Tap": "batchtap.tap",
    "autolog": "batchtap.autolog",
    "MetricsCallback": "batchtap.integrations.callback",
    **{
        name: "batchtap.rules"
        for name in ("NonFinite", "Plateau", "Spike", "StepTimeRegression", "Threshold", "GpuStarved")
    },
    **{
        name: "batchtap.recovery"
        for name in ("AdaptiveBatchSampler", "BatchSizeRule", "Rollback", "debug_mode", "split_on_oom")
    },
}
_SUBMODULES = frozenset({"metrics", "recovery", "rules", "sinks", "ui"})


__getattr__, __dir__ = lazy_exports("batchtap", _LAZY, globals(), modules=_SUBMODULES)

__version__ = "0.1.0"

__all__ = [
    "Tap",
    "autolog",
    "MetricsCallback",
    "metrics",
    "rules",
    "sinks",
    "NonFinite",
    "Threshold",
    "Spike",
    "Plateau",
    "StepTimeRegression",
    "GpuStarved",
    "recovery",
    "Rollback",
    "AdaptiveBatchSampler",
    "BatchSizeRule",
    "split_on_oom",
    "debug_mode",
    "Record",
    "Event",
    "EventKind",
    "RunInfo",
    "RunStatus",
    "ALL_RANKS",
    "BatchtapError",
    "ConfigError",
    "DistributedError",
    "InputError",
    "RunStateError",
    "SinkError",
    "TrainingDiverged",
    "__version__",
]
