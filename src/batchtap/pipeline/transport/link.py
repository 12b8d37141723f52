"""The training process's end of one pipeline process (:mod:`batchtap.pipeline.transport.child`).

Everything handed over waits in one outbox, in order, until it can be sent: a block once its copy
completed and its segment has room (it is then read and written into the segment), ``log()``
values once their copy completed, the rest at once. On the CPU nothing waits and the calling thread
sends; otherwise a forwarder thread polls. A receiver thread takes what comes back: answers,
acknowledgements, and what the process tells the :class:`~batchtap.pipeline.chain.control.Control`.

Every message sent stays *unconfirmed* until the process acknowledges it. When the process dies it
is restarted once, and the open run, its chains and every unconfirmed message are sent again
(blocks wait in their segment meanwhile). After a second death the link hands everything still
unconfirmed or waiting to the thread ``on_lost`` returns, and from then on forwards every call to
it: nothing handed over is lost either way.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing
import multiprocessing.util  # noqa: F401  (its exit handler terminates daemon processes: see Tap._end_at_exit)
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from batchtap.capture.clock import DeviceGate
from batchtap.capture.flush import POLL_INTERVAL, Block
from batchtap.capture.logged import Logged
from batchtap.errors import ConfigError
from batchtap.pipeline.chain.control import Control
from batchtap.pipeline.chain.core import PipelineSettings
from batchtap.pipeline.chain.messages import (
    Close,
    Events,
    FinishRun,
    Handover,
    LoggedValues,
    OpenChain,
    Request,
    RunEnd,
    RunStart,
)
from batchtap.pipeline.transport import child
from batchtap.pipeline.transport.crossing import (
    Ack,
    ChildChain,
    Counted,
    Crossing,
    Envelope,
    Failed,
    Judged,
    Meeting,
    Posted,
    Published,
    Reply,
    dumps_to_child,
    loads_from_child,
    main_path,
    rows_of,
    without_main,
)
from batchtap.pipeline.transport.host import PipelineHost
from batchtap.pipeline.transport.shm import BlockSegment
from batchtap.records import Event, EventKind, RunInfo
from batchtap.sinks.base import Sink

__all__ = ["ProcessLink"]

log = logging.getLogger("batchtap")

_SPAWN = multiprocessing.get_context("spawn")
#: segment slots per run: blocks the pipeline process may fall behind before the training thread waits
SEGMENT_SLOTS = 8
#: seconds a request may take beyond its own timeout (a restart in between)
REPLY_GRACE = 10.0

# ---------------------------------------------------------------------- what waits in the outbox


@dataclasses.dataclass(slots=True)
class _Chain:
    """One open chain: its opening (for the pipeline process) and its segment."""

    opening: ChildChain
    segment: BlockSegment


class _Out:
    """Something handed over, waiting to be sent."""

    def ready(self, gate: DeviceGate) -> Crossing | None:
        """The message to send now, or None while it must wait (never blocks)."""
        raise NotImplementedError

    def hand_to(self, host: PipelineHost, answer: Callable[[Request, int | None], None]) -> None:
        """Make the same call on ``host`` instead (the process is gone for good)."""
        raise NotImplementedError


@dataclasses.dataclass(slots=True)
class _Message(_Out):
    message: Crossing
    key: int | None = None  # a request's answer key

    def ready(self, gate: DeviceGate) -> Crossing | None:
        return self.message

    def hand_to(self, host: PipelineHost, answer: Callable[[Request, int | None], None]) -> None:
        _hand_to(host, self.message, self.key, answer)


@dataclasses.dataclass(slots=True)
class _Block(_Out):
    block: Block
    chain: _Chain
    logged: tuple[Logged, ...]
    index: int

    def ready(self, gate: DeviceGate) -> Crossing | None:
        # Never waits: it runs under the sending lock, which the training thread also takes.
        segment, opening = self.chain.segment, self.chain.opening.open
        with gate.open_now() as open_:
            if not (open_ and segment.has_room() and all(item.done() for item in self.logged)):
                return None
            data = self.block.read_now(gate)
        if data is None:
            return None
        records = tuple(item.record(opening.run_id, opening.rank) for item in self.logged)
        return Published(opening.chain, segment.publish(data), records, self.index)

    def hand_to(self, host: PipelineHost, answer: Callable[[Request, int | None], None]) -> None:
        host.submit(self.block, self.chain.opening.open.chain, self.logged, index=self.index)


@dataclasses.dataclass(slots=True)
class _Logged(_Out):
    logged: Logged
    run_id: str
    rank: int
    writes: bool

    def ready(self, gate: DeviceGate) -> Crossing | None:
        with gate.open_now() as open_:  # never waits (see _Block)
            if not (open_ and self.logged.done()):
                return None
        return LoggedValues(self.logged.record(self.run_id, self.rank), self.writes)

    def hand_to(self, host: PipelineHost, answer: Callable[[Request, int | None], None]) -> None:
        host.logged(self.logged, run_id=self.run_id, rank=self.rank, writes=self.writes)


def _hand_to(
    host: PipelineHost, message: Crossing, key: int | None, answer: Callable[[Request, int | None], None]
) -> None:
    """A message meant for the pipeline process, handed to ``host`` (a thread) instead."""
    if isinstance(message, Request):
        answer(message, key)
    elif isinstance(message, ChildChain):
        host.open(dataclasses.replace(message.open, reduce=None), max_rows=0)
    elif isinstance(message, Published):
        raise AssertionError("a published block is replayed from its segment")
    else:
        host.send(message)


class _Reply:
    __slots__ = ("done", "value")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None


# ---------------------------------------------------------------------- the link


class ProcessLink(PipelineHost):
    """See the module docstring.

    Args:
        sinks: the sinks, pickled into the pipeline process.
        control: where the process's verdicts, errors and anomaly counts are posted.
        settings: queues, backpressure and rules (pickled too).
        gate: the device gate to query inside.
        on_lost: called (under the link's lock) after the process's second death; returns the
            thread host that takes over.

    Raises:
        ConfigError: a sink or rule cannot be carried into another process (it does not pickle).
    """

    def __init__(
        self,
        sinks: Sequence[Sink],
        control: Control,
        settings: PipelineSettings,
        gate: DeviceGate,
        on_lost: Callable[[], PipelineHost],
    ) -> None:
        self.sinks = list(sinks)
        self.control = control
        self.gate = gate
        self._on_lost = on_lost
        self._refs: dict[int, object] = {}
        try:
            self._config = dumps_to_child((self.sinks, settings), self._refs)
        except Exception as exc:
            raise ConfigError(
                f"pipeline='process' carries the sinks and rules into another process, but they do not pickle: "
                f"{type(exc).__name__}: {exc}; expected sinks and rules defined at module level without open "
                "files, connections or lambdas. Fix: make them picklable, or use Tap(pipeline='thread')"
            ) from None
        self._lock = threading.Lock()  # one sender at a time, in order
        self._more = threading.Condition(self._lock)
        self._outbox: collections.deque[_Out] = collections.deque()
        self._seq = 0  # messages sent so far
        self._unconfirmed: collections.deque[Envelope] = collections.deque()
        self._replies: dict[int, _Reply] = {}
        self._chains: dict[int, _Chain] = {}
        self._run: RunInfo | None = None  # the open run, where this rank writes
        self._store: Any = None  # rank 0: the TCPStore the pipeline processes of all ranks meet at
        self._meeting_port: int | None = None  # its port, on every rank
        self._restarts = 0
        self._closing = False
        self.replaced_by: PipelineHost | None = None  # the thread after the process's second death
        self._start_process()
        self._forwarder = threading.Thread(target=self._forward_loop, name="batchtap-forward", daemon=True)
        self._forwarder.start()

    @property
    def process(self) -> Any:
        """The pipeline process (``multiprocessing.Process``): the latest one started."""
        return self._proc

    # ------------------------------------------------------------------ the host calls

    def send(self, message: Handover) -> None:
        self._queue(_Message(self.numbered(message)))

    def submit(self, block: Block, chain: int, logged: Sequence[Logged] = (), *, index: int | None = None) -> None:
        if index is None:
            index = self.number_block(chain)
        self._queue(_Block(block, self._chains[chain], tuple(logged), index))

    def logged(self, logged: Logged, *, run_id: str, rank: int, writes: bool) -> None:
        self._queue(_Logged(logged, run_id, rank, writes))

    def open(self, message: OpenChain, *, max_rows: int) -> None:
        for old in self._chains.values():  # the last run's blocks were drained at this run's start
            old.segment.close()
        self._chains.clear()
        layout_widths = _widths(message)
        segment = BlockSegment.create(slots=SEGMENT_SLOTS, max_rows=max_rows, **layout_widths)
        opening = message
        if message.reduce is not None:
            host, port = self._meeting_point(message.reduce)
            opening = dataclasses.replace(
                message, reduce=dataclasses.replace(message.reduce, group=Meeting(host, port))
            )
        chain = _Chain(ChildChain(opening, segment.shape), segment)
        self._chains[message.chain] = chain
        self._queue(_Message(chain.opening))

    def ask(self, request: Request, timeout: float | None) -> Any:
        """Send a request and wait (bounded) for its answer; None when none came in time."""
        reply = _Reply()
        key = id(reply)
        self._replies[key] = reply
        try:
            self._queue(_Message(request, key))
            wait = None if timeout is None else timeout + REPLY_GRACE
            if not reply.done.wait(wait):
                if isinstance(request, FinishRun):
                    log.warning(
                        "batchtap: run %r (%s): the pipeline process did not confirm within end_timeout=%g s that "
                        "every step was stored",
                        request.run.name,
                        request.run.id,
                        request.timeout,
                    )
                return None
            return reply.value
        finally:
            self._replies.pop(key, None)

    def close(self, timeout: float | None = 30.0) -> None:
        """Close the process's sinks (bounded), then end it."""
        if self._closing:
            return
        self._closing = True  # from here a closing process is not a dead one
        # sync: close — the pipeline process ends its sinks and exits (bounded).
        self.ask(Close(timeout), timeout)
        self.shut()

    def shut(self) -> None:
        """End the process (killed if it does not exit), the pipe and the segments."""
        self._closing = True
        with self._lock:
            self._more.notify_all()
        proc = self._proc
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
        self._conn.close()
        for chain in self._chains.values():
            chain.segment.close()
        self._chains.clear()

    def at_exit(self, timeout: float) -> None:
        """Interpreter exit with the Tap still open: the process stores what it has and exits
        (bounded), before multiprocessing would terminate it."""
        self.close(timeout)

    # ------------------------------------------------------------------ sending

    def _queue(self, out: _Out) -> None:
        with self._lock:
            thread = self.replaced_by
            if thread is not None:  # the process died for good while this call waited for the lock
                out.hand_to(thread, self._answerer(thread))
                return
            if not self._outbox:
                message = out.ready(self.gate)
                if message is not None:  # nothing waits before it: send now (every CPU flush)
                    self._send_locked(message, _key(out))
                    return
            self._outbox.append(out)
            self._more.notify()

    def _send_locked(self, message: Crossing, key: int | None) -> None:
        seq = self._seq
        self._seq += 1
        envelope = Envelope(seq, message, key)
        self._note(message)
        self._unconfirmed.append(envelope)
        self._transmit(envelope)

    def _note(self, message: Crossing) -> None:
        """Keep what a restarted process must be told again before the unconfirmed messages."""
        if isinstance(message, RunStart):
            self._run = message.run
        elif isinstance(message, RunEnd):
            self._run = None

    def _transmit(self, envelope: Envelope) -> None:
        try:
            self._conn.send_bytes(dumps_to_child(envelope, self._refs))
        except (OSError, ValueError):
            pass  # the process is gone: the receiver restarts it and sends every unconfirmed message again

    def _forward_loop(self) -> None:
        """Sends what waits for the device (a block's copy, ``log()`` values) or for segment room."""
        while True:
            with self._lock:
                while not self._outbox and not self._closing:
                    self._more.wait()
                if self._closing and not self._outbox:
                    return
                while self._outbox:
                    message = self._outbox[0].ready(self.gate)
                    if message is None:
                        break
                    self._send_locked(message, _key(self._outbox.popleft()))
            time.sleep(POLL_INTERVAL)  # polling leaves the GIL to the training thread

    # ------------------------------------------------------------------ the process and what it says

    def _start_process(self) -> None:
        ours, theirs = _SPAWN.Pipe(duplex=True)
        self._proc = _SPAWN.Process(
            target=child.main,
            args=(theirs, self._config, os.getpid(), main_path()),
            name="batchtap-pipeline",
            daemon=True,
        )
        with without_main():  # the child imports the training script only if a pickle needs it
            self._proc.start()
        theirs.close()
        self._conn = ours
        receiver = threading.Thread(
            target=self._receive_loop, args=(ours, self._proc), name="batchtap-receive", daemon=True
        )
        receiver.start()

    def _receive_loop(self, conn: Any, proc: Any) -> None:
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                break
            answer = loads_from_child(data, self._refs)
            if isinstance(answer, Ack):
                with self._lock:
                    while self._unconfirmed and self._unconfirmed[0].seq <= answer.seq:
                        self._unconfirmed.popleft()
            elif isinstance(answer, Reply):
                self._deliver(answer.key, answer.value)
            elif isinstance(answer, Posted):
                self.control.post(answer.verdict)
            elif isinstance(answer, Failed):
                self.control.fail(answer.error)
            elif isinstance(answer, Judged):
                self.control.judged(answer.chain, answer.index, answer.error)
            elif isinstance(answer, Counted):
                self.control.count_anomalies(answer.counts)
        if not self._closing:
            self._process_died(proc)

    def _deliver(self, key: int | None, value: Any) -> None:
        reply = self._replies.get(key) if key is not None else None
        if reply is not None:
            reply.value = value
            reply.done.set()

    def _process_died(self, proc: Any) -> None:
        proc.join(timeout=5)
        what = f"batchtap's pipeline process died (exit code {proc.exitcode})"
        with self._lock:
            if self._closing:
                return
            if self._restarts == 0:
                self._restarts += 1
                log.error("batchtap: %s; restarting it once, nothing flushed is lost", what)
                self._start_process()
                for envelope in self._resend():
                    self._transmit(envelope)
                self._report_locked(f"{what}; it was restarted and every unconfirmed block was sent again")
            else:
                log.error("batchtap: %s again; the pipeline goes on in a thread of the training process", what)
                self._fall_back_locked()
                self._report_locked(f"{what} again; the pipeline went on in a thread of the training process")

    def _resend(self) -> list[Envelope]:
        """What a successor must be told: the open run and chains (unless among the unconfirmed
        messages), then every unconfirmed message. A successor cannot rejoin the other ranks'
        reduction, so no chain reduces across ranks any more."""
        resent = list(self._unconfirmed)
        kinds = [envelope.message for envelope in resent]
        out: list[Envelope] = []
        if self._run is not None and not any(isinstance(m, RunStart) for m in kinds):
            out.append(Envelope(-1, RunStart(self._run)))
        for chain in self._chains.values():
            if chain.opening not in kinds:
                out.append(Envelope(-1, _local(chain.opening)))
        for envelope in resent:
            if isinstance(envelope.message, ChildChain):
                envelope = dataclasses.replace(envelope, message=_local(envelope.message))
            out.append(envelope)
        return out

    def _fall_back_locked(self) -> None:
        """Hand everything unconfirmed or waiting to the thread that takes over, in order."""
        thread = self._on_lost()
        answer = self._answerer(thread)
        for envelope in self._resend():
            message = envelope.message
            if isinstance(message, Published):
                segment = self._chains[message.chain].segment
                if message.seq >= segment.consumed:  # one the dead process had stored is not stored again
                    thread.send(rows_of(message, segment.read(message.seq)))  # a copy: the slot is free
                    segment.consume(message.seq)
            else:
                _hand_to(thread, message, envelope.key, answer)
        self._unconfirmed.clear()
        self.replaced_by = thread
        waiting = list(self._outbox)
        self._outbox.clear()
        for out in waiting:
            out.hand_to(thread, answer)

    def _answerer(self, thread: PipelineHost) -> Callable[[Request, int | None], None]:
        """How ``thread`` answers the requests the process cannot answer any more: on a helper
        thread each (its caller waits for the answer, as it would have for the process)."""

        def answer_later(request: Request, key: int | None) -> None:
            def answer() -> None:
                # sync: the caller of the request waits for this answer (as it would have for the process).
                self._deliver(key, thread.ask(request, None))

            threading.Thread(target=answer, name="batchtap-answer", daemon=True).start()

        return answer_later

    def _report_locked(self, message: str) -> None:
        if self._run is None:
            return
        event = Event(self._run.id, 0, EventKind.WARNING, message, time.time())
        if self.replaced_by is not None:
            self.replaced_by.send(Events((event,), None, True))
        else:
            self._send_locked(Events((event,), None, True), None)

    def _meeting_point(self, reduce: Any) -> tuple[str, int]:
        """Where the pipeline processes of all ranks meet to make their own gloo group: a TCPStore
        served by rank 0's training process (its port told to the other ranks over batchtap's group)."""
        import torch
        import torch.distributed as dist

        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        if self._meeting_port is None:  # once per Tap: the pipeline processes keep their group
            port = torch.zeros(1, dtype=torch.int64)
            if reduce.rank == 0:
                self._store = dist.TCPStore(host, 0, None, True, wait_for_workers=False)
                port[0] = self._store.port
            dist.broadcast(port, src=0, group=reduce.group)
            # sync: first step of a run in a process group — a CPU tensor of batchtap's own gloo group
            self._meeting_port = int(port.tolist()[0])
        return host, self._meeting_port


def _key(out: _Out) -> int | None:
    return out.key if isinstance(out, _Message) else None


def _local(opening: ChildChain) -> ChildChain:
    """The opening without its cross-rank reduction."""
    return dataclasses.replace(opening, open=dataclasses.replace(opening.open, reduce=None))


def _widths(message: OpenChain) -> dict[str, int]:
    """The segment's row widths: the run's device and host columns."""
    return {"device_width": message.columns.device_width, "host_width": message.columns.host_width}
