"""Leaving a run: wait for the sinks, but never forever, and say exactly what is missing where.

Used by :meth:`~batchtap.pipeline.chain.core.PipelineCore.finish_run`; the host it runs in says how to
wait for what is still on its way to the core (``drain``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from batchtap.pipeline.chain.dispatch import Dispatcher
from batchtap.records import Event, EventKind, RunInfo

__all__ = ["wait_for_sinks"]


log = logging.getLogger("batchtap")


def wait_for_sinks(
    drain: Callable[[float | None], bool], dispatcher: Dispatcher, info: RunInfo, *, timeout: float, last_step: int
) -> bool:
    """Wait at most ``timeout`` seconds until every captured step of the run went through the
    pipeline (``drain(timeout)``: False when it had not in time) and every sink took it; returns
    whether all did.

    Then report, with exact counts, what a sink dropped (``drop_oldest``) or failed to store in
    this run, and, past the deadline, what a hung sink had not taken yet: in the log and as an
    event to every sink that keeps up (never dropped).
    """
    began = time.monotonic()
    deadline = began + timeout
    # sync: end of run — the pipeline hands every captured step to the sinks (bounded).
    drained = drain(timeout)
    # sync: end of run — the sinks store what they were handed (bounded).
    flushed = dispatcher.flush(timeout=_left(deadline))
    events = dispatcher.loss_report(info)
    if not (drained and flushed):
        parts = [
            f"sink {name} had not stored {blocks} blocks ({records} records, steps {first}..{last})"
            for name, blocks, records, first, last in dispatcher.undelivered()
        ]
        if not drained:
            parts.append(f"the pipeline had not handed every captured step (up to step {last_step}) to the sinks")
        message = (
            # the time actually waited: a pipeline that is no longer running answers at once
            f"run {info.name!r} ({info.id}) ended after waiting {time.monotonic() - began:.1f} s "
            f"(end_timeout={timeout:g} s) for its sinks: "
            f"{'; '.join(parts) or 'a sink had not confirmed its last blocks'}; those steps may be missing there"
        )
        log.warning("batchtap: %s", message)
        events.append(Event(info.id, max(last_step, 0), EventKind.WARNING, message, time.time()))
    if events:
        dispatcher.report(events)
        # sync: end of run — the reports themselves are stored (bounded by what is left).
        dispatcher.flush(timeout=_left(deadline))
    return drained and flushed


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
