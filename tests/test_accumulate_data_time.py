"""``Tap.accumulate(data_time=)``: a loader wait a caller timed itself (an integration around its own
fetch) is summed over the step's micro-batches, as a watched loader's is; a bad value is refused."""

from __future__ import annotations

import math

import pytest
import torch

import batchtap as bt
from batchtap.errors import InputError
from tests.conftest import ListSink


def test_given_waits_are_summed_per_optimizer_step() -> None:
    sink = ListSink()
    with bt.Tap(sinks=[sink]) as tap, tap.run():
        for waits in ((0.25, 0.5), (0.125,), (None, None)):
            for wait in waits:
                tap.accumulate(loss=torch.tensor(1.0), batch_size=2, data_time=wait)
            tap.step()
    got = [r.values.get("data_time", math.nan) for r in sink.records]
    assert got[:2] == [0.75, 0.125] and math.isnan(got[2])


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf, "0.1", True])
def test_a_bad_wait_is_refused_and_earlier_steps_stay(bad: object) -> None:
    sink = ListSink()
    with bt.Tap(sinks=[sink]) as tap, tap.run():
        tap.accumulate(loss=torch.tensor(1.0), batch_size=2, data_time=0.5)
        tap.step()
        with pytest.raises(InputError, match=r"data_time= must be the seconds .* got"):
            tap.accumulate(loss=torch.tensor(1.0), batch_size=2, data_time=bad)  # type: ignore[arg-type]
    assert [r.values["data_time"] for r in sink.records] == [0.5]
