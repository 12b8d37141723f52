"""Host-side data model: what the pipeline hands to rules and sinks, and the one codec that
writes it down.

Everything here is plain Python (floats, ints, strings): a sink or a rule never sees a tensor.

* :class:`Record` — one captured training step: where it is (run, step, epoch, batch, rank, wall
  time) and one float per metric.
* :class:`Event` — something that happened at a step: an anomaly (a value outside its metric's
  domain, with the raw value kept), an action a rule took, or a warning.
* :class:`RunInfo` — a run's identity and metadata, sent to sinks when the run starts and ends.
* :class:`RunStart`, :class:`RunEnd`, :class:`EpochStart` and :class:`Write` — the sink calls
  ``start_run``, ``end_run``, ``start_epoch`` and ``write`` as values, so that a call can be
  stored or sent to another process like a record.

The record codec
----------------
Every object of the union :data:`Message` is written and read by one codec, shared by the JSONL
sink, the ``ResilientSink`` spool and the messages between batchtap's processes:
:func:`to_wire` / :func:`from_wire` turn an object into a JSON-ready dict tagged with a ``"type"``
and back; :func:`dumps` / :func:`loads` into one line of JSON and back. The rules, in one place:

* **Floats.** A finite float is a JSON number with Python's ``repr`` text, the shortest text that
  reads back to the same bits (``-0.0``, subnormals and ``1.7976931348623157e+308`` round-trip
  exactly). NaN and the infinities, for which strict JSON has no number, are the strings
  ``"nan"``, ``"inf"`` and ``"-inf"``; every NaN reads back as the one quiet NaN (its sign and
  payload are not kept). Only the fields that hold floats (metric values, ``wall_time``,
  ``raw_value``, ``started_at``, ``ended_at``) are converted back, and there only those three
  strings are accepted, so a message, a name or a config value ``"nan"`` stays a string.
  :func:`format_float` is the same rule as text, for SQL and CSV cells.
* **Lines** are JSON without spaces, UTF-8 (not ASCII-escaped), one object per line, and strict
  JSON except inside a run's ``config`` and ``environment``: those are written as given (the ``Tap``
  has already turned what JSON cannot hold, non-finite floats included, into text), and a value
  JSON cannot hold at all is written as its ``str()``.
* **Records are flat**: the position fields, then one key per metric, so that a line reads as a
  row. A metric named like a position key (``type``, ``run_id``, ``step``, ``epoch``, ``batch``,
  ``rank``, ``wall_time``, ``sparse``), or whose name starts with ``metric:``, is written under
  ``metric:<name>``; reading strips that prefix once, so every name round-trips.

The types, with their keys in the order they are written:

* ``record`` (:class:`Record`): run_id, step, epoch, batch, rank, wall_time, ``sparse: true``
  (only for a ``Tap.log()`` record), then the metric values.
* ``event`` (:class:`Event`): run_id, step, kind, metric, raw_value, message, wall_time, rank.
* ``run_start`` / ``run_end`` (:class:`RunStart` / :class:`RunEnd`, holding a :class:`RunInfo`):
  run_id, name, status, started_at, ended_at, stop_reason, world_size, config, environment, metrics.
* ``epoch_start`` (:class:`EpochStart`): run_id, epoch, total.
* ``write`` (:class:`Write`): records (a list of record objects), events (a list of event objects).

The codec is on the hot path (every record a JSONL sink writes, every message between processes):
each type is encoded and decoded by a hand-written function, without reflection.

Example:
    >>> r = Record("r1", step=3, epoch=0, batch=3, rank=0, wall_time=1.5, values={"loss": float("nan"), "step": 0.25})
    >>> line = dumps(r)
    >>> line
    '{"type":"record","run_id":"r1","step":3,"epoch":0,"batch":3,"rank":0,"wall_time":1.5,"loss":"nan","metric:step":0.25}'
    >>> loads(line).values
    {'loss': nan, 'step': 0.25}
    >>> end = loads(dumps(RunEnd(RunInfo("r1", "exp", {"lr": 0.1}, 0.0, status=RunStatus.FINISHED))))
    >>> end.run.status, end.run.config
    (<RunStatus.FINISHED: 'finished'>, {'lr': 0.1})
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "METRIC_PREFIX",
    "ALL_RANKS",
    "Record",
    "Event",
    "EventKind",
    "RunInfo",
    "RunStatus",
    "RunStart",
    "RunEnd",
    "EpochStart",
    "Write",
    "Message",
    "to_wire",
    "from_wire",
    "dumps",
    "loads",
    "format_float",
    "parse_float",
]

#: ``Record.rank`` of a record reduced over every rank of a process group.
ALL_RANKS = -1
#: put in front of a metric name wherever it would clash with a field of the row (a JSON line's
#: ``step``, a CSV or Parquet position column, a frame's ``epoch``): ``tap.log({"epoch": 3})``
#: is stored as ``metric:epoch`` there, so neither hides the other
METRIC_PREFIX = "metric:"


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
        """The record's codec form (:func:`to_wire`) without its ``"type"``: the position fields,
        then the metric values (non-finite as ``"nan"``, ``"inf"``, ``"-inf"``)."""
        out = _record_wire(self)
        del out["type"]
        return out


#: each field's slot setter, in field order (a frozen dataclass's own __setattr__ refuses)
_RECORD_SETTERS: tuple[Callable[[Any, Any], None], ...] = tuple(
    Record.__dict__[field.name].__set__ for field in dataclasses.fields(Record)
)
_new_object = object.__new__


def step_records(
    run_id: str,
    rank: int,
    steps: Sequence[int],
    epochs: Sequence[int],
    batches: Sequence[int],
    walls: Sequence[float],
    values: Sequence[Mapping[str, float]],
) -> list[Record]:
    """``Record(run_id, steps[i], epochs[i], batches[i], rank, walls[i], values[i])`` for every i:
    the records of a decoded block, made at half the cost of calling the class.

    A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``; the pipeline
    makes one record per captured step, on the training process's GIL, so these are filled
    through their slots directly. The objects are the same (equal, hashable, frozen afterwards).

    Example:
        >>> step_records("r", 0, [4], [0], [4], [1.5], [{"loss": 0.5}]) == [Record("r", 4, 0, 4, 0, 1.5, {"loss": 0.5})]
        True
    """
    s_run, s_step, s_epoch, s_batch, s_rank, s_wall, s_values, s_sparse = _RECORD_SETTERS
    out = []
    for step, epoch, batch, wall, row in zip(steps, epochs, batches, walls, values):
        record = _new_object(Record)
        s_run(record, run_id)
        s_step(record, step)
        s_epoch(record, epoch)
        s_batch(record, batch)
        s_rank(record, rank)
        s_wall(record, wall)
        s_values(record, row)
        s_sparse(record, False)
        out.append(record)
    return out


class EventKind(str, enum.Enum):
    """What an :class:`Event` reports."""

    ANOMALY = "anomaly"  #: a value outside its metric's domain (NaN, inf, accuracy > 1, ...)
    ACTION = "action"  #: something a rule did (stop, rollback, batch-size change, ...)
    WARNING = "warning"  #: the library itself had to degrade (a sink failed, the queue blocked, ...)
    INFO = "info"  #: a note: a choice or assumption the library made (how it read a loop), not a degradation
    SKIP = "skip"  #: the optimizer skipped the step (AMP GradScaler found inf/NaN gradients): expected, not an anomaly


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    """Something that happened at a step.

    Attributes:
        run_id: id of the run.
        step: global step the event refers to.
        kind: anomaly, action, warning, info or skip.
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
        """The event's codec form (:func:`to_wire`) without its ``"type"`` (a non-finite
        ``raw_value`` as ``"nan"``, ``"inf"``, ``"-inf"``)."""
        out = _event_wire(self)
        del out["type"]
        return out


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


