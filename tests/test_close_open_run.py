"""Closing a Tap whose run is still open never drops what was recorded.

``with bt.Tap(...) as tap: tap.start(...)`` without ``finish()``, ``with bt.autolog():`` (it returns
its Tap) and a bare ``tap.close()`` used to stop the pipeline with the run open: every step since
the last flush was lost (0 of 12 here), the run stayed ``running`` in the store, and the exit
handler then said it had waited ``end_timeout`` for the sinks when it had not waited at all.
"""

from __future__ import annotations

import pytest
import torch

import batchtap as bt
from batchtap.records import RunStatus
from tests.conftest import ListSink

STEPS = 12


def _steps(tap: bt.Tap) -> None:
    for i in range(STEPS):
        tap.step(loss=torch.tensor(float(i)))


def test_leaving_with_tap_ends_the_open_run_finished_with_every_step(sink: ListSink) -> None:
    with bt.Tap([bt.metrics.Loss()], [sink], flush_every=50) as tap:
        tap.start(name="open")
        _steps(tap)
    assert [r.status for r in sink.ended] == [RunStatus.FINISHED]
    assert sink.values("loss") == [float(i) for i in range(STEPS)]
    assert sink.closed


def test_an_exception_leaving_with_tap_ends_the_run_failed_and_propagates(sink: ListSink) -> None:
    with pytest.raises(ZeroDivisionError):
        with bt.Tap([bt.metrics.Loss()], [sink], flush_every=50) as tap:
            tap.start(name="open")
            _steps(tap)
            1 / 0  # noqa: B018
    assert [(r.status, r.stop_reason) for r in sink.ended] == [
        (RunStatus.FAILED, "ZeroDivisionError: division by zero")
    ]
    assert len(sink.values("loss")) == STEPS


def test_ctrl_c_leaving_with_tap_ends_the_run_stopped(sink: ListSink) -> None:
    with pytest.raises(KeyboardInterrupt):
        with bt.Tap([bt.metrics.Loss()], [sink], flush_every=50) as tap:
            tap.start(name="open")
            _steps(tap)
            raise KeyboardInterrupt
    assert [(r.status, r.stop_reason) for r in sink.ended] == [(RunStatus.STOPPED, "KeyboardInterrupt")]
    assert len(sink.values("loss")) == STEPS


def test_close_with_the_run_open_ends_it_failed_with_every_step(sink: ListSink) -> None:
    tap = bt.Tap([bt.metrics.Loss()], [sink], flush_every=50)
    tap.start(name="open")
    _steps(tap)
    tap.close()
    assert [r.status for r in sink.ended] == [RunStatus.FAILED]
    assert "close() was called with the run still open" in (sink.ended[0].stop_reason or "")
    assert len(sink.values("loss")) == STEPS
    tap.close()  # idempotent
    assert len(sink.ended) == 1


def test_an_input_error_the_last_rows_reveal_is_raised_when_the_block_ends(sink: ListSink) -> None:
    with pytest.raises(bt.InputError):
        with bt.Tap([bt.metrics.Loss(), bt.metrics.Accuracy()], [sink], flush_every=50) as tap:
            tap.start(name="open")
            tap.step(loss=torch.tensor(1.0), outputs=torch.randn(4, 3), targets=torch.tensor([0, 1, 7, 2]))
    assert [r.status for r in sink.ended] == [RunStatus.FAILED]
    assert sink.closed


def _train(steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(torch.randn(4, 3)), torch.randint(0, 2, (4,)))
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_leaving_with_autolog_ends_the_session_with_every_step(sink: ListSink) -> None:
    with bt.autolog(name="with-autolog", sinks=[sink], flush_every=50):
        _train(STEPS)
    assert [r.status for r in sink.ended] == [RunStatus.FINISHED]
    assert len(sink.values("loss")) == STEPS
    _train(3)  # the patches are undone: nothing more is recorded
    assert len(sink.values("loss")) == STEPS


def test_an_exception_leaving_with_autolog_ends_the_run_failed(sink: ListSink) -> None:
    with pytest.raises(RuntimeError, match="diverged"):
        with bt.autolog(name="with-autolog", sinks=[sink], flush_every=50):
            _train(5)
            raise RuntimeError("diverged")
    assert [(r.status, r.stop_reason) for r in sink.ended] == [(RunStatus.FAILED, "RuntimeError: diverged")]
    assert len(sink.values("loss")) == 5
