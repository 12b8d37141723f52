"""What the ``Tap`` asks of a pipeline, wherever it runs, and how one is made.

Two hosts implement :class:`PipelineHost`: :class:`~batchtap.pipeline.thread.ThreadPipeline` (a
thread of the training process) and :class:`~batchtap.pipeline.process.ProcessPipeline` (a process
of its own, fed through shared memory). Both run the same :class:`~batchtap.pipeline.chain.RunChain`
and post to the same :class:`~batchtap.pipeline.control.Control`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

from batchtap.capture.clock import DeviceGate
from batchtap.capture.flush import Block, Flusher
from batchtap.capture.logged import Logged
from batchtap.errors import ConfigError
from batchtap.metrics.layout import Layout
from batchtap.pipeline.chain import ReduceSpec
from batchtap.pipeline.control import Control
from batchtap.pipeline.core import PipelineSettings
from batchtap.records import Event, RunInfo
from batchtap.sinks.base import Sink

__all__ = ["PipelineHost", "PipelineKind", "make_pipeline"]

PipelineKind = Literal["thread", "process"]


class PipelineHost(Protocol):
    """The training thread's side of a pipeline. Every call but the waiting ones (``drain``,
    ``flush_sinks``, ``finish_run``, ``stored_position``, ``close``) only enqueues."""

    gate: DeviceGate  # paused around CUDA graph captures: no device queries meanwhile

    def open_chain(
        self, layout: Layout, *, run_id: str, rank: int, writes: bool, reduce: ReduceSpec | None, max_rows: int
    ) -> Any: ...
    def submit(self, flusher: Flusher, block: Block, chain: Any, logged: Sequence[Logged] = ()) -> None: ...
    def events(self, events: list[Event], chain: Any = None, *, writes: bool = True) -> None: ...
    def logged(self, logged: Logged, *, run_id: str, rank: int, writes: bool) -> None: ...
    def start_run(self, run: RunInfo, *, writes: bool = True) -> None: ...
    def end_run(self, run: RunInfo, *, writes: bool = True) -> None: ...
    def start_epoch(self, run_id: str, epoch: int, total: int | None, *, writes: bool = True) -> None: ...
    def ranks_failed(self, chain: Any, reason: str) -> None: ...
    def drain(self, timeout: float | None = None) -> bool: ...
    def flush_sinks(self, timeout: float | None = None) -> bool: ...
    def finish_run(self, info: RunInfo, *, timeout: float, last_step: int) -> bool: ...
    def stored_position(self, run_id: str) -> tuple[list[int], list[str]]: ...
    def close(self, timeout: float | None = 30.0) -> None: ...
    def at_exit(self, timeout: float) -> None: ...


def make_pipeline(
    kind: PipelineKind,
    sinks: Sequence[Sink],
    control: Control,
    settings: PipelineSettings,
) -> PipelineHost:
    """The pipeline host ``kind`` names."""
    if kind == "thread":
        from batchtap.pipeline.thread import ThreadPipeline

        return ThreadPipeline(sinks, control, settings)
    if kind == "process":
        from batchtap.pipeline.process import ProcessPipeline

        return ProcessPipeline(sinks, control, settings)
    raise ConfigError(f"pipeline must be 'thread' or 'process', got {kind!r}")
