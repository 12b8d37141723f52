"""Issue 38 item 14: a mid-run ``InputError`` that only the values reveal (a class index out of
range) stops training at a step fixed by the flushes, never by the pipeline's pace.

The contract (docs/loops.md): the error found in the block of flush *k* is raised by the first
``tap.step()`` after flush *k* + 1. With ``flush_every=F`` (and no time-based flush) a bad step
``s`` is raised at step ``F * (s // F + 2)``. A sink slow enough to keep the pipeline seconds
behind (a one-block queue that blocks) must not move that step, under the thread pipeline and
the process pipeline alike; the rows before it are all stored, the bad row with its accuracy NaN.
"""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

import pytest
import torch

import batchtap as bt
from batchtap.errors import InputError
from tests.pipeline.process_sinks import received
from tests.pipeline.slow_sinks import SlowFileSink

FLUSH_EVERY = 4
BAD_STEP = 21  # in the block of flush 5 (rows 20..23): the pipeline is far behind by then
STEPS = 60


def _raised_at(kind: str, delay: float, path: Path) -> tuple[int | None, BaseException | None]:
    tap = bt.Tap(
        [bt.metrics.Loss(), bt.metrics.Accuracy()],
        [SlowFileSink(path, delay)],
        flush_every=FLUSH_EVERY,
        flush_seconds=3600.0,  # count flushes only: the flush steps are fixed
        queue_size=1,
        backpressure="block",
        pipeline=kind,  # type: ignore[arg-type]
    )
    gen = torch.Generator().manual_seed(0)
    outputs = torch.randn(6, 3, generator=gen)
    good = torch.tensor([0, 1, 2, 0, 1, 2])
    bad = torch.tensor([0, 1, 2, 0, 1, 7])  # class 7 of 3: only its value tells
    raised: int | None = None
    error: BaseException | None = None
    with tap:
        try:
            with tap.run(name=f"{kind}-{delay}"):
                for step in range(STEPS):
                    tap.step(loss=torch.tensor(0.5), outputs=outputs, targets=bad if step == BAD_STEP else good)
                    raised = step + 1  # the step() that raises is the one after the last that returned
                raised = None
        except InputError as exc:
            error = exc
    return raised, error


@pytest.mark.parametrize("kind", ["thread", "process"])
@pytest.mark.parametrize("delay", [0.0, 0.15], ids=["fast-sink", "slow-sink"])
def test_the_step_a_value_revealed_input_error_stops_training_at_is_fixed_by_the_flushes(
    tmp_path: Path, kind: str, delay: float
) -> None:
    path = tmp_path / "sink.pkl"
    raised, error = _raised_at(kind, delay, path)
    expected = FLUSH_EVERY * (BAD_STEP // FLUSH_EVERY + 2)  # the first step() after the next flush
    assert raised == expected, (raised, error)
    assert error is not None and f"step {BAD_STEP}" in str(error) and "outside [0, 3)" in str(error)
    sink, _ = received(path)
    assert [r.step for r in sink.records] == list(range(expected))  # the refused call recorded nothing
    assert [r.step for r in sink.records if math.isnan(r.values["accuracy"])] == [BAD_STEP]
    assert sink.ended and sink.ended[-1].status is bt.RunStatus.FAILED


def _kill_pipeline(tap: bt.Tap) -> None:
    proc = tap._pipeline.link.process  # type: ignore[attr-defined]
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # already reaped: it is gone either way
        pass
    proc.join(10)


@pytest.mark.parametrize("bad_step", [58, 61], ids=["in-the-block-the-kill-hits", "after-the-thread-took-over"])
def test_the_step_holds_when_the_pipeline_process_dies_twice_and_a_thread_takes_over(
    tmp_path: Path, bad_step: int
) -> None:
    """The blocks keep their numbers through a restart and the failover to a thread (resent or
    replayed from the segment): the error of the block the second kill hits, or of a block the
    thread judges, is raised at the same step as without any death."""
    path = tmp_path / "sink.pkl"
    outputs = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    good = torch.tensor([0, 1, 2, 0, 1, 2])
    bad = torch.tensor([0, 1, 2, 0, 1, 7])
    raised: int | None = None
    tap = bt.Tap(
        [bt.metrics.Loss(), bt.metrics.Accuracy()],
        [SlowFileSink(path, 0.0)],
        flush_every=FLUSH_EVERY,
        flush_seconds=3600.0,
        pipeline="process",
    )
    with tap:
        with pytest.raises(InputError, match=f"step {bad_step}"):
            with tap.run(name="failover"):
                for step in range(90):
                    raised = step
                    tap.step(loss=torch.tensor(0.5), outputs=outputs, targets=bad if step == bad_step else good)
                    if step in (29, 59):
                        _kill_pipeline(tap)
        assert tap._pipeline.current is not tap._pipeline.link  # type: ignore[attr-defined]
    assert raised == FLUSH_EVERY * (bad_step // FLUSH_EVERY + 2)
    sink, _ = received(path)
    assert sorted({r.step for r in sink.records}) == list(range(raised))  # a resent block may repeat
