"""Metric math against references, over random shapes, dtypes and values (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchtap.metrics import functional as F

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 64),
    classes=st.integers(1, 20),
    dtype=st.sampled_from(DTYPES),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**31 - 1),
)
def test_topk_correct_matches_numpy(n, classes, dtype, scale, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randn(n, classes, generator=g) * scale).to(dtype)
    targets = torch.randint(0, classes, (n,), generator=g)
    ks = sorted({1, min(classes, 2), classes})
    got = F.topk_correct(scores, targets, ks)
    assert got.dtype == torch.float32
    order = np.argsort(-scores.float().numpy(), axis=1, kind="stable")
    rank = np.array([np.where(order[i] == targets[i].item())[0][0] for i in range(n)])
    # ties may order differently between torch.topk and numpy: compare where scores are distinct
    distinct = all(len(set(row)) == classes for row in scores.float().numpy().tolist())
    if distinct:
        assert got.tolist() == [float((rank < k).sum()) for k in ks]
    assert got.tolist() == sorted(got.tolist())  # top-k counts grow with k
    assert got[-1].item() == n  # k == C: always a hit


def test_topk_dense_prediction() -> None:
    scores = torch.randn(2, 3, 4, 5)  # [N, C, H, W]
    targets = torch.randint(0, 3, (2, 4, 5))
    got = F.topk_correct(scores, targets, (1,))
    assert got.item() == (scores.argmax(1) == targets).sum().item()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 50), classes=st.integers(1, 10), seed=st.integers(0, 2**31 - 1))
def test_target_range_and_top1_match_reference(n, classes, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(-3, classes + 3, (n,), generator=g)
    low, high = F.target_range(targets)
    assert (low.item(), high.item()) == (targets.min().item(), targets.max().item())
    scores = torch.randn(n, classes, generator=g)
    assert F.top1_correct(scores, targets).item() == (scores.argmax(1) == targets).sum().item()


@pytest.mark.parametrize("with_missing", [False, True], ids=["all-grads", "some-none"])
def test_global_grad_norm_equals_clip_grad_norm(with_missing) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2))
    model(torch.randn(3, 5)).pow(2).sum().backward()
    if with_missing:
        model[0].bias.grad = None
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf"))
    got = F.global_grad_norm(model.parameters(), torch.device("cpu"))
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)


def test_global_grad_norm_without_grads_is_zero() -> None:
    assert F.global_grad_norm([torch.nn.Parameter(torch.ones(2))], torch.device("cpu")).item() == 0.0
