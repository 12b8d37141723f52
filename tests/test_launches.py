"""Device launches per step on the CUDA path, counted under ``FakeTensorMode`` on ``cuda``: each
aten op that touches a CUDA tensor, views and metadata queries left out (they launch nothing).

On a GPU every launch costs host time in the training thread (a few microseconds of driver
work), so these counts are the step path's GPU cost in the only unit a CPU machine can measure.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import batchtap as bt
import batchtap.capture.ring as ring_module
import batchtap.capture.session as session_module
from batchtap.capture.clock import HostClock
from batchtap.metrics import StepInputs

aten = torch.ops.aten
CUDA = torch.device("cuda", 0)
#: ops that make a view or read metadata: no kernel, no copy
_NO_LAUNCH = {
    aten.select,
    aten.narrow,
    aten.view,
    aten.alias,
    aten.detach,
    aten.unsqueeze,
    aten._unsafe_view,
    aten.as_strided,
    aten.expand,
    aten.t,
    aten.squeeze,
    aten.unbind,
    aten.slice,
    aten.permute,
    aten.transpose,
    aten.reshape,
    aten.flatten,
}


class _Launches(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = getattr(func, "overloadpacket", func)
        if packet not in _NO_LAUNCH and getattr(func, "namespace", "aten") == "aten":
            flat = tree_flatten((args, kwargs, out))[0]
            if any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in flat):
                self.ops[str(packet)] += 1
        return out


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # CUDA events and pinned memory need a driver; the host clock and pageable buffers stand in
    # (neither launches anything: events are not kernels, the pinned copy is counted either way).
    monkeypatch.setattr(session_module, "clock_for", lambda device, capacity: HostClock(capacity))
    # A CPU build of torch has no CUDA streams to ask (its query raises); under fake CUDA nothing
    # is being captured. tests/test_graph_capture.py covers the capturing case.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(ring_module, "host_buffer", lambda shape, pin: torch.zeros(shape))


def _per_step(
    tap: bt.Tap, steps: int = 64, warm: int = 3, **inputs: torch.Tensor
) -> tuple[float, collections.Counter[str]]:
    for _ in range(warm):
        tap.step(**inputs)  # the first step makes the ring; the next ones take the short path
    with _Launches() as launches:
        for _ in range(steps):
            tap.step(**inputs)
    return sum(launches.ops.values()) / steps, launches.ops


DEFAULTS = lambda: [  # noqa: E731 - the metrics a Tap picks for loss/outputs/targets without an optimizer
    bt.metrics.Loss(),
    bt.metrics.Accuracy(),
    bt.metrics.StepTime(),
    bt.metrics.DataTime(),
    bt.metrics.Throughput(),
]


@pytest.mark.parametrize("nan_guard", [True, False], ids=["nan_guard", "no_guard"])
def test_default_metrics_launch_three_kernels_a_step_plus_the_nan_guards_copy(fake_cuda: None, nan_guard: bool) -> None:
    # flush by count only: a slow machine could otherwise flush by age within the counted steps
    tap = bt.Tap(DEFAULTS(), [], flush_every=16, flush_seconds=3600, capacity=64, nan_guard=nan_guard)
    with tap, tap.run(), FakeTensorMode(allow_non_fake_inputs=True):
        logits = torch.randn(8, 64, 100, device="cuda")  # [B, T, V] with -100 padding: the LM case
        targets = torch.randint(0, 100, (8, 64), device="cuda")
        # a lap of the ring first: the short path's first write of each slot also zeroes its constant columns
        per_step, ops = _per_step(tap, warm=64 + 3, loss=logits.mean(), outputs=logits, targets=targets)
    # the loss into the row; argmax, and sub writing targets - argmax and the targets into the
    # slot's buffer; the guard's loss copy; amortised: at each flush, for the whole block, eq
    # marking hits and ignored targets, one sum counting them into the rows, where, amin and
    # amax checking every step's target range (issue 29: no step's targets go unchecked), and the
    # rows' copy
    expected = 3 + (1 if nan_guard else 0) + 6 / 16
    assert per_step == pytest.approx(expected), str(dict(ops))


def test_loss_only_launches_one_kernel_a_step_plus_the_guards_copy(fake_cuda: None) -> None:
    tap = bt.Tap([bt.metrics.Loss()], [], flush_every=16, flush_seconds=3600, capacity=64)
    with tap, tap.run(), FakeTensorMode(allow_non_fake_inputs=True):
        per_step, ops = _per_step(tap, loss=torch.randn(4, device="cuda").mean())
    assert per_step == pytest.approx(2 + 1 / 16), dict(ops)  # row copy, guard copy; flush copy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_grad_norm_takes_three_launches_whatever_the_number_of_parameters(dtype: torch.dtype) -> None:
    with FakeTensorMode(allow_non_fake_inputs=True):
        params = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(16, 16, dtype=dtype, device="cuda")) for _ in range(100)]
        )
        for p in params:
            p.grad = torch.zeros_like(p)
        metric = bt.metrics.GradNorm(params)
        inputs = StepInputs(torch.zeros((), device="cuda"), None, None, 1.0, device=CUDA)
        metric.compute(inputs)
        with _Launches() as launches:
            metric.compute(inputs)
    assert sum(launches.ops.values()) == 3, dict(launches.ops)  # foreach norm, stack, norm of norms