@dataclasses.dataclass(frozen=True, slots=True)
class RunStart:
    """The sink call ``start_run(run)`` as a value."""

    run: RunInfo


@dataclasses.dataclass(frozen=True, slots=True)
class RunEnd:
    """The sink call ``end_run(run)`` as a value (``run.status`` is final)."""

    run: RunInfo


@dataclasses.dataclass(frozen=True, slots=True)
class EpochStart:
    """The sink call ``start_epoch(run_id, epoch, total)`` as a value: ``Tap.watch()`` began epoch
    ``epoch`` of a loader of ``total`` batches (None: the loader has no ``len()``)."""

    run_id: str
    epoch: int
    total: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class Write:
    """The sink call ``write(records, events)`` as a value: one block of records in step order and
    the events raised with them."""

    records: Sequence[Record]
    events: Sequence[Event] = ()


#: Everything the codec writes and reads.
Message = Record | Event | RunStart | RunEnd | EpochStart | Write


# -- the codec ------------------------------------------------------------------------------------
# Floats: finite ones as JSON numbers (json writes float.__repr__, exact), the rest as these strings.
_FLOAT_OF_TEXT = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
# Keys of a record line; a metric of one of these names (or starting with the prefix) is escaped.
_RECORD_KEYS = frozenset(("type", "run_id", "step", "epoch", "batch", "rank", "wall_time", "sparse"))
_ESCAPE = METRIC_PREFIX
_ESCAPE_LEN = len(_ESCAPE)


