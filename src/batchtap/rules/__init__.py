"""Anomaly rules: they judge decoded host records and decide what to do.

Rules see decoded host records only (``batchtap.records.Record``), never tensors, and import no
torch. The :class:`RuleEngine` runs them on the pipeline thread and returns :class:`Decision` s; the
training side applies those with the tools of :mod:`batchtap.recovery` (:class:`ActionRunner`,
:class:`Rollback`, :class:`AdaptiveBatchSampler`, :func:`split_on_oom`, :func:`debug_mode`), which
are also reachable here under their old names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
from batchtap.rules.engine import Agreement, RuleEngine, RuleLike

if TYPE_CHECKING:
    from batchtap.recovery import (
        ActionRunner,
        AdaptiveBatchSampler,
        BatchSizeRule,
        Outcome,
        Rollback,
        RollbackResult,
        SplitResult,
        debug_mode,
        is_oom_error,
        split_on_oom,
    )

# The training-side tools lived here before batchtap.recovery existed; `bt.rules.Rollback` and
# friends keep working, loaded on first use (PEP 562) so that importing the rules loads neither
# them nor torch, and recovery (which imports the rules) cannot form an import cycle with this file.
_RECOVERY = frozenset(
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
    if name not in _RECOVERY:
        raise AttributeError(f"module 'batchtap.rules' has no attribute {name!r}")
    value = getattr(importlib.import_module("batchtap.recovery"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | _RECOVERY)


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
