"""Records and events as Apache Parquet files (``batchtap export --format parquet``).

pyarrow is optional (``pip install 'batchtap[pandas]'``): imported when a file is written or read.

Layout of ``FILE`` (one row per record, step records and ``Tap.log()`` records alike)::

    run_id: string, step: int64, epoch: int64, batch: int64, rank: int64, wall_time: float64,
    logged: bool, <metric>: float64 ...

``logged`` is True for a record of ``Tap.log()`` values (a sparse record). It is not named
``sparse``: a column of that name would hide pandas' ``DataFrame.sparse`` accessor
(``df.sparse``); files written before it was renamed (with ``sparse``) still read back.

A metric cell is **null** where the record has no value of that metric (a ``Tap.log()`` record
holds only the names logged together) and **NaN** where a value failed validation; Arrow keeps the
two apart (pandas shows both as NaN). A metric named like a position column is stored as
``metric:<name>``. The run (id, name, status, config, ...) is JSON in the file's key-value
metadata under ``batchtap.run``. Events go to ``<FILE stem>.events.parquet``
(run_id, step, rank, kind, metric, raw_value, message, wall_time), written even when there are none
(an empty table with those columns), so a reader always finds it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchtap._optional import require
from batchtap.records import METRIC_PREFIX, Event, EventKind, Record, RunInfo, RunStatus

__all__ = ["POSITION_COLUMNS", "events_path", "write_run", "read_records", "read_events", "read_run"]

#: The columns every records file starts with.
POSITION_COLUMNS = ("run_id", "step", "epoch", "batch", "rank", "wall_time", "logged")
_OLD_LOGGED = "sparse"  # the ``logged`` column's name in Parquet files written by older batchtap versions
_CLASH = METRIC_PREFIX
_RUN_KEY = b"batchtap.run"


def _pa() -> Any:
    return require("pyarrow", extra="pandas", purpose="Parquet export")


def _pq() -> Any:
    _pa()
    return require("pyarrow.parquet", extra="pandas", purpose="Parquet export")


def events_path(path: str | os.PathLike[str]) -> Path:
    """Where the events of a records file go: ``run.parquet`` -> ``run.events.parquet``."""
    p = Path(path)
    return p.with_name(f"{p.stem}.events{p.suffix or '.parquet'}")


def _column(metric: str) -> str:
    return _CLASH + metric if metric in POSITION_COLUMNS else metric


def _metric_names(records: Sequence[Record], first: Sequence[str]) -> list[str]:
    """Every name with a value in ``records``: those of ``first`` in its order, then as first seen."""
    seen: dict[str, None] = {}
    for r in records:
        seen.update(dict.fromkeys(r.values))
    return [m for m in first if m in seen] + [m for m in seen if m not in first]


def write_run(
    path: str | os.PathLike[str], run: RunInfo, records: Sequence[Record], events: Sequence[Event] = ()
) -> list[Path]:
    """Write one run's records to ``path`` and its events beside it (an empty events file when
    there are none).

    Args:
        path: the records file (replaced when it exists).
        run: the run, kept as JSON in the file's metadata.
        records: step and sparse records, in the order to keep.
        events: the run's events.

    Returns:
        the files written.

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "run.parquet")
        >>> run = RunInfo("r1", "demo", {"lr": 0.1}, started_at=0.0)
        >>> recs = [Record("r1", step=0, epoch=0, batch=0, rank=0, wall_time=1.0, values={"loss": 0.5}),
        ...         Record("r1", step=0, epoch=0, batch=-1, rank=0, wall_time=1.5, values={"val_acc": 0.9}, sparse=True)]
        >>> [f.name for f in write_run(p, run, recs)]
        ['run.parquet', 'run.events.parquet']
        >>> [(r.step, r.sparse, dict(r.values)) for r in read_records(p)]
        [(0, False, {'loss': 0.5}), (0, True, {'val_acc': 0.9})]
    """
    pa, pq = _pa(), _pq()
    path = Path(path)
    names = _metric_names(records, run.metrics)
    cols: dict[str, Any] = {
        "run_id": pa.array([r.run_id for r in records], pa.string()),
        "step": pa.array([r.step for r in records], pa.int64()),
        "epoch": pa.array([r.epoch for r in records], pa.int64()),
        "batch": pa.array([r.batch for r in records], pa.int64()),
        "rank": pa.array([r.rank for r in records], pa.int64()),
        "wall_time": pa.array([r.wall_time for r in records], pa.float64()),
        "logged": pa.array([r.sparse for r in records], pa.bool_()),
    }
    for name in names:
        # None (null) = no value in this record; NaN stays NaN (a value that failed validation).
        cols[_column(name)] = pa.array([r.values.get(name) for r in records], pa.float64(), from_pandas=False)
    meta = {_RUN_KEY: json.dumps(_run_json(run), default=str).encode()}
    table = pa.table(cols).replace_schema_metadata(meta)
    pq.write_table(table, path)
    written = [path]
    # also without events: the file is where the docs say, with its columns
    ev = pa.table(
        {
            "run_id": pa.array([e.run_id for e in events], pa.string()),
            "step": pa.array([e.step for e in events], pa.int64()),
            "rank": pa.array([e.rank for e in events], pa.int64()),
            "kind": pa.array([e.kind.value for e in events], pa.string()),
            "metric": pa.array([e.metric for e in events], pa.string()),
            "raw_value": pa.array([e.raw_value for e in events], pa.float64(), from_pandas=False),
            "message": pa.array([e.message for e in events], pa.string()),
            "wall_time": pa.array([e.wall_time for e in events], pa.float64()),
        }
    ).replace_schema_metadata(meta)
    pq.write_table(ev, events_path(path))
    written.append(events_path(path))
    return written


def _run_json(run: RunInfo) -> dict[str, Any]:
    d = dataclasses.asdict(run)
    d["status"] = run.status.value
    d["metrics"] = list(run.metrics)
    return d


def read_run(path: str | os.PathLike[str]) -> RunInfo:
    """The run stored in a records file's metadata."""
    meta = _pq().read_schema(path).metadata or {}
    d = json.loads(meta[_RUN_KEY])
    d["status"] = RunStatus(d["status"])
    d["metrics"] = tuple(d["metrics"])
    return RunInfo(**d)


