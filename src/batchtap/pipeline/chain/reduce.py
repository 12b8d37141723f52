"""Combine every rank's records of a block into global records with fixed-size collectives.

Runs on the pipeline thread, on a gloo group of batchtap's own, so it never touches the training
thread, the device, or the user's process group (whose collectives DDP issues from the training
thread on NCCL; sharing a group between threads would interleave them differently on different ranks,
and batchtap's traffic stays out of the NCCL stream that carries the gradients).

Per flushed block every rank takes part in:

1. a header ``all_reduce`` (MAX, 8 floats): row count, first and last step, whether any rank has
   events — so every rank knows the blocks line up and which optional exchanges follow;
2. a ``SUM`` and a ``MAX`` ``all_reduce`` of ``rows x (about 2.5 floats per value + 4)``: for each
   value a presence/NaN code and what its reduction needs (the sum of value x weight and of the
   weights for a ``MEAN``, the sum for ``SUM``, of squares for ``L2``, the maximum for ``MAX``, the
   maximum of the negation for ``MIN``); per row the step times' NaN count, maximum, minimum and a
   (time, rank) key for the slowest rank;
3. only when needed, a ``gather_object`` to rank 0: the ranks' events (anomalies, actions — rare),
   and with ``per_rank_rows=True`` every rank's own records.

What a rank sends and receives per flush therefore does not grow with the world size (gloo's
all-reduce moves about ``2 * (w - 1) / w`` times the tensor), and no rank but 0 unpickles another
rank's objects. Every rank computes the same global records from the same reduced tensors, so rules
that run on them take the same decisions everywhere. Values combine by their metric's
:class:`~batchtap.metrics.Reduce`:

* ``MEAN`` — weighted by each rank's samples, or by the count the metric averaged over
  (outputs declared ``weight="metric"``: accuracy's kept targets): global accuracy = total correct / total kept targets,
  exact for uneven per-rank batches and uneven padding;
* ``SUM`` (throughput), ``MAX`` (step time, grad norm, lr), ``MIN``;
* ``L2`` (also named ``ROOT_SUM_SQUARE``) — the root of the summed squares: the global norm of
  gradients sharded over ranks, each rank's value the norm of its shard;
* ``GLOBAL`` — every rank holds the global value already (an FSDP2 gradient norm computed with a
  collective of its own): an alias of ``MAX``, whose maximum of equal values is that value;

a NaN on any rank makes the global value NaN (as the anomaly it is). A global record also carries
the straggler view: ``slowest_rank`` (the lowest rank among those with the longest step time) and
``step_time_spread`` (slowest over fastest rank's step time).

Blocks that do not line up (a different row count or steps on some rank: not expected, as ranks
flush at the same steps) fall back to one ``all_gather_object`` of the ranks' rows, as exact.
If an exchange fails (a rank died; the group's timeout expired), the reducer marks itself broken,
returns this rank's own records unreduced with a warning event, and never tries the group again, so
everything recorded stays stored and nothing waits forever.
"""

from __future__ import annotations

import math
import pickle
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from batchtap.metrics.domain import Output, Reduce
from batchtap.pipeline.chain.rows import DecodedBlock
from batchtap.records import ALL_RANKS, Event, EventKind, Record

__all__ = ["Reducer", "STRAGGLER_FIELDS"]

#: values the reducer adds to each global record
STRAGGLER_FIELDS = ("slowest_rank", "step_time_spread")

#: a value's presence/NaN code: ranks that have it + ranks where it is NaN times this (exact in float64)
_NAN_UNIT = 2**24


