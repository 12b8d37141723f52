"""The reducer's fixed-size packing, checked without a process group: each simulated rank packs
its rows, the ranks' tensors are summed / maxed as all_reduce would, and the global records are
compared with a plain per-kind reference computed from the ranks' values (the real collectives
run in tests/pipeline/test_distributed.py)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from batchtap.metrics.domain import Reduce
from batchtap.pipeline.chain.reduce import Reducer
from batchtap.pipeline.chain.rows import DecodedBlock
from batchtap.records import ALL_RANKS, Record
from tests.pipeline._decoded import decoded_from_records
from tests.pipeline.test_reduce import OUTPUTS  # one of each reduction kind


def _rank_block(rank: int, rows: list[dict], world: int) -> tuple[Reducer, DecodedBlock, np.ndarray, np.ndarray]:
    reducer = Reducer(OUTPUTS, group=None, rank=rank, world_size=world, per_rank_rows=False)
    records = [Record("run", i, 0, i, rank, 0.0, row["values"]) for i, row in enumerate(rows)]
    decoded = decoded_from_records(records, [o.name for o in OUTPUTS], weights=[row.get("weights", {}) for row in rows])
    samples = np.array([row["samples"] for row in rows], dtype=float)
    times = np.array([row["time"] for row in rows], dtype=float)
    return reducer, decoded, samples, times


def _reduce(ranks: list[list[dict]]) -> list[Record]:
    world = len(ranks)
    packed = []
    for rank, rows in enumerate(ranks):
        reducer, decoded, samples, times = _rank_block(rank, rows, world)
        packed.append(reducer._pack(decoded, samples, times))
    sums = np.sum([s for s, _ in packed], axis=0)  # what all_reduce(SUM) gives every rank
    maxima = np.max([m for _, m in packed], axis=0)  # ... and all_reduce(MAX)
    reducer0, decoded0, _, _ = _rank_block(0, ranks[0], world)
    values, present = reducer0._global_values(sums, maxima)
    names = reducer0.names
    return [
        Record(
            "run",
            r.step,
            r.epoch,
            r.batch,
            ALL_RANKS,
            r.wall_time,
            {n: float(v) for n, v, p in zip(names, row, flags) if p},
        )
        for r, row, flags in zip(decoded0.records, values.tolist(), present.tolist())
    ]


def _reference(ranks: list[list[dict]], i: int) -> dict[str, float]:
    rows = [rows[i] for rows in ranks]
    out: dict[str, float] = {}
    for o in OUTPUTS:
        have = [
            (r["values"][o.name], r.get("weights", {}).get(o.name, r["samples"])) for r in rows if o.name in r["values"]
        ]
        if not have:
            continue
        vals = [v for v, _ in have]
        if any(math.isnan(v) for v in vals):
            out[o.name] = math.nan
        elif o.reduce is Reduce.MEAN:
            out[o.name] = sum(v * w for v, w in have) / sum(w for _, w in have)
        elif o.reduce is Reduce.SUM:
            out[o.name] = sum(vals)
        elif o.reduce is Reduce.L2:
            out[o.name] = math.sqrt(sum(v * v for v in vals))
        elif o.reduce is Reduce.MAX:
            out[o.name] = max(vals)
        else:
            out[o.name] = min(vals)
    times = [r["time"] for r in rows]
    if len(rows) > 1 and not any(math.isnan(t) for t in times):
        out["slowest_rank"] = float(times.index(max(times)))  # the first (lowest) rank on ties
        out["step_time_spread"] = max(times) / min(times)
    return out


@pytest.mark.parametrize("world", [2, 3, 7, 16])
def test_every_reduction_kind_equals_the_plain_reference(world: int) -> None:
    rnd = random.Random(world)
    ranks = []
    for rank in range(world):
        rows = []
        for i in range(30):
            values = {o.name: rnd.uniform(-3, 3) for o in OUTPUTS if rnd.random() > 0.15}  # some absent
            if i == 4 and rank == world - 1:
                values["loss"] = math.nan  # a NaN on one rank makes the global value NaN
            row = {"values": values, "samples": float(rnd.randint(1, 64)), "time": rnd.choice([0.01, 0.02, 0.03])}
            if "accuracy" in values:
                row["weights"] = {"accuracy": float(rnd.randint(0, 500))}  # kept targets, 0 included
            if i == 7:
                row["time"] = math.nan  # a rank without a measured time: no straggler fields
            rows.append(row)
        ranks.append(rows)
    reduced = _reduce(ranks)
    for i, record in enumerate(reduced):
        expected = _reference(ranks, i)
        assert set(record.values) == set(expected), i
        for name, value in expected.items():
            got = record.values[name]
            if math.isnan(value):
                assert math.isnan(got), (i, name)
            elif name == "accuracy" and not sum(
                r[i].get("weights", {}).get("accuracy", 0) for r in ranks if "accuracy" in r[i]["values"]
            ):
                assert math.isnan(got)
            else:
                assert got == pytest.approx(value, rel=1e-12, abs=1e-12), (i, name)


def test_slowest_rank_on_a_tie_is_the_lowest_and_max_min_are_exact() -> None:
    ranks = [
        [{"values": {"step_time": 0.25, "min_lr": -1e-300}, "samples": 1.0, "time": 0.5}],
        [{"values": {"step_time": 0.5, "min_lr": 2.0}, "samples": 1.0, "time": 0.75}],
        [{"values": {"step_time": 0.125, "min_lr": 3.0}, "samples": 1.0, "time": 0.75}],
    ]
    (record,) = _reduce(ranks)
    assert record.values["slowest_rank"] == 1.0  # ranks 1 and 2 tie: the lower wins
    assert record.values["step_time_spread"] == 1.5
    assert record.values["step_time"] == 0.5 and record.values["min_lr"] == -1e-300


def test_the_packed_width_does_not_depend_on_the_world_size() -> None:
    row = [{"values": {o.name: 1.0 for o in OUTPUTS}, "samples": 4.0, "time": 0.1}] * 50
    widths = set()
    for world in (2, 16, 1000):
        reducer, decoded, samples, times = _rank_block(0, row, world)
        sums, maxima = reducer._pack(decoded, samples, times)
        widths.add((sums.nbytes, maxima.nbytes))
    assert len(widths) == 1
