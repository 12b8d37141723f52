"""CUDA-only checks: 1,000 steps with the CUDA sync debugger set to raise on any synchronization."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import batchtap as bt
from tests.conftest import ListSink

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_1000_steps_without_sync_and_exact_values() -> None:
    sink = ListSink()
    device = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = [(torch.randn(64, 32, device=device), torch.randint(0, 10, (64,), device=device)) for _ in range(20)]
    keep = []
    metrics = [bt.metrics.Loss(), bt.metrics.Accuracy(topk=(1, 5)), bt.metrics.GradNorm(model), bt.metrics.StepTime()]
    with bt.Tap(metrics, [sink], flush_every=50) as tap, tap.run():
        for step in range(1000):
            x, y = data[step % len(data)]
            if step == 1:
                torch.cuda.set_sync_debug_mode("error")  # after the one-time setup of the first step
            try:
                out = model(x)
                loss = F.cross_entropy(out, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                tap.step(loss=loss, outputs=out, targets=y)
                stop = tap.should_stop
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert not stop
            keep.append((loss.detach(), (out.argmax(1) == y).float().mean()))
    assert len(sink.records) == 1000
    for r, (loss, acc) in zip(sink.records, keep):
        assert np.float32(r.values["loss"]) == np.float32(loss.item())
        assert np.float32(r.values["accuracy"]) == np.float32(acc.item())
        assert r.step == 0 or r.values["step_time"] > 0


def test_nan_is_seen_within_the_device_lag() -> None:
    with bt.Tap([bt.metrics.Loss()], [ListSink()]) as tap, tap.run():
        seen = None
        for step in range(200):
            loss = torch.ones((), device="cuda") * (math.nan if step == 50 else 1.0)
            tap.step(loss=loss)
            if tap.should_stop:
                seen = step
                break
    assert seen is not None and seen - 50 <= 10
