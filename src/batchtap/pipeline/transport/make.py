"""Making the pipeline host the Tap's settings name (the hosts import :mod:`~batchtap.pipeline.transport.host`,
so the choice between them lives here, above all of them)."""

from __future__ import annotations

from collections.abc import Sequence

from batchtap.errors import ConfigError
from batchtap.pipeline.chain.control import Control
from batchtap.pipeline.chain.core import PipelineSettings
from batchtap.pipeline.transport.host import PipelineHost, PipelineKind
from batchtap.sinks.base import Sink

__all__ = ["make_pipeline"]


def make_pipeline(
    kind: PipelineKind,
    sinks: Sequence[Sink],
    control: Control,
    settings: PipelineSettings,
) -> PipelineHost:
    """The pipeline host ``kind`` names (the process host's module loads only when asked for)."""
    if kind == "thread":
        from batchtap.pipeline.transport.thread import ThreadPipeline

        return ThreadPipeline(sinks, control, settings)
    if kind == "process":
        from batchtap.pipeline.transport.process import ProcessPipeline

        return ProcessPipeline(sinks, control, settings)
    raise ConfigError(f"pipeline must be 'thread' or 'process', got {kind!r}")
