"""Autolog (no ``BatchtapCallback``) over a real Lightning ``Trainer`` fed by a loader without a length.

Lightning's ``_PrefetchDataFetcher`` fetches one batch ahead for such a loader (the first epoch's first
batch inside ``FitLoop.setup_data``, before any hook). Watching the ``DataLoader``'s own iteration
numbered and timed the fetcher's *fetches*: step n was stored as batch n+1 with batch n+1's wait, and
each epoch's last step had no ``data_time`` (issue 33). Autolog now watches the fetcher's hand-outs
and times the fetches beneath them (``autolog/_lightning.py``), as ``BatchtapCallback`` does since
f141c7e. More positions (accumulation, ``limit_train_batches``, validation): test_lightning_positions.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tests._lightning import BATCH, SlowStream, quiet_trainer
from tests.autolog._helpers import autologged
from tests.conftest import ListSink

pl = pytest.importorskip("lightning.pytorch")

BATCHES = 5


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 4)

    def training_step(self, batch, index):  # type: ignore[no-untyped-def]
        x, y = batch
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, y), "logits": logits}

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_autolog_stores_each_steps_own_batch_and_wait_from_a_loader_without_a_length(sink: ListSink) -> None:
    slow = {1, 3}
    with autologged(sink, name="lightning-unsized"):
        quiet_trainer(max_epochs=2).fit(_Module(), DataLoader(SlowStream(BATCHES, slow), batch_size=BATCH))
    records = [r for r in sink.records if not r.sparse]
    shown = [(r.epoch, r.batch, r.values.get("data_time")) for r in records]
    assert [(r.epoch, r.batch) for r in records] == [(e, b) for e in range(2) for b in range(BATCHES)], shown
    assert all("data_time" in r.values for r in records), shown
    for epoch in range(2):
        waits = {r.batch: r.values["data_time"] for r in records if r.epoch == epoch}
        # the slow batches' own steps carry the longest waits (an ordering, not a timing bound)
        assert max(w for b, w in waits.items() if b not in slow) < min(w for b, w in waits.items() if b in slow), shown
