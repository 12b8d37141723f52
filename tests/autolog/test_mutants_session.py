"""What autolog's session (``autolog/_session.py``) says when it cannot record: slips a sampled
mutation run over issue 38's files let through the other autolog tests (TESTING.md, "third
session"): the saying deleted, the run goes on silently incomplete."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from batchtap.autolog import active_session
from tests.autolog._helpers import autologged
from tests.conftest import ListSink


def test_an_error_of_autologs_own_is_said_once_and_the_training_goes_on(sink: ListSink) -> None:
    """A fault planted in autolog's backward hook (its row keeper raises): one warning event names
    the error, recording stops, and every training step still runs."""
    ran = 0
    with autologged(sink, name="own-error"):
        session = active_session()
        assert session is not None

        def broken(micro: object) -> None:
            raise RuntimeError("planted fault")

        session.rows.on_backward = broken  # type: ignore[method-assign]
        model = nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(3):
            F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
            opt.step()
            opt.zero_grad()
            ran += 1
    assert ran == 3
    said = [e.message for e in sink.events if "error of its own" in e.message]
    assert said == ["autolog: autolog stopped recording after an error of its own: RuntimeError: planted fault"]


def test_layers_asked_for_with_no_module_holding_the_parameters_is_said(sink: ListSink) -> None:
    """``bt.autolog(layers=1)`` with an optimizer over a bare parameter: no per-layer metrics, and
    the run says why instead of leaving them out silently."""
    with autologged(sink, name="no-module", layers=1):
        w = nn.Parameter(torch.randn(4, 1))
        opt = torch.optim.SGD([w], lr=0.01)
        for _ in range(2):
            (torch.randn(8, 4) @ w).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert [e for e in sink.events if "no torch.nn.Module holds the optimizer's parameters" in e.message]
    assert not [k for r in sink.records for k in r.values if "/" in k and k.split("/")[0].endswith("_norm")]


def test_the_run_starts_when_autolog_is_called_without_a_process_group_to_wait_for(sink: ListSink) -> None:
    """A single-process script: the run is started by ``bt.autolog()`` itself (not later, at the
    first optimizer), so a script that ends before training still has its run stored and ended."""
    with autologged(sink, name="started-at-once") as tap:
        assert tap.run_info is not None
        assert [run.name for run in sink.started] == ["started-at-once"]
    assert [run.name for run in sink.ended] == ["started-at-once"]


def test_the_row_still_open_at_the_end_is_written(sink: ListSink) -> None:
    """Two optimizers; the loop ends after the first one's step of a last iteration (the second never
    steps): that row is open when autolog ends, and is written with the first optimizer's loss."""
    torch.manual_seed(11)
    expected = []
    with autologged(sink, name="open-row"):
        a, b = nn.Linear(5, 3), nn.Linear(5, 3)
        opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.01), torch.optim.SGD(b.parameters(), lr=0.01)
        for i in range(4):
            x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
            loss = F.cross_entropy(a(x), y)
            loss.backward()
            opt_a.step()
            opt_a.zero_grad()
            expected.append(loss.item())
            if i == 3:
                break
            F.cross_entropy(b(x), y).backward()
            opt_b.step()
            opt_b.zero_grad()
    rows = [r for r in sink.records if not r.sparse]
    assert len(rows) == 4
    assert [r.values["loss"] for r in rows] == pytest.approx(expected, rel=1e-6)


def test_loss_only_is_said_for_a_regression_loss_and_nothing_for_a_recognised_one(sink: ListSink) -> None:
    """``F.mse_loss``: autolog says once that it records the loss only (no accuracy); a recognised
    classification loss (``F.cross_entropy``) gets neither that nor the "assumed" saying."""
    with autologged(sink, name="regression"):
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(2):
            F.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1)).backward()
            opt.step()
            opt.zero_grad()
    assert len([e for e in sink.events if "loss only, no accuracy" in e.message]) == 1
    other = ListSink()
    with autologged(other, name="classification"):
        model = nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(2):
            (F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,))) / 2).backward()
            opt.step()
            opt.zero_grad()
    assert not [e for e in other.events if "loss only" in e.message or "no recognised loss" in e.message], [
        e.message for e in other.events
    ]


def test_destroy_process_group_ends_the_run_there(sink: ListSink, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A distributed script (a real one-rank gloo group) that calls ``destroy_process_group()`` when
    done: the run is ended there (finished), not left open until autolog is switched off."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with autologged(sink, name="destroyed"):
            model = nn.Linear(4, 3)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            for _ in range(2):
                F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,))).backward()
                opt.step()
                opt.zero_grad()
            dist.destroy_process_group()
            assert [run.name for run in sink.ended] == ["destroyed"]
            assert sink.ended[0].status.value == "finished"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert len([r for r in sink.records if not r.sparse]) == 2
