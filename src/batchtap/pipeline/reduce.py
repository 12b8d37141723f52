"""Combine every rank's records of a block into global records: one collective per flush.

Runs on the pipeline thread, on a gloo group of batchtap's own, so it never touches the training
thread, the device, or the user's process group (whose collectives DDP issues from the training
thread; sharing a group between threads would interleave them differently on different ranks).

Each rank packs its decoded block — per row: samples, step time, then every value with a presence
bit — and its anomaly events, and the ranks exchange them with one ``all_gather_object``. Every rank
then computes the same global records from the same data, so rules that run on them take the same
decisions everywhere. Values combine by their metric's :class:`~batchtap.metrics.Reduce`:

* ``MEAN`` — weighted by each rank's samples, or by the count the metric averaged over
  (``Metric.weight``: accuracy's kept targets): global accuracy = total correct / total kept targets,
  exact for uneven per-rank batches and uneven padding;
* ``SUM`` (throughput), ``MAX`` (step time, grad norm, lr), ``MIN``;
* ``L2`` — the root of the summed squares: the global norm of gradients sharded over ranks.

A global record also carries the straggler view: ``slowest_rank``, and ``step_time_spread`` (slowest
over fastest rank's step time).

If the exchange fails (a rank died; the group's timeout expired), the reducer marks itself broken,
returns this rank's own records unreduced with a warning event, and never tries the group again, so
everything recorded stays stored and nothing waits forever.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch.distributed as dist

from batchtap.metrics.domain import Output, Reduce
from batchtap.pipeline.decode import Decoded
from batchtap.records import ALL_RANKS, Event, EventKind, Record

__all__ = ["Reducer", "STRAGGLER_FIELDS"]

#: values the reducer adds to each global record
STRAGGLER_FIELDS = ("slowest_rank", "step_time_spread")


class Reducer:
    """All-gathers each decoded block and reduces it to global records.

    Args:
        outputs: every value the layout reports, in column order (same on all ranks).
        group: the gloo process group reserved for this reducer.
        rank: this process's rank in ``group``.
        world_size: ranks in ``group``.
        per_rank_rows: also return every rank's own records (``rank`` column set).
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

    def reduce(self, decoded: Decoded, samples: np.ndarray, step_time: np.ndarray) -> Decoded:
        """Global records (plus per-rank rows when asked) and every rank's events."""
        if self.broken is not None:
            return decoded
        local = self._pack(decoded, samples, step_time)
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, (local, decoded.records, decoded.events), group=self.group)
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
        return self._combine(decoded, gathered)

    def _pack(self, decoded: Decoded, samples: np.ndarray, step_time: np.ndarray) -> np.ndarray:
        n, v = len(decoded.records), len(self.outputs)
        packed = np.full((n, 3 + 3 * v), math.nan)
        packed[:, 1] = samples
        packed[:, 2] = step_time
        weights = decoded.weights if len(decoded.weights) == n else [{}] * n
        for i, record in enumerate(decoded.records):
            packed[i, 0] = record.step
            for j, output in enumerate(self.outputs):
                value = record.values.get(output.name)
                if value is not None:
                    packed[i, 3 + 2 * j] = value
                    packed[i, 4 + 2 * j] = 1.0
                    packed[i, 3 + 2 * v + j] = weights[i].get(output.name, math.nan)
        return packed

    def _combine(self, decoded: Decoded, gathered: list[Any]) -> Decoded:
        out = Decoded()
        out.input_errors = decoded.input_errors
        by_step: dict[int, list[tuple[int, np.ndarray]]] = {}
        template: dict[int, Record] = {}
        for rank, (packed, records, events) in enumerate(gathered):
            out.events.extend(events)
            for row, record in zip(packed, records):
                by_step.setdefault(record.step, []).append((rank, row))
                template.setdefault(record.step, record)
                if self.per_rank_rows:
                    out.records.append(record)
        for step in sorted(by_step):
            out.records.append(self._global_record(template[step], by_step[step]))
        return out

    def _global_record(self, like: Record, rows: list[tuple[int, np.ndarray]]) -> Record:
        ranks = np.array([r for r, _ in rows])
        table = np.stack([row for _, row in rows])  # [ranks, 3 + 3V]
        samples = np.where(np.isnan(table[:, 1]), 1.0, table[:, 1])
        v = len(self.outputs)
        values: dict[str, float] = {}
        for j, output in enumerate(self.outputs):
            present = table[:, 4 + 2 * j] == 1.0
            if not present.any():
                continue
            # a MEAN averages over its own count where the metric gives one (kept targets), else samples
            own = table[:, 3 + 2 * v + j]
            weights = np.where(np.isnan(own), samples, own)
            column, w = table[present, 3 + 2 * j], weights[present]
            if output.reduce is Reduce.MEAN:
                values[output.name] = float(np.dot(column, w) / w.sum())
            elif output.reduce is Reduce.SUM:
                values[output.name] = float(column.sum())
            elif output.reduce is Reduce.MAX:
                values[output.name] = float(column.max())
            elif output.reduce is Reduce.L2:
                values[output.name] = float(np.sqrt(np.square(column).sum()))
            else:
                values[output.name] = float(column.min())
        times = table[:, 2]
        if not np.isnan(times).any() and len(times) > 1:
            values["slowest_rank"] = float(ranks[int(np.argmax(times))])
            fastest = times.min()
            values["step_time_spread"] = float(times.max() / fastest) if fastest > 0 else math.inf
        return Record(like.run_id, like.step, like.epoch, like.batch, ALL_RANKS, like.wall_time, values)


def new_group(timeout_s: float) -> Any:
    """A gloo group over every rank of the default group (a collective call: all ranks, same order)."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
