"""The pipeline in a process of its own (``Tap(pipeline="process")``).

The training process only captures. At each flush it reads the block back (at once on the CPU; on a
GPU a small forwarder thread polls the copy's marker first), writes its rows into a shared-memory
segment (:mod:`batchtap.pipeline.shm`) and sends a one-line notice down a pipe. The pipeline
process, started with the ``spawn`` method, runs the same :class:`~batchtap.pipeline.core.PipelineCore`
as the pipeline thread: decode, validate, reduce across ranks, rules, sinks. Its sinks' work never
holds the training process's GIL. Rule verdicts, errors and anomaly counts come back on the pipe; a
receiver thread posts them to the :class:`~batchtap.pipeline.control.Control`, where the training
thread acts on them at the same step boundaries as with the thread pipeline.

Failure handling:

* **The training process dies** (SIGKILL, a crash): the pipeline process sees the pipe close (or
  its parent change), processes every block and message already sent — every flushed block on the
  CPU, since the flush writes it to the segment before ``step()`` returns — and ends the open run
  as ``killed``.
* **The pipeline process dies**: reported (log error and a warning event), restarted once; every
  message it had not confirmed is sent again, and unprocessed blocks wait in the segment meanwhile
  (bounded: a full segment makes the training thread wait, as a full ring does). After a second
  death the pipeline falls back to a thread of the training process, which takes over the blocks
  still in the segment: nothing is lost either way.
* **Exit**: ``Tap.close()`` ends the process; it is a daemon, so no exit path leaves it behind.

Records, events and sink calls travel in the record codec's form (``records.to_wire``), the same
as JSONL lines and spool entries; verdicts, which hold training-side references, travel as pickles.

Objects that belong to the training side — modules, optimizers, tensors, GradScalers — are never
copied into the pipeline process: they travel as references (pickle persistent ids) and come back as
the same objects (a metric's optimizer, say, is not needed to decode its values).
"""

from __future__ import annotations

import collections
import dataclasses
import io
import logging
import multiprocessing
import multiprocessing.util  # noqa: F401  (its exit handler terminates daemon processes: see Tap._end_at_exit)
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from batchtap.capture.clock import DeviceGate
from batchtap.capture.flush import Block, Flusher
from batchtap.capture.logged import Logged
from batchtap.errors import ConfigError
from batchtap.metrics.layout import Layout
from batchtap.pipeline.chain import ReduceSpec, RunChain
from batchtap.pipeline.control import Control
from batchtap.pipeline.core import PipelineCore, PipelineSettings
from batchtap.pipeline.harvest import read_block
from batchtap.pipeline.shm import BlockSegment, SegmentShape
from batchtap.records import (
    EpochStart,
    Event,
    EventKind,
    Record,
    RunEnd,
    RunInfo,
    RunStart,
    RunStatus,
    Write,
    from_wire,
    to_wire,
)
from batchtap.sinks.base import Sink

__all__ = ["ProcessPipeline"]

log = logging.getLogger("batchtap")

_SPAWN = multiprocessing.get_context("spawn")
#: segment slots per run: blocks the pipeline process may fall behind before the training thread waits
_SEGMENT_SLOTS = 8
_POLL = 2e-4  # seconds between device/segment polls on the forwarder thread
_SETTLE_EVERY = 8  # the pipeline process confirms at least every this many messages
_SETTLE_TIMEOUT = 1.0  # seconds it waits for its sinks before confirming anyway (a stuck sink)
_REQUESTS = frozenset({"barrier", "flush_sinks", "finish_run", "stored_position", "close"})
_REPLY_GRACE = 10.0  # seconds a request may take beyond its own timeout (a restart in between)

# ---------------------------------------------------------------------- pickling across the boundary

#: training-side objects that travel as references, never as copies
_HOME_TYPES: tuple[type, ...] = (torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.amp.GradScaler)


