"""Builders shared by the rules tests."""

from __future__ import annotations

from collections.abc import Sequence

from batchtap.records import Record
from batchtap.rules import Decision, Rule, RuleEngine

__all__ = ["fire_steps", "rec", "records"]


def rec(step: int, **values: float) -> Record:
    """A record at ``step`` (epoch 0, batch = step, rank 0) with the given metric values."""
    return Record("run", step=step, epoch=0, batch=step, rank=0, wall_time=float(step), values=values)


def records(metric: str, values: Sequence[float], *, start: int = 0) -> list[Record]:
    """One record per value, consecutive steps from ``start``."""
    return [rec(start + i, **{metric: float(v)}) for i, v in enumerate(values)]


def fire_steps(rule: Rule, metric: str, values: Sequence[float]) -> list[int]:
    """Steps at which ``rule`` fires over ``values`` run through a fresh engine."""
    decisions: list[Decision] = RuleEngine([rule]).process(records(metric, values))
    return [d.step for d in decisions]
