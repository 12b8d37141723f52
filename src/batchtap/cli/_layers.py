"""``batchtap show``'s per-layer table: the values ``bt.metrics.Layers`` records
(``grad_norm/<layer>``, ``weight_norm/<layer>``, ``update_ratio/<layer>``), one row per layer
instead of three rows per layer in the metrics table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from batchtap.cli._common import fit_table, fmt_value

__all__ = ["LAYER_KINDS", "split_layer_metrics", "layer_table"]

#: the per-layer value kinds, in their column order
LAYER_KINDS = ("grad_norm", "weight_norm", "update_ratio")
#: layers listed at most (the largest last gradient norms); the rest are counted
MAX_LAYERS = 20


def split_layer_metrics(names: Sequence[str]) -> tuple[list[str], dict[str, dict[str, str]]]:
    """``names`` without the per-layer ones, and those as layer -> kind -> name.

    Example:
        >>> split_layer_metrics(["loss", "grad_norm", "grad_norm/fc", "update_ratio/fc"])
        (['loss', 'grad_norm'], {'fc': {'grad_norm': 'grad_norm/fc', 'update_ratio': 'update_ratio/fc'}})
    """
    rest: list[str] = []
    layers: dict[str, dict[str, str]] = {}
    for name in names:
        kind, sep, layer = name.partition("/")
        if sep and kind in LAYER_KINDS and layer:
            layers.setdefault(layer, {})[kind] = name
        else:
            rest.append(name)
    return rest, layers


def layer_table(layers: Mapping[str, Mapping[str, str]], summaries: Mapping[str, Any]) -> list[str]:
    """The ``layers`` section: per layer the last value of each kind (largest last gradient norm
    first), at most :data:`MAX_LAYERS` rows."""

    def last(layer: str, kind: str) -> float | None:
        name = layers[layer].get(kind)
        return None if name is None else summaries[name].last

    def key(layer: str) -> float:
        v = last(layer, "grad_norm")
        return -(v if v is not None and v == v else -1.0)

    ordered = sorted(layers, key=key)
    rows = [["  " + layer, *(fmt_value(last(layer, kind)) for kind in LAYER_KINDS)] for layer in ordered[:MAX_LAYERS]]
    out = ["layers (last values, largest gradient norm first)"]
    out.extend(
        fit_table(
            ["  layer", *LAYER_KINDS],
            rows,
            right=[False] + [True] * len(LAYER_KINDS),
            priority=[1] * (1 + len(LAYER_KINDS)),
        )
    )
    if len(ordered) > MAX_LAYERS:
        out.append(f"  ... {len(ordered) - MAX_LAYERS} more layers (batchtap export has every value)")
    return out
