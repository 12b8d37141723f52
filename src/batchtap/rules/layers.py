"""Rules on per-layer signals (:class:`~batchtap.metrics.Layers`): a layer whose weights move too
fast or have stopped moving, named in the decision."""

from __future__ import annotations

import fnmatch
import math

from batchtap._validate import require_int, require_number
from batchtap.errors import ConfigError
from batchtap.records import Record
from batchtap.rules.base import Action, ActionsArg, AlertHook, Anomaly, History, Rule

__all__ = ["LayerRatio"]


class LayerRatio(Rule):
    """Fires when a layer's update ratio ``‖Δw‖ / ‖w‖`` (``update_ratio/<layer>``, recorded by
    :class:`batchtap.metrics.Layers`) leaves ``[min, max]`` for ``patience`` captured steps in a row:
    above ``max`` the layer's weights move too fast (about to blow up), below ``min`` it stopped
    learning. Each layer keeps its own streak; the decision names the layer.

    Args:
        max: fire when a layer's ratio is above this (e.g. 0.1; ~1e-3 is a usual healthy scale).
        min: fire when a layer's ratio is below this (e.g. 1e-7: the layer is not learning).
        metric: the glob of the watched names (default every layer's ``update_ratio/*``).
        patience: consecutive captured values out of bounds needed, per layer.
        action: what to do when it fires (``alert``, ``stop``, ``rollback``, ...).
        warmup: no firing on steps before this.
        on_alert: hook for the ``alert`` action.
        name: the rule's label (default ``layer_ratio(update_ratio/*)``).

    Raises:
        ConfigError: neither bound, ``min > max``, a bound that is not a positive number, ``patience < 1``.

    Example:
        >>> rule = LayerRatio(max=0.1, min=1e-7)
        >>> r = Record("r", step=40, epoch=0, batch=40, rank=0, wall_time=0.0,
        ...            values={"update_ratio/embed": 1e-3, "update_ratio/blocks.3": 0.4})
        >>> rule.check(r, History()).message
        'layer blocks.3: update_ratio 0.4 > max 0.1 at step 40 (its weights move too fast)'
    """

    def __init__(
        self,
        *,
        max: float | None = None,  # noqa: A002 - the name users read in the rule
        min: float | None = None,  # noqa: A002
        metric: str = "update_ratio/*",
        patience: int = 1,
        action: ActionsArg = Action.ALERT,
        warmup: int = 0,
        on_alert: AlertHook | None = None,
        name: str | None = None,
    ) -> None:
        label = name or f"layer_ratio({metric})"
        super().__init__(name=label, metric=metric, action=action, warmup=warmup, on_alert=on_alert)
        if max is None and min is None:
            raise ConfigError(
                f"{label}: expected max= or min= (or both), got neither. Fix: e.g. LayerRatio(max=0.1, min=1e-7)."
            )
        self.max = None if max is None else require_number(label, "max", max, above=0.0)
        self.min = None if min is None else require_number(label, "min", min, above=0.0)
        if self.max is not None and self.min is not None and self.min > self.max:
            raise ConfigError(f"{label}: min={min} is greater than max={max}. Fix: min <= max.")
        require_int(label, "patience", patience, minimum=1)
        self.patience = patience
        self._prefix = metric.split("*", 1)[0] if metric.endswith("*") else ""
        self._matches: dict[str, bool] = {}
        self._streaks: dict[str, int] = {}
        self._fired: frozenset[str] = frozenset()

    def _watched(self, record: Record) -> list[str]:
        out = []
        for key in record.values:
            hit = self._matches.get(key)
            if hit is None:
                if len(self._matches) > 65536:
                    self._matches.clear()
                hit = self._matches[key] = fnmatch.fnmatchcase(key, self.metric)
            if hit:
                out.append(key)
        return out

    def _outside(self, v: float) -> str | None:
        if self.max is not None and v > self.max:
            return f"> max {self.max:g}"
        if self.min is not None and v < self.min:
            return f"< min {self.min:g}"
        return None

    def applies_to(self, record: Record) -> bool:
        return bool(self._watched(record))

    def check(self, record: Record, history: History) -> Anomaly | None:
        hits: list[tuple[str, float, str]] = []
        for key in self._watched(record):
            v = record.values[key]
            side = None if math.isnan(v) else self._outside(v)
            if side is not None and self._streaks.get(key, 0) + 1 >= self.patience:
                hits.append((key, v, side))
        self._fired = frozenset(h[0] for h in hits)
        if not hits:
            return None
        key, v, side = hits[0]
        layer = key[len(self._prefix) :] if self._prefix and key.startswith(self._prefix) else key
        kind = self._prefix.rstrip("/") or key
        why = "its weights move too fast" if side.startswith(">") else "it stopped learning"
        run = f" for {self.patience} captured steps" if self.patience > 1 else ""
        message = f"layer {layer}: {kind} {v:.6g} {side}{run} at step {record.step} ({why})"
        if len(hits) > 1:
            message += f" (also {', '.join(h[0] for h in hits[1:])})"
        return Anomaly(key, message, v)

    def update(self, record: Record, *, fired: bool) -> None:
        fired_keys = self._fired if fired else frozenset()
        self._fired = frozenset()
        for key in self._watched(record):
            v = record.values[key]
            if math.isnan(v):
                continue  # neither counts nor breaks the streak
            out = self._outside(v) is not None
            self._streaks[key] = 0 if key in fired_keys or not out else self._streaks.get(key, 0) + 1

    def reset(self) -> None:
        self._streaks.clear()
        self._fired = frozenset()
