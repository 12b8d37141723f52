"""BatchtapTrainer: each step's ``data_time`` (the wait for its batches) and the one place where the
Trainer's own logged loss is not batchtap's (a mean of unequal micro-batches' means), said once.

A real Hugging Face Trainer with tiny config-built models on the CPU. The dataset's ``__getitem__``
sleeps a known time, so every stored wait has a lower bound; only bounds and orderings are asserted.
"""

from __future__ import annotations

import os
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import batchtap as bt
from tests.conftest import ListSink

tf = pytest.importorskip("transformers")
from batchtap.integrations.transformers import BatchtapTrainer  # noqa: E402
from tests.integrations.test_transformers import _args, _bert, _Data, _gpt2, _logged, _Seen  # noqa: E402

SLEEP = 0.01  # per sample; a micro-batch of 4 waits at least 4 * SLEEP
NOTE = "mean of means"


class _Slow(_Data):
    def __init__(self, n: int, lm: bool, sleep: float) -> None:
        super().__init__(n, lm=lm)
        self.sleep = sleep

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.sleep:
            time.sleep(self.sleep)
        return super().__getitem__(i)


def _train(tmp_path: Any, model: Any, n: int, *, sleep: float = 0.0, accum: int = 2, divide: bool = True) -> Any:
    sink = ListSink()
    tap = bt.Tap(sinks=[sink], flush_every=4)
    seen = _Seen(model)
    lm = not isinstance(model, tf.BertForSequenceClassification)
    trainer = BatchtapTrainer(
        model=model,
        args=_args(tmp_path, gradient_accumulation_steps=accum),
        train_dataset=_Slow(n, lm, sleep),
        tap=tap,
    )
    if divide:  # BERT ignores num_items_in_batch: the Trainer divides each micro-batch mean by the count
        trainer.model_accepts_loss_kwargs = False
    trainer.train()
    tap.close()
    return [r for r in sink.records if not r.sparse], sink, seen, trainer


def _micro_per_step(per_epoch: int, accum: int, epochs: int = 2) -> list[int]:
    one = [min(accum, per_epoch - i) for i in range(0, per_epoch, accum)]
    return one * epochs


def test_every_step_stores_at_least_the_wait_for_its_batches_short_step_included(tmp_path) -> None:
    # 20 rows in micro-batches of 4: 5 an epoch, steps of 2, 2 and the one-micro-batch step
    records, _, _, trainer = _train(tmp_path, _bert(), 20, sleep=SLEEP)
    micro = _micro_per_step(5, 2)
    assert len(records) == len(micro) == trainer.state.global_step
    for record, count in zip(records, micro, strict=True):
        assert record.values["data_time"] >= count * 4 * SLEEP, (record.step, record.values["data_time"])
    fast, *_ = _train(tmp_path, _bert(), 20)
    assert statistics.median(r.values["data_time"] for r in fast) < 4 * SLEEP


def test_a_mean_of_unequal_micro_batch_means_is_said_once_and_the_samples_mean_stored(tmp_path) -> None:
    # 22 rows: micro-batches of 4, 4, 4, 4, 4, 2 an epoch; the third step (4 + 2) is uneven, twice
    records, sink, seen, trainer = _train(tmp_path, _bert(), 22)
    notes = [e for e in sink.events if NOTE in e.message]
    assert len(notes) == 1 and notes[0].kind is bt.EventKind.INFO and "4, 2 samples" in notes[0].message
    micro = iter(seen.micro)
    uneven = 0
    for record, count, logged in zip(records, _micro_per_step(6, 2), _logged(trainer, "loss"), strict=True):
        step = [next(micro) for _ in range(count)]
        sums = [F.cross_entropy(lg, lb, reduction="sum").item() for lg, lb in step]
        samples = [len(lb) for _, lb in step]
        assert record.values["loss"] == pytest.approx(sum(sums) / sum(samples), rel=1e-5)  # the samples' mean
        means = [s / k for s, k in zip(sums, samples)]
        assert logged == pytest.approx(sum(means) / len(means), rel=1e-5)  # the Trainer's mean of means
        if len(set(samples)) > 1:
            uneven += 1
            assert record.values["loss"] != pytest.approx(logged, rel=1e-5)
        else:
            assert record.values["loss"] == pytest.approx(logged, rel=1e-5)
    assert uneven == 2


@pytest.mark.parametrize(
    ("model", "divide"),
    [
        pytest.param(_gpt2, False, id="causal-lm-token-normalised"),
        pytest.param(_bert, True, id="bert-equal-micro-batches"),
    ],
)
def test_no_note_where_the_trainers_log_agrees(tmp_path, model, divide: bool) -> None:
    # the causal LM's loss is normalised over the whole step (num_items_in_batch): the Trainer's log is
    # the step's token mean even with the uneven 4 + 2 step; BERT on 20 rows has no uneven step
    records, sink, _, trainer = _train(tmp_path, model(), 22 if not divide else 20, divide=divide)
    assert not [e for e in sink.events if NOTE in e.message]
    assert [r.values["loss"] for r in records] == pytest.approx(_logged(trainer, "loss"), rel=1e-5)


WORKER = Path(__file__).with_name("transformers_data_time_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def test_a_dispatched_stream_on_two_gloo_ranks_gives_each_step_its_own_wait(tmp_path: Path) -> None:
    # Accelerate dispatches a stream: the main process fetches 2 raw batches per step (one per process)
    # and broadcasts them, the other rank waits in the broadcast. Step 1's raw batches (2 and 3) are slow:
    # on both ranks step 1 stores that wait, and no other step does
    from tests.integrations.transformers_data_time_worker import SLOW

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # torchrun sets them for each rank
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)]
    done = subprocess.run(
        [*command, "2,3", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    with sqlite3.connect(tmp_path / "store.db") as conn:
        rows = conn.execute("SELECT rank, step, value FROM metrics WHERE metric = 'data_time' AND rank >= 0").fetchall()
    for rank in (0, 1):
        waits = {step: value for r, step, value in rows if r == rank}
        assert sorted(waits) == [0, 1, 2, 3], (rank, rows)
        assert waits[1] >= SLOW, (rank, waits)
        assert max(w for s, w in waits.items() if s != 1) < waits[1] / 2, (rank, waits)
