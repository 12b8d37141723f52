"""The decoder's per-run bookkeeping, through a Tap: a metric's warning is reported once per run."""

from __future__ import annotations

import torch

import batchtap as bt
from tests.conftest import ListSink


def test_a_metric_warning_is_one_event_per_run_not_one_per_step() -> None:
    model = torch.nn.Linear(3, 2)
    sink = ListSink()
    with bt.Tap([bt.metrics.Loss(), bt.metrics.GradNorm(model)], [sink], flush_every=2) as tap:
        for run in range(2):
            with tap.run(name=f"run{run}"):
                for _ in range(5):
                    loss = model(torch.randn(4, 3)).square().mean()
                    model.zero_grad(set_to_none=True)  # too early: no gradient when tap.step runs
                    tap.step(loss=loss)
    assert len(sink.records) == 10 and all("grad_norm" not in r.values for r in sink.records)
    warnings = [e for e in sink.events if e.kind is bt.EventKind.WARNING]
    assert [(e.run_id, e.step) for e in warnings] == [(sink.started[0].id, 0), (sink.started[1].id, 0)]
    assert all(
        "grad_norm: " in e.message and "no parameter had a gradient when tap.step() ran" in e.message for e in warnings
    )
