"""A block of decoded rows as arrays, and the records made from them once.

The decoder (:mod:`batchtap.pipeline.chain.decode`) fills a :class:`DecodedBlock`; the cross-rank reducer
(:mod:`batchtap.pipeline.chain.reduce`) reads its arrays and returns another; :attr:`DecodedBlock.records`
turns the arrays into :class:`~batchtap.records.Record` objects once, for the rules and the sinks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from batchtap.records import Event, Record, step_records

__all__ = ["DecodedBlock"]


class DecodedBlock:
    """One block of a run's rows, decoded and validated, as arrays until records are asked for.

    The decoder fills it; the cross-rank reducer reads its arrays and returns another; records are
    built once, by :attr:`records`, for the rules and the sinks.

    Attributes:
        run_id: the run.
        rank: the rank the rows come from (``ALL_RANKS`` after reduction).
        names: value names, one per column.
        values: ``[n, len(names)]`` float64; NaN for a value that failed validation.
        present: ``[n, len(names)]`` bool: the row has the value (False: left out of its record).
        weights: ``[n, len(names)]`` float64, what each ``MEAN`` value averages over where that is
            not the step's samples (NaN: the samples), or None when nobody asked for weights.
        steps, epochs, batches, walls: the rows' positions and wall times.
        events: anomalies, warnings, skips and held training-side events, in row order.
        input_errors: messages of inputs only the values showed to be invalid.
        extra: records that travel with the block as they are, ahead of its own (every rank's own
            rows, gathered by the reducer with ``per_rank_rows``).
    """

    __slots__ = (
        "run_id",
        "rank",
        "names",
        "values",
        "present",
        "weights",
        "steps",
        "epochs",
        "batches",
        "walls",
        "events",
        "input_errors",
        "extra",
        "_records",
    )

    def __init__(
        self,
        run_id: str,
        rank: int,
        names: Sequence[str],
        values: np.ndarray,
        present: np.ndarray,
        steps: Sequence[int],
        epochs: Sequence[int],
        batches: Sequence[int],
        walls: Sequence[float],
        *,
        weights: np.ndarray | None = None,
        events: list[Event] | None = None,
        input_errors: list[str] | None = None,
        extra: list[Record] | None = None,
    ) -> None:
        self.run_id = run_id
        self.rank = rank
        self.names = tuple(names)
        self.values = values
        self.present = present
        self.weights = weights
        self.steps, self.epochs, self.batches, self.walls = list(steps), list(epochs), list(batches), list(walls)
        self.events: list[Event] = events if events is not None else []
        self.input_errors: list[str] = input_errors if input_errors is not None else []
        self.extra: list[Record] = extra if extra is not None else []
        self._records: list[Record] | None = None

    @classmethod
    def empty(cls, run_id: str, rank: int, names: Sequence[str]) -> DecodedBlock:
        width = len(names)
        return cls(run_id, rank, names, np.zeros((0, width)), np.zeros((0, width), dtype=bool), [], [], [], [])

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def records(self) -> list[Record]:
        """:attr:`extra`, then the block's own records (made once). A column no row has (data wait
        without a watched loader) appears in none; NaN values are the one ``math.nan`` object, as a
        row-by-row decode stores them (records then compare equal wherever their NaNs sit)."""
        if self._records is None:
            self._records = self.extra + self._make_records()
        return self._records

    def _make_records(self) -> list[Record]:
        if not self.steps:
            return []
        values, present, names = self.values, self.present, list(self.names)
        somewhere = present.any(axis=0)
        if not somewhere.all():
            keep = np.flatnonzero(somewhere)
            values, present, names = values[:, keep], present[:, keep], [names[k] for k in keep.tolist()]
        table = values.tolist()
        for i, j in zip(*np.nonzero(np.isnan(values))):
            table[i][j] = math.nan
        if present.all():
            rows = [dict(zip(names, row)) for row in table]
        else:
            rows = [
                {name: v for name, v, p in zip(names, row, flags) if p} for row, flags in zip(table, present.tolist())
            ]
        return step_records(self.run_id, self.rank, self.steps, self.epochs, self.batches, self.walls, rows)
