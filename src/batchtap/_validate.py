"""Argument checks shared by the rules and the recovery tools: each error names what was expected, what
came, and the fix."""

from __future__ import annotations

import math
from collections.abc import Mapping

from batchtap.errors import ConfigError
from batchtap.records import Record

__all__ = ["require_int", "require_number", "value_of"]


def require_int(rule: str, arg: str, value: object, *, minimum: int) -> None:
    """ConfigError unless ``value`` is an int >= ``minimum`` (bools rejected: ``patience=True`` is a typo)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(
            f"{rule}: {arg} must be an integer >= {minimum}, got {value!r}. Fix: pass {arg}={max(minimum, 1)} or more."
        )


def require_number(rule: str, arg: str, value: object, *, above: float | None = None) -> float:
    """ConfigError unless ``value`` is a finite real number (``> above`` when given); return it as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{rule}: {arg} must be a finite number, got {value!r}.")
    if above is not None and value <= above:
        raise ConfigError(f"{rule}: {arg} must be > {above}, got {value!r}. Fix: pass a value above {above}.")
    return float(value)


def value_of(record: Record, metric: str) -> float:
    """The record's value for ``metric`` (callers checked it is present)."""
    values: Mapping[str, float] = record.values
    return float(values[metric])