class HomeRef:
    """In the pipeline process: a training-side object left at home (see the module docstring)."""

    def __init__(self, key: int, kind: str) -> None:
        self.key = key
        self.kind = kind

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"{self.kind}.{name}: this {self.kind} lives in the training process, and batchtap's pipeline "
            "process only has a reference to it; code that runs in the pipeline (decoding, rules, sinks) "
            "cannot use it. Fix: read what you need on the training side (a metric's read_host()), or use "
            "Tap(pipeline='thread')"
        )

    def __reduce__(self) -> Any:  # pragma: no cover - HomeRefs travel by persistent id
        raise TypeError("a HomeRef only travels back to the training process")


class _ToChild(pickle.Pickler):
    def __init__(self, file: io.BytesIO, refs: dict[int, object]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.refs = refs

    def persistent_id(self, obj: object) -> Any:
        if isinstance(obj, _HOME_TYPES):
            self.refs[id(obj)] = obj
            return (id(obj), type(obj).__name__)
        return None


class _FromParent(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        return HomeRef(*pid)


class _ToParent(pickle.Pickler):
    def persistent_id(self, obj: object) -> Any:
        return obj.key if isinstance(obj, HomeRef) else None


class _FromChild(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, refs: dict[int, object]) -> None:
        super().__init__(file)
        self.refs = refs

    def persistent_load(self, pid: Any) -> Any:
        return self.refs[pid]


T = TypeVar("T")


def _message(wire: Any, kind: type[T]) -> T:
    """A record, event or sink call sent in the record codec's form (``records.to_wire``)."""
    message = from_wire(wire)
    assert isinstance(message, kind), f"expected a {kind.__name__}, got {type(message).__name__}"
    return message


def _dumps(pickler: Callable[[io.BytesIO], pickle.Pickler], obj: object) -> bytes:
    buf = io.BytesIO()
    pickler(buf).dump(obj)
    return buf.getvalue()


# ---------------------------------------------------------------------- the training process's side


@dataclasses.dataclass(slots=True)
class _Chain:
    """The training process's handle on one run's chain in the pipeline process."""

    id: int
    layout: Layout
    segment: BlockSegment
    open_message: tuple[Any, ...]
    run_id: str
    rank: int
    writes: bool
    reduce: ReduceSpec | None
    local: RunChain | None = None  # after the fallback to a thread


@dataclasses.dataclass(slots=True)
class _Outgoing:
    """A message on its way: ``prepare()`` returns its payload once it can be sent (a block's copy
    finished and the segment has room), else None."""

    kind: str
    prepare: Callable[[], tuple[Any, ...] | None]


class _Reply:
    __slots__ = ("done", "value")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None


class ProcessPipeline:
    """The training process's end of the pipeline process (see the module docstring).

    Args as for :class:`~batchtap.pipeline.thread.ThreadPipeline` (the sinks and settings are
    pickled into the pipeline process).

    Raises:
        ConfigError: a sink or rule cannot be carried into another process (it does not pickle).
    """

    def __init__(self, sinks: Sequence[Sink], control: Control, settings: PipelineSettings | None = None) -> None:
        self.sinks = list(sinks)
        self.control = control
        self.gate = DeviceGate()
        self._settings = settings = settings or PipelineSettings()
        stay = [
            r.name
            for r in (settings.rules.rules if settings.rules is not None else ())
            if not r.runs_in_pipeline_process
        ]
        if stay:
            raise ConfigError(
                f"rules {stay} read training-side objects while they decide (an adaptive sampler's batch size), "
                "which a pipeline process cannot see; fix: use Tap(pipeline='thread') with them"
            )
        self._refs: dict[int, object] = {}
        try:
            self._config = self._pickle((self.sinks, settings))
        except Exception as exc:
            raise ConfigError(
                f"pipeline='process' carries the sinks and rules into another process, but they do not pickle: "
                f"{type(exc).__name__}: {exc}; expected sinks and rules defined at module level without open "
                "files, connections or lambdas. Fix: make them picklable, or use Tap(pipeline='thread')"
            ) from None
        self._lock = threading.Lock()  # one sender at a time, in order
        self._more = threading.Condition(self._lock)
        self._outbox: collections.deque[_Outgoing] = collections.deque()
        self._seq = 0  # messages sent so far
        self._unconfirmed: collections.deque[tuple[int, str, tuple[Any, ...]]] = collections.deque()
        self._replies: dict[int, _Reply] = {}
        self._chains: dict[int, _Chain] = {}
        self._chain_ids = 0
        self._run: tuple[RunInfo, bool] | None = None  # the open run's start message payload
        self._store: Any = None  # rank 0: the TCPStore the pipeline processes of all ranks meet at
        self._meeting_port: int | None = None  # its port, on every rank
        self._restarts = 0
        self._closing = False
        self._fallback: Any = None  # a ThreadPipeline after the second death of the process
        self._start_child()
        self._forwarder = threading.Thread(target=self._forward_loop, name="batchtap-forward", daemon=True)
        self._forwarder.start()

    # ------------------------------------------------------------------ the PipelineHost calls

    def open_chain(
        self, layout: Layout, *, run_id: str, rank: int, writes: bool, reduce: ReduceSpec | None, max_rows: int
    ) -> _Chain:
        for old in list(self._chains.values()):  # the last run's blocks were drained at this run's start
            if old.segment is not None:
                old.segment.close()
            del self._chains[old.id]
        segment = BlockSegment.create(
            slots=_SEGMENT_SLOTS, max_rows=max_rows, device_width=layout.device_width, host_width=layout.host_width
        )
        remote_reduce = None
        if reduce is not None:
            host, port = self._meeting_point(reduce)
            remote_reduce = (reduce.rank, reduce.world_size, reduce.per_rank_rows, host, port)
        self._chain_ids += 1
        chain = _Chain(self._chain_ids, layout, segment, (), run_id, rank, writes, reduce)
        metrics = [span.metric for span in layout.spans]
        chain.open_message = (chain.id, metrics, run_id, rank, writes, remote_reduce, segment.shape)
        self._chains[chain.id] = chain
        if self._fallback is not None:
            chain.local = self._fallback.open_chain(
                layout, run_id=run_id, rank=rank, writes=writes, reduce=None, max_rows=max_rows
            )
        else:
            self._post("open_chain", chain.open_message)
        return chain

    def submit(self, flusher: Flusher, block: Block, chain: _Chain, logged: Sequence[Logged] = ()) -> None:
        if self._fallback is not None:
            self._fallback.submit(flusher, block, chain.local, logged)
            return
        clock, segment, gate = flusher.clock, chain.segment, self.gate

        def prepare() -> tuple[Any, ...] | None:
            # Never waits: it runs under the sending lock, which the training thread also takes.
            with gate.open_now() as open_:
                ready = clock.marker_done(block.marker) and all(item.done() for item in logged)
                if not (open_ and ready and segment.has_room()):
                    return None
                seq = segment.publish(read_block(flusher, block, gate))
            return (chain.id, seq, [to_wire(item.record(chain.run_id, chain.rank)) for item in logged])

        self._queue(_Outgoing("block", prepare))

    def events(self, events: list[Event], chain: _Chain | None = None, *, writes: bool = True) -> None:
        if not events:
            return
        if self._fallback is not None:
            self._fallback.events(events, chain.local if chain is not None else None, writes=writes)
            return
        self._post("events", (to_wire(Write((), list(events))), chain.id if chain is not None else None, writes))

    def logged(self, logged: Logged, *, run_id: str, rank: int, writes: bool) -> None:
        if self._fallback is not None:
            self._fallback.logged(logged, run_id=run_id, rank=rank, writes=writes)
            return
        gate = self.gate

        def prepare() -> tuple[Any, ...] | None:
            with gate.open_now() as open_:  # never waits (see submit)
                if not (open_ and logged.done()):
                    return None
            return (to_wire(logged.record(run_id, rank)), writes)

        self._queue(_Outgoing("logged", prepare))

    def start_run(self, run: RunInfo, *, writes: bool = True) -> None:
        self._run = (run, writes)
        if self._fallback is not None:
            self._fallback.start_run(run, writes=writes)
        elif writes:
            self._post("start_run", (to_wire(RunStart(run)),))

    def end_run(self, run: RunInfo, *, writes: bool = True) -> None:
        self._run = None
        if self._fallback is not None:
            self._fallback.end_run(run, writes=writes)
        elif writes:
            self._post("end_run", (to_wire(RunEnd(run)),))

    def start_epoch(self, run_id: str, epoch: int, total: int | None, *, writes: bool = True) -> None:
        if self._fallback is not None:
            self._fallback.start_epoch(run_id, epoch, total, writes=writes)
        elif writes:
            self._post("start_epoch", (to_wire(EpochStart(run_id, epoch, total)),))

    def ranks_failed(self, chain: _Chain, reason: str) -> None:
        if self._fallback is not None:
            self._fallback.ranks_failed(chain.local, reason)
        else:
            self._post("ranks_failed", (chain.id, reason))

    def drain(self, timeout: float | None = None) -> bool:
        # sync: run start/end, explicit flush — everything handed over so far is processed.
        if self._fallback is not None:
            return self._fallback.drain(timeout)
        return self._request("barrier", (), timeout) is not None

    def flush_sinks(self, timeout: float | None = None) -> bool:
        # sync: run start/end, explicit flush — the sinks store what they were handed (bounded).
        if self._fallback is not None:
            return self._fallback.flush_sinks(timeout)
        return bool(self._request("flush_sinks", (timeout,), timeout))

    def finish_run(self, info: RunInfo, *, timeout: float, last_step: int) -> bool:
        if self._fallback is not None:
            return self._fallback.finish_run(info, timeout=timeout, last_step=last_step)
        # sync: end of run — every captured step reaches the sinks before run() returns, within end_timeout.
        done = self._request("finish_run", (to_wire(RunEnd(info)), timeout, last_step), timeout)
        if done is None:
            log.warning(
                "batchtap: run %r (%s): the pipeline process did not confirm within end_timeout=%g s that every "
                "step was stored",
                info.name,
                info.id,
                timeout,
            )
        return bool(done)

    def stored_position(self, run_id: str) -> tuple[list[int], list[str]]:
        if self._fallback is not None:
            return self._fallback.stored_position(run_id)
        # sync: resume — the sinks say where the run ended (once per resumed run).
        answer = self._request("stored_position", (run_id,), 60.0)
        return answer if answer is not None else ([], [])

    def at_exit(self, timeout: float) -> None:
        """Interpreter exit with the Tap still open: the process stores what it has and exits
        (bounded), before multiprocessing would terminate it."""
        self.close(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        if self._closing:
            return
        if self._fallback is not None:
            self._closing = True
            self._fallback.close(timeout)
        else:
            self._closing = True  # from here a closing process is not a dead one
            # sync: close — the pipeline process ends its sinks and exits (bounded).
            self._request("close", (timeout,), timeout)
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

    # ------------------------------------------------------------------ sending

    def _pickle(self, obj: object) -> bytes:
        return _dumps(lambda buf: _ToChild(buf, self._refs), obj)

    def _post(self, kind: str, payload: tuple[Any, ...]) -> None:
        self._queue(_Outgoing(kind, lambda: payload))

    def _queue(self, message: _Outgoing) -> None:
        with self._lock:
            if self._fallback is not None:  # the process died for good while this call waited for the lock
                self._outbox.append(message)
                self._outbox_to(self._fallback, {c.id: c for c in self._chains.values()})
                return
            if not self._outbox:
                payload = message.prepare()
                if payload is not None:  # nothing waits before it: send now (every CPU flush)
                    self._send_locked(message.kind, payload)
                    return
            self._outbox.append(message)
            self._more.notify()

    def _send_locked(self, kind: str, payload: tuple[Any, ...]) -> None:
        seq = self._seq
        self._seq += 1
        self._unconfirmed.append((seq, kind, payload))
        self._transmit(seq, kind, payload)

    def _transmit(self, seq: int, kind: str, payload: tuple[Any, ...]) -> None:
        try:
            self._conn.send_bytes(self._pickle((seq, kind, payload)))
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
                    payload = self._outbox[0].prepare()
                    if payload is None:
                        break
                    self._send_locked(self._outbox.popleft().kind, payload)
            time.sleep(_POLL)  # polling leaves the GIL to the training thread

    def _request(self, kind: str, payload: tuple[Any, ...], timeout: float | None) -> Any:
        """Send a request and wait (bounded) for its answer; None when none came in time."""
        reply = _Reply()
        key = id(reply)
        self._replies[key] = reply
        try:
            self._post(kind, (key, *payload))
            wait = None if timeout is None else timeout + _REPLY_GRACE
            if not reply.done.wait(wait):
                return None
            return reply.value
        finally:
            self._replies.pop(key, None)

    # ------------------------------------------------------------------ the process and what it says

    def _start_child(self) -> None:
        ours, theirs = _SPAWN.Pipe(duplex=True)
        self._proc = _SPAWN.Process(
            target=_child_main, args=(theirs, self._config, os.getpid()), name="batchtap-pipeline", daemon=True
        )
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
            message = _FromChild(io.BytesIO(data), self._refs).load()
            kind = message[0]
            if kind == "ack":
                with self._lock:
                    while self._unconfirmed and self._unconfirmed[0][0] <= message[1]:
                        self._unconfirmed.popleft()
            elif kind == "verdict":
                self.control.post(message[1])
            elif kind == "error":
                self.control.fail(message[1])
            elif kind == "anomalies":
                self.control.anomaly_counts = message[1]
            elif kind == "reply":
                reply = self._replies.get(message[1])
                if reply is not None:
                    reply.value = message[2]
                    reply.done.set()
        if not self._closing:
            self._process_died(proc)

    def _process_died(self, proc: Any) -> None:
        proc.join(timeout=5)
        what = f"batchtap's pipeline process died (exit code {proc.exitcode})"
        with self._lock:
            if self._closing:
                return
            if self._restarts == 0:
                self._restarts += 1
                log.error("batchtap: %s; restarting it once, nothing flushed is lost", what)
                self._start_child()
                self._resend_locked(f"{what}; it was restarted and every unconfirmed block was sent again")
            else:
                log.error("batchtap: %s again; the pipeline goes on in a thread of the training process", what)
                self._fall_back_locked(f"{what} again; the pipeline went on in a thread of the training process")

    def _resend_locked(self, report: str) -> None:
        """After a restart: the open run and chain again, then every message not confirmed."""
        resent = list(self._unconfirmed)
        if self._run is not None and self._run[1] and not any(k == "start_run" for _, k, _ in resent):
            self._transmit(-1, "start_run", (to_wire(RunStart(self._run[0])),))
        for chain in self._chains.values():
            if not any(k == "open_chain" and p[0] == chain.id for _, k, p in resent):
                message = list(chain.open_message)
                message[5] = None  # a restarted process cannot rejoin the other ranks' reduction
                self._transmit(-1, "open_chain", tuple(message))
        for seq, kind, payload in resent:
            if kind == "open_chain":
                payload = (*payload[:5], None, *payload[6:])
            self._transmit(seq, kind, payload)
        self._report_locked(report)

    def _report_locked(self, message: str) -> None:
        if self._run is None:
            return
        info, writes = self._run
        event = Event(info.id, 0, EventKind.WARNING, message, time.time())
        if self._fallback is not None:
            self._fallback.events([event], None, writes=writes)
        elif writes:
            self._send_locked("events", (to_wire(Write((), [event])), None, writes))

    def _fall_back_locked(self, report: str) -> None:
        from batchtap.pipeline.thread import ThreadPipeline

        fallback = ThreadPipeline(self.sinks, self.control, self._settings)
        if self._run is not None:
            fallback.start_run(self._run[0], writes=self._run[1])
        for chain in self._chains.values():
            chain.local = fallback.open_chain(
                chain.layout, run_id=chain.run_id, rank=chain.rank, writes=chain.writes, reduce=None
            )
        by_id = {c.id: c for c in self._chains.values()}
        for _, kind, payload in self._unconfirmed:
            if kind in _REQUESTS:  # a caller waits for its answer: the thread gives it
                threading.Thread(target=self._answer, args=(fallback, kind, payload), daemon=True).start()
            else:
                self._replay_into(fallback, by_id, kind, payload)
        self._outbox_to(fallback, by_id)
        self._unconfirmed.clear()
        self._fallback = fallback
        self._report_locked(report)

    def _answer(self, fallback: Any, kind: str, payload: tuple[Any, ...]) -> None:
        """A request the dead process left unanswered, answered by the fallback thread."""
        # sync: the caller of the request waits for this answer (as it would have for the process).
        key, *args = payload
        if kind == "barrier":
            value: Any = fallback.drain(None)
        elif kind == "flush_sinks":
            value = fallback.flush_sinks(*args)
        elif kind == "finish_run":
            wire, timeout, last_step = args
            value = fallback.finish_run(_message(wire, RunEnd).run, timeout=timeout, last_step=last_step)
        elif kind == "stored_position":
            value = fallback.stored_position(*args)
        else:  # close
            fallback.close(*args)
            value = True
        reply = self._replies.get(key)
        if reply is not None:
            reply.value = value
            reply.done.set()

    def _outbox_to(self, fallback: Any, by_id: dict[int, _Chain]) -> None:
        """Messages not sent yet (waiting for the device): handed to the thread as they are ready."""
        waiting = list(self._outbox)
        self._outbox.clear()
        for message in waiting:
            while True:
                payload = message.prepare()
                if payload is not None:
                    if message.kind in _REQUESTS:
                        threading.Thread(
                            target=self._answer, args=(fallback, message.kind, payload), daemon=True
                        ).start()
                    else:
                        self._replay_into(fallback, by_id, message.kind, payload)
                    break
                time.sleep(_POLL)

    @staticmethod
    def _replay_into(fallback: Any, by_id: dict[int, _Chain], kind: str, payload: tuple[Any, ...] | None) -> None:
        if payload is None:
            return
        if kind == "block":
            chain = by_id[payload[0]]
            logged = [_message(wire, Record) for wire in payload[2]]
            fallback.submit_data(chain.segment.read(payload[1]), chain.local, logged)  # a copy: the slot is free
            chain.segment.consume(payload[1])
        elif kind == "events":
            wire, chain_id, writes = payload
            events = list(_message(wire, Write).events)
            fallback.events(events, by_id[chain_id].local if chain_id in by_id else None, writes=writes)
        elif kind == "logged":
            fallback.core.sparse(_message(payload[0], Record), writes=payload[1])
        elif kind == "start_run":
            fallback.start_run(_message(payload[0], RunStart).run)
        elif kind == "end_run":
            fallback.end_run(_message(payload[0], RunEnd).run)
        elif kind == "start_epoch":
            epoch = _message(payload[0], EpochStart)
            fallback.start_epoch(epoch.run_id, epoch.epoch, epoch.total)
        elif kind == "ranks_failed":
            fallback.ranks_failed(by_id[payload[0]].local, payload[1])
        # requests (barrier, flush_sinks, finish_run, close...) are asked of the fallback by their callers

    def _meeting_point(self, reduce: ReduceSpec) -> tuple[str, int]:
        """Where the pipeline processes of all ranks meet to make their own gloo group: a TCPStore
        served by rank 0's training process (its port told to the other ranks over batchtap's group)."""
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        if self._meeting_port is None:  # once per Tap: the pipeline processes keep their group
            port = torch.zeros(1, dtype=torch.int64)
            if reduce.rank == 0:
                self._store = torch.distributed.TCPStore(host, 0, None, True, wait_for_workers=False)
                port[0] = self._store.port
            torch.distributed.broadcast(port, src=0, group=reduce.group)
            # sync: first step of a run in a process group — a CPU tensor of batchtap's own gloo group
            self._meeting_port = int(port.tolist()[0])
        return host, self._meeting_port


# ---------------------------------------------------------------------- the pipeline process


class _PipeControl(Control):
    """The pipeline process's Control: what it posts goes back to the training process."""

    def __init__(self, send: Callable[[tuple[Any, ...]], None]) -> None:
        super().__init__()
        self._send = send

    def post(self, verdict: Any) -> None:
        self._send(("verdict", verdict))

    def fail(self, error: BaseException) -> None:
        try:
            self._send(("error", error))
        except Exception:  # an exception that does not pickle: its text does
            self._send(("error", RuntimeError(f"batchtap pipeline failed: {error!r}")))


def _child_main(conn: Any, config: bytes, parent_pid: int) -> None:
    """The pipeline process: one loop over the training process's messages, in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the training process to handle

    def send(message: tuple[Any, ...]) -> None:
        conn.send_bytes(_dumps(_ToParent, message))

    sinks, settings = _FromParent(io.BytesIO(config)).load()
    control = _PipeControl(send)
    core = PipelineCore(sinks, control, settings)
    worker = _ChildWorker(core, send)
    try:
        while True:
            if not conn.poll(0 if worker.unsettled else 1.0):
                if worker.unsettled:  # nothing more waiting: confirm what was handled
                    worker.settle()
                elif os.getppid() != parent_pid:  # orphaned: a descendant holds the pipe open
                    break
                continue
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                break
            seq, kind, payload = _FromParent(io.BytesIO(data)).load()
            if not worker.handle(seq, kind, payload):
                return
            if worker.unsettled >= _SETTLE_EVERY:
                worker.settle()
    finally:
        worker.end_if_killed()


class _ChildWorker:
    """Handles each message in the pipeline process (see :func:`_child_main`)."""

    def __init__(self, core: PipelineCore, send: Callable[[tuple[Any, ...]], None]) -> None:
        self.core = core
        self.send = send
        self.chains: dict[int, tuple[RunChain, BlockSegment]] = {}
        self.run: RunInfo | None = None
        self.closed = False
        self._counts: dict[str, int] = {}
        self._group_made = False
        self._handled = -1  # the last message handled, confirmed at the next settle()
        self._consumable: list[tuple[BlockSegment, int]] = []
        self.unsettled = 0  # messages handled since the last settle()

    def settle(self) -> None:
        """Confirm what was handled: once the sinks took it (bounded), free its segment slots and
        tell the training process, which then forgets those messages (no resend after a restart)."""
        # sync: pipeline process only — its sinks store what they were handed (bounded).
        self.core.flush_sinks(_SETTLE_TIMEOUT)
        for segment, block_seq in self._consumable:
            segment.consume(block_seq)
        self._consumable.clear()
        if self._handled >= 0:
            self.send(("ack", self._handled))
        self.unsettled = 0

    def handle(self, seq: int, kind: str, payload: tuple[Any, ...]) -> bool:
        """Handle one message; False after ``close``."""
        core = self.core
        try:
            if kind == "block":
                chain, segment = self.chains[payload[0]]
                block_seq = payload[1]
                if block_seq >= segment.consumed:  # a resent block a predecessor had processed is skipped
                    core.block(segment.read(block_seq), chain, [_message(wire, Record) for wire in payload[2]])
                    self._consumable.append((segment, block_seq))
                    counts = chain.anomaly_counts
                    if counts != self._counts:
                        self._counts = counts
                        self.send(("anomalies", counts))
            elif kind == "open_chain":
                self._open_chain(*payload)
            elif kind == "events":
                wire, chain_id, writes = payload
                target = self.chains[chain_id][0] if chain_id in self.chains else None
                core.events(list(_message(wire, Write).events), target, writes)
            elif kind == "logged":
                core.sparse(_message(payload[0], Record), writes=payload[1])
            elif kind == "start_run":
                self.run = _message(payload[0], RunStart).run
                core.start_run(self.run)
            elif kind == "end_run":
                self.run = None
                core.end_run(_message(payload[0], RunEnd).run)
            elif kind == "start_epoch":
                epoch = _message(payload[0], EpochStart)
                core.start_epoch(epoch.run_id, epoch.epoch, epoch.total)
            elif kind == "ranks_failed":
                self.chains[payload[0]][0].ranks_failed(payload[1])
            elif kind == "barrier":
                self.send(("reply", payload[0], True))
            elif kind == "flush_sinks":
                self.send(("reply", payload[0], core.flush_sinks(payload[1])))
            elif kind == "finish_run":
                key, wire, timeout, last_step = payload
                info = _message(wire, RunEnd).run
                self.send(("reply", key, core.finish_run(_Drained(), info, timeout=timeout, last_step=last_step)))
            elif kind == "stored_position":
                self.send(("reply", payload[0], core.stored_position(payload[1])))
            elif kind == "close":
                core.close(payload[1])
                self.closed = True
                for segment, block_seq in self._consumable:
                    segment.consume(block_seq)
                for _, segment in self.chains.values():
                    segment.close()
                self.send(("ack", seq))
                self.send(("reply", payload[0], True))
                return False
        except Exception as exc:
            log.exception("batchtap pipeline failed")
            self.core.control.fail(RuntimeError(f"batchtap pipeline failed: {exc!r}"))
        if seq >= 0:
            self._handled = seq
        self.unsettled += 1
        return True

    def _open_chain(
        self, chain_id: int, metrics: list[Any], run_id: str, rank: int, writes: bool, reduce: Any, shape: SegmentShape
    ) -> None:
        spec = None
        if reduce is not None:
            rank_, world, per_rank_rows, host, port = reduce
            if not self._group_made:
                store = torch.distributed.TCPStore(host, port, None, False)
                torch.distributed.init_process_group(
                    "gloo",
                    store=torch.distributed.PrefixStore("batchtap-pipeline", store),
                    rank=rank_,
                    world_size=world,
                )
                self._group_made = True
            spec = ReduceSpec(torch.distributed.group.WORLD, rank_, world, per_rank_rows)
        chain = self.core.open_chain(Layout(metrics), run_id=run_id, rank=rank, writes=writes, reduce=spec)
        self.chains[chain_id] = (chain, BlockSegment.attach(shape))

    def end_if_killed(self) -> None:
        """The training process is gone: end its open run as killed, store everything, exit."""
        if self.closed:
            return
        if self.run is not None:
            info = dataclasses.replace(
                self.run,
                status=RunStatus.KILLED,
                stop_reason="the training process died (killed or crashed) before it ended the run; "
                "every block it had flushed was stored",
                ended_at=time.time(),
            )
            self.core.end_run(info)
            self.core.flush_sinks(60.0)
        self.core.close(60.0)


class _Drained:
    """In the pipeline process everything received was handled before a request is read."""

    def drain(self, timeout: float | None = None) -> bool:
        return True
