"""Anomaly rules and the actions they take: stop, raise, alert, roll back, adapt the batch size.

Rules see decoded host records only (``batchtap.records.Record``), never tensors. The
:class:`RuleEngine` decides on the pipeline thread; the :class:`ActionRunner` applies decisions on the
training thread at its next step; :class:`Rollback`, :class:`AdaptiveBatchSampler`,
:func:`split_on_oom` and :func:`debug_mode` are the training-side tools those actions use.
"""

from __future__ import annotations

from batchtap.rules.actions import ActionRunner, Outcome
from batchtap.rules.base import (
    Action,
    ActionName,
    AlertHook,
    Anomaly,
    BatchSizeTarget,
    CallableRule,
    Decision,
    History,
    Rule,
    RuleFn,
)
from batchtap.rules.builtin import NonFinite, Plateau, Spike, StepTimeRegression, Threshold
from batchtap.rules.debug import debug_mode
from batchtap.rules.engine import Agreement, RuleEngine, RuleLike
from batchtap.rules.oom import SplitResult, is_oom_error, split_on_oom
from batchtap.rules.rollback import Rollback, RollbackResult
from batchtap.rules.sampler import AdaptiveBatchSampler, BatchSizeRule

__all__ = [
    "Action",
    "ActionName",
    "ActionRunner",
    "AdaptiveBatchSampler",
    "Agreement",
    "AlertHook",
    "Anomaly",
    "BatchSizeRule",
    "BatchSizeTarget",
    "CallableRule",
    "Decision",
    "History",
    "NonFinite",
    "Outcome",
    "Plateau",
    "Rollback",
    "RollbackResult",
    "Rule",
    "RuleEngine",
    "RuleFn",
    "RuleLike",
    "Spike",
    "SplitResult",
    "StepTimeRegression",
    "Threshold",
    "debug_mode",
    "is_oom_error",
    "split_on_oom",
]
