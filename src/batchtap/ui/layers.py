"""The browser view's per-layer data: ``/api/runs/{id}/layers`` (each layer's latest gradient norm,
weight norm and update ratio, grouped by layer, the top ones first) and ``/api/runs/{id}/histograms``
(each layer's stored histograms as a steps x bins matrix, for the heatmap ``static/layers.js`` draws).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from batchtap.store.histograms import read_histograms
from batchtap.ui.data import ReadOnlyStore

__all__ = ["layer_routes", "layers_payload", "histograms_payload", "LAYER_KINDS"]

#: the per-layer values bt.metrics.Layers records, as name prefixes
LAYER_KINDS = ("grad_norm", "weight_norm", "update_ratio")
#: at most this many steps per heatmap (the latest ones)
MAX_HISTOGRAM_STEPS = 2000


def _clean(v: Any) -> float | None:
    return None if v is None or not math.isfinite(float(v)) else float(v)


def layers_payload(store: ReadOnlyStore, run_id: str, top: int = 8) -> dict[str, Any]:
    """Each layer's latest ``grad_norm/``, ``weight_norm/`` and ``update_ratio/`` value (the lowest
    rank's rows: the reduced ones in a process group), layers ordered by their gradient norm,
    largest first; ``top`` names the first ``top`` of them (the table's default rows); ``order``
    gives, per kind, the layers by their latest value of that kind, largest first (the order of the
    lines of that kind's chart, whose first few are shown by default)."""
    names = [
        str(r[0])
        for r in store.reader.query(
            "SELECT DISTINCT metric FROM metrics WHERE run_id = ? AND metric LIKE ?", (run_id, "%/%")
        )
        if str(r[0]).split("/", 1)[0] in LAYER_KINDS
    ]
    layers: dict[str, dict[str, Any]] = {}
    for name in names:
        kind, layer = name.split("/", 1)
        row = store.reader.query(
            "SELECT step, value FROM metrics WHERE run_id = ? AND metric = ? AND rank = "
            "(SELECT MIN(rank) FROM metrics WHERE run_id = ? AND metric = ?) ORDER BY step DESC LIMIT 1",
            (run_id, name, run_id, name),
        )
        entry = layers.setdefault(layer, {"layer": layer})
        if row:
            entry[kind] = _clean(row[0][1])
            entry["step"] = max(int(row[0][0]), entry.get("step", -1))
    ordered = sorted(layers.values(), key=lambda e: -(e.get("grad_norm") or 0.0))
    # Per kind, every layer with a value, the largest latest value first: a family's chart shows
    # the first ``top`` lines by default (the layer whose gradients explode is at the top).
    by_kind = {
        kind: [
            e["layer"] for e in sorted((e for e in layers.values() if e.get(kind) is not None), key=lambda e: -e[kind])
        ]
        for kind in LAYER_KINDS
    }
    return {
        "kinds": list(LAYER_KINDS),
        "layers": ordered,
        "top": [e["layer"] for e in ordered[:top]],
        "order": {kind: names for kind, names in by_kind.items() if names},
    }


def histograms_payload(store: ReadOnlyStore, run_id: str, kind: str | None = None) -> dict[str, Any]:
    """The run's histograms per (kind, layer): steps, each step's low and high, and the counts
    (one list of bins per step), the lowest rank's rows, the latest :data:`MAX_HISTOGRAM_STEPS` steps."""
    found = read_histograms(store.reader, run_id, kind=kind)
    if not found:
        return {"histograms": []}
    rank = min(h.rank for h in found)
    grouped: dict[tuple[str, str], dict[str, Any]] = {}
    for h in found:
        if h.rank != rank:
            continue
        g = grouped.setdefault(
            (h.kind, h.layer), {"kind": h.kind, "layer": h.layer, "steps": [], "low": [], "high": [], "counts": []}
        )
        g["steps"].append(h.step)
        g["low"].append(_clean(h.low))
        g["high"].append(_clean(h.high))
        g["counts"].append(list(h.counts))
    out = []
    for g in grouped.values():
        for key in ("steps", "low", "high", "counts"):
            g[key] = g[key][-MAX_HISTOGRAM_STEPS:]
        out.append(g)
    return {"histograms": out}


def layer_routes(store: ReadOnlyStore, run_id: Callable[[Request], str], headers: dict[str, str]) -> list[Route]:
    """The two routes, for :func:`batchtap.ui.app.make_app`."""

    def respond(body: dict[str, Any]) -> Response:
        return JSONResponse(body, headers=headers)

    def layers(request: Request) -> Response:
        try:
            top = max(1, min(100, int(request.query_params.get("top", "8"))))
        except ValueError:
            top = 8
        return respond(layers_payload(store, run_id(request), top))

    def histograms(request: Request) -> Response:
        return respond(histograms_payload(store, run_id(request), request.query_params.get("kind") or None))

    return [
        Route("/api/runs/{run_id:str}/layers", layers),
        Route("/api/runs/{run_id:str}/histograms", histograms),
    ]
