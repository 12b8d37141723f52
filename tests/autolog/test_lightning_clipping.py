"""Lightning's ``gradient_clip_val`` under ``bt.autolog()``: Lightning steps every optimizer with a
closure (forward and ``backward()`` run inside ``optimizer.step``) and clips after the closure, before
the step: the stored gradient norm is the one before clipping, and the loss the training step's,
each compared with ``.item()`` taken by the LightningModule itself in the same run."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.autolog._helpers import autologged
from tests.conftest import ListSink
from tests.realloops._loops import F32_REL, assert_one_record_per_step

pl = pytest.importorskip("lightning.pytorch")

STEPS = 6


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        self.losses: list[float] = []
        self.norms: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Lightning calls this after the closure and before it clips: the pre-clip gradients
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms.append(math.sqrt(sum(g.double().pow(2).sum().item() for g in grads)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_lightning_gradient_clip_val_stores_the_norm_before_clipping(sink: ListSink) -> None:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(STEPS * 8, 6), torch.randint(0, 3, (STEPS * 8,)))
    module = Classifier()
    with autologged(sink, name="lightning-clip"):
        trainer = pl.Trainer(
            max_epochs=1,
            accelerator="cpu",
            devices=1,
            gradient_clip_val=0.05,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    rows = assert_one_record_per_step(sink.records, STEPS)
    assert len(module.norms) == len(module.losses) == STEPS
    for record, loss, norm in zip(rows, module.losses, module.norms):
        assert norm > 0.1  # well above the clip value: a clipped norm would show
        assert record.values["grad_norm"] == pytest.approx(norm, rel=F32_REL), record.step
        assert record.values["loss"] == pytest.approx(loss, rel=F32_REL), record.step
