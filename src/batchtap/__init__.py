"""batchtap: per-batch training metrics for PyTorch, captured on the device with zero host syncs,
validated, stored and acted on while training runs.

Example:
    >>> import batchtap as bt
    >>> tap = bt.Tap(sinks=[])
    >>> tap.close()
"""

from batchtap import metrics, sinks
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
from batchtap.tap import Tap

__version__ = "0.1.0"

__all__ = [
    "Tap",
    "MetricsCallback",
    "metrics",
    "sinks",
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
