"""``ResilientSink``: a failing sink never loses a block, and never stalls the others.

While the wrapped sink fails, each block (and each ``start_run``/``end_run``) is appended to a
JSONL spool file. Later calls retry with exponential backoff; when the sink takes writes again the
spool is replayed in order, then deleted. A spool left behind by a process that ended while the
sink was down is replayed when the next ``ResilientSink`` on that path is constructed (or, if the
sink is still down, at its next successful retry).

Delivery is at least once: a block may reach the sink twice when the process dies between a
successful replay and the spool's deletion, or when a sink stored part of a block before failing.
The SQL sinks make that exactly once in effect: they upsert on (run, metric, step, rank) and
ignore events already stored.

The spool's format and side files are described in :mod:`batchtap.sinks.spool`; a line of the
spool format before the record codec is set aside in the quarantine file with a WARNING naming it,
and the rest is delivered.

A sink that hangs is a failing sink: every call into it runs on a helper thread and is given
``call_timeout`` seconds; past that the block is spooled and training goes on, and until the hung
call returns every further block is spooled too. A block the sink refuses for what it holds
(:class:`~batchtap.sinks.base.SinkDataError`, or a ``ValueError``/``TypeError`` from a sink of
your own) is never held in front of the others: it is set aside in a quarantine file
(``<spool>.quarantine.jsonl``, same format) and reported, after ``max_data_tries`` tries when
it comes from the spool.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from batchtap.errors import ConfigError, SinkError
from batchtap.records import Event, EventKind, Record, RunEnd, RunInfo, RunStart, Write
from batchtap.sinks.base import Sink, SinkDataError
from batchtap.sinks.callthread import CallThread, SinkStalled
from batchtap.sinks.spool import Spool, SpoolEntry, decode_entry, describe, encode_entry

__all__ = ["ResilientSink", "SinkStalled", "SpoolEntry", "encode_entry", "decode_entry"]

_log = logging.getLogger(__name__)


def _is_data_error(exc: BaseException) -> bool:
    """Whether a sink refused a block for what it holds (retrying cannot help), rather than
    because it is unavailable (retrying later can)."""
    if isinstance(exc, SinkDataError):
        return True
    if isinstance(exc, (SinkError, ConfigError, OSError)):
        return False
    return isinstance(exc, (ValueError, TypeError, KeyError, ArithmeticError))


# -- the wrapper --------------------------------------------------------------------------------
class ResilientSink(Sink):
    """Wrap a sink so that its failures are retried with backoff and nothing is lost meanwhile.

    The wrapper never raises from ``start_run``, ``write``, ``end_run``, ``flush`` or ``close``
    because of the wrapped sink; it raises :class:`~batchtap.errors.SinkError` only when the spool
    file itself cannot be written (then the block really cannot be kept). What went wrong is
    reported as WARNING :class:`~batchtap.records.Event` s collected by :meth:`take_events` (and
    logged), for the dispatcher to route to the other sinks.

    Retries happen on later calls (``write``, ``start_run``, ``end_run``, ``flush``) once the
    backoff delay has passed; the wrapper's only thread runs the sink's calls under
    ``call_timeout``. The delay starts at
    ``retry_initial`` seconds, doubles after each failed retry, and is capped at ``retry_max``.
    ``close()`` makes one last attempt regardless of the delay; what still fails stays in the spool
    for the next start.

    Not for several processes at once: give every process and sink its own ``spool_path``.

    Args:
        sink: the sink to protect.
        spool_path: JSONL file for blocks the sink could not take (created when needed, deleted
            once replayed).
        retry_initial: seconds before the first retry.
        retry_max: longest delay between retries, in seconds.
        name: the sink's name in messages (default: its class name).
        clock: monotonic clock in seconds (tests may drive time by hand).
        call_timeout: seconds one call into the sink may take before the sink counts as failed
            (``None``: wait as long as it takes, on the caller's thread).
        max_data_tries: tries of a spooled block the sink refuses for what it holds before it is
            moved to the quarantine file.

    Example:
        >>> import tempfile, os
        >>> class Flaky(Sink):
        ...     def __init__(self):
        ...         self.down, self.got = True, []
        ...     def write(self, records, events=()):
        ...         if self.down:
        ...             raise OSError("disk gone")
        ...         self.got.extend(records)
        >>> inner = Flaky()
        >>> sink = ResilientSink(inner, spool_path=os.path.join(tempfile.mkdtemp(), "spool.jsonl"), retry_initial=0.0001)
        >>> r = Record("r", step=0, epoch=0, batch=0, rank=0, wall_time=0.0, values={"loss": 1.0})
        >>> sink.write([r])                       # fails: spooled, reported
        >>> [e.kind.value for e in sink.take_events()]
        ['warning']
        >>> inner.down = False
        >>> sink.flush()                          # retry: replays the spool
        >>> [x.step for x in inner.got], sink.pending
        ([0], False)
    """

    _live = ("_caller", "_lock")

    def __init__(
        self,
        sink: Sink,
        *,
        spool_path: str | os.PathLike[str],
        retry_initial: float = 0.1,
        retry_max: float = 5.0,
        name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        call_timeout: float | None = 10.0,
        max_data_tries: int = 3,
    ) -> None:
        if not (retry_initial >= 0 and retry_max >= retry_initial and math.isfinite(retry_max)):
            raise ConfigError(
                f"need 0 <= retry_initial <= retry_max (finite), got retry_initial={retry_initial} "
                f"and retry_max={retry_max}"
            )
        if call_timeout is not None and not (call_timeout > 0 and math.isfinite(call_timeout)):
            raise ConfigError(f"call_timeout must be a finite number of seconds > 0 or None, got {call_timeout!r}")
        if isinstance(max_data_tries, bool) or not isinstance(max_data_tries, int) or max_data_tries < 1:
            raise ConfigError(f"max_data_tries must be an integer >= 1, got {max_data_tries!r}")
        self.sink = sink
        self.name = name or type(sink).__name__
        self._spool = Spool(spool_path, self.name)
        #: the spool file, and beside it the files for calls set aside and lines that cannot be read
        self.spool_path = self._spool.path
        self.quarantine_path = self._spool.quarantine_path
        self.rejected_path = self._spool.rejected_path
        self.call_timeout = call_timeout
        self.max_data_tries = max_data_tries
        self._caller = CallThread(self.name)
        self._head_tries = 0  # data failures of the spool's first entry so far
        self._initial = float(retry_initial)
        self._max = float(retry_max)
        self._delay = self._initial
        self._clock = clock
        self._lock = threading.RLock()
        self._events: list[Event] = []
        self._down_since: float | None = None
        self._next_retry = 0.0
        self._where: tuple[str, int, int] = ("", 0, 0)  # (run_id, step, rank) of the latest op, for events
        #: blocks (and run life-cycle calls) appended to the spool since construction.
        self.spooled = 0
        #: spool entries replayed into the sink since construction.
        self.replayed = 0
        self._spool.check_place()
        if self.pending:
            # A previous process left blocks behind: deliver them before anything new.
            self._down_since = self._clock()
            self._replay(why="left by an earlier run")

    def _open_live(self) -> None:
        """In a copy unpickled in another process (the wrapped sink travels with it): a call
        thread and lock of its own, the spool reopened when next appended to; warnings not yet
        taken stay with the original."""
        self._caller = CallThread(self.name)
        self._lock = threading.RLock()
        self._events = []

    # -- state ------------------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        """Whether the spool holds blocks not yet delivered."""
        return self._spool.pending

    @property
    def rejected(self) -> int:
        """Spool lines kept in ``rejected_path`` (they could not be read) since construction."""
        return self._spool.rejected

    @property
    def quarantined(self) -> int:
        """Blocks (and run calls) set aside in ``quarantine_path`` since construction."""
        return self._spool.quarantined

    def last_step(self, run_id: str) -> int | None:
        """The wrapped sink's last stored step for ``run_id`` (None while it is down)."""
        found = self._ask(self.sink.last_step, run_id)
        return None if found is None else int(found)

    def run_name(self, run_id: str) -> str | None:
        """The wrapped sink's stored name of ``run_id`` (None while it is down)."""
        found = self._ask(self.sink.run_name, run_id)
        return None if found is None else str(found)

    def _ask(self, question: Callable[[str], Any], run_id: str) -> Any:
        """The wrapped sink's answer about ``run_id``, or None while it is down (the caller then
        treats it as unknown)."""
        try:
            return self._call(question, run_id)
        except Exception:
            return None

    def take_events(self) -> list[Event]:
        """The WARNING events raised since the last call (sink failed, recovered, spool damaged)."""
        with self._lock:
            out, self._events = self._events, []
        return out + self.sink.take_events()  # e.g. rows a SQL sink refused

    def _warn(self, message: str) -> None:
        _log.warning("%s", message)
        run_id, step, rank = self._where
        self._events.append(Event(run_id, step, EventKind.WARNING, message, time.time(), rank=rank))

    # -- sink interface ---------------------------------------------------------------------
    def start_run(self, run: RunInfo) -> None:
        """Forward ``start_run`` (spooled if the sink is down)."""
        self._do(RunStart(run))

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        """Forward one block (spooled if the sink is down)."""
        self._do(Write(list(records), list(events)))

    def end_run(self, run: RunInfo) -> None:
        """Forward ``end_run`` (spooled if the sink is down)."""
        self._do(RunEnd(run))

    def start_epoch(self, run_id: str, epoch: int, total: int | None) -> None:
        """Forward ``start_epoch`` while the sink is up; it only feeds progress displays, so it is
        neither spooled nor retried."""
        with self._lock:
            if self.pending:
                return
            try:
                self.sink.start_epoch(run_id, epoch, total)
            except Exception as exc:  # noqa: BLE001 - reported like any failure of the sink
                self._warn(f"sink {self.name}: start_epoch failed: {type(exc).__name__}: {exc}")

    def flush(self) -> None:
        """Retry a down sink if its backoff delay has passed, then flush it."""
        with self._lock:
            if self.pending:
                if self._clock() >= self._next_retry:
                    self._replay(why="on flush")
                if self.pending:
                    return
            try:
                self._call(self.sink.flush)
            except Exception as exc:  # noqa: BLE001 - any failure of a sink is reported, not raised
                self._warn(f"sink {self.name}: flush failed: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """One last replay attempt (ignoring the backoff delay), then close the sink."""
        with self._lock:
            if self.pending:
                self._replay(why="at close")
                if self.pending:
                    self._warn(
                        f"sink {self.name} is still failing at close; its undelivered blocks stay in "
                        f"{self.spool_path} and are replayed when a ResilientSink next opens that spool"
                    )
            self._spool.close()
            try:
                self._call(self.sink.close)
            except Exception as exc:  # noqa: BLE001
                self._warn(f"sink {self.name}: close failed: {type(exc).__name__}: {exc}")

    # -- machinery --------------------------------------------------------------------------
    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.call_timeout is None:
            return fn(*args)
        return self._caller.call(fn, args, self.call_timeout)

    def _apply(self, entry: SpoolEntry) -> None:
        if isinstance(entry, Write):
            self._call(self.sink.write, entry.records, entry.events)
        elif isinstance(entry, RunStart):
            self._call(self.sink.start_run, entry.run)
        else:
            self._call(self.sink.end_run, entry.run)

    def _quarantine(self, line: str, entry: SpoolEntry | None, exc: BaseException, *, tries: int) -> None:
        """Set a block the sink refuses for what it holds aside, so it never blocks the others."""
        what = describe(entry) if entry else "a spooled block"
        self._spool.set_aside(line, f"{what} it refused")
        self._warn(
            f"sink {self.name} refused {what} for what it holds "
            f"({type(exc).__name__}: {exc}) after {tries} {'try' if tries == 1 else 'tries'}; set aside in "
            f"{self.quarantine_path} so that later blocks are not held up behind it"
        )

    def _note_where(self, entry: SpoolEntry) -> None:
        if isinstance(entry, Write):
            first = entry.records[0] if entry.records else (entry.events[0] if entry.events else None)
            if first is not None:
                self._where = (first.run_id, first.step, first.rank)
        else:
            run_id = entry.run.id
            self._where = (run_id, self._where[1] if self._where[0] == run_id else 0, self._where[2])

    def _do(self, op: SpoolEntry) -> None:
        with self._lock:
            self._note_where(op)
            if self.pending:
                # Order matters: behind the spooled blocks, never ahead of them.
                self._spool.append(op)
                self.spooled += 1
                if self._clock() >= self._next_retry:
                    self._replay(why="on retry")
                return
            try:
                self._apply(op)
            except Exception as exc:  # noqa: BLE001 - whatever the sink raises, the block is kept
                if _is_data_error(exc):
                    # it would fail the same way again: never hold the queue up behind it
                    self._quarantine(encode_entry(op), op, exc, tries=1)
                    return
                self._spool.append(op)
                self.spooled += 1
                now = self._clock()
                self._down_since = now
                self._delay = self._initial
                self._next_retry = now + self._delay
                self._warn(
                    f"sink {self.name} failed: {type(exc).__name__}: {exc}; spooling its blocks to "
                    f"{self.spool_path} and retrying with backoff (nothing is lost)"
                )

    def _replay(self, *, why: str) -> None:
        """Deliver the spool in order. On the first failure keep the rest and back off."""
        self._spool.close()
        done_offset = 0
        delivered = 0
        try:
            for end, line, op in self._spool.read(self._warn):
                if op is None:  # unreadable or of an older format: kept aside by the spool, reported
                    done_offset = end
                    continue
                try:
                    self._apply(op)
                except Exception as exc:  # noqa: BLE001 - classified below
                    if not _is_data_error(exc):
                        raise
                    self._head_tries += 1
                    if self._head_tries < self.max_data_tries:
                        raise
                    self._quarantine(line, op, exc, tries=self._head_tries)
                self._head_tries = 0
                done_offset = end
                delivered += 1
                self.replayed += 1
        except OSError as exc:
            if not self.spool_path.exists():
                return
            failure: BaseException = exc
        except Exception as exc:  # noqa: BLE001 - the sink is still down
            failure = exc
        else:
            self._spool.delete()
            down_for = self._clock() - (self._down_since if self._down_since is not None else self._clock())
            self._down_since = None
            self._delay = self._initial
            self._next_retry = 0.0
            msg = f"sink {self.name} recovered ({why}) after {down_for:.1f} s; replayed {delivered} spooled blocks"
            _log.warning("%s", msg)
            run_id, step, rank = self._where
            self._events.append(Event(run_id, step, EventKind.WARNING, msg, time.time(), rank=rank))
            return
        if done_offset:
            self._spool.drop_head(done_offset)
        now = self._clock()
        self._delay = min(max(self._delay * 2, self._initial), self._max) if self._next_retry else self._initial
        self._next_retry = now + self._delay
        _log.info(
            "sink %s still failing (%s: %s); next retry in %.2f s",
            self.name,
            type(failure).__name__,
            failure,
            self._delay,
        )
