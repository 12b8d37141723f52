"""``tap.watch`` over a loader Accelerate prepared: each batch's own wait, not the next batch's.

``accelerator.prepare(loader)`` returns a ``DataLoaderShard`` that fetches batch ``i + 1`` before it
hands out batch ``i``. Slow batches (a dataset that sleeps for the samples of chosen batches) must be
stored at their own index, the first and the last batch included. Only lower bounds and orderings
of waits are asserted, never a wall-clock time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import batchtap as bt
from tests.conftest import ListSink

accelerate = pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]

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


def _waits(
    slow: set[int], batches: int = 5, *, skip: int = 0, stream: bool = False, dispatch: bool = False
) -> list[tuple[int, float]]:
    """(batch, data_time) of every stored step of one epoch under ``tap.watch`` (one process)."""
    return [(batch, waited) for _, batch, waited in _rows(slow, batches, skip=skip, stream=stream, dispatch=dispatch)]


def _rows(
    slow: set[int], batches: int = 5, *, skip: int = 0, stream: bool = False, dispatch: bool = False
) -> list[tuple[int, int, float]]:
    """(rank, batch, data_time) of every stored step of one epoch under ``tap.watch``: each process fetching
    its own shard (``DataLoaderShard``), or (``dispatch``) the main process fetching and dispatching
    every batch (``DataLoaderDispatcher``: ``dispatch_batches=True``, a stream's default). In a process
    group each rank's own rows too (rank 0's sinks get them all)."""
    config = accelerate.DataLoaderConfiguration(dispatch_batches=dispatch)
    accelerator = accelerate.Accelerator(cpu=True, dataloader_config=config)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = _SleepyStream(batches, slow) if stream else _Sleepy(batches, slow)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    assert type(loader).__name__ == ("DataLoaderDispatcher" if dispatch else "DataLoaderShard")
    if skip:
        loader = accelerator.skip_first_batches(loader, skip)
    sink = ListSink()
    tap = bt.Tap(sinks=[sink], per_rank_rows=accelerator.num_processes > 1)
    with tap.run(name="accelerate-data-time"):
        for x, y in tap.watch(loader, epoch=0):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            tap.step(loss)
    tap.close()
    return [(r.rank, r.batch, r.values["data_time"]) for r in sink.records if not r.sparse]


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


@pytest.mark.parametrize("stream", [False, True], ids=["map-style", "stream"])
@pytest.mark.parametrize("slow", [{0, 2}, {1, 4}], ids=["first-and-middle", "second-and-last"])
def test_a_dispatched_batch_gets_its_own_fetch(slow: set[int], stream: bool) -> None:
    waits = _waits(slow, dispatch=True, stream=stream)
    assert [b for b, _ in waits] == [0, 1, 2, 3, 4]
    for batch, waited in waits:
        if batch in slow:
            assert waited >= SLOW, (batch, waits)
    assert max(w for b, w in waits if b not in slow) < min(w for b, w in waits if b in slow), waits


WORKER = Path(__file__).with_name("accelerate_data_time_worker.py")


@pytest.mark.parametrize("slow", [{0, 2}, {1, 3}], ids=["first-and-middle", "second-and-last"])
def test_two_gloo_ranks_each_store_the_dispatched_batchs_own_wait(slow: set[int], tmp_path: Path) -> None:
    # the main process fetches 2 batches per dispatched batch (one per process) and broadcasts them; the
    # other rank waits in that broadcast: on both ranks the wait belongs to the batch it brought
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # torchrun sets them for each rank
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)]
    raw_slow = ",".join(str(2 * b + i) for b in sorted(slow) for i in range(2))  # the raw batches of each
    done = subprocess.run(
        [*command, raw_slow, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    for rank in range(2):
        waits = [tuple(w) for w in json.loads((tmp_path / f"waits{rank}.json").read_text())]
        assert [b for b, _ in waits] == [0, 1, 2, 3], (rank, waits)
        for batch, waited in waits:
            if batch in slow:
                assert waited >= SLOW, (rank, batch, waits)
        assert max(w for b, w in waits if b not in slow) < min(w for b, w in waits if b in slow), (rank, waits)
