"""On a GPU, snapshot and restore must not synchronize (they run inside the training loop)."""

from __future__ import annotations

import pytest
import torch

from batchtap.recovery import Rollback
from batchtap.rules import Action, Decision

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_snapshot_and_restore_do_not_sync_and_are_exact(kind):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 1)).cuda()
    opt = (
        torch.optim.Adam(model.parameters(), lr=1e-3)
        if kind == "adam"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    g = torch.Generator(device="cuda").manual_seed(1)

    def train_step():
        x, y = torch.randn(64, 16, device="cuda", generator=g), torch.randn(64, 1, device="cuda", generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    train_step()
    rb = Rollback(model, opt, every=1, keep=2)

    def no_sync(fn, *args, **kwargs):
        # only batchtap's calls run under "error": a sync inside them fails the test
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    no_sync(rb.maybe_snapshot, 0)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    train_step()
    no_sync(rb.maybe_snapshot, 1)
    no_sync(rb.confirm, 1)
    train_step()
    decision = Decision(step=2, rule="r", metric="loss", actions=(Action.ROLLBACK,), message="bad")
    no_sync(rb.restore, decision, step=2)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
