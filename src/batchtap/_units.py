"""The unit of each metric and how it is shown: one convention for the console, the CLI and the
browser view (torch-free, imports nothing of batchtap: the CLI starts fast).

Values are *stored* in their plain units: seconds, bytes, fractions in [0, 1], percent for the
GPU's own utilisation readings. They are *shown* as a person reads them:

=============  ==============================================  ===========================
kind           stored                                          shown
=============  ==============================================  ===========================
``fraction``   0-1 (``accuracy*``, ``*_acc``, ``*_accuracy``)  ``91.25%`` (x100; a value
                                                               outside [0, 1] as it is)
``seconds``    s (``*_time``: ``step_time``, ``data_time``)    ``1.63ms`` below 1 s, else
                                                               ``12.50s``
``bytes``      bytes (``memory*``, ``*_mem_used``, ``*_rss``)  ``3072MiB``, ``12.0GiB`` from
                                                               10 GiB
``percent``    0-100 (``*_util``, ``*_percent``)               ``87%``
``per_second`` 1/s (``throughput``)                            ``5496/s``
``ratio``      x (``step_time_spread``)                        ``2.56x``
``watts``,     W, degrees C, MHz (``*_power``, ``*_temp``,     ``250W``, ``71C``,
``celsius``,   ``*_sm_clock``)                                 ``1410MHz``
``mhz``
``loss``       as logged (``*loss``)                           4 decimals
``count``      an integer (``slowest_rank``)                   ``3``
``plain``      anything else                                   4 significant digits
=============  ==============================================  ===========================

:data:`RULES` is that table as data: the console formats with :func:`format_value`, the browser
view receives :func:`table` in its page and applies the same rules (its charts' axes say the unit,
``accuracy (%)``, ``step_time (ms)``, ``memory_allocated (MiB)``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

__all__ = ["Kind", "RULES", "unit_of", "format_value", "format_values", "number", "table", "LABELS"]

Kind = Literal[
    "fraction",
    "seconds",
    "bytes",
    "percent",
    "per_second",
    "ratio",
    "watts",
    "celsius",
    "mhz",
    "loss",
    "count",
    "plain",
]

#: How a name is matched, in order, first match wins: (``exact`` | ``prefix`` | ``suffix`` | ``contains``,
#: text, kind).
RULES: tuple[tuple[str, str, Kind], ...] = (
    ("exact", "step_time_spread", "ratio"),
    ("exact", "slowest_rank", "count"),
    ("prefix", "accuracy", "fraction"),
    ("suffix", "_acc", "fraction"),
    ("suffix", "_accuracy", "fraction"),
    ("exact", "acc", "fraction"),
    ("suffix", "_time", "seconds"),
    ("suffix", "_util", "percent"),
    ("suffix", "_util_min", "percent"),
    ("suffix", "_percent", "percent"),
    ("suffix", "_mem_used", "bytes"),
    ("suffix", "_mem_total", "bytes"),
    ("suffix", "_rss", "bytes"),
    ("suffix", "_ram_used", "bytes"),
    ("prefix", "memory", "bytes"),
    ("suffix", "_power", "watts"),
    ("suffix", "_temp", "celsius"),
    ("suffix", "_sm_clock", "mhz"),
    ("exact", "throughput", "per_second"),
    ("suffix", "_per_second", "per_second"),  # tokens_per_second, flops_per_second (metrics/throughput.py)
    ("exact", "mfu", "fraction"),  # model FLOPs utilisation, stored 0-1
    ("suffix", "loss", "loss"),
)

#: Short labels the console shows instead of the stored names (``tail`` and the UI show the stored names).
LABELS = {
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


def unit_of(name: str) -> Kind:
    """The kind of unit a metric's values have, from its name (:data:`RULES`).

    Example:
        >>> [unit_of(n) for n in ("accuracy_top5", "val_acc", "step_time", "memory_reserved", "gpu0_util", "lr")]
        ['fraction', 'fraction', 'seconds', 'bytes', 'percent', 'plain']
    """
    for how, text, kind in RULES:
        if (
            (how == "exact" and name == text)
            or (how == "prefix" and name.startswith(text))
            or (how == "suffix" and name.endswith(text))
            or (how == "contains" and text in name)
        ):
            return kind
    return "plain"


def number(value: float, decimals: int | None = None) -> str:
    """A plain number formatted for its size: fixed in [1e-3, 1e5), else 2 significant digits in
    exponent form (``7.5e+29``), so a diverging value never prints 30 digits.

    Example:
        >>> number(0.42131), number(7.465e29), number(3.0, 2)
        ('0.4213', '7.5e+29', '3.00')
    """
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


_FORMATS: dict[str, Any] = {
    "seconds": _seconds,
    "bytes": _bytes,
    "percent": lambda v: f"{number(v, 0)}%",
    "per_second": lambda v: f"{number(v, 0)}/s",
    "ratio": lambda v: f"{number(v, 2)}x",
    "watts": lambda v: f"{number(v, 0)}W",
    "celsius": lambda v: f"{number(v, 0)}C",
    "mhz": lambda v: f"{number(v, 0)}MHz",
    "count": lambda v: number(v, 0),
    "loss": lambda v: number(v, 4),
}


def format_value(name: str, value: float | None) -> str:
    """One value with its unit, formatted for its size; ``-`` for a missing value.

    Example:
        >>> [format_value(n, v) for n, v in [("loss", 0.42131), ("loss", 7.465e29), ("accuracy", 0.9125),
        ...     ("step_time", 0.0016341), ("step_time", 12.5), ("throughput", 5496.2), ("lr", 2.437e-06),
        ...     ("memory_allocated", 3 * 2**30), ("step_time_spread", 2.561), ("gpu0_util", 87.0),
        ...     ("val_acc", 0.9), ("val_acc", 90.5), ("memory_reserved", 12 * 2**30)]]
        ['0.4213', '7.5e+29', '91.25%', '1.63ms', '12.50s', '5496/s', '2.4e-06', '3072MiB', '2.56x', '87%', \
'90.00%', '90.50', '12.0GiB']
    """
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    kind = unit_of(name)
    if not math.isfinite(value):
        return number(value)
    if kind == "fraction":
        # a name that reads like an accuracy but holds a percent already is shown as it is
        return f"{value * 100:.2f}%" if 0.0 <= value <= 1.0 else number(value, 2)
    fmt = _FORMATS.get(kind)
    return str(fmt(value)) if fmt is not None else number(value)


def format_values(values: Mapping[str, float] | Any) -> str:
    """Values as ``name=value`` pairs with short labels and units (:func:`format_value`).

    Example:
        >>> format_values({"loss": 0.42131, "accuracy": 0.9125, "accuracy_top5": 1.0, "step_time": 0.0032})
        'loss=0.4213 acc=91.25% acc5=100.00% step=3.20ms'
    """
    parts = []
    for name, value in values.items():
        label = LABELS.get(name) or name.replace("accuracy_top", "acc")
        parts.append(f"{label}={format_value(name, value)}")
    return " ".join(parts)


def table() -> dict[str, Any]:
    """The rules as JSON for the browser view (which applies them the same way).

    Example:
        >>> t = table(); t["rules"][0], t["mib"]
        (['exact', 'step_time_spread', 'ratio'], 1048576)
    """
    return {"rules": [list(rule) for rule in RULES], "mib": int(_MIB), "gib": int(_GIB)}
