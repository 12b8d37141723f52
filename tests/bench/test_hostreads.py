"""The benchmarks' host-read counter (``bench/_hostreads.py``) counts what it claims to."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _hostreads import HostReadCounter  # noqa: E402


@pytest.mark.parametrize(
    "read",
    [
        pytest.param(lambda t: t.sum().item(), id="item"),
        pytest.param(lambda t: float(t.sum()), id="float"),
        pytest.param(lambda t: bool(t.sum() > 0), id="bool"),
        pytest.param(lambda t: t.tolist(), id="tolist"),
        pytest.param(lambda t: t.numpy(), id="numpy"),
        pytest.param(lambda t: np.asarray(t), id="array"),
        pytest.param(lambda t: f"{t.sum():.3f}", id="format"),
    ],
)
def test_each_host_read_counts_once(read) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(5, generator=torch.Generator().manual_seed(0))
    with HostReadCounter() as c:
        read(x)
    assert c.count == 1, dict(c.by_op)


def test_device_ops_count_nothing_and_reset_forgets() -> None:
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    with HostReadCounter() as c:
        x.sum().item()
        c.reset()
        y = (x @ x.T).softmax(1).argmax(1)
        torch.stack([y.float().mean(), x.std()])
    assert c.count == 0 and c.nonblocking_copies == 0


def test_other_threads_are_not_counted_and_methods_are_restored() -> None:
    x = torch.ones(3)
    original = torch.Tensor.item
    with HostReadCounter() as c:
        worker = threading.Thread(target=lambda: x.sum().item())
        worker.start()
        worker.join()
    assert c.count == 0
    assert torch.Tensor.item is original
