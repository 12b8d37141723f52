"""The whole CUDA step path under ``FakeTensorMode`` on ``cuda``: every built-in metric,
``accumulate()``, ``log()``, rules and rollback snapshots, with 0 host reads and 0 host->device
copies counted over hundreds of steps (a ``torch.tensor(..., device="cuda")`` built from Python
data would be a blocking copy each step).

What a CPU machine cannot run is left to the GPU tests (``*_gpu.py``, ``bench/gpu_check.sh``):
CUDA events (the host clock stands in; an event is no kernel), pinned memory (pageable buffers
stand in) and device-to-device ``copy_``, which FakeTensorMode cannot run on a CPU-only build
(the rollback's restore uses it).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import batchtap as bt
import batchtap.capture.logged as logged_module
import batchtap.capture.ring as ring_module
import batchtap.capture.session as session_module
from batchtap.capture.clock import HostClock
from batchtap.hostreads import HostReadCounter
from tests.conftest import ListSink
from tests.test_no_sync import ALL_STEP_METRICS

_COPIES = {"copy_", "_to_copy", "lift_fresh", "lift_fresh_copy", "_copy_from", "_copy_from_and_resize"}


class _HostToDevice(TorchDispatchMode):
    """Counts copies whose source is a host tensor (not a 0-dim scalar) and whose result is on CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(getattr(func, "overloadpacket", None), "__name__", str(func))
        if name in _COPIES:
            sources = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            results = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if any(t.device.type == "cpu" for t in sources) and any(t.device.type == "cuda" for t in results):
                self.copies.append(name)
        return out


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session_module, "clock_for", lambda device, capacity: HostClock(capacity))
    # A CPU build of torch has no CUDA streams to ask (its query raises); under fake CUDA nothing
    # is being captured. tests/test_graph_capture.py covers the capturing case.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(ring_module, "host_buffer", lambda shape, pin: torch.zeros(shape))
    monkeypatch.setattr(logged_module, "host_buffer", lambda shape, pin: torch.zeros(shape))


def _model() -> torch.nn.Module:
    # parameters made directly on the fake device: nn.Linear's init cannot run there
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(8, 5, device="cuda"))
    model.b = torch.nn.Parameter(torch.zeros(5, device="cuda", dtype=torch.bfloat16))
    return model


