"""Anomaly rules: they judge decoded host records and decide what to do.

Rules see decoded host records only (``batchtap.records.Record``), never tensors, and import no
torch. The :class:`RuleEngine` runs them on the pipeline thread and returns :class:`Decision` s; the
training side applies those with the tools of :mod:`batchtap.recovery` (``ActionRunner``,
``Rollback``, ``AdaptiveBatchSampler``, ``split_on_oom``, ``debug_mode``; ``bt.Rollback`` and friends
at the top level), which import the rules and are not re-exported here.
"""

from __future__ import annotations

from typing import Any

from batchtap.rules.base import (
    Action,
    ActionName,
    AlertHook,
    Anomaly,
    BatchSizeTarget,
    CallableRule,
    Decision,
    History,
    MetricGlob,
    Rule,
    RuleFn,
)
from batchtap.rules.builtin import GpuStarved, NonFinite, Plateau, Spike, StepTimeRegression, Threshold
from batchtap.rules.engine import Agreement, RuleEngine, RuleLike
from batchtap.rules.layers import LayerRatio

# The training-side tools (Rollback, BatchSizeRule, ActionRunner ...) lived here before
# batchtap.recovery existed. They are not re-exported: recovery imports the rules, so a re-export,
# even a lazy one, would make the two packages import each other. An old name says where it went.
_MOVED = frozenset(
    {
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
    }
)


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        raise AttributeError(
            f"batchtap.rules.{name} moved to batchtap.recovery: use bt.recovery.{name} "
            f"(`from batchtap.recovery import {name}`)"
            + (
                f" or bt.{name}"
                if name in ("AdaptiveBatchSampler", "BatchSizeRule", "Rollback", "debug_mode", "split_on_oom")
                else ""
            )
        )
    raise AttributeError(f"module 'batchtap.rules' has no attribute {name!r}")


__all__ = [
    "Action",
    "ActionName",
    "Agreement",
    "AlertHook",
    "Anomaly",
    "BatchSizeTarget",
    "CallableRule",
    "Decision",
    "GpuStarved",
    "History",
    "LayerRatio",
    "MetricGlob",
    "NonFinite",
    "Plateau",
    "Rule",
    "RuleEngine",
    "RuleFn",
    "RuleLike",
    "Spike",
    "StepTimeRegression",
    "Threshold",
]
