"""The pipeline process itself: one loop over the training process's messages, in order.

Each message goes to the same :meth:`~batchtap.pipeline.chain.core.PipelineCore.handle` as on the
pipeline thread; a :class:`~batchtap.pipeline.transport.crossing.Published` block is read from its segment
first. What the core posts to its :class:`~batchtap.pipeline.chain.control.Control` goes back over the
pipe. Every few messages (or when nothing more waits) the process *confirms*: once its sinks took
what it handled (bounded), it frees those segment slots and acknowledges, and the training process
forgets those messages (it resends the others to a restarted process).

When the training process dies (the pipe closes, or the parent changes), every message already
received is handled and the open run is ended as ``killed``.

This module imports neither torch nor the training script, and neither does decoding a block:
what crosses is arrays and the run's torch-free column layout (the built-in metrics' decoders are
numpy only). Torch loads here only for a cross-rank reduction (its gloo group) or a user's metric
that decodes itself in its own module.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from batchtap.pipeline.chain.control import Control
from batchtap.pipeline.chain.core import PipelineCore
from batchtap.pipeline.chain.messages import Close, Request, RunEnd, RunStart
from batchtap.pipeline.transport.crossing import (
    Ack,
    ChildChain,
    Counted,
    Envelope,
    Failed,
    Judged,
    Meeting,
    Posted,
    Published,
    Reply,
    dumps_to_parent,
    loads_from_parent,
    rows_of,
)
from batchtap.pipeline.transport.shm import BlockSegment
from batchtap.records import RunInfo, RunStatus

__all__ = ["main"]

log = logging.getLogger("batchtap")

#: the pipeline process confirms at least every this many messages
CONFIRM_EVERY = 8
#: seconds it waits for its sinks before confirming anyway (a stuck sink)
CONFIRM_TIMEOUT = 1.0


def _exit_now() -> None:
    """After a clean close: run the exit handlers, then end without tearing the interpreter down
    (with torch loaded that takes about a second, which ``Tap.close()`` would wait for)."""
    atexit._run_exitfuncs()  # multiprocessing's finalizers among them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _PipeControl(Control):
    """The pipeline process's Control: what it is told goes back to the training process."""

    def __init__(self, send: Callable[[object], None]) -> None:
        super().__init__()
        self._send = send

    def post(self, verdict: Any) -> None:
        self._send(Posted(verdict))

    def count_anomalies(self, counts: Any) -> None:
        self._send(Counted(dict(counts)))

    def fail(self, error: BaseException) -> None:
        try:
            self._send(Failed(error))
        except Exception:  # an exception that does not pickle: its text does
            self._send(Failed(RuntimeError(f"batchtap pipeline failed: {error!r}")))

    def judged(self, chain: int, index: int, error: BaseException | None = None) -> None:
        try:
            self._send(Judged(chain, index, error))
        except Exception:  # an error that does not pickle: its text does (an InputError pickles)
            self._send(Judged(chain, index, RuntimeError(f"batchtap pipeline failed: {error!r}")))


def main(conn: Any, config: bytes, parent_pid: int, main_path: str | None) -> None:
    """The pipeline process's entry point (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the training process to handle

    def send(message: object) -> None:
        conn.send_bytes(dumps_to_parent(message))

    sinks, settings = loads_from_parent(config, main_path)
    worker = _Worker(sinks, settings, send)
    try:
        while True:
            if not conn.poll(0 if worker.unconfirmed else 1.0):
                if worker.unconfirmed:  # nothing more waiting: confirm what was handled
                    worker.confirm()
                elif os.getppid() != parent_pid:  # orphaned: a descendant holds the pipe open
                    break
                continue
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                break
            if not worker.handle(loads_from_parent(data, main_path)):
                _exit_now()
            if worker.unconfirmed >= CONFIRM_EVERY:
                worker.confirm()
    finally:
        worker.end_if_killed()


class _Worker:
    """Handles each envelope in the pipeline process (see :func:`main`)."""

    def __init__(self, sinks: Any, settings: Any, send: Callable[[object], None]) -> None:
        self.core = PipelineCore(sinks, _PipeControl(send), settings, join=self._join)
        self.send = send
        self.segments: dict[int, BlockSegment] = {}
        self.run: RunInfo | None = None
        self.closed = False
        self._group_made = False
        self._handled = -1  # the last message handled, acknowledged at the next confirm()
        self._consumable: list[tuple[BlockSegment, int]] = []
        self.unconfirmed = 0  # messages handled since the last confirm()

    def confirm(self) -> None:
        """Once the sinks took what was handled (bounded), free its segment slots and tell the
        training process, which then forgets those messages (no resend after a restart)."""
        # sync: pipeline process only — its sinks store what they were handed (bounded).
        self.core.flush_sinks(CONFIRM_TIMEOUT)
        self._consume()
        if self._handled >= 0:
            self.send(Ack(self._handled))
        self.unconfirmed = 0

    def handle(self, envelope: Envelope) -> bool:
        """Handle one envelope; False after :class:`~batchtap.pipeline.chain.messages.Close`."""
        message = envelope.message
        try:
            if isinstance(message, Close):
                return self._close(envelope, message)
            answer = self._handle(message)
            if envelope.key is not None:
                self.send(Reply(envelope.key, answer))
        except Exception as exc:
            log.exception("batchtap pipeline failed")
            self.core.control.fail(RuntimeError(f"batchtap pipeline failed: {exc!r}"))
        if envelope.seq >= 0:
            self._handled = envelope.seq
        self.unconfirmed += 1
        return True

    def _handle(self, message: Any) -> Any:
        if isinstance(message, Published):
            segment = self.segments[message.chain]
            if message.seq < segment.consumed:  # a resent block a predecessor had processed is skipped
                return None
            self.core.handle(rows_of(message, segment.read(message.seq)))
            self._consumable.append((segment, message.seq))
            return None
        if isinstance(message, ChildChain):
            for old in self.segments.values():
                old.close()
            self.segments = {message.open.chain: BlockSegment.attach(message.segment)}
            return self.core.handle(message.open)
        if isinstance(message, RunStart):
            self.run = message.run
        elif isinstance(message, RunEnd):
            self.run = None
        return self.core.handle(message)

    def _close(self, envelope: Envelope, message: Request) -> bool:
        self.core.handle(message)
        self.closed = True
        self._consume()
        for segment in self.segments.values():
            segment.close()
        self.send(Ack(envelope.seq))
        if envelope.key is not None:
            self.send(Reply(envelope.key, True))
        return False

    def _consume(self) -> None:
        for segment, block_seq in self._consumable:
            segment.consume(block_seq)
        self._consumable.clear()

    def _join(self, reduce: Any) -> Any:
        """The first reduction: join the gloo group the pipeline processes of all ranks make."""
        import torch.distributed as dist  # only in a process group

        meeting = reduce.group
        assert isinstance(meeting, Meeting)
        if not self._group_made:
            store = dist.TCPStore(meeting.host, meeting.port, None, False)
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore("batchtap-pipeline", store),
                rank=reduce.rank,
                world_size=reduce.world_size,
            )
            self._group_made = True
        return dataclasses.replace(reduce, group=dist.group.WORLD)

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
            self.core.handle(RunEnd(info))
            self.core.flush_sinks(60.0)
        self.core.close(60.0)
