"""CUDA-only: the built-in metrics' compute() under the CUDA sync debugger set to raise, with their
values against the ordinary (synchronizing) reference of the same tensors."""

from __future__ import annotations

import math

import pytest
import torch

import batchtap as bt
from batchtap.metrics import StepInputs
from tests.metrics._helpers import TIMING

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = torch.device("cuda", 0)


def _no_sync_raw(metric: bt.metrics.Metric, inputs: StepInputs, *, warm: bool = True) -> list[float]:
    """compute() under the debugger; with ``warm`` once before, outside it (constants are made at the
    first call). LossScale keeps state between calls: no warm-up call for it."""
    if warm:
        metric.compute(inputs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            values = list(metric.compute(inputs))
            row = torch.stack(values).float() if values else torch.empty(0, device=DEVICE)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return row.tolist() + list(metric.read_host(inputs))


@pytest.mark.parametrize("topk", [(1,), (1, 5)], ids=["top1", "top1+5"])
def test_accuracy_lm_logits_with_padding(topk) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    logits = torch.randn(4, 64, 1000, device=DEVICE, generator=g, dtype=torch.bfloat16)
    targets = torch.randint(0, 1000, (4, 64), device=DEVICE, generator=g)
    targets[:, :7] = -100
    metric = bt.metrics.Accuracy(topk=topk)
    got = metric.finalize(_no_sync_raw(metric, StepInputs(None, logits, targets, 4.0, device=DEVICE)), TIMING)
    keep = targets != -100
    top = logits.float().topk(max(topk), dim=-1).indices
    expected = [((top[..., :k] == targets[..., None]).any(-1) & keep).sum().item() / keep.sum().item() for k in topk]
    assert got == pytest.approx(expected, abs=1e-12)


def test_grad_norm_bf16_and_scaled() -> None:
    torch.manual_seed(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(50)]).to(DEVICE, torch.bfloat16)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8)
    scaler.scale(model(torch.randn(8, 64, device=DEVICE, dtype=torch.bfloat16)).float().pow(2).mean()).backward()
    metric = bt.metrics.GradNorm(model, scaler=scaler)
    scaled_value = metric.finalize(_no_sync_raw(metric, StepInputs(None, None, None, 8.0, device=DEVICE)), TIMING)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.unscale_(opt)
    reference = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()])).item()
    assert scaled_value == pytest.approx(reference, rel=1e-5)
    unscaled_value = metric.finalize(_no_sync_raw(metric, StepInputs(None, None, None, 8.0, device=DEVICE)), TIMING)[0]
    assert unscaled_value == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("overflow", [False, True], ids=["finite", "overflow"])
def test_loss_scale_before_and_after_update(overflow) -> None:
    model = torch.nn.Linear(16, 4).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    before, after = bt.metrics.LossScale(scaler), bt.metrics.LossScale(scaler)
    inputs = StepInputs(None, None, None, 8.0, device=DEVICE)
    for i in range(2):  # the second iteration may overflow
        scaler.scale(model(torch.randn(8, 16, device=DEVICE)).pow(2).mean()).backward()
        if overflow and i == 1:
            model.weight.grad[0, 0] = math.inf
        scaler.step(opt)
        raw_before = _no_sync_raw(before, inputs, warm=False)
        scale_used = scaler.get_scale()
        scaler.update()
        raw_after = _no_sync_raw(after, inputs, warm=False)
        opt.zero_grad(set_to_none=True)
    skipped = overflow
    assert before.finalize(raw_before, TIMING) == [scale_used, float(skipped)] and before.skipped(raw_before) is skipped
    assert (
        after.finalize(raw_after, TIMING) == [scaler.get_scale(), float(skipped)]
        and after.skipped(raw_after) is skipped
    )


def test_memory_peak_is_the_peak_of_its_flush_interval() -> None:
    from tests.conftest import ListSink

    sink = ListSink()
    spike_bytes = 256 * 2**20
    loss = torch.tensor(1.0, device=DEVICE)
    with bt.Tap([bt.metrics.Loss(), bt.metrics.Memory()], [sink], flush_every=4, flush_seconds=3600) as tap, tap.run():
        for step in range(8):
            if step == 1:
                spike = torch.empty(spike_bytes, dtype=torch.uint8, device=DEVICE)
                del spike
            tap.step(loss=loss)
    peaks = [r.values["memory_peak"] for r in sink.records]
    assert min(peaks[1:4]) >= spike_bytes, peaks  # the spike shows in its own interval
    assert max(peaks[4:]) < spike_bytes, peaks  # and not after the flush that reset the peak
