"""CUDA-only: Layers, Histograms and MFU on the GPU, the optimizer step and tap.step under the CUDA
sync debugger set to raise (from the second step on), values against .item() / numpy of the same
tensors; mfu from the H100/H200 table."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import batchtap as bt
from batchtap.metrics.histograms import histogram_edges
from batchtap.metrics.layers import layer_groups
from batchtap.metrics.throughput import peak_flops_of
from tests.conftest import ListSink

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = torch.device("cuda", 0)
BINS = 8


@contextlib.contextmanager
def _no_sync(armed: bool) -> Iterator[None]:
    if not armed:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _norm(ts: list[torch.Tensor]) -> float:
    return math.sqrt(sum(t.detach().double().pow(2).sum().item() for t in ts))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10)).to(DEVICE)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast-GradScaler"])
def test_layers_on_cuda_without_sync(sink: ListSink, amp: bool) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10) if amp else None
    groups = layer_groups(model)
    layers = bt.metrics.Layers(model, every=2, scaler=scaler)
    tap = bt.Tap([bt.metrics.Loss(), layers], [sink], flush_every=4)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    expected: dict[int, dict[str, float]] = {}
    with tap, tap.run(name="layers-cuda"):
        for step in range(8):
            x = torch.randn(32, 64, device=DEVICE, generator=g)
            y = torch.randint(0, 10, (32,), device=DEVICE, generator=g)
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                loss = F.cross_entropy(model(x), y)
            if scaler is None:
                loss.backward()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)  # the hand values read unscaled gradients, as the hook does
            grads = {k: _norm([p.grad for p in ps]) for k, ps in groups.items()}
            before = {k: [p.detach().clone() for p in ps] for k, ps in groups.items()}
            torch.cuda.synchronize()
            # GradScaler.step reads found_inf on the host by design: only tap.step is armed then
            with _no_sync(step > 0 and scaler is None):
                opt.step() if scaler is None else scaler.step(opt)
            with _no_sync(step > 0):
                tap.step(loss=loss)
            if scaler is not None:
                scaler.update()
            if step % 2 == 0:
                expected[step] = {}
                for k, ps in groups.items():
                    expected[step][f"grad_norm/{k}"] = grads[k]
                    expected[step][f"weight_norm/{k}"] = _norm(list(ps))
                    moved = _norm([p.detach() - b for p, b in zip(ps, before[k])])
                    expected[step][f"update_ratio/{k}"] = moved / _norm(before[k])
    for record in sink.records:
        got = {k: v for k, v in record.values.items() if "/" in k}
        if record.step not in expected:
            assert got == {}
            continue
        for name, value in expected[record.step].items():
            assert got[name] == pytest.approx(value, rel=1e-4), (record.step, name)


def test_histograms_on_cuda_equal_numpy(sink: ListSink) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    groups = layer_groups(model)
    tap = bt.Tap([bt.metrics.Loss(), bt.metrics.Histograms(model, every=3, bins=BINS)], [sink], flush_every=3)
    g = torch.Generator(device=DEVICE).manual_seed(2)
    weights: dict[int, dict[str, np.ndarray]] = {}
    with tap, tap.run(name="hist-cuda"):
        for step in range(6):
            x = torch.randn(32, 64, device=DEVICE, generator=g)
            y = torch.randint(0, 10, (32,), device=DEVICE, generator=g)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            torch.cuda.synchronize()
            with _no_sync(step > 0):
                opt.step()
                tap.step(loss=loss)
            if step % 3 == 0:
                weights[step] = {
                    k: np.concatenate([p.detach().double().cpu().numpy().reshape(-1) for p in ps])
                    for k, ps in groups.items()
                }
    for record in sink.records:
        if record.step not in weights:
            continue
        for layer, flat in weights[record.step].items():
            prefix = f"hist/weight/{layer}/"
            counts, _ = np.histogram(flat, bins=histogram_edges(flat.min(), flat.max(), BINS))
            assert [record.values[f"{prefix}{i}"] for i in range(BINS)] == counts.astype(float).tolist()
            assert record.values[prefix + "max"] == pytest.approx(flat.max(), rel=1e-6)


def test_mfu_from_the_peak_table(sink: ListSink) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    tap = bt.Tap([bt.metrics.Loss(), bt.metrics.StepTime(), bt.metrics.MFU(dtype=torch.bfloat16)], [sink])
    with tap, tap.run(name="mfu-cuda"):
        for _ in range(5):
            x = torch.randn(256, 64, device=DEVICE)
            y = torch.randint(0, 10, (256,), device=DEVICE)
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            tap.step(loss=loss)
    name = torch.cuda.get_device_name(DEVICE)
    peak = peak_flops_of(name, torch.bfloat16)
    with_mfu = [r for r in sink.records if "mfu" in r.values]
    if peak is None:
        assert not with_mfu and any("mfu: left out" in e.message for e in sink.events)
        return
    if "H100" in name or "H200" in name:
        assert peak == 989.4e12 or "PCIe" in name or "NVL" in name
    assert with_mfu
    for r in with_mfu:
        assert r.values["mfu"] == pytest.approx(r.values["flops_per_second"] / peak, rel=1e-9)