def read_records(path: str | os.PathLike[str]) -> list[Record]:
    """The records of a file written by :func:`write_run`, in file order (null cells left out)."""
    table = _pq().read_table(path)
    old = "logged" not in table.column_names and _OLD_LOGGED in table.column_names
    positions = (*POSITION_COLUMNS[:-1], _OLD_LOGGED) if old else POSITION_COLUMNS
    rows = table.to_pylist()
    out = []
    for row in rows:
        values = {
            (k.removeprefix(_CLASH) if k.removeprefix(_CLASH) in positions else k): float(v)
            for k, v in row.items()
            if k not in positions and v is not None
        }
        out.append(
            Record(
                row["run_id"],
                step=row["step"],
                epoch=row["epoch"],
                batch=row["batch"],
                rank=row["rank"],
                wall_time=row["wall_time"],
                values=values,
                sparse=bool(row[positions[-1]]),
            )
        )
    return out


def read_events(path: str | os.PathLike[str]) -> list[Event]:
    """The events written beside the records file ``path`` (none when there is no events file)."""
    ep = events_path(path)
    if not ep.exists():
        return []
    return [
        Event(
            e["run_id"],
            e["step"],
            EventKind(e["kind"]),
            e["message"],
            e["wall_time"],
            e["metric"],
            None if e["raw_value"] is None else float(e["raw_value"]),
            e["rank"],
        )
        for e in _pq().read_table(ep).to_pylist()
    ]
