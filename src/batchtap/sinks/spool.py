"""The spool of a :class:`~batchtap.sinks.resilient.ResilientSink`: the JSONL file that keeps the
sink calls a failing sink could not take, and its two side files.

Spool format: one line of the record codec (:mod:`batchtap.records`) per sink call, so that values
round-trip bit for bit (NaN and infinities as ``"nan"``, ``"inf"``, ``"-inf"``) and a spool or
quarantine file can also be fed into any sink by hand with :func:`batchtap.sinks.jsonl.replay`::

    {"type":"run_start","run_id":"...","name":"...","status":"running",...}
    {"type":"write","records":[{"type":"record","run_id":"...","step":7,...,"loss":0.25}],"events":[]}
    {"type":"run_end","run_id":"...","status":"finished",...}

Beside ``<spool>``: ``<spool>.quarantine.jsonl`` (same format) holds the calls set aside — refused
by the sink for what they hold, or lines of spool format 1 (``{"v": 1, "op": ...}``, before the
codec) that this version does not read; ``<spool>.rejected`` holds lines that cannot be read at all
(damaged, cut short by a kill), as read, for repair by hand. Neither is ever deleted.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from batchtap.errors import SinkError
from batchtap.records import RunEnd, RunStart, Write, dumps, from_wire

__all__ = ["Spool", "SpoolEntry", "decode_entry", "describe", "encode_entry"]

#: a spooled sink call: the record codec's value of it
SpoolEntry = Write | RunStart | RunEnd


class _OldSpoolLine(ValueError):
    """A line of spool format 1 (``{"v": 1, "op": ...}``), written before the record codec."""


def encode_entry(entry: SpoolEntry) -> str:
    """One spool line (without the newline) for a sink call: the record codec's line of it
    (:func:`batchtap.records.dumps`).

    Example:
        >>> from batchtap.records import Record
        >>> r = Record("r", step=1, epoch=0, batch=1, rank=0, wall_time=2.5, values={"loss": float("nan")})
        >>> line = encode_entry(Write([r], []))
        >>> line
        '{"type":"write","records":[{"type":"record","run_id":"r","step":1,"epoch":0,"batch":1,"rank":0,"wall_time":2.5,"loss":"nan"}],"events":[]}'
        >>> decode_entry(line).records[0].values["loss"]
        nan
    """
    if not isinstance(entry, (Write, RunStart, RunEnd)):
        raise ValueError(f"expected a Write, RunStart or RunEnd to spool, got {type(entry).__name__}")
    return dumps(entry)


def decode_entry(line: str) -> SpoolEntry:
    """Inverse of :func:`encode_entry`.

    Raises:
        ValueError: the line is not a spool entry this batchtap understands (a line of spool
            format 1, written before the record codec, among them).
    """
    d = json.loads(line)
    if not isinstance(d, dict):
        raise ValueError(f"expected a JSON object, got {str(line)[:80]!r}")
    if "type" not in d and "v" in d:
        raise _OldSpoolLine(
            f"it is in spool format {d['v']!r} of an older batchtap (before the record codec), which this "
            "version does not read"
        )
    msg = from_wire(d)
    if isinstance(msg, (Write, RunStart, RunEnd)):
        return msg
    raise ValueError(f"expected a write, run_start or run_end line in a spool, got {d['type']!r}")


def describe(entry: SpoolEntry) -> str:
    """A spooled call in words, for messages: ``a block (steps 3..7, 5 records, 0 events)``."""
    if isinstance(entry, RunStart):
        return f"start_run of run {entry.run.id}"
    if isinstance(entry, RunEnd):
        return f"end_run of run {entry.run.id}"
    steps = [r.step for r in entry.records]
    where = f"steps {min(steps)}..{max(steps)}, " if steps else ""
    return f"a block ({where}{len(entry.records)} records, {len(entry.events)} events)"


def _append_synced(path: Path, line: str) -> None:
    """Append one line to ``path``, to the disk at once: what is set aside must outlive a crash."""
    with path.open("a", encoding="utf-8") as f:
        f.write(line if line.endswith("\n") else line + "\n")
        f.flush()
        os.fsync(f.fileno())


class Spool:
    """The spool file of the sink called ``name``: appending, reading back in order, dropping what
    was delivered, and the side files for what cannot be delivered.

    Not for several processes at once: every process and sink needs its own path. Pickling leaves
    the append handle out; the copy reopens it when next appended to.

    Args:
        path: the spool file (created when needed).
        name: the sink's name in messages.
    """

    def __init__(self, path: str | os.PathLike[str], name: str) -> None:
        self.path = Path(path)
        self.name = name
        #: where calls set aside (refused for what they hold, older format) are kept, never deleted
        self.quarantine_path = self.path.with_name(self.path.name + ".quarantine.jsonl")
        #: where spool lines that cannot be read (damaged, cut short) are kept, never deleted
        self.rejected_path = self.path.with_name(self.path.name + ".rejected")
        #: lines kept in ``rejected_path`` since construction
        self.rejected = 0
        #: lines set aside in ``quarantine_path`` since construction
        self.quarantined = 0
        self._handle: IO[str] | None = None  # the append handle, open while spooling

    def __getstate__(self) -> dict[str, Any]:
        """What pickling carries: all but the append handle (reopened when next appended to)."""
        return {**self.__dict__, "_handle": None}

    def check_place(self) -> None:
        """Make sure the spool's directory exists and is writable: finding out only when the sink
        fails is too late.

        Raises:
            SinkError: it cannot be created or written.
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(self.path.parent, os.W_OK | os.X_OK):
                raise PermissionError(13, "Permission denied", str(self.path.parent))
        except OSError as exc:
            raise SinkError(
                f"cannot use spool {self.path} for sink {self.name}: {exc.strerror or exc}; expected a "
                "writable directory; fix: choose another spool_path or fix its permissions"
            ) from exc

    @property
    def pending(self) -> bool:
        """Whether the spool holds calls not yet delivered."""
        try:
            return self.path.stat().st_size > 0
        except OSError:  # missing, or its directory is gone
            return False

    def append(self, entry: SpoolEntry) -> None:
        """Add a call at the end, to the OS at once: a killed process keeps every spooled block.

        Raises:
            SinkError: the spool cannot be written (then the call really cannot be kept).
        """
        line = encode_entry(entry) + "\n"
        try:
            if self._handle is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._handle = self.path.open("a", encoding="utf-8")
            self._handle.write(line)
            self._handle.flush()
        except OSError as exc:
            raise SinkError(
                f"sink {self.name} failed and its spool {self.path} cannot be written either "
                f"({exc.strerror or exc}); this block cannot be kept; fix: make the spool's directory "
                "writable or free disk space"
            ) from exc

    def close(self) -> None:
        """Close the append handle (to the disk, best effort); the next append reopens it."""
        if self._handle is not None:
            try:
                self._handle.flush()
                os.fsync(self._handle.fileno())
            except OSError:
                pass  # best effort; the lines already reached the OS in append()
            self._handle.close()
            self._handle = None

    def read(self, warn: Callable[[str], None]) -> Iterator[tuple[int, str, SpoolEntry | None]]:
        """Every line in order as (byte offset after it, line, call). A line that cannot be
        delivered is kept aside here (torn or damaged: the rejected file; an older format: the
        quarantine file), reported through ``warn``, and comes with call None.

        Raises:
            OSError: the spool cannot be read.
            SinkError: a side file cannot be written (the spool is then left as it is).
        """
        with self.path.open("rb") as f:
            lineno = 0
            for raw in f:
                lineno += 1
                end, line = f.tell(), raw.decode("utf-8", errors="replace")
                if not line.endswith("\n"):
                    self._reject(line, lineno)
                    warn(
                        f"sink {self.name}: spool {self.path} line {lineno} is incomplete (the process "
                        f"writing it was killed mid-line); kept in {self.rejected_path}, the rest delivered"
                    )
                    yield end, line, None
                    continue
                try:
                    entry = decode_entry(line)
                except _OldSpoolLine as exc:
                    self.set_aside(line, f"line {lineno} of its spool")
                    warn(
                        f"sink {self.name}: spool {self.path} line {lineno} is not delivered: {exc}; set aside "
                        f"in {self.quarantine_path} and the rest delivered; to deliver it, open that file as the "
                        "spool_path of a ResilientSink under the batchtap version that wrote it"
                    )
                    yield end, line, None
                    continue
                except (ValueError, KeyError, TypeError) as exc:
                    self._reject(line, lineno)
                    warn(
                        f"sink {self.name}: spool {self.path} line {lineno} is damaged ({exc}); kept in "
                        f"{self.rejected_path}, the rest delivered"
                    )
                    yield end, line, None
                    continue
                yield end, line, entry

    def set_aside(self, line: str, what: str) -> None:
        """Append a spool line to the quarantine file, to the disk at once.

        Raises:
            SinkError: the quarantine file cannot be written.
        """
        try:
            _append_synced(self.quarantine_path, line)
        except OSError as err:
            raise SinkError(
                f"sink {self.name} cannot set aside {what}: its quarantine file {self.quarantine_path} cannot be "
                f"written ({err.strerror or err}); fix: make the spool's directory writable or free disk space"
            ) from err
        self.quarantined += 1

    def _reject(self, line: str, lineno: int) -> None:
        """Keep an unreadable spool line (as read) in the rejected file, to the disk at once: a
        damaged line may still be repaired by hand, and it must never vanish with the spool."""
        try:
            _append_synced(self.rejected_path, line)
        except OSError as err:
            raise SinkError(
                f"sink {self.name} cannot keep line {lineno} of its spool {self.path}: the file "
                f"{self.rejected_path} cannot be written ({err.strerror or err}); the spool is left as it is; "
                "fix: make the spool's directory writable or free disk space"
            ) from err
        self.rejected += 1

    def drop_head(self, offset: int) -> None:
        """Remove the delivered first ``offset`` bytes (write the rest, then rename)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        with self.path.open("rb") as src, tmp.open("wb") as dst:
            src.seek(offset)
            shutil.copyfileobj(src, dst)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, self.path)

    def delete(self) -> None:
        """Remove the spool once everything in it was delivered."""
        self.path.unlink(missing_ok=True)
