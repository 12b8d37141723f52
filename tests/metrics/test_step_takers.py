"""The metrics that take a value at the optimizer step (through ``optimizer_hooks.TakeAtStep``) take
it at their own optimizer's steps only: a second optimizer stepping after the first (a GAN's
discriminator and generator) never replaces the value."""

from __future__ import annotations

import torch

import batchtap as bt
from tests.conftest import ListSink


def test_learning_rate_is_taken_at_its_own_optimizers_step_not_at_anothers() -> None:
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    opt_first = torch.optim.SGD(first.parameters(), lr=0.1)
    opt_second = torch.optim.SGD(second.parameters(), lr=0.5)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt_first, lambda step: 1.0 / (step + 1))
    sink = ListSink()
    used = []
    with bt.Tap([bt.metrics.Loss(), bt.metrics.LearningRate(opt_first)], sinks=[sink], flush_every=2) as tap:
        with tap.run("two-optimizers"):
            for _ in range(6):
                x = torch.randn(8, 4)
                loss = first(x).pow(2).mean() + second(x).pow(2).mean()
                opt_first.zero_grad()
                opt_second.zero_grad()
                loss.backward()
                used.append(opt_first.param_groups[0]["lr"])
                opt_first.step()
                schedule.step()  # the first optimizer's lr moves before the second one steps
                opt_second.step()
                tap.step(loss=loss.detach())
    assert [r.values["lr"] for r in sink.records if not r.sparse] == used