def format_float(x: float) -> str:
    """The codec's text of a float: ``repr`` (exact) for a finite one, ``"nan"``, ``"inf"`` or
    ``"-inf"`` otherwise; what a JSON line holds, as text (SQL and CSV cells use it).

    Example:
        >>> [format_float(x) for x in (0.1, -0.0, float("nan"), float("-inf"), 5e-324)]
        ['0.1', '-0.0', 'nan', '-inf', '5e-324']
    """
    return repr(float(x))  # repr of a non-finite float is exactly 'nan', 'inf' or '-inf'


def parse_float(text: str) -> float:
    """Inverse of :func:`format_float`.

    Example:
        >>> parse_float("-inf"), parse_float("0.1")
        (-inf, 0.1)
    """
    return float(text)


def _num(x: float) -> float | str:
    """A float field's JSON value: the float itself when finite, else its text."""
    # x - x is 0 for every finite number and NaN for NaN and both infinities (cheaper than isfinite).
    return x if x - x == 0 else repr(float(x))


def _float(v: Any) -> float:
    """A float field's value read back from JSON: a number, or one of the three strings."""
    if type(v) is float:
        return v
    if type(v) is int:
        return float(v)
    if type(v) is str:
        found = _FLOAT_OF_TEXT.get(v)
        if found is not None:
            return found
    raise ValueError(f"expected a number or one of 'nan', 'inf', '-inf' in a float field, got {v!r}")


def _opt_float(v: Any) -> float | None:
    return None if v is None else _float(v)


def _record_wire(r: Record) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "record",
        "run_id": r.run_id,
        "step": r.step,
        "epoch": r.epoch,
        "batch": r.batch,
        "rank": r.rank,
        "wall_time": _num(r.wall_time),
    }
    if r.sparse:
        out["sparse"] = True
    keys = _RECORD_KEYS
    for k, v in r.values.items():
        if k in keys or k.startswith(_ESCAPE):
            k = _ESCAPE + k
        out[k] = v if v - v == 0 else repr(float(v))  # _num, inlined: this loop is the hot one
    return out


def _record_from(d: Mapping[str, Any]) -> Record:
    keys = _RECORD_KEYS
    values: dict[str, float] = {}
    for k, v in d.items():
        if k in keys:
            continue
        if k.startswith(_ESCAPE):
            k = k[_ESCAPE_LEN:]
        values[k] = v if type(v) is float else _float(v)
    sparse = d.get("sparse", False)
    if type(sparse) is not bool:
        raise ValueError(f"expected true or false for 'sparse', got {sparse!r}")
    return Record(d["run_id"], d["step"], d["epoch"], d["batch"], d["rank"], _float(d["wall_time"]), values, sparse)


def _event_wire(e: Event) -> dict[str, Any]:
    raw = e.raw_value
    return {
        "type": "event",
        "run_id": e.run_id,
        "step": e.step,
        "kind": e.kind.value,
        "metric": e.metric,
        "raw_value": None if raw is None else _num(raw),
        "message": e.message,
        "wall_time": _num(e.wall_time),
        "rank": e.rank,
    }


def _event_from(d: Mapping[str, Any]) -> Event:
    return Event(
        d["run_id"],
        d["step"],
        EventKind(d["kind"]),
        d["message"],
        _float(d["wall_time"]),
        d.get("metric"),
        _opt_float(d.get("raw_value")),
        d.get("rank", 0),
    )


def _run_wire(kind: str, run: RunInfo) -> dict[str, Any]:
    return {
        "type": kind,
        "run_id": run.id,
        "name": run.name,
        "status": run.status.value,
        "started_at": _num(run.started_at),
        "ended_at": None if run.ended_at is None else _num(run.ended_at),
        "stop_reason": run.stop_reason,
        "world_size": run.world_size,
        "config": run.config,
        "environment": run.environment,
        "metrics": list(run.metrics),
    }


