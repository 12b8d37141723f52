"""MicroBatches folds each micro-batch into the step's sums through views made once (one in-place op
per run of adjacent columns that combine alike) where that takes fewer ops than the column masks;
both folds must give the same bits."""

from __future__ import annotations

import pytest
import torch

import batchtap as bt
from batchtap.capture.accumulate import MicroBatches

R = bt.metrics.Reduce


def _metrics(reduces: list[R]) -> list[bt.metrics.Metric]:
    return [
        bt.metrics.Custom(f"m{i}", lambda outputs: outputs.sum(), requires=("outputs",), reduce=r)
        for i, r in enumerate(reduces)
    ]


def _folded(micro: MicroBatches, rows: list[tuple[list[float], float]]) -> torch.Tensor:
    micro.reset()
    for values, samples in rows:
        micro.add([torch.tensor(v) for v in values], samples=samples, tokens=None)
    return micro.result().clone()


@pytest.mark.parametrize(
    ("reduces", "by_views"),
    [
        ([R.MEAN, R.SUM, R.SUM, R.MIN, R.MAX], True),  # Loss + Accuracy's layout: add, minimum, maximum
        ([R.SUM, R.MEAN], True),
        ([R.MAX], True),
        ([R.MIN, R.SUM, R.MAX, R.MEAN, R.MIN, R.MAX], False),  # interleaved: the masks take fewer ops
    ],
)
def test_fold_by_views_equals_the_masked_fold_bit_for_bit(reduces: list[R], by_views: bool) -> None:
    g = torch.Generator().manual_seed(0)
    rows = []
    for samples in (8.0, 8.0, 5.0, 8.0, 3.0, 3.0):  # the cached weight column changes and comes back
        values = (torch.randn(len(reduces), generator=g) * 1e3).tolist()
        rows.append((values, samples))
    rows[2][0][0] = float("nan")  # a NaN goes through min/max/sum as before
    micro = MicroBatches(_metrics(reduces), torch.device("cpu"))
    assert (micro._folds is not None) is by_views
    masked = MicroBatches(_metrics(reduces), torch.device("cpu"))
    masked._folds = None
    for n in (1, 2, len(rows)):
        got, want = _folded(micro, rows[:n]), _folded(masked, rows[:n])
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)) and torch.equal(got.isnan(), want.isnan())


def test_the_default_metrics_fold_by_views() -> None:
    micro = MicroBatches([bt.metrics.Loss(), bt.metrics.Accuracy()], torch.device("cpu"))
    assert micro._folds is not None and len(micro._folds) == 3
