"""Decoded blocks built from records, for the reducer's tests (the pipeline makes them with its
decoder, never from records)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from batchtap.pipeline.chain.rows import DecodedBlock
from batchtap.records import Record


def decoded_from_records(
    records: Sequence[Record],
    names: Sequence[str],
    *,
    run_id: str = "",
    rank: int = 0,
    weights: Sequence[Mapping[str, float]] | None = None,
) -> DecodedBlock:
    """The block these records were decoded from; ``weights``: per record, value name -> what its
    MEAN averages over."""
    n, width = len(records), len(names)
    values = np.full((n, width), math.nan)
    present = np.zeros((n, width), dtype=bool)
    weighed = np.full((n, width), math.nan) if weights is not None else None
    for i, record in enumerate(records):
        for j, name in enumerate(names):
            value = record.values.get(name)
            if value is not None:
                values[i, j], present[i, j] = value, True
                if weighed is not None and weights is not None:
                    weighed[i, j] = weights[i].get(name, math.nan)
    if records:
        run_id, rank = records[0].run_id, records[0].rank
    return DecodedBlock(
        run_id,
        rank,
        names,
        values,
        present,
        [r.step for r in records],
        [r.epoch for r in records],
        [r.batch for r in records],
        [r.wall_time for r in records],
        weights=weighed,
    )
