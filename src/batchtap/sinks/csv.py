"""``CSV(path)``: one row per record, one column per metric, in plain CSV files.

The header comes from the first record. Files are only ever appended to, never rewritten, so a
metric that first appears later cannot be added to the existing header. Instead the sink
continues in a new *part* whose header is the old one plus the new columns:

    metrics.csv       run_id,step,epoch,batch,rank,wall_time,loss
    metrics.2.csv     run_id,step,epoch,batch,rank,wall_time,loss,grad_norm

Every part is a valid CSV on its own; concatenating them aligned by column name (``pandas.concat``
or :func:`read_records`) gives every value. A cell is empty where a record had no such metric, and
``nan`` where the value was NaN. Floats are written by the record codec's rule
(:func:`batchtap.records.format_float`: ``repr``, and ``nan``, ``inf``, ``-inf``), so they read back exactly.
Events go to ``metrics.events.csv`` (columns :data:`EVENT_FIELDS`). A metric named like a
position column (``step``, ``rank``, ...) gets the column ``metric:<name>``.

Sparse records (``Tap.log()``: evaluation, epoch-level values, any name at any time) never touch
the step files' header: they go to ``metrics.sparse.csv`` in long form, one line per value
(columns :data:`SPARSE_FIELDS`), read back with :func:`read_sparse_records`.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from batchtap.errors import SinkError
from batchtap.records import METRIC_PREFIX, Event, EventKind, Record, format_float, parse_float
from batchtap.sinks.base import Sink

__all__ = [
    "CSV",
    "POSITION_FIELDS",
    "EVENT_FIELDS",
    "SPARSE_FIELDS",
    "part_paths",
    "events_path",
    "sparse_path",
    "read_records",
    "read_sparse_records",
    "read_events",
]

#: The columns every metrics part starts with.
POSITION_FIELDS = ("run_id", "step", "epoch", "batch", "rank", "wall_time")
#: The columns of the events file.
EVENT_FIELDS = ("run_id", "step", "rank", "kind", "metric", "raw_value", "message", "wall_time")
#: The columns of the sparse values file: one line per value logged with ``Tap.log()``.
SPARSE_FIELDS = ("run_id", "step", "epoch", "rank", "wall_time", "name", "value")


_CLASH = METRIC_PREFIX


def _column(metric: str) -> str:
    return _CLASH + metric if metric in POSITION_FIELDS else metric


def _part_path(path: Path, k: int) -> Path:
    return path if k == 1 else path.with_name(f"{path.stem}.{k}{path.suffix}")


def events_path(path: str | os.PathLike[str]) -> Path:
    """Where a :class:`CSV` sink writing ``path`` puts its events: ``<stem>.events<suffix>``."""
    p = Path(path)
    return p.with_name(f"{p.stem}.events{p.suffix or '.csv'}")


def sparse_path(path: str | os.PathLike[str]) -> Path:
    """Where a :class:`CSV` sink writing ``path`` puts its sparse values: ``<stem>.sparse<suffix>``."""
    p = Path(path)
    return p.with_name(f"{p.stem}.sparse{p.suffix or '.csv'}")


def part_paths(path: str | os.PathLike[str]) -> list[Path]:
    """The metric files of a CSV sink that exist, in order: ``path``, then ``<stem>.2<suffix>``, ..."""
    base = Path(path)
    out: list[Path] = []
    k = 1
    while _part_path(base, k).exists():
        out.append(_part_path(base, k))
        k += 1
    return out


def _read_header(p: Path) -> list[str] | None:
    with p.open(newline="", encoding="utf-8") as f:
        return next(csv.reader(f), None)


class CSV(Sink):
    """Append records to CSV files; see the module docstring for the layout.

    Appending to an existing file continues its last part when the header fits.

    Args:
        path: the first metrics file (its directory is created when missing).

    Raises:
        SinkError: the path cannot be written, or an existing file there is not a batchtap CSV.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "m.csv")
        >>> sink = CSV(path)
        >>> sink.write([Record("r", step=0, epoch=0, batch=0, rank=0, wall_time=1.0, values={"loss": 0.5})])
        >>> sink.write([Record("r", step=1, epoch=0, batch=1, rank=0, wall_time=2.0, values={"loss": 0.4, "lr": 0.1})])
        >>> sink.close()
        >>> [p.name for p in part_paths(path)]
        ['m.csv', 'm.2.csv']
        >>> [dict(r.values) for r in read_records(path)]
        [{'loss': 0.5}, {'loss': 0.4, 'lr': 0.1}]
        >>> sink = CSV(path)
        >>> sink.write([Record("r", step=1, epoch=0, batch=-1, rank=0, wall_time=3.0, values={"val_loss": 0.3}, sparse=True)])
        >>> sink.close()
        >>> [(r.step, dict(r.values)) for r in read_sparse_records(path)]
        [(1, {'val_loss': 0.3})]
    """

    _live = ("_file", "_writer", "_events_file", "_events_writer", "_sparse_file", "_sparse_writer")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._part = 1
        self._fields: list[str] | None = None
        self._file: IO[str] | None = None
        self._writer: csv.DictWriter[str] | None = None
        self._events_file: IO[str] | None = None
        self._events_writer: csv.DictWriter[str] | None = None
        self._sparse_file: IO[str] | None = None
        self._sparse_writer: csv.DictWriter[str] | None = None
        existing = part_paths(self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if existing:
                self._part = len(existing)
                header = _read_header(existing[-1])
                if header:
                    if tuple(header[: len(POSITION_FIELDS)]) != POSITION_FIELDS:
                        raise SinkError(
                            f"{existing[-1]} is not a batchtap CSV: its header starts {header[:6]}, expected "
                            f"{list(POSITION_FIELDS)}; fix: choose another path"
                        )
                    self._fields = header
            self._open_part(write_header=False)
        except OSError as exc:
            raise SinkError(
                f"cannot write CSV file {_part_path(self.path, self._part)}: {exc.strerror or exc}; expected a "
                "writable path; fix: choose another path or fix its permissions"
            ) from exc

    def _open_live(self) -> None:
        """In a copy unpickled in another process: append to the part the original was appending
        to, under its header (the events and sparse files open when first written, as always)."""
        try:
            self._open_part(write_header=False)
        except OSError as exc:
            raise SinkError(
                f"cannot reopen CSV file {_part_path(self.path, self._part)} in this process: {exc.strerror or exc}; "
                "expected a writable path; fix: choose another path or fix its permissions"
            ) from exc

    def _open_part(self, *, write_header: bool) -> None:
        if self._file is not None:
            self._file.close()
        self._file = _part_path(self.path, self._part).open("a", newline="", encoding="utf-8")
        if self._fields is not None:
            self._writer = csv.DictWriter(self._file, fieldnames=self._fields, restval="")
            if write_header:
                self._writer.writeheader()

    def _ensure_columns(self, records: Sequence[Record]) -> None:
        known = set(self._fields) if self._fields is not None else set(POSITION_FIELDS)
        new: list[str] = []
        for r in records:
            for metric in r.values:
                name = _column(metric)
                if name not in known:
                    known.add(name)
                    new.append(name)
        if self._fields is None:
            self._fields = [*POSITION_FIELDS, *new]
            self._open_part(write_header=True)
        elif new:
            # Never rewrite a file: a new part with the widened header takes over from here.
            self._fields = [*self._fields, *new]
            self._part += 1
            self._open_part(write_header=True)

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        """Append one block (and its events), then flush the files so followers see it."""
        try:
            steps = [r for r in records if not r.sparse]
            if len(steps) < len(records):
                self._write_sparse([r for r in records if r.sparse])
            if steps:
                self._ensure_columns(steps)
                assert self._writer is not None and self._file is not None
                for r in steps:
                    row: dict[str, object] = {
                        "run_id": r.run_id,
                        "step": r.step,
                        "epoch": r.epoch,
                        "batch": r.batch,
                        "rank": r.rank,
                        "wall_time": format_float(r.wall_time),
                    }
                    for k, v in r.values.items():
                        row[_column(k)] = format_float(v)
                    self._writer.writerow(row)
                self._file.flush()
            if events:
                self._write_events(events)
        except OSError as exc:
            raise SinkError(
                f"cannot write CSV file {_part_path(self.path, self._part)}: {exc.strerror or exc}"
            ) from exc

    def _write_sparse(self, records: Sequence[Record]) -> None:
        if self._sparse_writer is None:
            self._sparse_file, self._sparse_writer = _open_sidecar(sparse_path(self.path), SPARSE_FIELDS)
        assert self._sparse_file is not None
        for r in records:
            wall = format_float(r.wall_time)
            for name, value in r.values.items():
                self._sparse_writer.writerow(
                    {
                        "run_id": r.run_id,
                        "step": r.step,
                        "epoch": r.epoch,
                        "rank": r.rank,
                        "wall_time": wall,
                        "name": name,
                        "value": format_float(value),
                    }
                )
        self._sparse_file.flush()

    def _write_events(self, events: Sequence[Event]) -> None:
        if self._events_writer is None:
            self._events_file, self._events_writer = _open_sidecar(events_path(self.path), EVENT_FIELDS)
        assert self._events_file is not None
        for e in events:
            self._events_writer.writerow(
                {
                    "run_id": e.run_id,
                    "step": e.step,
                    "rank": e.rank,
                    "kind": e.kind.value,
                    "metric": "" if e.metric is None else e.metric,
                    "raw_value": "" if e.raw_value is None else format_float(e.raw_value),
                    "message": e.message,
                    "wall_time": format_float(e.wall_time),
                }
            )
        self._events_file.flush()

    def flush(self) -> None:
        """Push buffered rows to the OS (each ``write`` already does)."""
        for f in (self._file, self._events_file, self._sparse_file):
            if f is not None:
                f.flush()

    def close(self) -> None:
        """Close the files (idempotent)."""
        for f in (self._file, self._events_file, self._sparse_file):
            if f is not None:
                f.close()
        self._file = self._events_file = self._sparse_file = None
        self._writer = self._events_writer = self._sparse_writer = None


def _open_sidecar(p: Path, fields: Sequence[str]) -> tuple[IO[str], csv.DictWriter[str]]:
    """Open a file next to the step parts for appending; its header only when it is new."""
    fresh = not p.exists() or p.stat().st_size == 0
    f = p.open("a", newline="", encoding="utf-8")
    writer = csv.DictWriter(f, fieldnames=fields)
    if fresh:
        writer.writeheader()
    return f, writer


def read_records(path: str | os.PathLike[str]) -> list[Record]:
    """Read every record a :class:`CSV` sink wrote at ``path``, across all parts, in file order.

    Empty cells (a metric the record did not have) are left out of ``values``; ``nan`` reads back
    as NaN.
    """
    out: list[Record] = []
    for p in part_paths(path):
        with p.open(newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                values = {
                    k.removeprefix(_CLASH) if k.removeprefix(_CLASH) in POSITION_FIELDS else k: parse_float(v)
                    for k, v in row.items()
                    if k not in POSITION_FIELDS and v != ""
                }
                out.append(
                    Record(
                        run_id=row["run_id"],
                        step=int(row["step"]),
                        epoch=int(row["epoch"]),
                        batch=int(row["batch"]),
                        rank=int(row["rank"]),
                        wall_time=parse_float(row["wall_time"]),
                        values=values,
                    )
                )
    return out


def read_sparse_records(path: str | os.PathLike[str]) -> list[Record]:
    """Read the sparse records (``Tap.log()`` values) a :class:`CSV` sink wrote next to ``path``.

    Consecutive lines of one record (same run, step, rank and wall time) come back as one record
    with ``sparse=True`` and ``batch=-1``, in file order.
    """
    p = sparse_path(path)
    if not p.exists():
        return []
    groups: list[tuple[dict[str, str], dict[str, float]]] = []
    key: tuple[str, str, str, str] | None = None
    with p.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            this = (row["run_id"], row["step"], row["rank"], row["wall_time"])
            if this != key:
                key = this
                groups.append((row, {}))
            groups[-1][1][row["name"]] = parse_float(row["value"])
    return [
        Record(
            run_id=row["run_id"],
            step=int(row["step"]),
            epoch=int(row["epoch"]),
            batch=-1,
            rank=int(row["rank"]),
            wall_time=parse_float(row["wall_time"]),
            values=values,
            sparse=True,
        )
        for row, values in groups
    ]


def read_events(path: str | os.PathLike[str]) -> list[Event]:
    """Read the events a :class:`CSV` sink wrote next to ``path``."""
    p = events_path(Path(path))
    if not p.exists():
        return []
    with p.open(newline="", encoding="utf-8") as f:
        return [
            Event(
                run_id=row["run_id"],
                step=int(row["step"]),
                kind=EventKind(row["kind"]),
                message=row["message"],
                wall_time=parse_float(row["wall_time"]),
                metric=row["metric"] or None,
                raw_value=parse_float(row["raw_value"]) if row["raw_value"] else None,
                rank=int(row["rank"]),
            )
            for row in csv.DictReader(f)
        ]
