"""``JSONL``: one JSON object per line, appended; the simplest durable record of a run, and one that
can be read back (:func:`read_jsonl`) and fed into any other sink (:func:`replay`)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

from batchtap.errors import SinkError
from batchtap.records import Event, Message, Record, RunEnd, RunInfo, RunStart, dumps, loads
from batchtap.sinks.base import Sink, feed

__all__ = ["JSONL", "read_jsonl", "replay"]


class JSONL(Sink):
    """Append records, events and run start/end lines to a JSON-lines file.

    The lines are the record codec's (:mod:`batchtap.records`): each has a ``"type"``,
    ``"run_start"``, ``"record"``, ``"event"`` or ``"run_end"``; NaN and infinities are the strings
    ``"nan"``, ``"inf"``, ``"-inf"`` and other floats read back bit for bit. A record line is flat
    (position fields, then one key per metric); a sparse record (``Tap.log()``) is a ``"record"``
    line with ``"sparse": true``, ``"batch": -1`` and only the names logged together. The file
    reads back with :func:`read_jsonl`, and :func:`replay` feeds it into another sink (a
    database, say) as if that sink had been attached to the run.

    Every call writes its lines with one unbuffered append, whole records only: when the disk
    fills up (or any write fails) the file is truncated back to where the call began and the
    call raises :class:`~batchtap.errors.SinkError`, so the file never ends in half a record
    (a ``ResilientSink`` then keeps the block and writes it again later).

    Args:
        path: file to append to; parent folders are created.
        fsync: also ``os.fsync`` on every flush (durable against power loss, slower).

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "m.jsonl")
        >>> sink = JSONL(path)
        >>> sink.write([Record("r", 0, 0, 0, 0, 0.0, {"loss": 1.5})])
        >>> sink.close()
        >>> open(path).read().strip()
        '{"type":"record","run_id":"r","step":0,"epoch":0,"batch":0,"rank":0,"wall_time":0.0,"loss":1.5}'
        >>> list(read_jsonl(path))
        [Record(run_id='r', step=0, epoch=0, batch=0, rank=0, wall_time=0.0, values={'loss': 1.5}, sparse=False)]
    """

    _live = ("_fd",)

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self._fd: int | None = None
        self._open_live()

    def _open_live(self) -> None:
        """Open the file for appending (a copy unpickled in another process opens its own)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise SinkError(
                f"JSONL sink cannot open {str(self.path)!r} for appending: {exc.strerror}; choose a writable path"
            ) from exc

    def start_run(self, run: RunInfo) -> None:
        self._emit([dumps(RunStart(run))])

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        lines = [dumps(r) for r in records]
        lines += [dumps(e) for e in events]
        self._emit(lines)

    def end_run(self, run: RunInfo) -> None:
        self._emit([dumps(RunEnd(run))])

    def _emit(self, lines: list[str]) -> None:
        fd = self._fd
        if fd is None:
            raise SinkError(f"JSONL sink for {str(self.path)!r} is closed")
        if not lines:
            return
        data = memoryview(("\n".join(lines) + "\n").encode("utf-8"))
        start = os.fstat(fd).st_size
        try:
            while data:
                data = data[os.write(fd, data) :]
        except OSError as exc:
            try:
                os.ftruncate(fd, start)  # never leave half a record behind
                cut = "truncated back to its last whole record"
            except OSError:
                cut = "could not be truncated back: its last line may be incomplete"
            raise SinkError(
                f"JSONL sink cannot append {len(lines)} lines to {str(self.path)!r}: {exc.strerror or exc}; "
                f"the file was {cut}; fix: free disk space (or raise the file size limit)"
            ) from exc

    def flush(self) -> None:
        """Every line is with the OS once written; with ``fsync`` also on disk."""
        if self._fd is not None and self.fsync:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            self.flush()
            os.close(self._fd)
            self._fd = None


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[Message]:
    """The objects of a JSON-lines file of the record codec, in file order: what a :class:`JSONL`
    sink wrote (:class:`~batchtap.records.Record`, :class:`~batchtap.records.Event`,
    :class:`~batchtap.records.RunStart`, :class:`~batchtap.records.RunEnd`), or a
    ``ResilientSink`` spool or quarantine file (:class:`~batchtap.records.Write` lines too).

    Empty lines are skipped. A last line without its newline that does not parse is what a
    writer killed mid-append leaves: it is skipped with a :class:`RuntimeWarning`; any other line
    that is not a codec object raises.

    Raises:
        ValueError: a line is not a record codec object; the message names the file and line.
    """
    path = Path(path)
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                yield loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                if not raw.endswith(b"\n"):
                    warnings.warn(
                        f"{path} line {n} is incomplete (its writer was stopped mid-line); skipped it",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    return
                raise ValueError(f"{path} line {n} is not a batchtap JSONL line: {exc}") from None


def replay(path: str | os.PathLike[str], sink: Sink, *, block_size: int = 10_000) -> int:
    """Feed a JSON-lines file (see :func:`read_jsonl`) into ``sink``: ``start_run``, ``write`` and
    ``end_run`` in file order, as if the sink had been attached to the runs it holds, then
    ``sink.flush()``. The caller keeps the sink (it is not closed).

    Consecutive record and event lines are handed over in blocks of up to ``block_size`` lines
    (:func:`~batchtap.sinks.base.feed`).
    Replaying into a SQL sink twice stores nothing twice (it upserts).

    Returns:
        The number of lines fed.

    Example:
        >>> import tempfile, os
        >>> from batchtap.records import RunInfo, RunStatus
        >>> from batchtap.sinks.sqlite import SQLite
        >>> folder = tempfile.mkdtemp()
        >>> log = JSONL(os.path.join(folder, "m.jsonl"))
        >>> run = RunInfo("r1", "exp", {"lr": 0.1}, 0.0)
        >>> log.start_run(run)
        >>> log.write([Record("r1", s, 0, s, 0, float(s), {"loss": 1.0 / (s + 1)}) for s in range(3)])
        >>> run.status = RunStatus.FINISHED
        >>> log.end_run(run)
        >>> log.close()
        >>> db = SQLite(os.path.join(folder, "bt.db"))
        >>> replay(os.path.join(folder, "m.jsonl"), db)
        5
        >>> db.last_step("r1")
        2
        >>> db.close()
    """
    n = feed(read_jsonl(path), sink, block_size=block_size)
    sink.flush()
    return n
