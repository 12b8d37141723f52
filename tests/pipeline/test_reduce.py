"""The reducer's arithmetic for every reduction kind, rank by rank, against a hand-computed reference.

``tests/pipeline/test_distributed.py`` drives the same code through real gloo groups; here the
network is the one thing left out: each "rank" runs ``Reducer.reduce`` in a thread of its own, and
its collectives meet in-process (an all-reduce sums / maxes every rank's tensor, a gather hands rank
0 every rank's objects), so every kind is checked exactly, quickly and with values chosen to tell
the kinds apart (a mean, a sum, a max and a min of these differ).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

from batchtap.metrics.domain import Output, Reduce
from batchtap.pipeline.chain.reduce import STRAGGLER_FIELDS, Reducer
from batchtap.pipeline.chain.rows import DecodedBlock
from batchtap.records import ALL_RANKS, Event, EventKind, Record
from tests.pipeline._decoded import decoded_from_records

OUTPUTS = (
    Output("loss", reduce=Reduce.MEAN),
    Output("accuracy", reduce=Reduce.MEAN),
    Output("throughput", reduce=Reduce.SUM),
    Output("step_time", reduce=Reduce.MAX),
    Output("grad_norm", reduce=Reduce.MAX),
    Output("shard_norm", reduce=Reduce.L2),
    Output("min_lr", reduce=Reduce.MIN),
)

#: per rank: samples, step time, values, accuracy's kept targets (its MEAN weight)
RANKS = [
    (
        4.0,
        0.25,
        {
            "loss": 1.0,
            "accuracy": 0.5,
            "throughput": 16.0,
            "step_time": 0.25,
            "grad_norm": 3.0,
            "shard_norm": 3.0,
            "min_lr": 0.5,
        },
        2.0,
    ),
    (
        12.0,
        1.0,
        {
            "loss": 3.0,
            "accuracy": 0.25,
            "throughput": 12.0,
            "step_time": 1.0,
            "grad_norm": 1.0,
            "shard_norm": 4.0,
            "min_lr": 0.125,
        },
        8.0,
    ),
    (
        8.0,
        0.5,
        {
            "loss": 2.0,
            "accuracy": 1.0,
            "throughput": 16.0,
            "step_time": 0.5,
            "grad_norm": 2.0,
            "shard_norm": 12.0,
            "min_lr": 0.25,
        },
        6.0,
    ),
]


def _block(
    rank: int, steps: list[int], *, per_rank_rows: bool = False, drop: str | None = None
) -> tuple[Reducer, DecodedBlock, np.ndarray, np.ndarray]:
    samples, step_time, values, kept = RANKS[rank]
    records = [
        Record("run", step, 0, step, rank, 100.0 + step, {k: v for k, v in values.items() if k != drop})
        for step in steps
    ]
    decoded = decoded_from_records(records, [o.name for o in OUTPUTS], weights=[{"accuracy": kept}] * len(steps))
    decoded.events.append(Event("run", steps[0], EventKind.ANOMALY, f"from rank {rank}", 0.0, rank=rank))
    reducer = Reducer(OUTPUTS, group=None, rank=rank, world_size=len(RANKS), per_rank_rows=per_rank_rows)
    n = len(steps)
    return reducer, decoded, np.full(n, samples), np.full(n, step_time)


class _InProcessGroup:
    """The collectives of ``world`` reducers running in threads, met in this process."""

    def __init__(self, world: int) -> None:
        self._barrier = threading.Barrier(world, timeout=30)
        self._slots: list[Any] = [None] * world

    def _all(self, rank: int, value: Any) -> list[Any]:
        self._slots[rank] = value
        self._barrier.wait()
        everyone = list(self._slots)
        self._barrier.wait()  # nobody writes the next round before everyone read this one
        return everyone

    def bind(self, reducer: Reducer) -> None:
        rank = reducer.rank

        def all_reduce(array: np.ndarray, op: Any) -> np.ndarray:
            arrays = self._all(rank, np.array(array, dtype=np.float64))
            return np.sum(arrays, axis=0) if op == dist.ReduceOp.SUM else np.max(arrays, axis=0)

        def gather(objects: list[Any]) -> list[Any] | None:
            everyone = self._all(rank, objects)
            return everyone if rank == 0 else None

        def all_gather(obj: Any) -> list[Any]:
            return self._all(rank, obj)

        reducer._net_all_reduce = all_reduce  # type: ignore[method-assign]
        reducer._net_gather = gather  # type: ignore[method-assign]
        reducer._net_all_gather = all_gather  # type: ignore[method-assign]


def _run(blocks: list[tuple[Reducer, DecodedBlock, np.ndarray, np.ndarray]]) -> list[DecodedBlock]:
    """Every rank's ``reduce()`` of its block, run together as the ranks would."""
    group = _InProcessGroup(len(blocks))
    outs: list[Any] = [None] * len(blocks)

    def one(i: int) -> None:
        reducer, decoded, samples, times = blocks[i]
        group.bind(reducer)
        outs[i] = reducer.reduce(decoded, samples, times)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(blocks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(out is not None for out in outs), "a simulated rank did not finish"
    for reducer, *_ in blocks:
        assert reducer.broken is None, reducer.broken
    return outs


def _reduce(world: int, steps: list[int], **kw: object) -> list[DecodedBlock]:
    """What every rank computes from the same collectives."""
    return _run([_block(rank, steps, **kw) for rank in range(world)])  # type: ignore[arg-type]


def test_every_reduction_kind_matches_its_reference_over_three_uneven_ranks() -> None:
    outs = _reduce(3, [7, 8])
    samples = np.array([r[0] for r in RANKS])
    kept = np.array([r[3] for r in RANKS])

    def col(name: str) -> np.ndarray:
        return np.array([r[2][name] for r in RANKS])

    expected = {
        "loss": float((col("loss") * samples).sum() / samples.sum()),  # 56 / 24, sample-weighted
        "accuracy": float((col("accuracy") * kept).sum() / kept.sum()),  # correct / kept = 9 / 16
        "throughput": 44.0,  # summed: the whole group's samples per second
        "step_time": 1.0,  # the slowest rank's time is the group's
        "grad_norm": 3.0,
        "shard_norm": 13.0,  # sqrt(9 + 16 + 144)
        "min_lr": 0.125,
        "slowest_rank": 1.0,
        "step_time_spread": 4.0,  # 1.0 / 0.25
    }
    assert expected["loss"] == pytest.approx(56 / 24) and expected["accuracy"] == 9 / 16
    for out in outs:  # every rank reaches the same records (rules decide on them everywhere)
        assert [(r.step, r.rank) for r in out.records] == [(7, ALL_RANKS), (8, ALL_RANKS)]
        for record in out.records:
            assert record.values == pytest.approx(expected, rel=1e-12)
            assert set(record.values) == set(expected)
            assert (record.run_id, record.epoch, record.batch, record.wall_time) == (
                "run",
                0,
                record.step,
                100.0 + record.step,
            )
    # events travel to rank 0 alone (it writes); the other ranks keep their own
    assert sorted(e.message for e in outs[0].events) == ["from rank 0", "from rank 1", "from rank 2"]
    assert [[e.message for e in out.events] for out in outs[1:]] == [["from rank 1"], ["from rank 2"]]


def test_the_straggler_is_named_exactly_and_its_spread_is_slowest_over_fastest() -> None:
    # rank 2 is slowest here (0.5 s against 0.25 s): the field is an index, not "the last rank"
    blocks = [_block(0, [3]), _block(2, [3])]  # rank 2's figures, as rank 1 of a group of 2
    blocks[1][0].rank, blocks[1][0].world_size = 1, 2
    blocks[0][0].world_size = 2
    (record,) = _run(blocks)[0].records
    assert record.values["slowest_rank"] == 1.0
    assert record.values["step_time_spread"] == 2.0
    assert record.values["throughput"] == 32.0 and record.values["step_time"] == 0.5


def test_without_a_measured_time_on_some_rank_there_is_no_straggler_view() -> None:
    blocks = [_block(rank, [0]) for rank in range(2)]
    _, _, _, times = blocks[1]
    times[:] = math.nan  # the first step of a run has no start mark
    (record,) = _run(blocks)[0].records
    assert not set(STRAGGLER_FIELDS) & set(record.values)
    assert record.values["throughput"] == 28.0  # the values themselves still reduce


def test_a_value_missing_on_one_rank_reduces_over_the_ranks_that_have_it() -> None:
    blocks = [_block(0, [0]), _block(1, [0], drop="loss")]
    (record,) = _run(blocks)[0].records
    assert record.values["loss"] == 1.0  # rank 0's alone, not diluted by rank 1's 12 samples
    assert record.values["throughput"] == 28.0


def test_per_rank_rows_come_with_the_global_row() -> None:
    outs = _reduce(2, [5], per_rank_rows=True)
    out = outs[0]
    assert sorted(r.rank for r in out.records) == [ALL_RANKS, 0, 1]
    assert [r.rank for r in outs[1].records] == [ALL_RANKS]  # only rank 0 receives the ranks' own rows
    own = {r.rank: r.values for r in out.records if r.rank != ALL_RANKS}
    assert own[0]["throughput"] == 16.0 and own[1]["throughput"] == 12.0


def test_a_zero_fastest_time_gives_an_infinite_spread_not_a_division_error() -> None:
    blocks = [_block(rank, [1]) for rank in range(2)]
    blocks[0][3][:] = 0.0
    (record,) = _run(blocks)[0].records
    assert record.values["step_time_spread"] == math.inf and record.values["slowest_rank"] == 1.0


@pytest.mark.parametrize("steps_of_rank_1", [[7], [7, 9]], ids=["fewer-rows", "other-last-step"])
def test_blocks_that_do_not_line_up_fall_back_to_the_object_exchange_with_the_same_arithmetic(
    steps_of_rank_1: list[int],
) -> None:
    blocks = [_block(0, [7, 8], per_rank_rows=True), _block(1, steps_of_rank_1, per_rank_rows=True)]
    for reducer, *_ in blocks:
        reducer.world_size = 2
    outs = _run(blocks)
    for reducer, *_ in blocks:
        assert reducer.traffic["collectives"] == 2  # the header, then one all_gather_object
    by_step = {r.step: r for r in outs[0].records if r.rank == ALL_RANKS}
    assert sorted(by_step) == sorted({7, 8, *steps_of_rank_1})
    assert by_step[7].values["throughput"] == 28.0  # both ranks: 16 + 12
    assert by_step[8].values["throughput"] == 16.0  # rank 0 alone had step 8
    assert by_step[7].values["loss"] == pytest.approx((1.0 * 4 + 3.0 * 12) / 16)
    # per-rank rows and every rank's events on rank 0 only
    assert sorted(r.rank for r in outs[0].records if r.rank != ALL_RANKS) == [0, 0] + [1] * len(steps_of_rank_1)
    assert all(r.rank == ALL_RANKS for r in outs[1].records)
    assert sorted(e.message for e in outs[0].events) == ["from rank 0", "from rank 1"]
    assert [e.message for e in outs[1].events] == ["from rank 1"]


def test_a_block_with_events_adds_one_gather_of_them() -> None:
    blocks = [_block(rank, [1, 2]) for rank in range(2)]
    for reducer, *_ in blocks:
        reducer.world_size = 2
    _run(blocks)
    assert [reducer.traffic["collectives"] for reducer, *_ in blocks] == [4, 4]  # header, SUM, MAX, gather


def test_a_block_without_events_takes_three_collectives_and_counts_its_payload() -> None:
    blocks = [_block(rank, [1, 2]) for rank in range(2)]
    for reducer, decoded, *_ in blocks:
        decoded.events.clear()
        reducer.world_size = 2
    _run(blocks)
    reducer = blocks[0][0]
    assert reducer.traffic["collectives"] == 3  # header, SUM, MAX: no gather without events
    sums, maxima = reducer._pack(blocks[0][1], blocks[0][2], blocks[0][3])
    assert reducer.traffic["payload_bytes"] == 8 * 8 + sums.nbytes + maxima.nbytes


def test_a_row_of_unknown_size_weighs_one_in_a_mean() -> None:
    blocks = [_block(rank, [0]) for rank in range(2)]
    blocks[0][2][:] = math.nan  # rank 0 knows no sample count (a loss-only loop); rank 1 has 12
    for reducer, *_ in blocks:
        reducer.world_size = 2
    (record,) = _run(blocks)[0].records
    assert record.values["loss"] == pytest.approx((1.0 * 1 + 3.0 * 12) / 13)


def test_a_failed_exchange_keeps_the_ranks_own_rows_and_says_so() -> None:
    reducer, decoded, samples, times = _block(0, [4, 5])

    def broken(array: np.ndarray, op: Any) -> np.ndarray:
        raise RuntimeError("Connection closed by peer")

    reducer._net_all_reduce = broken  # type: ignore[method-assign]
    out = reducer.reduce(decoded, samples, times)
    assert reducer.broken == "RuntimeError: Connection closed by peer"
    assert [(r.step, r.rank) for r in out.records] == [(4, 0), (5, 0)]  # unreduced, nothing lost
    warning = out.events[-1]
    assert warning.kind is EventKind.WARNING and warning.step == 5 and warning.rank == 0
    assert "rank 0: reducing over ranks failed (RuntimeError: Connection closed by peer)" in warning.message
    assert reducer.reduce(decoded, samples, times) is decoded  # never tries the group again


def test_the_fsdp2_grad_norm_kinds_root_sum_square_of_shards_and_already_global() -> None:
    """A gradient norm per shard combines as the root of the summed squares; a norm every rank
    already computed globally (its own collective) is stored as it is, never combined again."""
    outputs = (Output("shard_norm", reduce=Reduce.ROOT_SUM_SQUARE), Output("full_norm", reduce=Reduce.GLOBAL))
    shards = [3.0, 4.0, 12.0]
    blocks = []
    for rank, shard in enumerate(shards):
        records = [Record("run", 5, 0, 5, rank, 105.0, {"shard_norm": shard, "full_norm": 13.0})]
        decoded = decoded_from_records(records, [o.name for o in outputs])
        reducer = Reducer(outputs, group=None, rank=rank, world_size=len(shards), per_rank_rows=False)
        blocks.append((reducer, decoded, np.full(1, 8.0), np.full(1, 0.5)))
    for out in _run(blocks):
        (record,) = out.records
        assert record.values["shard_norm"] == pytest.approx(13.0, rel=1e-12)  # sqrt(9 + 16 + 144)
        assert record.values["full_norm"] == 13.0  # not 3 * 13, not sqrt(3) * 13
