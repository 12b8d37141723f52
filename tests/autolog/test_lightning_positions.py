"""Autolog (no ``BatchtapCallback``) over a real Lightning ``Trainer``: every optimizer step stored at
the (epoch, batch) Lightning trained it at, with the wait of its own batches, whatever the loader.

Lightning's fetcher fetches one batch ahead of what it hands out when the loader has no length;
autolog watches the fetcher's hand-outs and times the fetches beneath them. The truth is read from
the module itself: the ``batch_idx`` of each step's ``training_step`` calls and their ``.item()``
losses. Slow batches (a stream or dataset that sleeps) are checked by ordering only: a step that
trained on a slow batch waited longer than every step that did not, never against a wall-clock time.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from batchtap.hostreads import HostReadCounter
from tests._lightning import BATCH, SLOW_BATCH, SlowStream, quiet_trainer
from tests._lightning import sample as _sample
from tests.autolog._helpers import autologged
from tests.conftest import ListSink

pl = pytest.importorskip("lightning.pytorch")
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated")  # inside Lightning itself
from lightning.pytorch.loops import fetchers  # noqa: E402 - after the importorskip

ROOT = Path(__file__).resolve().parents[2]
_Stream = SlowStream  # the name the subprocess test imports


class _Sized(Dataset):  # type: ignore[type-arg]
    """The same batches with a length (map-style)."""

    def __init__(self, batches: int, slow: set[int]) -> None:
        self.batches, self.slow = batches, slow

    def __len__(self) -> int:
        return self.batches * BATCH

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i // BATCH in self.slow:
            time.sleep(SLOW_BATCH / BATCH)
        return _sample(i)


class _Module(pl.LightningModule):  # type: ignore[misc]
    """Keeps each optimizer step's truth: its epoch, the batch indices it trained on, their losses."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 4)
        self.micro: list[tuple[int, float]] = []  # (batch_idx, loss) since the last optimizer step
        self.steps: list[tuple[int, list[int], list[float]]] = []

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.micro.append((batch_idx, loss.item()))  # the test's truth, not the loop's
        return {"loss": loss, "logits": logits}

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.steps.append((self.current_epoch, [b for b, _ in self.micro], [v for _, v in self.micro]))
        self.micro = []

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(data: Any, *, val: Any = None, **settings: Any) -> tuple[list[Any], _Module]:
    sink = ListSink()
    module = _Module()
    with autologged(sink, name="lightning-positions"):
        trainer = quiet_trainer(max_epochs=2, **settings)
        loaders = (DataLoader(data, batch_size=BATCH),)
        if val is not None:
            loaders += (DataLoader(val, batch_size=BATCH),)
        trainer.fit(module, *loaders)
    return [r for r in sink.records if not r.sparse], module


CASES = [
    pytest.param(_Stream(5, {0, 4}), {}, id="stream-slow-first-and-last"),
    pytest.param(_Stream(5, {1, 3}), {"accumulate_grad_batches": 2}, id="stream-accum-2-epoch-end-short-step"),
    pytest.param(_Stream(6, {2}), {"accumulate_grad_batches": 2}, id="stream-accum-2-slow-middle"),
    pytest.param(_Stream(6, {1}), {"limit_train_batches": 3}, id="stream-limit-3-of-6"),
    pytest.param(_Stream(6, {2}), {"limit_train_batches": 4, "accumulate_grad_batches": 2}, id="stream-limit-accum"),
    pytest.param(_Sized(5, {0, 3}), {}, id="sized-slow-first-and-middle"),
    pytest.param(_Sized(5, {2}), {"accumulate_grad_batches": 2}, id="sized-accum-2"),
    # a new fetcher each epoch: the last epoch's pass, left suspended, must not keep the new one unwatched
    pytest.param(_Stream(5, {1}), {"reload_dataloaders_every_n_epochs": 1}, id="stream-reloaded-each-epoch"),
    pytest.param(_Sized(5, {3}), {"reload_dataloaders_every_n_epochs": 1}, id="sized-reloaded-each-epoch"),
]


