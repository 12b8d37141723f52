"""What autolog's session (``autolog/_session.py``) says when it cannot record: slips a sampled
mutation run over issue 38's files let through the other autolog tests (TESTING.md, "third
session"): the saying deleted, the run goes on silently incomplete."""

from __future__ import annotations

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