class Reducer:
    """Reduces each decoded block over the ranks to global records (see the module docstring).

    Args:
        outputs: every value the layout reports, in column order (same on all ranks).
        group: the gloo process group reserved for this reducer.
        rank: this process's rank in ``group``.
        world_size: ranks in ``group``.
        per_rank_rows: also return every rank's own records (``rank`` column set), on rank 0.

    Attributes:
        traffic: what this rank handed to collectives so far: ``flushes``, ``collectives`` and
            ``payload_bytes`` (tensor bytes plus pickled objects sent; what bench/distributed.py
            reports beside the socket bytes it measures).
    """

    def __init__(
        self, outputs: Sequence[Output], *, group: Any, rank: int, world_size: int, per_rank_rows: bool
    ) -> None:
        self.outputs = tuple(outputs)
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.per_rank_rows = per_rank_rows
        self.broken: str | None = None
        self.traffic = {"flushes": 0, "collectives": 0, "payload_bytes": 0}
        kinds = [o.reduce for o in self.outputs]
        v = len(kinds)
        self._mean = np.array([k is Reduce.MEAN for k in kinds], dtype=bool)
        self._l2 = np.array([k is Reduce.L2 for k in kinds], dtype=bool)
        summed = np.array([k in (Reduce.MEAN, Reduce.SUM, Reduce.L2) for k in kinds], dtype=bool)
        extreme = ~summed  # MAX (and GLOBAL, its alias) and MIN
        # Columns of the SUM tensor: a presence/NaN code per value, a sum per summed value, a weight
        # sum per MEAN, the step time's NaN count. Of the MAX tensor: the value (MAX) or its
        # negation (MIN) per extreme value, then step time, its negation and the slowest-rank key.
        self._s1_of = np.flatnonzero(summed)  # value index of each s1 column
        self._s2_of = np.flatnonzero(self._mean)
        self._ext_of = np.flatnonzero(extreme)
        self._neg = np.array([kinds[j] is Reduce.MIN for j in self._ext_of], dtype=bool)
        self._sum_width = v + len(self._s1_of) + len(self._s2_of) + 1
        self._max_width = len(self._ext_of) + 3
        # value index -> its column, for the values that have one
        self._s1_col = {int(j): v + i for i, j in enumerate(self._s1_of)}
        self._s2_col = {int(j): v + len(self._s1_of) + i for i, j in enumerate(self._s2_of)}
        self._ext_col = {int(j): i for i, j in enumerate(self._ext_of)}

    def reduce(self, block: DecodedBlock, samples: np.ndarray, step_time: np.ndarray) -> DecodedBlock:
        """The global rows (plus, on rank 0, every rank's own records in ``extra`` when asked) and,
        on rank 0, every rank's events."""
        if self.broken is not None:
            return block
        try:
            self.traffic["flushes"] += 1
            return self._exchange(block, samples, step_time)
        except Exception as exc:  # a dead peer, a timeout: degrade, never hang or lose local rows
            self.broken = f"{type(exc).__name__}: {exc}"
            if len(block):
                block.events.append(
                    Event(
                        block.run_id,
                        block.steps[-1],
                        EventKind.WARNING,
                        f"rank {self.rank}: reducing over ranks failed ({self.broken}); storing this rank's "
                        "rows unreduced from here on",
                        time.time(),
                        rank=self.rank,
                    )
                )
            return block

    @property
    def names(self) -> tuple[str, ...]:
        """The value names of a global row: every output, then the straggler fields (several ranks)."""
        straggler = STRAGGLER_FIELDS if self.world_size > 1 else ()
        return tuple(o.name for o in self.outputs) + straggler

    # ----------------------------------------------------------------- the fixed-size exchange

    def _exchange(self, block: DecodedBlock, samples: np.ndarray, step_time: np.ndarray) -> DecodedBlock:
        dist = _dist()
        n = len(block)
        first, last = (block.steps[0], block.steps[-1]) if n else (-1, -1)
        header = self._all_reduce(
            np.array([n, -n, first, -first, last, -last, float(bool(block.events)), 0.0]), dist.ReduceOp.MAX
        )
        if header[0] != -header[1] or header[2] != -header[3] or header[4] != -header[5]:
            return self._exchange_objects(block, samples, step_time)  # blocks do not line up
        if n:
            sums, maxima = self._pack(block, samples, step_time)
            sums = self._all_reduce(sums, dist.ReduceOp.SUM)
            maxima = self._all_reduce(maxima, dist.ReduceOp.MAX)
            values, present = self._global_values(sums, maxima)
        else:
            values, present = np.zeros((0, len(self.names))), np.zeros((0, len(self.names)), dtype=bool)
        if header[6] > 0:  # some rank has events: rank 0 gathers them (rare)
            gathered = self._gather(block.events)
            events = [e for events in gathered for e in events] if gathered is not None else list(block.events)
        else:
            events = list(block.events)
        extra: list[Record] = []
        if self.per_rank_rows:
            gathered_rows = self._gather(block.records)
            if gathered_rows is not None:
                extra = [r for rows in gathered_rows for r in rows]
        return DecodedBlock(
            block.run_id,
            ALL_RANKS,
            self.names,
            values,
            present,
            block.steps,
            block.epochs,
            block.batches,
            block.walls,
            events=events,
            input_errors=block.input_errors,
            extra=extra,
        )

    def _columns(self, block: DecodedBlock) -> list[int]:
        """Where each of the reducer's outputs sits among the block's columns."""
        if block.names[: len(self.outputs)] == tuple(o.name for o in self.outputs):
            return list(range(len(self.outputs)))
        where = {name: j for j, name in enumerate(block.names)}
        return [where.get(o.name, -1) for o in self.outputs]

    def _pack(self, block: DecodedBlock, samples: np.ndarray, step_time: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """This rank's share of the SUM and MAX tensors, one row per block row (columns: see __init__).

        A value's code is ``present + NaN * 2**24`` (ranks that have it, ranks where it is NaN);
        its sum is value x weight (MEAN), value (SUM) or value squared (L2) over the ranks where it
        is a number. The slowest-rank key is ``time_ns * 2**16 + (2**16 - 1 - rank)``.
        """
        n, v = len(block), len(self.outputs)
        columns = self._columns(block)
        if columns == list(range(v)) and block.values.shape[1] == v:
            values, present = block.values, block.present
            weights = block.weights if block.weights is not None else np.full((n, v), np.nan)
        else:  # a value the block does not have is absent on this rank
            take = np.array([max(c, 0) for c in columns], dtype=np.intp)
            has = np.array([c >= 0 for c in columns], dtype=bool)
            values = np.where(has, block.values[:, take], np.nan) if n else np.zeros((0, v))
            present = (block.present[:, take] & has) if n else np.zeros((0, v), dtype=bool)
            weights = np.full((n, v), np.nan)
            if block.weights is not None and n:
                weights = np.where(has, block.weights[:, take], np.nan)
        rows_samples = np.where(np.isnan(samples[:n]), 1.0, samples[:n])
        # a MEAN averages over its own count where the metric gives one (kept targets), else samples
        w = np.where(np.isnan(weights), rows_samples[:, None], weights)
        nan = present & np.isnan(values)
        counted = present & ~nan
        finite = np.where(counted, values, 0.0)
        s1 = np.where(self._mean, finite * w, np.where(self._l2, finite * finite, finite))
        sums = np.zeros((n, self._sum_width))
        sums[:, :v] = present + nan * _NAN_UNIT
        sums[:, v : v + len(self._s1_of)] = s1[:, self._s1_of]
        sums[:, v + len(self._s1_of) : -1] = np.where(counted, w, 0.0)[:, self._s2_of]
        times = step_time[:n]
        known = ~np.isnan(times)
        sums[:, -1] = ~known
        maxima = np.full((n, self._max_width), -np.inf)
        extremes = np.where(counted, values, np.nan)[:, self._ext_of]
        extremes = np.where(self._neg, -extremes, extremes)
        maxima[:, : len(self._ext_of)] = np.where(np.isnan(extremes), -np.inf, extremes)
        maxima[:, -3] = np.where(known, times, -np.inf)
        maxima[:, -2] = np.where(known, -times, -np.inf)
        # Ties go to the lowest rank, as np.argmax would; nanosecond resolution is far finer than
        # step times differ (a 2**16-rank key leaves 2**37 ns, 137 s, of exact float64 room).
        nanos = np.round(np.where(known, times, 0.0) * 1e9)
        maxima[:, -1] = np.where(known, nanos * 65536.0 + (65535 - self.rank), -np.inf)
        return sums, maxima

    def _global_values(self, sums: np.ndarray, maxima: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The global rows' values and presence (``[n, len(names)]``) from the reduced tensors."""
        n, v = sums.shape[0], len(self.outputs)
        codes = sums[:, :v].astype(np.int64)
        nans, counts = codes // _NAN_UNIT, codes % _NAN_UNIT
        values = np.full((n, len(self.names)), math.nan)
        present = np.zeros((n, len(self.names)), dtype=bool)
        present[:, :v] = counts > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            for j, output in enumerate(self.outputs):
                if output.reduce is Reduce.MEAN:
                    weight = sums[:, self._s2_col[j]]
                    values[:, j] = np.where(weight != 0, sums[:, self._s1_col[j]] / weight, math.nan)
                elif output.reduce is Reduce.SUM:
                    values[:, j] = sums[:, self._s1_col[j]]
                elif output.reduce is Reduce.L2:
                    values[:, j] = np.sqrt(sums[:, self._s1_col[j]])
                elif output.reduce is Reduce.MAX:
                    values[:, j] = maxima[:, self._ext_col[j]]
                else:
                    values[:, j] = -maxima[:, self._ext_col[j]]
            values[:, :v][nans > 0] = math.nan
            if self.world_size > 1:  # where every rank measured the step's time
                timed = sums[:, -1] == 0
                slowest, fastest = maxima[:, -3], -maxima[:, -2]
                values[:, v] = 65535 - maxima[:, -1].astype(np.int64) % 65536
                values[:, v + 1] = np.where(fastest > 0, slowest / fastest, math.inf)
                present[:, v : v + 2] = timed[:, None]
        return values, present

    # Each collective is counted here and carried out by a ``_net_*`` method: the network part, the
    # one thing tests replace to run several ranks' reducers in one process.

    def _all_reduce(self, array: np.ndarray, op: Any) -> np.ndarray:
        array = np.ascontiguousarray(array, dtype=np.float64)
        self.traffic["collectives"] += 1
        self.traffic["payload_bytes"] += array.nbytes
        return self._net_all_reduce(array, op)

    def _gather(self, objects: list[Any]) -> list[Any] | None:
        """Every rank's ``objects`` on rank 0 (None elsewhere)."""
        self.traffic["collectives"] += 1
        self.traffic["payload_bytes"] += len(pickle.dumps(objects))
        return self._net_gather(objects)

    def _all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, on every rank (the fallback's one collective)."""
        self.traffic["collectives"] += 1
        self.traffic["payload_bytes"] += len(pickle.dumps(obj))
        return self._net_all_gather(obj)

    def _net_all_reduce(self, array: np.ndarray, op: Any) -> np.ndarray:
        import torch

        tensor = torch.from_numpy(array)
        _dist().all_reduce(tensor, op=op, group=self.group)
        return tensor.numpy()

    def _net_gather(self, objects: list[Any]) -> list[Any] | None:
        dist = _dist()
        received: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(objects, received, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return received

    def _net_all_gather(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        _dist().all_gather_object(gathered, obj, group=self.group)
        return gathered

    # ----------------------------------------------------------------- the fallback: whole rows

    def _exchange_objects(self, block: DecodedBlock, samples: np.ndarray, step_time: np.ndarray) -> DecodedBlock:
        """Blocks that do not line up: one ``all_gather_object`` of every rank's rows, reduced by step
        with the same packing (each row's SUM and MAX parts combined on the host)."""
        sums, maxima = self._pack(block, samples, step_time)
        positions = list(zip(block.steps, block.epochs, block.batches, block.walls))
        own = block.records if self.per_rank_rows else []
        gathered = self._all_gather((sums, maxima, positions, own, block.events))
        events = [e for *_, events in gathered for e in events] if self.rank == 0 else list(block.events)
        by_step: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        where: dict[int, tuple[int, int, int, float]] = {}
        extra: list[Record] = []
        for rank_sums, rank_maxima, rank_positions, records, _ in gathered:
            for i, position in enumerate(rank_positions):
                by_step.setdefault(position[0], []).append((rank_sums[i], rank_maxima[i]))
                where.setdefault(position[0], position)
            if self.per_rank_rows and self.rank == 0:
                extra.extend(records)
        steps = sorted(by_step)
        total = np.array([np.sum([s for s, _ in by_step[step]], axis=0) for step in steps]).reshape(
            len(steps), self._sum_width
        )
        top = np.array([np.max([m for _, m in by_step[step]], axis=0) for step in steps]).reshape(
            len(steps), self._max_width
        )
        values, present = self._global_values(total, top)
        return DecodedBlock(
            block.run_id,
            ALL_RANKS,
            self.names,
            values,
            present,
            steps,
            [where[step][1] for step in steps],
            [where[step][2] for step in steps],
            [where[step][3] for step in steps],
            events=events,
            input_errors=block.input_errors,
            extra=extra,
        )


def new_group(timeout_s: float) -> Any:
    """A gloo group over every rank of the default group (a collective call: all ranks, same order)."""
    return _dist().new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def _dist() -> Any:
    """``torch.distributed``, loaded by the first exchange: a pipeline process outside a process
    group never loads torch."""
    import torch.distributed as dist

    return dist
