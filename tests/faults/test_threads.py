"""Issue 15 §3: ``step()`` from a second thread is refused at its first call, clearly, and the
run driven by the first thread loses nothing."""

from __future__ import annotations

import threading

import pytest
import torch

import batchtap as bt
from batchtap.errors import RunStateError
from tests.conftest import ListSink


@pytest.mark.parametrize("call", ["step", "log", "accumulate"])
def test_a_second_thread_is_refused_at_its_first_call_and_the_first_loses_nothing(call: str) -> None:
    sink = ListSink()
    steps = 400
    started = threading.Event()
    errors: list[BaseException] = []
    with bt.Tap(sinks=[sink], flush_every=10) as tap, tap.run(name="threads"):

        def intruder() -> None:
            started.wait()
            try:
                if call == "step":
                    tap.step(loss=torch.tensor(9.0))
                elif call == "log":
                    tap.log({"eval": 1.0})
                else:
                    tap.accumulate(loss=torch.tensor(9.0))
            except BaseException as exc:  # noqa: BLE001 - inspected below
                errors.append(exc)

        other = threading.Thread(target=intruder, name="intruder")
        other.start()
        for i in range(steps):
            tap.step(loss=torch.tensor(float(i)))
            if i == steps // 2:
                started.set()
                other.join()
    assert len(errors) == 1 and isinstance(errors[0], RunStateError), errors
    message = str(errors[0])
    assert "'intruder'" in message and "'MainThread'" in message and "fix:" in message
    assert [r.values["loss"] for r in sink.records if not r.sparse] == [float(i) for i in range(steps)]


def test_a_later_run_may_be_driven_by_another_thread() -> None:
    sink = ListSink()
    tap = bt.Tap(sinks=[sink])
    with tap.run(name="main"):
        tap.step(loss=torch.tensor(1.0))

    def second() -> None:
        with tap.run(name="worker"):
            tap.step(loss=torch.tensor(2.0))

    t = threading.Thread(target=second)
    t.start()
    t.join()
    tap.close()
    assert [r.values["loss"] for r in sink.records] == [1.0, 2.0]
