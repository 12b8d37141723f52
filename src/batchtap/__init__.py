"""batchtap: per-batch training metrics for PyTorch, captured on the device with zero host syncs,
validated, stored and acted on while training runs.

Example:
    >>> import batchtap as bt
    >>> tap = bt.Tap(sinks=[])
    >>> tap.close()
"""

from batchtap import metrics, rules, sinks
from batchtap.callback import MetricsCallback
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
from batchtap.rules import (
    AdaptiveBatchSampler,
    BatchSizeRule,
    NonFinite,
    Plateau,
    Rollback,
    Spike,
    StepTimeRegression,
    Threshold,
    debug_mode,
    split_on_oom,
)
from batchtap.tap import Tap

__version__ = "0.1.0"

__all__ = [
    "Tap",
    "MetricsCallback",
    "metrics",
    "rules",
    "sinks",
    "NonFinite",
    "Threshold",
    "Spike",
    "Plateau",
    "StepTimeRegression",
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
