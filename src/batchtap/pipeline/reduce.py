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
  (``Metric.weight``: accuracy's kept targets): global accuracy = total correct / total kept targets,
  exact for uneven per-rank batches and uneven padding;
* ``SUM`` (throughput), ``MAX`` (step time, grad norm, lr), ``MIN``;
* ``L2`` — the root of the summed squares: the global norm of gradients sharded over ranks;

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
import torch
import torch.distributed as dist

from batchtap.metrics.domain import Output, Reduce
from batchtap.pipeline.decode import Decoded
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
        extreme = ~summed  # MAX and MIN
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

    def reduce(self, decoded: Decoded, samples: np.ndarray, step_time: np.ndarray) -> Decoded:
        """Global records (plus, on rank 0, per-rank rows when asked) and, on rank 0, every rank's events."""
        if self.broken is not None:
            return decoded
        try:
            self.traffic["flushes"] += 1
            return self._exchange(decoded, samples, step_time)
        except Exception as exc:  # a dead peer, a timeout: degrade, never hang or lose local rows
            self.broken = f"{type(exc).__name__}: {exc}"
            out = Decoded()
            out.records, out.input_errors = decoded.records, decoded.input_errors
            out.events = list(decoded.events)
            if decoded.records:
                r = decoded.records[-1]
                out.events.append(
                    Event(
                        r.run_id,
                        r.step,
                        EventKind.WARNING,
                        f"rank {self.rank}: reducing over ranks failed ({self.broken}); storing this rank's "
                        "rows unreduced from here on",
                        time.time(),
                        rank=self.rank,
                    )
                )
            return out

    # ----------------------------------------------------------------- the fixed-size exchange

    def _exchange(self, decoded: Decoded, samples: np.ndarray, step_time: np.ndarray) -> Decoded:
        records = decoded.records
        n = len(records)
        first, last = (records[0].step, records[-1].step) if n else (-1, -1)
        header = self._all_reduce(
            np.array([n, -n, first, -first, last, -last, float(bool(decoded.events)), 0.0]), dist.ReduceOp.MAX
        )
        if header[0] != -header[1] or header[2] != -header[3] or header[4] != -header[5]:
            return self._exchange_objects(decoded, samples, step_time)  # blocks do not line up
        out = Decoded()
        out.input_errors = decoded.input_errors
        if n:
            sums, maxima = self._pack(decoded, samples, step_time)
            sums = self._all_reduce(sums, dist.ReduceOp.SUM)
            maxima = self._all_reduce(maxima, dist.ReduceOp.MAX)
            globals_ = [self._global_record(r, sums[i], maxima[i]) for i, r in enumerate(records)]
        else:
            globals_ = []
        if header[6] > 0:  # some rank has events: rank 0 gathers them (rare)
            gathered = self._gather(decoded.events)
            out.events = [e for events in gathered for e in events] if gathered is not None else list(decoded.events)
        else:
            out.events = list(decoded.events)
        if self.per_rank_rows:
            gathered_rows = self._gather(records)
            if gathered_rows is not None:
                out.records.extend(r for rows in gathered_rows for r in rows)
        out.records.extend(globals_)
        return out

    def _pack(self, decoded: Decoded, samples: np.ndarray, step_time: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """This rank's share of the SUM and MAX tensors, one row per record (columns: see __init__).

        A value's code is ``present + NaN * 2**24`` (ranks that have it, ranks where it is NaN);
        its sum is value x weight (MEAN), value (SUM) or value squared (L2) over the ranks where it
        is a number. The slowest-rank key is ``time_ns * 2**16 + (2**16 - 1 - rank)``.
        """
        n, v = len(decoded.records), len(self.outputs)
        values = np.full((n, v), np.nan)
        present = np.zeros((n, v), dtype=bool)
        weights = np.full((n, v), np.nan)
        per_record = decoded.weights if len(decoded.weights) == n else [{}] * n
        for i, record in enumerate(decoded.records):
            for j, output in enumerate(self.outputs):
                value = record.values.get(output.name)
                if value is not None:
                    values[i, j] = value
                    present[i, j] = True
                    weights[i, j] = per_record[i].get(output.name, math.nan)
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

    def _global_record(self, like: Record, sums: np.ndarray, maxima: np.ndarray) -> Record:
        values: dict[str, float] = {}
        for j, output in enumerate(self.outputs):
            nans, count = divmod(int(sums[j]), _NAN_UNIT)
            if count == 0:
                continue
            if nans > 0:
                values[output.name] = math.nan
            elif output.reduce is Reduce.MEAN:
                weight = sums[self._s2_col[j]]
                values[output.name] = float(sums[self._s1_col[j]] / weight) if weight else math.nan
            elif output.reduce is Reduce.SUM:
                values[output.name] = float(sums[self._s1_col[j]])
            elif output.reduce is Reduce.L2:
                values[output.name] = float(math.sqrt(sums[self._s1_col[j]]))
            elif output.reduce is Reduce.MAX:
                values[output.name] = float(maxima[self._ext_col[j]])
            else:
                values[output.name] = float(-maxima[self._ext_col[j]])
        if self.world_size > 1 and sums[-1] == 0:  # every rank measured the step's time
            slowest, fastest = maxima[-3], -maxima[-2]
            values["slowest_rank"] = float(65535 - int(maxima[-1]) % 65536)
            values["step_time_spread"] = float(slowest / fastest) if fastest > 0 else math.inf
        return Record(like.run_id, like.step, like.epoch, like.batch, ALL_RANKS, like.wall_time, values)

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
        tensor = torch.from_numpy(array)
        dist.all_reduce(tensor, op=op, group=self.group)
        return tensor.numpy()

    def _net_gather(self, objects: list[Any]) -> list[Any] | None:
        received: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(objects, received, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return received

    def _net_all_gather(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    # ----------------------------------------------------------------- the fallback: whole rows

    def _exchange_objects(self, decoded: Decoded, samples: np.ndarray, step_time: np.ndarray) -> Decoded:
        """Blocks that do not line up: one ``all_gather_object`` of every rank's rows, reduced by step
        with the same packing (each row's SUM and MAX parts combined on the host)."""
        n = len(decoded.records)
        local = []
        for i, record in enumerate(decoded.records):
            one = Decoded()
            one.records = [record]
            one.weights = [decoded.weights[i]] if len(decoded.weights) == n else []
            local.append(self._pack(one, samples[i : i + 1], step_time[i : i + 1]))
        gathered = self._all_gather((local, decoded.records, decoded.events))
        out = Decoded()
        out.input_errors = decoded.input_errors
        out.events = [e for _, _, events in gathered for e in events] if self.rank == 0 else list(decoded.events)
        by_step: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        template: dict[int, Record] = {}
        for packed, records, _ in gathered:
            for (sums, maxima), record in zip(packed, records):
                by_step.setdefault(record.step, []).append((sums[0], maxima[0]))
                template.setdefault(record.step, record)
                if self.per_rank_rows and self.rank == 0:
                    out.records.append(record)
        for step in sorted(by_step):
            rows = by_step[step]
            total = np.sum([sums for sums, _ in rows], axis=0)
            top = np.max([maxima for _, maxima in rows], axis=0)
            out.records.append(self._global_record(template[step], total, top))
        return out


def new_group(timeout_s: float) -> Any:
    """A gloo group over every rank of the default group (a collective call: all ranks, same order)."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
