"""BatchtapCallback's ``data_time``: the fit loop's wait for each batch, on a real Lightning Trainer.

The dataset's ``__getitem__`` sleeps a known time, so every stored wait has a lower bound; a loop
without the sleep waits much less. Only lower bounds and orderings are asserted, never times.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import batchtap as bt
from tests._lightning import SLOW_BATCH, SlowStream, quiet_trainer
from tests.conftest import ListSink

pl = pytest.importorskip("lightning.pytorch")
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated")  # inside Lightning itself
from batchtap.integrations.lightning import BatchtapCallback  # noqa: E402 - after the importorskip

BATCH = 4
SLEEP = 0.01  # per sample: a batch waits at least BATCH * SLEEP


class _Slow(Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, sleep: float) -> None:
        self.n, self.sleep = n, sleep

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.sleep:
            time.sleep(self.sleep)
        return torch.randn(8, generator=torch.Generator().manual_seed(i)), i % 4


class _Module(pl.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 4)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, y), "logits": logits}

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(sleep: float, accumulate: int = 1, n: int = 5 * BATCH, epochs: int = 2) -> tuple[list, pl.Trainer]:  # type: ignore[type-arg]
    sink = ListSink()
    tap = bt.Tap(sinks=[sink], flush_every=4)
    trainer = quiet_trainer(
        max_epochs=epochs,
        accumulate_grad_batches=accumulate,
        callbacks=[BatchtapCallback(tap)],
    )
    trainer.fit(_Module(), DataLoader(_Slow(n, sleep), batch_size=BATCH))
    tap.close()
    return [r for r in sink.records if not r.sparse], trainer


def test_every_step_of_every_epoch_stores_at_least_the_loaders_wait() -> None:
    records, trainer = _fit(SLEEP)
    assert [(r.epoch, r.batch) for r in records] == [(e, b) for e in range(2) for b in range(5)]
    assert all(r.values["data_time"] >= BATCH * SLEEP for r in records), [r.values["data_time"] for r in records]
    # the fetcher is Lightning's own again after fit()
    assert type(trainer.fit_loop._data_fetcher).__name__ in ("_PrefetchDataFetcher", "NoneType")
    fast, _ = _fit(0.0)
    assert [(r.epoch, r.batch) for r in fast] == [(r.epoch, r.batch) for r in records]
    assert statistics.median(r.values["data_time"] for r in fast) < BATCH * SLEEP / 2


def test_accumulation_sums_the_waits_of_the_steps_micro_batches_short_step_included() -> None:
    # 5 batches an epoch, 2 per optimizer step: steps at batches 1, 3 and the one-batch step at 4
    records, _ = _fit(SLEEP, accumulate=2)
    assert [(r.epoch, r.batch) for r in records] == [(e, b) for e in range(2) for b in (1, 3, 4)]
    for r in records:
        micro = 1 if r.batch == 4 else 2
        assert r.values["data_time"] >= micro * BATCH * SLEEP, (r.epoch, r.batch, r.values["data_time"])


def test_step_time_leaves_the_wait_out() -> None:
    # a long wait per batch against a tiny model: the step's clock starts when its batch arrives
    records, _ = _fit(0.05, n=3 * BATCH, epochs=1)
    timed = [r for r in records if "step_time" in r.values]
    assert timed and all(r.values["step_time"] < r.values["data_time"] for r in timed)


def _fit_stream(slow: set[int], accumulate: int = 1) -> tuple[list, pl.Trainer]:  # type: ignore[type-arg]
    sink = ListSink()
    tap = bt.Tap(sinks=[sink], flush_every=4)
    trainer = quiet_trainer(
        max_epochs=2,
        accumulate_grad_batches=accumulate,
        callbacks=[BatchtapCallback(tap)],
    )
    trainer.fit(_Module(), DataLoader(SlowStream(5, slow), batch_size=BATCH))
    tap.close()
    return [r for r in sink.records if not r.sparse], trainer


@pytest.mark.parametrize("slow", [{0, 2}, {1, 4}], ids=["first-and-middle", "second-and-last"])
def test_a_loader_without_a_length_gives_each_step_its_own_batchs_wait(slow: set[int]) -> None:
    # Lightning's fetcher fetches one batch ahead of what it hands out when the loader has no length
    # (the first epoch's first batch inside fit()'s set-up, before any hook): the slow batches' waits
    # are stored at their own steps in both epochs, not one step early
    records, trainer = _fit_stream(slow)
    assert [(r.epoch, r.batch) for r in records] == [(e, b) for e in range(2) for b in range(5)]
    for r in records:
        if r.batch in slow:
            assert r.values["data_time"] >= SLOW_BATCH, [(r.epoch, r.batch, r.values["data_time"]) for r in records]
    for epoch in range(2):
        waits = {r.batch: r.values["data_time"] for r in records if r.epoch == epoch}
        assert max(w for b, w in waits.items() if b not in slow) < min(w for b, w in waits.items() if b in slow), waits
    # the fit loop and its fetcher are Lightning's own again after fit()
    assert type(trainer.fit_loop).__name__ == "_FitLoop" and type(trainer.fit_loop).__module__.startswith("lightning.")
    assert "_data_fetcher" in vars(trainer.fit_loop)


def test_a_loader_without_a_length_under_accumulation_sums_its_own_micro_batches() -> None:
    # 2 micro-batches a step: steps end at batches 1, 3 and the one-batch step at 4; batch 2 slow (its
    # fetch runs while batch 1 is handed out: the step of batches 0-1 must not get it)
    records, _ = _fit_stream({2}, accumulate=2)
    assert [(r.epoch, r.batch) for r in records] == [(e, b) for e in range(2) for b in (1, 3, 4)]
    for r in records:
        if r.batch == 3:
            assert r.values["data_time"] >= SLOW_BATCH, r.values
        else:
            assert r.values["data_time"] < SLOW_BATCH, (r.epoch, r.batch, r.values)
