"""``tap.watch`` over a loader Accelerate prepared: each batch's own wait, not the next batch's.

``accelerator.prepare(loader)`` returns a ``DataLoaderShard`` that fetches batch ``i + 1`` before it
hands out batch ``i``. Slow batches (a dataset that sleeps for the samples of chosen batches) must be
stored at their own index, the first and the last batch included. Only lower bounds and orderings
of waits are asserted, never a wall-clock time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import batchtap as bt
from tests.conftest import ListSink

accelerate = pytest.importorskip("accelerate")

BATCH = 4
SLOW = 0.3  # seconds a slow batch waits (a sleep per sample, BATCH of them)


class _Sleepy(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Batches whose index is in ``slow`` take ``SLOW`` seconds to fetch."""

    def __init__(self, batches: int, slow: set[int]) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(batches * BATCH, 8, generator=g)
        self.y = torch.randint(0, 4, (batches * BATCH,), generator=g)
        self.slow = slow

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i // BATCH in self.slow:
            time.sleep(SLOW / BATCH)
        return self.x[i], self.y[i]


class _SleepyStream(torch.utils.data.IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """``_Sleepy`` as a stream: Accelerate can only skip its first batches by fetching them."""

    def __init__(self, batches: int, slow: set[int]) -> None:
        self.data = _Sleepy(batches, slow)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self.data[i] for i in range(len(self.data)))


def _waits(slow: set[int], batches: int = 5, *, skip: int = 0, stream: bool = False) -> list[tuple[int, float]]:
    """(batch, data_time) of every stored step of one epoch under ``tap.watch``."""
    # a stream is dispatched from the main process by default (DataLoaderDispatcher); each process
    # fetching its own shard is the DataLoaderShard this file is about
    config = accelerate.DataLoaderConfiguration(dispatch_batches=False)
    accelerator = accelerate.Accelerator(cpu=True, dataloader_config=config)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = _SleepyStream(batches, slow) if stream else _Sleepy(batches, slow)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    assert type(loader).__name__ == "DataLoaderShard"
    if skip:
        loader = accelerator.skip_first_batches(loader, skip)
    sink = ListSink()
    tap = bt.Tap(sinks=[sink])
    with tap.run(name="accelerate-data-time"):
        for x, y in tap.watch(loader, epoch=0):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            tap.step(loss)
    tap.close()
    rows = [r for r in sink.records if not r.sparse]
    return [(r.batch, r.values["data_time"]) for r in rows]


@pytest.mark.parametrize("slow", [{0, 2}, {1, 4}], ids=["first-and-middle", "second-and-last"])
def test_each_batch_gets_its_own_fetch(slow: set[int]) -> None:
    waits = _waits(slow)
    assert [b for b, _ in waits] == [0, 1, 2, 3, 4]
    for batch, waited in waits:
        if batch in slow:
            assert waited >= SLOW, (batch, waits)
    fast = max(w for b, w in waits if b not in slow)
    assert fast < min(w for b, w in waits if b in slow), waits


def test_skipped_batches_count_as_the_first_batch_wait() -> None:
    # skip_first_batches over a stream: the two skipped batches are fetched (and waited for) before
    # the first one handed out (a map-style dataset skips in its sampler instead: nothing fetched)
    waits = _waits({1, 3}, skip=2, stream=True)
    assert len(waits) == 3
    first, second, third = (w for _, w in waits)
    assert first >= SLOW  # batch 1 skipped, its fetch waited for before batch 2
    assert second >= SLOW  # batch 3 itself
    assert third < second, waits


def test_the_loader_is_left_as_it_was() -> None:
    accelerator = accelerate.Accelerator(cpu=True)
    loader = accelerator.prepare(torch.utils.data.DataLoader(_Sleepy(2, set()), batch_size=BATCH))
    tap = bt.Tap(sinks=[ListSink()])
    with tap.run(name="restore"):
        for _ in tap.watch(loader):
            tap.step(torch.tensor(1.0))
    tap.close()
    assert "__iter__" not in vars(loader.base_dataloader)
    assert len(list(loader)) == 2
