"""The training-side pieces read no tensor value on the host: no .item(), no device-to-host copy."""

from __future__ import annotations

import pytest
import torch

from batchtap.hostreads import HostReadCounter
from batchtap.recovery import ActionRunner, Rollback, split_on_oom
from batchtap.rules import Action, Decision


def _model_and_optimizer(kind: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 1))
    opt = (
        torch.optim.Adam(model.parameters(), lr=1e-3)
        if kind == "adam"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()  # populate optimizer state
    return model, opt


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_snapshot_confirm_and_restore_read_nothing(kind):
    model, opt = _model_and_optimizer(kind)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    rb = Rollback(model, opt, sched, every=1, keep=3, skip_batches=1)
    runner = ActionRunner([Action.ROLLBACK], rollback=rb)
    d = Decision(step=3, rule="r", metric="loss", actions=(Action.ROLLBACK,), message="bad")
    with HostReadCounter() as reads:
        for step in range(3):
            runner.after_step(step)
        runner.apply([], step=3, cleared_through=2)
        runner.apply([d], step=4)
        runner.should_skip(0, 5, step=5)
    assert reads.count == 0, reads.reads


def test_split_on_oom_reads_nothing():
    model, opt = _model_and_optimizer("sgd")
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)

    def loss_fn(a, b):
        if a.shape[0] > 3:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return torch.nn.functional.mse_loss(model(a), b)

    opt.zero_grad()
    with HostReadCounter() as reads:
        split_on_oom(loss_fn, x, y, zero_grad=opt.zero_grad)
    assert reads.count == 0, reads.reads
