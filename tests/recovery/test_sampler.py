"""Adaptive batch sampler: size changes at the intended batch, stays in bounds, yields every sample once."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from batchtap.errors import ConfigError
from batchtap.recovery import ActionRunner, AdaptiveBatchSampler, BatchSizeRule
from batchtap.rules import RuleEngine
from tests.rules._helpers import records

PROPERTY = settings(derandomize=True, deadline=None, max_examples=150)


def test_a_change_applies_to_the_next_batch():
    s = AdaptiveBatchSampler(range(40), 4, min_size=1, max_size=16)
    sizes = []
    for i, batch in enumerate(s):
        sizes.append(len(batch))
        if i == 2:
            s.set_batch_size(8)
    assert sizes[:3] == [4, 4, 4] and sizes[3] == 8


@PROPERTY
@given(
    n=st.integers(0, 300),
    start=st.integers(1, 32),
    bounds=st.tuples(st.integers(1, 16), st.integers(16, 64)),
    changes=st.dictionaries(st.integers(0, 100), st.integers(-5, 200), max_size=12),
    seed=st.integers(0, 2**31 - 1),
    shuffle=st.booleans(),
)
def test_every_sample_once_and_sizes_in_bounds(n, start, bounds, changes, seed, shuffle):
    lo, hi = bounds
    start = min(max(start, lo), hi)
    data = range(n)
    source = RandomSampler(data, generator=torch.Generator().manual_seed(seed)) if shuffle else data
    s = AdaptiveBatchSampler(source, start, min_size=lo, max_size=hi)
    seen: list[int] = []
    batches = list_with_changes(s, changes)
    for i, (size_in_force, batch) in enumerate(batches):
        seen += batch
        if i < len(batches) - 1:
            assert len(batch) == size_in_force  # only the last batch of an epoch may be short
        assert lo <= size_in_force <= hi and 1 <= len(batch) <= hi
    assert sorted(seen) == list(range(n))
    if not shuffle:
        assert seen == list(range(n))


def list_with_changes(s: AdaptiveBatchSampler, changes: dict[int, int]) -> list[tuple[int, list[int]]]:
    """Iterate one epoch, calling set_batch_size(changes[i]) right after batch i; pair each batch with
    the size that was in force when it was built."""
    out, expected = [], s.batch_size
    for i, batch in enumerate(s):
        out.append((expected, batch))
        if i in changes:
            expected = s.set_batch_size(changes[i])  # returns the clamped size now in force
    return out


def test_set_batch_size_clamps_and_rejects_non_integers():
    s = AdaptiveBatchSampler(range(10), 4, min_size=2, max_size=6)
    assert (s.set_batch_size(1), s.set_batch_size(100), s.set_batch_size(5)) == (2, 6, 5)
    with pytest.raises(TypeError):
        s.set_batch_size(3.0)  # type: ignore[arg-type]


def test_drop_last_drops_only_the_short_tail():
    s = AdaptiveBatchSampler(range(10), 4, drop_last=True)
    assert list(s) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(s) == 2 and len(AdaptiveBatchSampler(range(10), 4)) == 3


def test_a_dataset_is_sampled_in_order():
    ds = TensorDataset(torch.arange(7))
    assert list(AdaptiveBatchSampler(ds, 3)) == [[0, 1, 2], [3, 4, 5], [6]]


def test_dataloader_in_process_applies_the_change_to_the_next_batch():
    ds = TensorDataset(torch.arange(50))
    s = AdaptiveBatchSampler(ds, 5, min_size=1, max_size=20)
    sizes, seen = [], []
    for i, (x,) in enumerate(DataLoader(ds, batch_sampler=s)):
        sizes.append(len(x))
        seen += x.tolist()
        if i == 1:
            s.set_batch_size(10)
    assert sizes == [5, 5, 10, 10, 10, 10] and seen == list(range(50))


def test_dataloader_with_workers_applies_the_change_after_the_prefetched_batches():
    ds = TensorDataset(torch.arange(200))
    s = AdaptiveBatchSampler(ds, 4, min_size=1, max_size=32)
    workers, prefetch = 2, 2
    loader = DataLoader(ds, batch_sampler=s, num_workers=workers, prefetch_factor=prefetch)
    sizes, seen = [], []
    for i, (x,) in enumerate(loader):
        sizes.append(len(x))
        seen += x.tolist()
        if i == 1:
            s.set_batch_size(16)
    first_new = sizes.index(16)
    assert 2 <= first_new <= 2 + workers * prefetch  # the documented prefetch delay
    assert sorted(seen) == list(range(200))


def test_resizing_from_another_thread_keeps_every_sample_once():
    s = AdaptiveBatchSampler(range(5000), 8, min_size=1, max_size=64)
    stop = threading.Event()

    def churn():
        n = 1
        while not stop.is_set():
            s.set_batch_size(n % 64 + 1)
            n += 7

    t = threading.Thread(target=churn)
    t.start()
    try:
        seen = [i for batch in s for i in batch]
    finally:
        stop.set()
        t.join()
    assert seen == list(range(5000))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        pytest.param({"batch_size": 8, "min_size": 16, "max_size": 4}, "min_size=16 > max_size=4", id="min-above-max"),
        pytest.param({"batch_size": 2, "min_size": 4, "max_size": 8}, "outside", id="start-below-min"),
        pytest.param({"batch_size": 16, "min_size": 4, "max_size": 8}, "outside", id="start-above-max"),
        pytest.param({"batch_size": 0}, "batch_size", id="zero-size"),
        pytest.param({"batch_size": 4, "min_size": 0}, "min_size", id="zero-min"),
    ],
)
def test_bad_sampler_configuration(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        AdaptiveBatchSampler(range(10), **kwargs)


# ---- the rule that drives it ---------------------------------------------------------------------


def test_batch_size_rule_grows_shrinks_with_cooldown_and_bounds():
    s = AdaptiveBatchSampler(range(10_000), 32, min_size=16, max_size=64)
    rule = BatchSizeRule(s, "accuracy", grow_above=0.9, shrink_below=0.7, cooldown=2)
    engine, runner = RuleEngine([rule]), ActionRunner([])
    applied = []
    # the training side applies each block's decisions before the next block, as the Tap will
    for step, acc in enumerate([0.8, 0.95, 0.95, 0.95, 0.95, 0.95, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]):
        out = runner.apply(engine.process(records("accuracy", [acc], start=step)), step=step + 1)
        applied += [(step, size) for size in out.batch_sizes]
    # grow at 1 (32 -> 64); at max afterwards; shrink at 6 (64 -> 32), cooldown 7-8, shrink at 9 (-> 16)
    assert applied == [(1, 64), (6, 32), (9, 16)]
    assert s.batch_size == 16
    events = runner.take_events()
    assert [e.message.split(" (")[0] for e in events] == [
        "batch size 32 -> 64",
        "batch size 64 -> 32",
        "batch size 32 -> 16",
    ]


def test_batch_size_rule_patience():
    s = AdaptiveBatchSampler(range(100), 8, max_size=64)
    rule = BatchSizeRule(s, "accuracy", grow_above=0.9, patience=3, cooldown=0)
    ds = RuleEngine([rule]).process(records("accuracy", [0.95, 0.95, 0.5, 0.95, 0.95, 0.95]))
    assert [(d.step, d.batch_size) for d in ds] == [(5, 16)]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        pytest.param({}, "grow_above= or shrink_below=", id="no-threshold"),
        pytest.param({"grow_above": 0.5, "shrink_below": 0.7}, "dead band", id="inverted"),
        pytest.param({"grow_above": 0.9, "factor": 1.0}, "factor", id="factor-1"),
        pytest.param({"grow_above": 0.9, "action": "alert"}, "must include 'batch_size'", id="no-batch-size-action"),
        pytest.param({"grow_above": 0.9, "cooldown": -1}, "cooldown", id="negative-cooldown"),
    ],
)
def test_bad_batch_size_rule_configuration(kwargs, needle):
    s = AdaptiveBatchSampler(range(10), 2)
    with pytest.raises(ConfigError, match=needle):
        BatchSizeRule(s, "accuracy", **kwargs)
