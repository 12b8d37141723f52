"""The pipeline in a process of its own (``Tap(pipeline="process")``).

The training process only captures. At each flush it reads the block back (at once on the CPU; on a
GPU a small forwarder thread polls the copy's marker first), writes its rows into a shared-memory
segment (:mod:`batchtap.pipeline.transport.shm`) and sends a one-line notice down a pipe. The pipeline
process (:mod:`batchtap.pipeline.transport.child`) runs the same :class:`~batchtap.pipeline.chain.core.PipelineCore`
as the pipeline thread: decode, validate, reduce across ranks, rules, sinks. Its sinks' work never
holds the training process's GIL. Rule verdicts, errors and anomaly counts come back on the pipe and
are posted to the :class:`~batchtap.pipeline.chain.control.Control`, where the training thread acts on
them at the same step boundaries as with the thread pipeline. What crosses, and how, is
:mod:`batchtap.pipeline.transport.crossing`; the training side of the pipe is
:class:`~batchtap.pipeline.transport.link.ProcessLink`.

Failure handling:

* **The training process dies** (SIGKILL, a crash): the pipeline process sees the pipe close (or
  its parent change), processes every block and message already sent — every flushed block on the
  CPU, since the flush writes it to the segment before ``step()`` returns — and ends the open run
  as ``killed``.
* **The pipeline process dies**: reported (log error and a warning event), restarted once; every
  message it had not confirmed is sent again, and unprocessed blocks wait in the segment meanwhile
  (bounded: a full segment makes the training thread wait, as a full ring does). After a second
  death the pipeline falls back to a thread of the training process, which takes over the blocks
  still in the segment: nothing is lost either way. :class:`ProcessPipeline` holds *the current
  host* — the link, then that thread — and hands every call to it.
* **Exit**: ``Tap.close()`` ends the process; it is a daemon, so no exit path leaves it behind.

Objects that belong to the training side — modules, optimizers, tensors, GradScalers — are never
copied into the pipeline process: they travel as references and come back as the same objects (a
metric's optimizer, say, is not needed to decode its values).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from batchtap.capture.clock import DeviceGate
from batchtap.capture.flush import Block
from batchtap.capture.logged import Logged
from batchtap.errors import ConfigError
from batchtap.pipeline.chain.control import Control
from batchtap.pipeline.chain.core import PipelineSettings
from batchtap.pipeline.chain.messages import Handover, OpenChain, Request
from batchtap.pipeline.transport.host import PipelineHost
from batchtap.pipeline.transport.link import ProcessLink
from batchtap.sinks.base import Sink

__all__ = ["ProcessPipeline"]


class ProcessPipeline(PipelineHost):
    """The training process's side of the process pipeline (see the module docstring).

    Args as for :class:`~batchtap.pipeline.transport.thread.ThreadPipeline` (the sinks and settings are
    pickled into the pipeline process).

    Raises:
        ConfigError: a rule reads training-side objects, or a sink or rule cannot be carried into
            another process (it does not pickle).
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
        self.link = ProcessLink(self.sinks, control, settings, self.gate, on_lost=self._fall_back)
        #: the host every call goes to: the link, or the thread after the process died twice
        self.current: PipelineHost = self.link
        self._closed = False

    def _fall_back(self) -> PipelineHost:
        """The process died twice: a thread of this process takes over (called by the link)."""
        from batchtap.pipeline.transport.thread import ThreadPipeline

        self.current = ThreadPipeline(self.sinks, self.control, self._settings, gate=self.gate)
        return self.current

    # ------------------------------------------------------------------ every call to the current host

    def send(self, message: Handover) -> None:
        self.current.send(message)

    def ask(self, request: Request, timeout: float | None) -> Any:
        return self.current.ask(request, timeout)

    def submit(self, block: Block, chain: int, logged: Sequence[Logged] = (), *, index: int | None = None) -> None:
        self.current.submit(block, chain, logged, index=index)

    def logged(self, logged: Logged, *, run_id: str, rank: int, writes: bool) -> None:
        self.current.logged(logged, run_id=run_id, rank=rank, writes=writes)

    def open(self, message: OpenChain, *, max_rows: int) -> None:
        self.current.open(message if self.current is self.link else _local(message), max_rows=max_rows)

    def at_exit(self, timeout: float) -> None:
        """Interpreter exit with the Tap still open: the process stores what it has and exits
        (bounded), before multiprocessing would terminate it."""
        self.close(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        current = self.current
        current.close(timeout)
        if current is not self.link:
            self.link.shut()


def _local(message: OpenChain) -> OpenChain:
    """A thread that took over cannot join the pipeline processes' reduction: its chains reduce
    nothing across ranks."""
    return dataclasses.replace(message, reduce=None)
