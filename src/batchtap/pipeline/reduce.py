"""Combine every rank's records of a block into global records with fixed-size collectives.

Runs on the pipeline thread, on a gloo group of batchtap's own, so it never touches the training
thread, the device, or the user's process group (whose collectives DDP issues from the training
thread on NCCL; sharing a group between threads would interleave them differently on different ranks,
and batchtap's traffic stays out of the NCCL stream that carries the gradients).

Per flushed block every rank takes part in:

1. a header ``all_reduce`` (MAX, 8 floats): row count, first and last step, whether any rank has
   events — so every rank knows the blocks line up and which optional exchanges follow;
2. a ``SUM`` ``all_reduce`` of ``rows x (4 * values + 2)`` floats and a ``MAX`` ``all_reduce`` of
   ``rows x (2 * values + 3)`` floats: for each value its presence and NaN counts and the sums its
   reduction needs, its maximum and the maximum of its negation (the minimum); per row the step
   times' NaN count, maximum, minimum and a (time, rank) key for the slowest rank;
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
        self._mean = np.array([k is Reduce.MEAN for k in kinds])
        self._sum = np.array([k is Reduce.SUM for k in kinds])
        self._l2 = np.array([k is Reduce.L2 for k in kinds])
        self._max = np.array([k is Reduce.MAX for k in kinds])

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
                        r.run_id, r.step, EventKind.WARNING,
                        f"rank {self.rank}: reducing over ranks failed ({self.broken}); storing this rank's "
                        "rows unreduced from here on", time.time(), rank=self.rank,
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
        """This rank's share of the SUM and MAX tensors, one row per record.

        SUM row: per value ``[present, nan, s1, s2]`` (MEAN: value x weight, weight; SUM: value;
        L2: value squared), then the step time's ``[nan, 0]``.
        MAX row: per value ``[value, -value]`` (``-inf`` when absent or NaN), then the step time,
        its negation and the slowest-rank key ``time_ns * 2**16 + (2**16 - 1 - rank)``.
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
        finite = np.where(present & ~nan, values, 0.0)
        counted = present & ~nan
        sums = np.zeros((n, 4 * v + 2))
        sums[:, 0 : 4 * v : 4] = present
        sums[:, 1 : 4 * v : 4] = nan
        s1 = np.where(self._mean, finite * w, np.where(self._l2, finite * finite, finite))
        sums[:, 2 : 4 * v : 4] = np.where(counted, s1, 0.0)
        sums[:, 3 : 4 * v : 4] = np.where(counted & self._mean, w, 0.0)
        times = step_time[:n]
        sums[:, 4 * v] = np.isnan(times)
        maxima = np.full((n, 2 * v + 3), -np.inf)
        maxima[:, 0 : 2 * v : 2] = np.where(counted, values, -np.inf)
        maxima[:, 1 : 2 * v : 2] = np.where(counted, -values, -np.inf)
        known = ~np.isnan(times)
        maxima[:, 2 * v] = np.where(known, times, -np.inf)
        maxima[:, 2 * v + 1] = np.where(known, -times, -np.inf)
        # Ties go to the lowest rank, as np.argmax would; nanosecond resolution is far finer than
        # step times differ (a 2**16-rank key leaves 2**37 ns, 137 s, of exact float64 room).
        nanos = np.round(np.where(known, times, 0.0) * 1e9)
        maxima[:, 2 * v + 2] = np.where(known, nanos * 65536.0 + (65535 - self.rank), -np.inf)
        return sums, maxima

    def _global_record(self, like: Record, sums: np.ndarray, maxima: np.ndarray) -> Record:
        values: dict[str, float] = {}
        for j, output in enumerate(self.outputs):
            count, nans, s1, s2 = sums[4 * j : 4 * j + 4]
            if count == 0:
                continue
            if nans > 0:
                values[output.name] = math.nan
            elif output.reduce is Reduce.MEAN:
                values[output.name] = float(s1 / s2) if s2 else math.nan
            elif output.reduce is Reduce.SUM:
                values[output.name] = float(s1)
            elif output.reduce is Reduce.L2:
                values[output.name] = float(math.sqrt(s1))
            elif output.reduce is Reduce.MAX:
                values[output.name] = float(maxima[2 * j])
            else:
                values[output.name] = float(-maxima[2 * j + 1])
        v = len(self.outputs)
        if self.world_size > 1 and sums[4 * v] == 0:  # every rank measured the step's time
            slowest, fastest = maxima[2 * v], -maxima[2 * v + 1]
            values["slowest_rank"] = float(65535 - int(maxima[2 * v + 2]) % 65536)
            values["step_time_spread"] = float(slowest / fastest) if fastest > 0 else math.inf
        return Record(like.run_id, like.step, like.epoch, like.batch, ALL_RANKS, like.wall_time, values)

    def _all_reduce(self, array: np.ndarray, op: Any) -> np.ndarray:
        tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float64))
        dist.all_reduce(tensor, op=op, group=self.group)
        self.traffic["collectives"] += 1
        self.traffic["payload_bytes"] += tensor.numel() * 8
        return tensor.numpy()

    def _gather(self, objects: list[Any]) -> list[Any] | None:
        """Every rank's ``objects`` on rank 0 (None elsewhere)."""
        received: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(objects, received, dst=dist.get_global_rank(self.group, 0), group=self.group)
        self.traffic["collectives"] += 1
        self.traffic["payload_bytes"] += len(pickle.dumps(objects))
        return received

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
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (local, decoded.records, decoded.events), group=self.group)
        self.traffic["collectives"] += 1
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