@pytest.mark.parametrize(("data", "settings"), CASES)
def test_each_step_is_stored_at_its_own_batch_with_its_own_wait_and_loss(data: Any, settings: dict[str, Any]) -> None:
    records, module = _fit(data, **settings)
    shown = [(r.epoch, r.batch, r.values.get("data_time")) for r in records]
    assert [(r.epoch, r.batch) for r in records] == [(e, batches[-1]) for e, batches, _ in module.steps], shown
    for record, (_, _, losses) in zip(records, module.steps):
        assert record.values["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5), shown
    assert all("data_time" in r.values for r in records), shown
    slow = [any(b in data.slow for b in batches) for _, batches, _ in module.steps]
    assert any(slow) and not all(slow)
    waits = [r.values["data_time"] for r in records]
    # the steps that trained on a slow batch carry the longest waits (an ordering, not a timing bound)
    assert max(w for w, s in zip(waits, slow) if not s) < min(w for w, s in zip(waits, slow) if s), shown


class _Pair(_Module):  # type: ignore[misc]
    """Trains on the first of two combined loaders' batches."""

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return super().training_step(batch[0], batch_idx)


@pytest.mark.parametrize("kind", [_Stream, _Sized], ids=["streams", "sized"])
def test_two_combined_loaders_give_each_step_one_wait_for_both_its_batches(kind: type) -> None:
    # Lightning's CombinedLoader fetches one batch of each loader per step: one fetch, one wait
    sink, module = ListSink(), _Pair()
    slow = kind(4, {1})
    with autologged(sink, name="lightning-combined"):
        loaders = [DataLoader(slow, batch_size=BATCH), DataLoader(kind(4, {2}), batch_size=BATCH)]
        quiet_trainer(max_epochs=2).fit(module, loaders)
    records = [r for r in sink.records if not r.sparse]
    shown = [(r.epoch, r.batch, r.values.get("data_time")) for r in records]
    assert (
        [(r.epoch, r.batch) for r in records]
        == [(e, b[-1]) for e, b, _ in module.steps]
        == [(e, b) for e in range(2) for b in range(4)]
    ), shown
    waits = {(r.epoch, r.batch): r.values["data_time"] for r in records}
    for epoch in range(2):
        fast = max(waits[(epoch, b)] for b in (0, 3))
        assert fast < waits[(epoch, 1)] and fast < waits[(epoch, 2)], shown


class _Batches:
    """Batches from a plain iterable, not a ``DataLoader`` (Lightning takes any iterable)."""

    def __init__(self, batches: int, slow: set[int]) -> None:
        self.batches, self.slow = batches, slow

    def __iter__(self):  # type: ignore[no-untyped-def]
        for b in range(self.batches):
            if b in self.slow:
                time.sleep(SLOW_BATCH)
            xs, ys = zip(*(_sample(b * BATCH + i) for i in range(BATCH)))
            yield torch.stack(xs), torch.tensor(ys)


def test_an_iterable_that_is_not_a_dataloader_is_watched_too() -> None:
    sink, module = ListSink(), _Module()
    with autologged(sink, name="lightning-iterable"):
        quiet_trainer(max_epochs=2).fit(module, _Batches(4, {2}))
    records = [r for r in sink.records if not r.sparse]
    shown = [(r.epoch, r.batch, r.values.get("data_time")) for r in records]
    assert [(r.epoch, r.batch) for r in records] == [(e, b) for e in range(2) for b in range(4)], shown
    waits = {(r.epoch, r.batch): r.values["data_time"] for r in records}
    assert all(w < waits[(e, 2)] for (e, b), w in waits.items() if b != 2), shown


def test_a_validation_loader_is_not_counted_with_the_training_batches() -> None:
    records, module = _fit(_Stream(5, {3}), val=_Stream(3, {0, 1, 2}), limit_val_batches=2)
    shown = [(r.epoch, r.batch, r.values.get("data_time")) for r in records]
    assert (
        [(r.epoch, r.batch) for r in records]
        == [(e, b[-1]) for e, b, _ in module.steps]
        == [(e, b) for e in range(2) for b in range(5)]
    ), shown
    waits = {(r.epoch, r.batch): r.values["data_time"] for r in records}
    # no validation fetch (every one slow) lands in a training step's wait
    assert all(w < waits[(e, 3)] for (e, b), w in waits.items() if b != 3), shown


@pytest.mark.parametrize("data", [_Stream(3, set()), _Sized(3, set())], ids=["stream", "sized"])
def test_a_loop_after_the_fit_is_watched_again(data: Any) -> None:
    sink = ListSink()
    module = _Module()
    with autologged(sink, name="after-fit"):
        trainer = quiet_trainer(max_epochs=2)
        trainer.fit(module, DataLoader(data, batch_size=BATCH))
        optimizer = trainer.optimizers[0]
        for x, y in DataLoader(_Sized(3, set()), batch_size=BATCH):  # the fit's last pass ended with it
            F.cross_entropy(module.net(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    records = [r for r in sink.records if not r.sparse]
    assert [(r.epoch, r.batch) for r in records] == [(e, b) for e in range(3) for b in range(3)]
    assert all("data_time" in r.values for r in records)


def test_the_fetcher_is_lightnings_own_again_after_autolog() -> None:
    kind = fetchers._PrefetchDataFetcher
    names = ("__iter__", "__next__", "teardown")
    before, finders = [kind.__dict__.get(n) for n in names], list(sys.meta_path)
    fetch = fetchers._DataFetcher.__next__
    with autologged(ListSink()):
        assert all(kind.__dict__.get(n) is not b for n, b in zip(names, before))  # wrapped
        assert fetchers._DataFetcher.__next__ is not fetch
        fetcher = kind()
        fetcher.setup(pl.utilities.CombinedLoader(DataLoader(_Stream(2, set()), batch_size=BATCH)))
        assert len(list(iter(fetcher))) == 2  # wrapped, it hands out every batch as before
        fetcher.teardown()
    assert [kind.__dict__.get(n) for n in names] == before and fetchers._DataFetcher.__next__ is fetch
    assert sys.meta_path == finders


SCRIPT = """
import sys
sys.path.insert(0, sys.argv[2])
import batchtap as bt
bt.autolog(sinks=[bt.sinks.SQLite(sys.argv[1])], name="late-lightning")
import lightning.pytorch as pl  # after autolog: its fetcher is wrapped as it is imported
from torch.utils.data import DataLoader
from tests._lightning import quiet_trainer
from tests.autolog.test_lightning_positions import BATCH, _Module, _Stream
quiet_trainer(max_epochs=2).fit(_Module(), DataLoader(_Stream(3, set()), batch_size=BATCH))
"""


def test_lightning_imported_after_autolog_is_watched_too(tmp_path: Path) -> None:
    import sqlite3
    import subprocess

    db = tmp_path / "runs.db"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(db), str(ROOT)], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT DISTINCT step, epoch, batch FROM metrics ORDER BY step").fetchall()
    assert [(epoch, batch) for _, epoch, batch in rows] == [(e, b) for e in range(2) for b in range(3)]


def _reads(batches: int, *, autolog: bool) -> Counter[str]:
    module = _Module()
    loader = DataLoader(_Stream(batches, set()), batch_size=BATCH)
    with contextlib.ExitStack() as stack:
        if autolog:
            stack.enter_context(autologged(ListSink(), name="lightning-reads"))
        with HostReadCounter() as reads:
            quiet_trainer(max_epochs=2).fit(module, loader)
    return Counter(r.op for r in reads.reads)


def test_watching_the_fetcher_adds_no_host_read_per_step() -> None:
    # what autolog adds to a fit (the module's own .item() reads are in both) does not grow with its steps
    added = [_reads(n, autolog=True) - _reads(n, autolog=False) for n in (3, 6)]
    assert added[0] == added[1], added
