"""The sink interface: where decoded records go.

A sink runs on batchtap's dispatcher thread, never on the training thread, and sees host values
only. The contract is deliberately small:

* ``write(records, events)`` — a block of records in step order, plus the events raised while
  decoding them. Called once per flushed block.
* ``flush()`` — make everything written so far durable/visible.
* ``close()`` — release files and connections.
* ``start_run(run)`` / ``end_run(run)`` — run life-cycle hooks; the defaults do nothing.
* ``start_epoch(run_id, epoch, total)`` — ``Tap.watch()`` began an epoch of ``total`` batches
  (None: the loader has no length); for progress displays; the default does nothing.

Optional third-party packages a sink needs are imported inside the sink's constructor, with an error
naming the extra to install (see :func:`require`).

:func:`feed` makes the calls that a stream of record codec objects (:data:`batchtap.records.Message`:
read from a JSONL file, a spool, another process) stands for.

A sink is pickled into the pipeline process under ``bt.Tap(pipeline="process")``: what it holds of
this process only (connections, open files, threads, locks, servers) must not travel. The built-in
sinks name those attributes in :attr:`Sink._live`; pickling leaves them out, and unpickling opens
them again through :meth:`Sink._open_live`, as the constructor did.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from batchtap._optional import require  # re-exported: sinks import it from here
from batchtap.errors import ConfigError, SinkError
from batchtap.records import EpochStart, Event, EventKind, Message, Record, RunEnd, RunInfo, RunStart, Write

#: Counter names under which sinks of other trackers (MLflow, W&B) count a run's events by kind.
EVENT_COUNTERS = {
    EventKind.ANOMALY: "batchtap/anomalies",
    EventKind.ACTION: "batchtap/actions",
    EventKind.SKIP: "batchtap/skipped_steps",
    EventKind.WARNING: "batchtap/warnings",
    EventKind.INFO: "batchtap/notes",
}

__all__ = ["Sink", "SinkDataError", "EVENT_COUNTERS", "require", "feed"]


class SinkDataError(SinkError):
    """A block cannot be stored because of what it holds (a value or name the store refuses),
    not because the store is unavailable: writing it again later fails the same way.

    :class:`batchtap.sinks.resilient.ResilientSink` therefore never spools such a block
    behind the others: it reports it and, for a spooled block, sets it aside in a quarantine
    file after a bounded number of tries.
    """


class Sink:
    """Base class of every sink. Subclasses implement :meth:`write`; the rest is optional.

    Example:
        >>> class Count(Sink):
        ...     def __init__(self) -> None:
        ...         self.n = 0
        ...     def write(self, records, events=()):
        ...         self.n += len(records)
        >>> Count().n
        0
    """

    #: Attributes holding what only this process can use (connections, open files, threads,
    #: locks, servers): pickling leaves them out, and the unpickled copy has them None until
    #: :meth:`_open_live` opens its own.
    _live: ClassVar[tuple[str, ...]] = ()

    #: Whether ``bt.Tap(spool_dir=...)`` wraps the sink in a spooling
    #: :class:`~batchtap.sinks.resilient.ResilientSink`. False for a sink that shows what happens
    #: now (the console): replaying its blocks later, into another run's output, would show stale lines.
    wrap_in_spool: ClassVar[bool] = True

    def __getstate__(self) -> dict[str, Any]:
        """What pickling carries: every attribute but those named in :attr:`_live`."""
        state = self.__dict__.copy()
        for name in self._live:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled sink in this process, then open its live resources (:meth:`_open_live`)."""
        self.__dict__.update(state)
        for name in self._live:
            setattr(self, name, None)
        self._open_live()

    def _open_live(self) -> None:
        """Open this process's resources of the sink (the attributes named in :attr:`_live`).

        Called by unpickling; a sink whose constructor opens them calls it too, so that a copy
        in another process opens them, with the same checks and errors, exactly as the original
        did. The default opens nothing.
        """

    def start_run(self, run: RunInfo) -> None:
        """Called once when a run starts, before any of its records."""

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        """Store or show one block of records (step order) and the events raised with them."""
        raise NotImplementedError

    def end_run(self, run: RunInfo) -> None:
        """Called once when a run ends, after all of its records; ``run.status`` is final."""

    def start_epoch(self, run_id: str, epoch: int, total: int | None) -> None:
        """``Tap.watch()`` began epoch ``epoch`` of a loader of ``total`` batches (None: no
        ``len()``). Sent through the pipeline like records, so it may arrive while the previous
        epoch's last records are still on their way: key what it tells by ``epoch``."""

    def flush(self) -> None:
        """Make everything written so far durable or visible."""

    def take_events(self) -> list[Event]:
        """Events the sink raised about itself since the last call (an outage, a recovery, rows it
        refused), stored through the other sinks. Asked after every call; the default has none."""
        return []

    def last_step(self, run_id: str) -> int | None:
        """The largest step stored for ``run_id``, or None when unknown (``tap.run(resume=...)``
        asks the sinks that can answer: the SQL sinks)."""
        return None

    def run_name(self, run_id: str) -> str | None:
        """The name ``run_id`` was stored under, or None when unknown (a resumed run without a
        ``name=`` keeps it)."""
        return None

    def close(self) -> None:
        """Release resources. The sink is not used afterwards."""


