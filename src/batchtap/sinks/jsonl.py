"""``JSONL``: one JSON object per line, appended; the simplest durable record of a run."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchtap.errors import SinkError
from batchtap.records import Event, Record, RunInfo
from batchtap.sinks.base import Sink

__all__ = ["JSONL"]


def _jsonable(value: Any) -> Any:
    # JSON has no NaN/inf; keep them readable and round-trippable as strings.
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


class JSONL(Sink):
    """Append records, events and run start/end lines to a JSON-lines file.

    Each line has a ``"type"``: ``"run_start"``, ``"record"``, ``"event"`` or ``"run_end"``. NaN and
    infinities are written as the strings ``"nan"``, ``"inf"``, ``"-inf"``. A sparse record
    (``Tap.log()``) is a ``"record"`` line with ``"sparse": true``, ``"batch": -1`` and only the
    names logged together.

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
        '{"type": "record", "run_id": "r", "step": 0, "epoch": 0, "batch": 0, "rank": 0, "wall_time": 0.0, "loss": 1.5}'
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
                f"JSONL sink cannot open {str(self.path)!r} for appending: {exc.strerror}; "
                "choose a writable path"
            ) from exc

    def _line(self, obj: dict[str, Any]) -> str:
        return json.dumps({k: _jsonable(v) for k, v in obj.items()}, ensure_ascii=False)

    def start_run(self, run: RunInfo) -> None:
        self._emit([self._line(_run_dict("run_start", run))])

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        lines = [self._line({"type": "record", **r.to_dict()}) for r in records]
        lines += [self._line({"type": "event", **e.to_dict()}) for e in events]
        self._emit(lines)

    def end_run(self, run: RunInfo) -> None:
        self._emit([self._line(_run_dict("run_end", run))])

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


def _run_dict(kind: str, run: RunInfo) -> dict[str, Any]:
    return {
        "type": kind,
        "run_id": run.id,
        "name": run.name,
        "status": run.status.value,
        "started_at": run.started_at,
        "ended_at": run.ended_at,
        "stop_reason": run.stop_reason,
        "world_size": run.world_size,
        "config": run.config,
        "environment": run.environment,
        "metrics": list(run.metrics),
    }
