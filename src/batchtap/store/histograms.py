"""Reading the histograms table (``bt.metrics.Histograms``' values, one row per layer, kind and
captured step) back from a store, for the CLI's export and the browser view."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Protocol

__all__ = ["Histogram", "read_histograms", "HISTOGRAM_CSV_COLUMNS", "histogram_csv_row"]

#: the columns of an exported histograms CSV (the counts follow as bin0, bin1, ...)
HISTOGRAM_CSV_COLUMNS = ("run_id", "kind", "layer", "step", "rank", "low", "high")


class _Queries(Protocol):
    def query(self, sql: str, params: Any = ()) -> list[tuple[Any, ...]]: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Histogram:
    """One stored histogram: ``counts[i]`` values fell in bin ``i`` of ``len(counts)`` equal bins
    spanning ``[low, high]`` (the last bin includes ``high``)."""

    run_id: str
    kind: str  #: "weight" or "grad"
    layer: str
    step: int
    rank: int
    low: float | None
    high: float | None
    counts: tuple[float, ...]


def read_histograms(
    store: _Queries, run_id: str, *, kind: str | None = None, layer: str | None = None
) -> list[Histogram]:
    """The run's histograms in (kind, layer, step, rank) order; empty for a store written before
    histograms were stored (no table) or a run without any.

    Example:
        >>> import sqlite3
        >>> class Conn:
        ...     def __init__(self): self.c = sqlite3.connect(":memory:")
        ...     def query(self, sql, params=()): return self.c.execute(sql, params).fetchall()
        >>> read_histograms(Conn(), "r1")  # no table: a store of an older batchtap
        []
    """
    where, params = "run_id = ?", [run_id]
    if kind is not None:
        where, params = where + " AND kind = ?", [*params, kind]
    if layer is not None:
        where, params = where + " AND layer = ?", [*params, layer]
    sql = f"SELECT run_id, kind, layer, step, rank, low, high, counts FROM histograms WHERE {where} ORDER BY kind, layer, step, rank"
    try:
        rows = store.query(sql, tuple(params))
    except Exception as exc:  # noqa: BLE001 - sqlite3 and psycopg spell "no such table" differently
        if "histograms" in str(exc):
            return []
        raise
    return [
        Histogram(r, k, la, int(s), int(rank), lo, hi, tuple(float(c) for c in json.loads(counts)))
        for r, k, la, s, rank, lo, hi, counts in rows
    ]


def histogram_csv_row(h: Histogram) -> list[Any]:
    """One line of an exported histograms CSV: :data:`HISTOGRAM_CSV_COLUMNS`, then the counts."""
    return [h.run_id, h.kind, h.layer, h.step, h.rank, h.low, h.high, *h.counts]