def _run_from(d: Mapping[str, Any]) -> RunInfo:
    return RunInfo(
        id=d["run_id"],
        name=d["name"],
        config=d.get("config") or {},
        started_at=_float(d["started_at"]),
        status=RunStatus(d.get("status", "running")),
        ended_at=_opt_float(d.get("ended_at")),
        stop_reason=d.get("stop_reason"),
        world_size=d.get("world_size", 1),
        environment=d.get("environment") or {},
        metrics=tuple(d.get("metrics") or ()),
    )


_TO_WIRE: dict[type, Callable[[Any], dict[str, Any]]] = {
    Record: _record_wire,
    Event: _event_wire,
    RunStart: lambda m: _run_wire("run_start", m.run),
    RunEnd: lambda m: _run_wire("run_end", m.run),
    EpochStart: lambda m: {"type": "epoch_start", "run_id": m.run_id, "epoch": m.epoch, "total": m.total},
    Write: lambda m: {
        "type": "write",
        "records": [_record_wire(r) for r in m.records],
        "events": [_event_wire(e) for e in m.events],
    },
}

_FROM_WIRE: dict[str, Callable[[Mapping[str, Any]], Message]] = {
    "record": _record_from,
    "event": _event_from,
    "run_start": lambda d: RunStart(_run_from(d)),
    "run_end": lambda d: RunEnd(_run_from(d)),
    "epoch_start": lambda d: EpochStart(d["run_id"], d["epoch"], d.get("total")),
    "write": lambda d: Write([_record_from(r) for r in d["records"]], [_event_from(e) for e in d["events"]]),
}


def to_wire(obj: Message) -> dict[str, Any]:
    """The codec's JSON-ready dict of ``obj``, with its ``"type"`` (see the module docstring).

    Raises:
        TypeError: ``obj`` is not one of the :data:`Message` types.

    Example:
        >>> to_wire(EpochStart("r1", epoch=2, total=45))
        {'type': 'epoch_start', 'run_id': 'r1', 'epoch': 2, 'total': 45}
    """
    encode = _TO_WIRE.get(type(obj))
    if encode is None:
        raise TypeError(
            f"the record codec writes Record, Event, RunStart, RunEnd, EpochStart and Write, got {type(obj).__name__}"
        )
    return encode(obj)


def from_wire(d: Mapping[str, Any]) -> Message:
    """Inverse of :func:`to_wire`.

    Raises:
        ValueError: ``d`` is not a codec dict: no or an unknown ``"type"``, a missing key, or a
            value of the wrong kind (a float field holding a string other than the three).
    """
    try:
        decode = _FROM_WIRE[d["type"]]
    except (KeyError, TypeError):
        kind = d.get("type") if isinstance(d, Mapping) else None
        raise ValueError(
            f'expected a record codec object with a "type" of {", ".join(_FROM_WIRE)}, got '
            f"{'none' if kind is None else repr(kind)} in {str(d)[:80]!r}"
        ) from None
    try:
        return decode(d)
    except KeyError as exc:
        raise ValueError(f"a {d['type']!r} object lacks the key {exc}: {str(d)[:80]!r}") from None
    except (TypeError, AttributeError) as exc:
        raise ValueError(f"a {d['type']!r} object is malformed ({exc}): {str(d)[:80]!r}") from None


# One encoder made once: json.dumps with non-default options builds a new one per call.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=str)
_decode_json = json.JSONDecoder().decode


def dumps(obj: Message) -> str:
    """``obj`` as one line of JSON (no newline), by the codec's rules.

    Example:
        >>> dumps(Event("r1", 4, EventKind.ANOMALY, "loss is inf", 2.0, metric="loss", raw_value=float("inf")))
        '{"type":"event","run_id":"r1","step":4,"kind":"anomaly","metric":"loss","raw_value":"inf","message":"loss is inf","wall_time":2.0,"rank":0}'
    """
    return _ENCODER.encode(to_wire(obj))


def loads(line: str | bytes) -> Message:
    """Inverse of :func:`dumps` (a trailing newline is fine).

    Raises:
        ValueError: the line is not JSON, or not a codec object (see :func:`from_wire`).
    """
    d = _decode_json(line.decode("utf-8") if isinstance(line, bytes) else line)
    if not isinstance(d, dict):
        raise ValueError(f"expected a JSON object, got {str(line)[:80]!r}")
    return from_wire(d)
