"""What the reader gives back: a run (:class:`RunRow`), a point of a series, a metric summed up,
and the rules every reader applies to them (the derived ``killed`` status, which way is best).

Example:
    >>> best_is_max("accuracy"), status_of("running", None, {})[0].value
    (True, 'running')
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, NamedTuple

from batchtap._stale import owner_gone
from batchtap.records import RunStatus

__all__ = [
    "Point",
    "RunRow",
    "MetricSummary",
    "best_is_max",
    "killed_reason",
    "status_of",
    "json_object",
    "run_from_row",
    "RUN_SELECT",
]


class Point(NamedTuple):
    """One value of a metric series.

    Attributes:
        step: global step.
        value: the stored value; ``nan`` for a value that failed validation.
        wall_time: ``time.time()`` of the step.
        epoch: epoch of the step.
        batch: batch index within the epoch.
    """

    step: int
    value: float
    wall_time: float
    epoch: int
    batch: int


@dataclasses.dataclass(frozen=True, slots=True)
class RunRow:
    """A run as stored, with figures derived from its metric rows.

    Attributes:
        id: run id.
        name: run name.
        status: running, finished, failed, stopped or killed. A run stored as ``running`` whose
            training process is certainly gone (recorded on this host, and no process of that pid
            and start time exists: a process-group SIGKILL, which leaves nobody to store its end)
            reads as ``killed``, with a ``stop_reason`` saying so; see :mod:`batchtap._stale`.
        started_at: ``time.time()`` at the start.
        ended_at: ``time.time()`` at the end, if it ended.
        stop_reason: why it stopped or failed.
        config: the run's configuration.
        world_size: processes in the process group.
        environment: host, pid, versions, git commit, device, as recorded.
        metrics: declared metric names, in column order.
        steps: number of distinct steps with at least one stored step value. Here and in the three
            figures below, values logged with ``Tap.log()`` (sparse) do not count: they may name
            any step.
        first_step: smallest step with a stored step value, ``None`` without any.
        last_step: largest step with a stored step value, ``None`` without any.
        last_wall_time: wall time of the latest stored step value, ``None`` without any.
    """

    id: str
    name: str
    status: RunStatus
    started_at: float
    ended_at: float | None
    stop_reason: str | None
    config: dict[str, Any]
    world_size: int
    environment: dict[str, Any]
    metrics: tuple[str, ...]
    steps: int
    first_step: int | None
    last_step: int | None
    last_wall_time: float | None

    @property
    def tags(self) -> tuple[str, ...]:
        """The run's tags (``tap.run(tags=)``, ``batchtap tag``), kept in its environment."""
        tags = self.environment.get("tags")
        return tuple(str(t) for t in tags) if isinstance(tags, list) else ()

    @property
    def notes(self) -> str | None:
        """The run's note (``tap.run(notes=)``, ``batchtap tag --notes``), ``None`` without one."""
        notes = self.environment.get("notes")
        return None if notes is None else str(notes)

    @property
    def duration(self) -> float | None:
        """Seconds from start to end (or to the latest stored value while running)."""
        end = self.ended_at if self.ended_at is not None else self.last_wall_time
        return None if end is None else end - self.started_at


# Step figures come from step values only: the rows of a run's sparse names (few, listed in
# sparse_metrics) are left out by a probe of that small table per row (measured on 10^6 rows in
# SQLite: about +25 % for one run, +50 % for the whole listing, against a scan without it).
RUN_SELECT = (
    "SELECT r.id, r.name, r.status, r.started_at, r.ended_at, r.stop_reason, r.config, r.world_size,"
    " r.environment, r.metric_names, s.steps, s.first_step, s.last_step, s.last_wall_time"
    " FROM runs r LEFT JOIN (SELECT m.run_id AS run_id, COUNT(DISTINCT m.step) AS steps, MIN(m.step) AS first_step,"
    " MAX(m.step) AS last_step, MAX(m.wall_time) AS last_wall_time FROM metrics m WHERE {where}NOT EXISTS"
    " (SELECT 1 FROM sparse_metrics sp WHERE sp.run_id = m.run_id AND sp.metric = m.metric) GROUP BY m.run_id) s"
    " ON s.run_id = r.id"
)


def killed_reason(environment: dict[str, Any]) -> str:
    """The stop reason shown for a run read as ``killed`` (see :attr:`RunRow.status`)."""
    return (
        f"the training process (pid {environment.get('pid')} on {environment.get('host')}) is gone and "
        "never ended the run (killed with its process group, e.g. by SLURM, Kubernetes or the OOM killer); "
        "seen by a later batchtap process"
    )


def status_of(stored: str, reason: str | None, environment: dict[str, Any]) -> tuple[RunStatus, str | None]:
    """A run's status as every reader shows it: the stored one, or ``killed`` for a ``running`` run
    whose training process is certainly gone (the one owner-gone rule, :func:`batchtap._stale.owner_gone`)."""
    try:
        run_status = RunStatus(stored)
    except ValueError:
        run_status = RunStatus.RUNNING
    if run_status is RunStatus.RUNNING and owner_gone(environment):
        return RunStatus.KILLED, killed_reason(environment)
    return run_status, reason


def json_object(text: str | None) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def best_is_max(metric: str) -> bool:
    """Whether larger is better for a metric, judged by its name (accuracy-like, throughput).

    Example:
        >>> best_is_max("val_acc"), best_is_max("loss")
        (True, False)
    """
    name = metric.lower()
    return any(k in name for k in ("acc", "throughput", "f1", "precision", "recall", "auc"))


@dataclasses.dataclass(frozen=True, slots=True)
class MetricSummary:
    """One metric of one run summed up on its kept trajectory (steps a rollback undid left out).

    Attributes:
        metric: the name.
        rank: the rank summed up (``-1``: the rows reduced over ranks).
        count: stored values (NaN included).
        nans: values stored as NaN (they failed validation; the anomaly keeps the raw value).
        last: the value at the latest kept step (``nan`` when it failed validation), ``None`` without any.
        last_step: that step.
        last_wall_time: its wall time.
        min: the smallest finite value, ``None`` without any.
        max: the largest finite value, ``None`` without any.
        higher_is_better: what :attr:`best` picks (:func:`best_is_max`).
    """

    metric: str
    rank: int
    count: int
    nans: int
    last: float | None
    last_step: int | None
    last_wall_time: float | None
    min: float | None
    max: float | None
    higher_is_better: bool

    @property
    def best(self) -> float | None:
        """:attr:`max` when higher is better, else :attr:`min`."""
        return self.max if self.higher_is_better else self.min


def run_from_row(row: tuple[Any, ...]) -> RunRow:
    (rid, name, status, started, ended, reason, config, world, env, metrics, steps, first, last, last_wall) = row
    environment = json_object(env)
    run_status, reason = status_of(status, reason, environment)
    return RunRow(
        id=rid,
        name=name,
        status=run_status,
        started_at=float(started),
        ended_at=None if ended is None else float(ended),
        stop_reason=reason,
        config=json_object(config),
        world_size=int(world),
        environment=environment,
        metrics=tuple(json.loads(metrics)) if metrics else (),
        steps=int(steps or 0),
        first_step=None if first is None else int(first),
        last_step=None if last is None else int(last),
        last_wall_time=None if last_wall is None else float(last_wall),
    )