def _forward(model: torch.nn.Module, batch: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(batch, 8, device="cuda")
    targets = torch.randint(0, 5, (batch,), device="cuda")
    with torch.no_grad():  # recording a graph on the fake device aborts on a CPU-only build
        outputs = x @ model.w + model.b.float()
        return F.cross_entropy(outputs, targets), outputs, targets


def _backward(model: torch.nn.Module) -> None:
    # gradients set by hand: no graph was recorded (see _forward)
    for p in model.parameters():
        p.grad = torch.randn_like(p)


def _all_metrics(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[bt.metrics.Metric]:
    metrics = ALL_STEP_METRICS(model, opt)  # every built-in per-step metric, as the CPU test uses
    for metric in metrics:
        if isinstance(metric, bt.metrics.Accuracy):
            metric.check_targets_every = 1  # the target-range check on every step
    margin = bt.metrics.Custom("margin", lambda outputs: outputs.max(1).values.mean(), requires=("outputs",))
    return [*metrics, margin]


def test_every_metric_rules_and_snapshots_on_cuda_no_host_read_no_upload(fake_cuda: None) -> None:
    sink = ListSink()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rules = [bt.rules.NonFinite("loss"), bt.rules.Threshold("grad_norm", above=1e9), bt.rules.Spike("loss")]
        rollback = bt.Rollback(model, opt, every=10, keep=2)
        tap = bt.Tap(_all_metrics(model, opt), [sink], flush_every=10, capacity=40, rules=rules, rollback=rollback)
        with tap, tap.run():
            loss, outputs, targets = _forward(model)
            _backward(model)
            tap.step(loss=loss, outputs=outputs, targets=targets, extra={"kl": loss.detach(), "temp": 0.5})
            with HostReadCounter() as reads, _HostToDevice() as uploads:
                for step in range(300):
                    loss, outputs, targets = _forward(model)
                    _backward(model)
                    tap.step(loss=loss, outputs=outputs, targets=targets, extra={"kl": loss.detach(), "temp": 0.5})
                    if step % 50 == 0:
                        tap.log({"val_loss": loss.detach(), "val_acc": 0.5})
                    assert not tap.should_stop
            assert reads.count == 0, reads.reads
            assert uploads.copies == [], uploads.copies
    assert len([r for r in sink.records if not r.sparse]) == 301


def test_accumulate_on_cuda_no_host_read_no_upload(fake_cuda: None) -> None:
    sink = ListSink()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tap = bt.Tap(_all_metrics(model, opt), [sink], flush_every=8, capacity=32)
        with tap, tap.run():
            for _ in range(2):  # the first optimizer step makes the ring and the device sums
                loss, outputs, targets = _forward(model)
                tap.accumulate(loss=loss, outputs=outputs, targets=targets)
            tap.step(grad_norm=torch.zeros((), device="cuda"))
            with HostReadCounter() as reads, _HostToDevice() as uploads:
                for _ in range(100):
                    for micro in range(4):
                        loss, outputs, targets = _forward(model, batch=8 + micro)  # uneven micro-batches
                        tap.accumulate(loss=loss, outputs=outputs, targets=targets)
                    tap.step(grad_norm=torch.zeros((), device="cuda"))
            assert reads.count == 0, reads.reads
            assert uploads.copies == [], uploads.copies
    assert len(sink.records) == 101
    assert all(
        math.isclose(r.values["throughput"] * r.values["step_time"], 38, rel_tol=1e-6)
        for r in sink.records[1:]
        if "throughput" in r.values
    )


def test_accumulate_short_path_on_cuda_no_host_read_no_upload(fake_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Micro-batches of one shape take the short accumulation path (``Metric.micro_writer``): its
    writes and the step's settle read nothing and upload nothing either."""
    from batchtap.capture.accumulate import MicroBatches

    kept = []
    add_short = MicroBatches.add_short
    monkeypatch.setattr(MicroBatches, "add_short", lambda self, *a, **k: (kept.append(1), add_short(self, *a, **k)))
    sink = ListSink()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        metrics = [bt.metrics.Loss(), bt.metrics.Accuracy(), bt.metrics.LearningRate(opt), bt.metrics.GradNorm(model)]
        tap = bt.Tap(metrics, [sink], flush_every=8, capacity=32)
        with tap, tap.run():
            for _ in range(2):  # the ring, the device sums and the writers are made here
                for _ in range(4):
                    loss, outputs, targets = _forward(model)
                    tap.accumulate(loss=loss, outputs=outputs, targets=targets)
                _backward(model)
                tap.step()
            with HostReadCounter() as reads, _HostToDevice() as uploads:
                for _ in range(50):
                    for _ in range(4):
                        loss, outputs, targets = _forward(model)
                        tap.accumulate(loss=loss, outputs=outputs, targets=targets)
                    _backward(model)
                    tap.step()
            assert reads.count == 0, reads.reads
            assert uploads.copies == [], uploads.copies
    assert len(kept) >= 50 * 4
    assert len(sink.records) == 52


def test_the_upload_counter_sees_a_tensor_built_from_python_data() -> None:
    with FakeTensorMode(allow_non_fake_inputs=True), _HostToDevice() as uploads:
        torch.tensor([1.0, 2.0], device="cuda")
        torch.as_tensor([3, 4], device="cuda")
        torch.zeros(3, device="cuda")  # made on the device: no upload
    # (a host tensor's .to("cuda") cannot even run under FakeTensorMode on a CPU-only build: it
    # raises, so the tests above would fail on one as well)
    assert len(uploads.copies) == 2, uploads.copies
