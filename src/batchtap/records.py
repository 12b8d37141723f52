"""Host-side data model: what the pipeline hands to rules and sinks.

Everything here is plain Python (floats, ints, strings): a sink or a rule never sees a tensor.

* :class:`Record` — one captured training step: where it is (run, step, epoch, batch, rank, wall
  time) and one float per metric.
* :class:`Event` — something that happened at a step: an anomaly (a value outside its metric's
  domain, with the raw value kept), an action a rule took, or a warning.
* :class:`RunInfo` — a run's identity and metadata, sent to sinks when the run starts and ends.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["ALL_RANKS", "Record", "Event", "EventKind", "RunInfo", "RunStatus"]

#: ``Record.rank`` of a record reduced over every rank of a process group.
ALL_RANKS = -1


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    """One captured training step, decoded and validated on the host.

    Attributes:
        run_id: id of the run the step belongs to.
        step: global step, counted from 0 over the whole run (every ``Tap.step()`` call counts,
            sampled or not).
        epoch: epoch given to ``Tap.watch()`` (0 when no loader is watched).
        batch: index of the batch within its epoch.
        rank: process rank, or :data:`ALL_RANKS` for a record reduced over all ranks.
        wall_time: ``time.time()`` when ``Tap.step()`` was called for this step.
        values: metric name -> float. A value that failed validation is ``nan`` here; its raw value
            is kept in an anomaly :class:`Event`.
        sparse: a value logged with ``Tap.log()`` (evaluation, epoch-level) rather than a captured
            training step: it holds only the names logged together, at the step they refer to.

    Example:
        >>> r = Record("r1", step=3, epoch=0, batch=3, rank=0, wall_time=0.0, values={"loss": 0.5})
        >>> r.values["loss"]
        0.5
    """

    run_id: str
    step: int
    epoch: int
    batch: int
    rank: int
    wall_time: float
    values: Mapping[str, float]
    sparse: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A flat JSON-friendly dict: the position fields followed by the metric values."""
        out: dict[str, Any] = {
            "run_id": self.run_id,
            "step": self.step,
            "epoch": self.epoch,
            "batch": self.batch,
            "rank": self.rank,
            "wall_time": self.wall_time,
        }
        if self.sparse:
            out["sparse"] = True
        out.update(self.values)
        return out


class EventKind(str, enum.Enum):
    """What an :class:`Event` reports."""

    ANOMALY = "anomaly"  #: a value outside its metric's domain (NaN, inf, accuracy > 1, ...)
    ACTION = "action"  #: something a rule did (stop, rollback, batch-size change, ...)
    WARNING = "warning"  #: the library itself had to degrade (a sink failed, the queue blocked, ...)
    SKIP = "skip"  #: the optimizer skipped the step (AMP GradScaler found inf/NaN gradients): expected, not an anomaly


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    """Something that happened at a step.

    Attributes:
        run_id: id of the run.
        step: global step the event refers to.
        kind: anomaly, action or warning.
        message: human-readable explanation, naming what was expected and what arrived.
        wall_time: ``time.time()`` of the step (or of the event when it has no step of its own).
        metric: the metric concerned, if any.
        raw_value: the offending value as captured (for anomalies), before it was replaced by NaN.
        rank: process rank, or :data:`ALL_RANKS`.
    """

    run_id: str
    step: int
    kind: EventKind
    message: str
    wall_time: float
    metric: str | None = None
    raw_value: float | None = None
    rank: int = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (``raw_value`` NaN/inf become the strings ``"nan"``/``"inf"``)."""
        raw: float | str | None = self.raw_value
        if self.raw_value is not None and not math.isfinite(self.raw_value):
            raw = repr(self.raw_value)
        return {
            "run_id": self.run_id,
            "step": self.step,
            "kind": self.kind.value,
            "metric": self.metric,
            "raw_value": raw,
            "message": self.message,
            "wall_time": self.wall_time,
            "rank": self.rank,
        }


class RunStatus(str, enum.Enum):
    """Life-cycle state of a run."""

    RUNNING = "running"
    FINISHED = "finished"  #: the ``run()`` block ended normally
    FAILED = "failed"  #: an exception left the ``run()`` block
    STOPPED = "stopped"  #: a stop rule, KeyboardInterrupt or SIGTERM ended it
    KILLED = "killed"  #: the training process died without ending it (stored by the pipeline process)


@dataclasses.dataclass(slots=True)
class RunInfo:
    """A run's identity and metadata.

    Sinks receive it in ``start_run`` (status RUNNING) and again in ``end_run`` with ``status``,
    ``ended_at`` and ``stop_reason`` filled in.

    Attributes:
        id: unique id (hex string).
        name: user-given name (several runs may share one).
        config: user-given JSON-serialisable configuration.
        started_at: ``time.time()`` at the start of the run.
        status: current status.
        ended_at: ``time.time()`` at the end of the run, if it ended.
        stop_reason: why it stopped or failed, if it did.
        world_size: number of processes in the process group (1 without one).
        environment: host, pid, Python/torch/CUDA/cuDNN versions, git commit, device.
        metrics: names of the metric values the run records, in column order.
    """

    id: str
    name: str
    config: dict[str, Any]
    started_at: float
    status: RunStatus = RunStatus.RUNNING
    ended_at: float | None = None
    stop_reason: str | None = None
    world_size: int = 1
    environment: dict[str, Any] = dataclasses.field(default_factory=dict)
    metrics: tuple[str, ...] = ()
