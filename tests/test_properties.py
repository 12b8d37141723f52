"""Property test through the whole Tap: random batch sizes, class counts, dtypes and values."""

from __future__ import annotations

import numpy as np
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
)
def test_tap_records_match_reference(batches, dtype, flush_every, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    sink = ListSink()
    reference = []
    metrics = [bt.metrics.Loss(nonnegative=False), bt.metrics.Accuracy(topk=(1, 2))]
    with bt.Tap(metrics, [sink], flush_every=flush_every) as tap, tap.run():
        for n, classes in batches:
            outputs = (torch.randn(n, classes, generator=g) * 3).to(dtype)
            targets = torch.randint(0, classes, (n,), generator=g)
            loss = (torch.randn((), generator=g) * 10).to(dtype)
            tap.step(loss=loss, outputs=outputs, targets=targets)
            top = outputs.float().topk(2, dim=1).indices
            reference.append(
                (loss.float().item(), (top[:, 0] == targets).float().mean().item(),
                 (top == targets[:, None]).any(1).float().mean().item())
            )
    assert len(sink.records) == len(batches)
    for r, (loss, acc1, acc2) in zip(sink.records, reference):
        assert np.float32(r.values["loss"]) == np.float32(loss)
        # ties in low precision may rank differently between the two topk calls: allow one sample
        n = batches[r.step][0]
        assert abs(r.values["accuracy"] - acc1) <= 1 / n + 1e-7
        assert abs(r.values["accuracy_top2"] - acc2) <= 1 / n + 1e-7
        assert 0.0 <= r.values["accuracy"] <= r.values["accuracy_top2"] <= 1.0
