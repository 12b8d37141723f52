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


class _ExplicitSyncs:
    """Counts calls of the explicit waits the sync debugger does not see (it flags implicit syncs
    such as ``.item()`` only): ``torch.cuda.synchronize``, ``Event.synchronize``,
    ``Stream.synchronize``, ``torch.accelerator.synchronize``; any thread."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        targets = [(torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize")]
        if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "synchronize"):
            targets.append((torch.accelerator, "synchronize"))
        for owner, name in targets:
            original = getattr(owner, name)

            def counted(*args, _original=original, _label=f"{getattr(owner, '__name__', owner)}.{name}", **kwargs):
                self.calls.append(_label)
                return _original(*args, **kwargs)

            monkeypatch.setattr(owner, name, counted)


def test_1000_steps_without_sync_and_exact_values(monkeypatch: pytest.MonkeyPatch) -> None:
    sink = ListSink()
    device = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = [(torch.randn(64, 32, device=device), torch.randint(0, 10, (64,), device=device)) for _ in range(20)]
    keep = []
    metrics = [
        bt.metrics.Loss(),
        bt.metrics.Accuracy(topk=(1, 5)),
        bt.metrics.GradNorm(model),
        bt.metrics.StepTime(),
        bt.metrics.LearningRate(opt),
        bt.metrics.Memory(),
        bt.metrics.Throughput(),
    ]
    syncs = _ExplicitSyncs(monkeypatch)
    with bt.Tap(metrics, [sink], flush_every=50) as tap, tap.run():

        def train(step: int) -> None:
            x, y = data[step % len(data)]
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tap.step(loss=loss, outputs=out, targets=y)
            assert not tap.should_stop
            keep.append((loss.detach(), (out.argmax(1) == y).float().mean()))

        train(0)  # the run's first step allocates the ring (and CUDA's lazy init may sync)
        syncs.calls.clear()
        # Armed for all 999 later steps, flushes and ring-slot hand-outs included: any implicit
        # synchronization on any thread raises.
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in range(1, 1000):
                train(step)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        explicit = list(syncs.calls)
    assert explicit == [], explicit
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


def test_default_accuracy_counted_at_the_flush_is_exact_on_padded_lm_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default Accuracy on [B, T, V] logits with -100 padding takes the short path's writer that
    # marks hits per slot and counts a whole block with one sum at the flush (bool -> float32 into
    # strided ring views): every step's value must be what .item() says, with no sync.
    sink = ListSink()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    steps = []
    for i in range(40):
        logits = torch.randn(4, 16, 50, device=device, generator=gen)
        targets = torch.randint(0, 50, (4, 16), device=device, generator=gen)
        share = (0.0, 0.3, 1.0, 0.6)[i % 4]  # of padded targets; all of them every 4th step
        targets[torch.rand(4, 16, device=device, generator=gen) < share] = -100
        steps.append((logits, targets))
    syncs = _ExplicitSyncs(monkeypatch)
    with bt.Tap([bt.metrics.Loss(), bt.metrics.Accuracy()], [sink], flush_every=8, capacity=16) as tap, tap.run():
        tap.step(loss=steps[0][0].mean(), outputs=steps[0][0], targets=steps[0][1])
        syncs.calls.clear()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for logits, targets in steps[1:]:
                tap.step(loss=logits.mean(), outputs=logits, targets=targets)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert syncs.calls == []
    assert len(sink.records) == len(steps)
    for record, (logits, targets) in zip(sink.records, steps):
        kept = targets != -100
        if not kept.any().item():
            assert "accuracy" not in record.values  # every target ignored: no accuracy at this step
            continue
        hits = ((logits.argmax(-1) == targets) & kept).sum().float()
        expected = (hits / kept.sum().float()).item()
        assert np.float32(record.values["accuracy"]) == np.float32(expected), record.step


def test_a_captured_graph_replayed_with_steps_after_each_replay() -> None:
    # The supported pattern: capture the model's step inside tap.paused(), then tap.step() on the
    # graph's static outputs after each replay; blocks are in flight when the capture starts.
    sink = ListSink()
    device = torch.device("cuda")
    model = torch.nn.Linear(16, 4).to(device)
    static_x = torch.randn(32, 16, device=device)
    static_y = torch.randint(0, 4, (32,), device=device)
    expected = []
    with bt.Tap([bt.metrics.Loss(), bt.metrics.Accuracy()], [sink], flush_every=4) as tap, tap.run():
        for _ in range(6):
            out = model(static_x)
            loss = F.cross_entropy(out, static_y)
            tap.step(loss=loss, outputs=out, targets=static_y)
            expected.append(loss.detach())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model(static_x)  # warm-up on a side stream, as torch.cuda.graph asks
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with tap.paused(), torch.cuda.graph(graph):
            static_out = model(static_x)
            static_loss = F.cross_entropy(static_out, static_y)
        for _ in range(20):
            static_x.copy_(torch.randn(32, 16, device=device))
            graph.replay()
            tap.step(loss=static_loss, outputs=static_out, targets=static_y)
            expected.append(static_loss.detach().clone())
    assert len(sink.records) == 26
    for record, loss in zip(sink.records, expected):
        assert np.float32(record.values["loss"]) == np.float32(loss.item())


def test_a_step_on_another_stream_is_refused_and_the_run_goes_on() -> None:
    sink = ListSink()
    with bt.Tap([bt.metrics.Loss()], [sink]) as tap, tap.run():
        tap.step(loss=torch.ones((), device="cuda"))
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            with pytest.raises(bt.InputError, match="another CUDA stream"):
                tap.step(loss=torch.full((), 2.0, device="cuda"))
        tap.step(loss=torch.full((), 3.0, device="cuda"))
    assert [r.values["loss"] for r in sink.records] == [1.0, 3.0]