def feed(messages: Iterable[Message], sink: Sink, *, block_size: int = 10_000) -> int:
    """Make the sink calls that ``messages`` stand for, in order: ``start_run`` for a
    :class:`~batchtap.records.RunStart`, ``write`` for a :class:`~batchtap.records.Write`, and so on.

    Consecutive :class:`~batchtap.records.Record` and :class:`~batchtap.records.Event` objects are
    gathered into one ``write`` of up to ``block_size`` items (a JSONL file holds them one per
    line); any other object first hands over what was gathered, so the order of runs, epochs and
    blocks is kept. The sink is neither flushed nor closed.

    Args:
        messages: record codec objects, e.g. from :func:`batchtap.sinks.jsonl.read_jsonl`.
        sink: the sink to call.
        block_size: most records and events in one ``write``.

    Returns:
        The number of objects fed.

    Raises:
        ConfigError: ``block_size`` is below 1.
        TypeError: an object is not a record codec object.

    Example:
        >>> from batchtap.records import RunStart
        >>> class Steps(Sink):
        ...     def __init__(self):
        ...         self.calls = []
        ...     def start_run(self, run):
        ...         self.calls.append(("start_run", run.id))
        ...     def write(self, records, events=()):
        ...         self.calls.append(("write", [r.step for r in records], len(events)))
        >>> sink = Steps()
        >>> msgs = [RunStart(RunInfo("r1", "exp", {}, 0.0))]
        >>> msgs += [Record("r1", s, 0, s, 0, 0.0, {"loss": 0.5}) for s in range(5)]
        >>> msgs += [Event("r1", 4, EventKind.WARNING, "slow disk", 0.0)]
        >>> feed(msgs, sink, block_size=3)
        7
        >>> sink.calls
        [('start_run', 'r1'), ('write', [0, 1, 2], 0), ('write', [3, 4], 1)]
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block_size must be an integer >= 1, got {block_size!r}")
    records: list[Record] = []
    events: list[Event] = []

    def hand_over() -> None:
        nonlocal records, events
        if records or events:
            sink.write(records, events)
            records, events = [], []

    n = 0
    for m in messages:
        n += 1
        if isinstance(m, Record):
            records.append(m)
        elif isinstance(m, Event):
            events.append(m)
        else:
            hand_over()
            if isinstance(m, Write):
                sink.write(m.records, m.events)
            elif isinstance(m, RunStart):
                sink.start_run(m.run)
            elif isinstance(m, RunEnd):
                sink.end_run(m.run)
            elif isinstance(m, EpochStart):
                sink.start_epoch(m.run_id, m.epoch, m.total)
            else:
                raise TypeError(f"expected record codec objects (batchtap.records.Message), got {type(m).__name__}")
            continue
        if len(records) + len(events) >= block_size:
            hand_over()
    hand_over()
    return n
