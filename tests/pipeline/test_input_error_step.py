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
