"""Values as a person reads them: units and a size-fit format, shared by the console and
``batchtap tail`` (no torch, no sinks imported: the CLI starts fast)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["format_value", "format_values", "number"]

#: Short labels the console shows instead of the stored names (``tail`` shows the stored names).
_LABELS = {
    "accuracy": "acc",
    "step_time": "step",
    "data_time": "data",
    "grad_norm": "gnorm",
    "throughput": "tput",
    "step_time_spread": "spread",
    "slowest_rank": "slowest",
}

_MIB = 2.0**20
_GIB = 2.0**30


def number(value: float, decimals: int | None = None) -> str:
    """A plain number formatted for its size: fixed in [1e-3, 1e5), else 2 significant digits
    in exponent form (``7.5e+29``), so a diverging value never prints 30 digits."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    if 1e-3 <= abs(value) < 1e5:
        return f"{value:.{decimals}f}" if decimals is not None else f"{value:.4g}"
    return f"{value:.2g}"


def _seconds(value: float) -> str:
    if 0 <= value < 1:
        return f"{value * 1e3:.2f}ms"
    return f"{number(value, 2)}s"


def _bytes(value: float) -> str:
    if abs(value) >= 10 * _GIB:
        return f"{number(value / _GIB, 1)}GiB"
    return f"{value / _MIB:.0f}MiB"


#: unit of each kind of value, by how its name ends (the System metric's names, memory, times)
_SUFFIX_FORMATS: tuple[tuple[str, Any], ...] = (
    ("_time", _seconds),
    ("_util", lambda v: f"{number(v, 0)}%"),
    ("_util_min", lambda v: f"{number(v, 0)}%"),
    ("_percent", lambda v: f"{number(v, 0)}%"),
    ("_mem_used", _bytes),
    ("_mem_total", _bytes),
    ("_power", lambda v: f"{number(v, 0)}W"),
    ("_temp", lambda v: f"{number(v, 0)}C"),
    ("_sm_clock", lambda v: f"{number(v, 0)}MHz"),
    ("_rss", _bytes),
    ("_ram_used", _bytes),
)


def format_value(name: str, value: float | None) -> str:
    """One value with its unit, formatted for its size; ``-`` for a missing value.

    The console and ``batchtap tail`` both use it, so a value reads the same in both.

    Example:
        >>> [format_value(n, v) for n, v in [("loss", 0.42131), ("loss", 7.465e29), ("accuracy", 0.9125),
        ...     ("step_time", 0.0016341), ("step_time", 12.5), ("throughput", 5496.2), ("lr", 2.437e-06),
        ...     ("memory_allocated", 3 * 2**30), ("step_time_spread", 2.561), ("gpu0_util", 87.0)]]
        ['0.4213', '7.5e+29', '91.25%', '1.63ms', '12.50s', '5496/s', '2.4e-06', '3072MiB', '2.56x', '87%']
    """
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    if name.startswith("accuracy"):
        return f"{value * 100:.2f}%" if math.isfinite(value) else number(value)
    if name == "step_time_spread":  # the slowest rank's step time over the fastest's
        return f"{number(value, 2)}x"
    if name == "slowest_rank":
        return number(value, 0)
    for suffix, fmt in _SUFFIX_FORMATS:
        if name.endswith(suffix) and math.isfinite(value):
            return str(fmt(value))
    if name.startswith("memory") and math.isfinite(value):
        return _bytes(value)
    if name == "throughput":
        return f"{number(value, 0)}/s"
    if name.endswith("loss"):
        return number(value, 4)
    return number(value)


def format_values(values: Mapping[str, float] | Any) -> str:
    """Values as ``name=value`` pairs with short labels and units (:func:`format_value`).

    Example:
        >>> format_values({"loss": 0.42131, "accuracy": 0.9125, "accuracy_top5": 1.0, "step_time": 0.0032})
        'loss=0.4213 acc=91.25% acc5=100.00% step=3.20ms'
    """
    parts = []
    for name, value in values.items():
        label = _LABELS.get(name) or name.replace("accuracy_top", "acc")
        parts.append(f"{label}={format_value(name, value)}")
    return " ".join(parts)
