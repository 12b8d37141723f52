"""Training-side recovery: what the training thread does when the rules decide.

The rules (:mod:`batchtap.rules`) judge host records on the pipeline thread and return decisions;
everything here touches training state (the model, the optimizer, the data loader, process-wide
torch flags) and so runs on the training thread, between two steps:

* :class:`ActionRunner` applies decisions at the next ``step()``: stop, raise, roll back, resize.
* :class:`Rollback` keeps last-good snapshots of the model and optimizer on their device.
* :class:`AdaptiveBatchSampler` is a batch sampler whose size a :class:`BatchSizeRule` sets.
* :func:`split_on_oom` retries an out-of-memory batch in chunks with gradient accumulation.
* :func:`debug_mode` runs a block with deterministic kernels and autograd anomaly detection.

Every name is also available as ``bt.rules.<name>`` (where they lived before this package).
"""

from __future__ import annotations

from batchtap.recovery.actions import ActionRunner, Outcome
from batchtap.recovery.debug import debug_mode
from batchtap.recovery.oom import SplitResult, is_oom_error, split_on_oom
from batchtap.recovery.rollback import Rollback, RollbackResult
from batchtap.recovery.sampler import AdaptiveBatchSampler, BatchSizeRule

__all__ = [
    "ActionRunner",
    "AdaptiveBatchSampler",
    "BatchSizeRule",
    "Outcome",
    "Rollback",
    "RollbackResult",
    "SplitResult",
    "debug_mode",
    "is_oom_error",
    "split_on_oom",
]
