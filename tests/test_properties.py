"""Property test through the whole Tap: random batch sizes, class counts, dtypes and values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import batchtap as bt
from tests.conftest import ListSink


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batches=st.lists(st.tuples(st.integers(1, 40), st.integers(2, 12)), min_size=1, max_size=12),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
    flush_every=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
    topk=st.sampled_from([(1,), (1, 2)]),
)
def test_tap_records_match_reference(batches, dtype, flush_every, seed, topk) -> None:
    g = torch.Generator().manual_seed(seed)
    sink = ListSink()
    reference = []
    metrics = [bt.metrics.Loss(nonnegative=False), bt.metrics.Accuracy(topk=topk)]
    with bt.Tap(metrics, [sink], flush_every=flush_every) as tap, tap.run():
        for n, classes in batches:
            outputs = (torch.randn(n, classes, generator=g) * 3).to(dtype)
            targets = torch.randint(0, classes, (n,), generator=g)
            loss = (torch.randn((), generator=g) * 10).to(dtype)
            tap.step(loss=loss, outputs=outputs, targets=targets)
            top = outputs.float().topk(2, dim=1).indices
            hits1 = int((top[:, 0] == targets).sum())
            hits2 = int((top == targets[:, None]).any(1).sum())
            reference.append((loss.float().item(), hits1 / n, hits2 / n))
    assert len(sink.records) == len(batches)
    exact = dtype in (torch.float32, torch.float64)
    for r, (loss, acc1, acc2) in zip(sink.records, reference):
        assert np.float32(r.values["loss"]) == np.float32(loss)
        assert ("accuracy_top2" in r.values) == (topk == (1, 2))
        n = batches[r.step][0]
        if exact:  # distinct random scores: no ties, so correct / n exactly, for every k
            assert r.values["accuracy"] == acc1
            if topk == (1, 2):
                assert r.values["accuracy_top2"] == acc2
        else:  # ties in half precision may rank differently between two topk calls: one sample
            assert abs(r.values["accuracy"] - acc1) <= 1 / n + 1e-7
            if topk == (1, 2):
                assert abs(r.values["accuracy_top2"] - acc2) <= 1 / n + 1e-7
        assert 0.0 <= r.values["accuracy"] <= r.values.get("accuracy_top2", 1.0) <= 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("topk", [(1,), (1, 3)], ids=["top1-only", "top1-and-top3"])
def test_accuracy_is_exactly_correct_over_n(dtype: torch.dtype, topk: tuple[int, ...]) -> None:
    # Every batch size 1..40, so an accuracy off by a single sample at any size shows.
    g = torch.Generator().manual_seed(16)
    sink = ListSink()
    expected = []
    with bt.Tap([bt.metrics.Accuracy(topk=topk)], [sink], flush_every=7) as tap, tap.run():
        for n in range(1, 41):
            outputs = torch.randn(n, 6, generator=g, dtype=dtype)
            targets = torch.randint(0, 6, (n,), generator=g)
            tap.step(outputs=outputs, targets=targets)
            top = outputs.topk(3, dim=1).indices
            expected.append(
                ((top[:, 0] == targets).sum().item() / n, (top == targets[:, None]).any(1).sum().item() / n)
            )
    assert len(sink.records) == 40
    assert [r.values["accuracy"] for r in sink.records] == [e[0] for e in expected]
    if topk == (1, 3):
        assert [r.values["accuracy_top3"] for r in sink.records] == [e[1] for e in expected]
    assert any(0 < e[0] < 1 for e in expected)  # the data are not degenerate
