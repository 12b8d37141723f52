"""Zero host reads inside ``Tap.step()``: counted on the CPU, proven for the CUDA path under
``FakeTensorMode`` (which raises on any data-dependent host read)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import batchtap as bt
import batchtap.capture.ring as ring_module
import batchtap.capture.session as session_module
from batchtap.capture.clock import HostClock
from batchtap.hostreads import HostReadCounter
from tests.conftest import ListSink, classifier

ALL_STEP_METRICS = lambda model, opt: [  # noqa: E731 - a fresh set per test
    bt.metrics.Loss(),
    bt.metrics.Accuracy(topk=(1, 3)),
    bt.metrics.LearningRate(opt),
    bt.metrics.GradNorm(model),
    bt.metrics.StepTime(),
    bt.metrics.DataTime(),
    bt.metrics.Throughput(),
    bt.metrics.Memory(),
]


def test_counter_sees_planted_reads() -> None:
    x = torch.randn(4)
    with HostReadCounter() as reads:
        x.sum().item()
        bool(x.max() > 0)
        x.tolist()
        x.numpy()
    assert reads.count == 4


def test_no_host_read_in_1000_cpu_steps_including_flushes(sink: ListSink) -> None:
    model, opt = classifier()
    data = [(torch.randn(16, 8), torch.randint(0, 5, (16,))) for _ in range(10)]
    tap = bt.Tap(ALL_STEP_METRICS(model, opt), [sink], flush_every=25, flush_seconds=1e-3)
    steps = 0
    with tap, tap.run():
        while steps < 1001:
            for x, y in tap.watch(data):
                out = model(x)
                loss = F.cross_entropy(out, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                extra = {"kl": loss.detach() * 0.5, "temp": 1.0}
                if steps == 0:  # the run's first step allocates the ring and its host views: once per run
                    tap.step(loss=loss, outputs=out, targets=y, extra=extra)
                    steps += 1
                    continue
                with HostReadCounter() as reads:
                    tap.step(loss=loss, outputs=out, targets=y, extra=extra)
                    stop = tap.should_stop
                assert reads.count == 0, reads.reads
                assert not stop
                steps += 1
    assert len(sink.records) == steps >= 1001


def _record_captures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Keep every RunCapture the runs make (the device side a test inspects after its steps)."""
    made: list[Any] = []
    create = session_module.RunCapture.create

    def recording(*args: Any, **kwargs: Any) -> Any:
        made.append(create(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(session_module.RunCapture, "create", recording)
    return made


def test_cuda_path_issues_no_host_read_under_fake_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    # Events need a real GPU; everything else of the CUDA path (ring on cuda, pinned buffers,
    # non_blocking copies, metric kernels) runs under FakeTensorMode, where a host read raises.
    monkeypatch.setattr(session_module, "clock_for", lambda device, capacity: HostClock(capacity))
    # A CPU build of torch has no CUDA streams to ask (its query raises); under fake CUDA nothing
    # is being captured. tests/test_graph_capture.py covers the capturing case.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    # Pinned memory needs a CUDA driver; pageable memory behaves the same for what is tested here.
    monkeypatch.setattr(ring_module, "host_buffer", lambda shape, pin: torch.zeros(shape))
    captures = _record_captures(monkeypatch)
    tap = bt.Tap(
        [bt.metrics.Loss(), bt.metrics.Accuracy(topk=(1, 5)), bt.metrics.StepTime(), bt.metrics.Throughput()],
        [ListSink()],
        flush_every=10,
        capacity=20,
    )
    with tap, tap.run():
        with FakeTensorMode(allow_non_fake_inputs=True):
            outputs = torch.randn(32, 10, device="cuda")
            tap.step(loss=outputs.mean(), outputs=outputs, targets=outputs.argmax(1))  # setup step
        with FakeTensorMode(allow_non_fake_inputs=True), HostReadCounter() as reads:
            for _ in range(1000):
                outputs = torch.randn(32, 10, device="cuda")
                targets = torch.randint(0, 10, (32,), device="cuda")
                loss = outputs.logsumexp(1).mean()
                tap.step(loss=loss, outputs=outputs, targets=targets)
            (capture,) = captures
            assert capture.ring.device_rows.device.type == "cuda"
            assert capture.ring.non_blocking  # the pinned, asynchronous transfer path
        assert reads.count == 0, reads.reads
    assert tap.steps_recorded == 1001
