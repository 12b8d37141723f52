"""Autolog under ``DistributedDataParallel``: the loss given to ``backward()`` is found below DDP's
output node (``_DDPSinkBackward``, put on the model's outputs when DDP looks for unused parameters,
as the HF Trainer's DDP does), at the right output of it (the loss is not the model's first output).

A token-normalised loss (``CE(reduction="sum") / N``, the HF Trainer's causal-LM path) times the
Trainer's process factor is only known as such from the loss call beneath the node: not found, the
factor is taken for an accumulation division and the step is stored as the mean of the micro-batches
with the factor undone (a quarter of the truth on 2 ranks). One gloo rank in this process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.autolog._helpers import autologged
from tests.conftest import ListSink
from tests.realloops._loops import F32_REL, assert_one_record_per_step


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Model(nn.Module):
    """Returns (logits, loss): the loss is DDP's sink's second output."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.net(x)
        return logits, F.cross_entropy(logits, y, reduction="sum") / n


def test_a_token_normalised_loss_below_ddps_sink_is_the_steps_summed_loss(sink: ListSink, one_rank: None) -> None:
    torch.manual_seed(3)
    expected = []
    with autologged(sink, name="ddp-sink"):
        model = nn.parallel.DistributedDataParallel(_Model(), find_unused_parameters=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(3):
            xs = [torch.randn(10, 6), torch.randn(10, 6)]
            ys = [torch.randint(0, 5, (10,)), torch.randint(0, 5, (10,))]
            ys[1][:4] = -100
            n = torch.tensor(sum(int((y != -100).sum()) for y in ys))
            total = 0.0
            for x, y in zip(xs, ys):
                _, loss = model(x, y, n)
                assert loss.grad_fn is not None and "DDPSink" in loss.grad_fn.name()
                # the HF Trainer's ``loss *= num_processes`` (2 ranks), kept by a token-normalised loss
                (loss * 2).backward()
                total += 2 * loss.item()
            opt.step()
            opt.zero_grad()
            expected.append(total)
    for record, ref in zip(assert_one_record_per_step(sink.records, 3), expected):
        assert record.values["loss"] == pytest.approx(ref, rel=F32_REL), record.step
