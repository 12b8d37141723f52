"""``bt.autolog()`` over an unmodified Hugging Face ``Trainer`` script: every optimizer step stored
at the (epoch, batch) the Trainer is at, with the wait for its own batches.

The Trainer iterates Accelerate's prepared loader, which fetches one batch ahead, and takes all of a
step's micro-batches before the first backward (``get_batch_samples``). Autolog watches the prepared
loader itself (not the ``DataLoader`` beneath it) and hands each micro-batch the wait of the batch
it trained on. The positions must equal what ``BatchtapTrainer`` stores for the same script (batch =
the index of the step's last micro-batch in the epoch), the epoch-end short step included; waits
are checked by lower bounds only (a dataset that sleeps per sample), never by a wall-clock time.
"""

from __future__ import annotations

import math
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import batchtap as bt
from tests.autolog._helpers import autologged
from tests.conftest import ListSink

tf = pytest.importorskip("transformers")
from batchtap.integrations.transformers import BatchtapTrainer  # noqa: E402
from tests.integrations.test_transformers import _args, _bert, _Data  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SLEEP = 0.01  # seconds per sample fetched


class _Slow(_Data):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        time.sleep(SLEEP)
        return super().__getitem__(i)


def _positions(records: list[Any]) -> list[tuple[int, int]]:
    return [(r.epoch, r.batch) for r in records]


def _run(tmp_path: Path, n: int, accum: int, *, autolog: bool) -> list[Any]:
    sink = ListSink()
    args = _args(tmp_path, gradient_accumulation_steps=accum)
    if autolog:
        with autologged(sink):
            trainer = tf.Trainer(model=_bert(), args=args, train_dataset=_Slow(n, lm=False))
            trainer.model_accepts_loss_kwargs = False
            trainer.train()
    else:
        tap = bt.Tap(sinks=[sink], flush_every=4)
        trainer = BatchtapTrainer(model=_bert(), args=args, train_dataset=_Slow(n, lm=False), tap=tap)
        trainer.model_accepts_loss_kwargs = False
        trainer.train()
        tap.close()
    return [r for r in sink.records if not r.sparse]


@pytest.mark.parametrize(
    ("n", "accum"),
    [
        pytest.param(22, 2, id="22-rows-accum-2"),  # 6 micro-batches of 4, 4, 4, 4, 4, 2: steps of 2
        pytest.param(20, 2, id="20-rows-accum-2"),  # 5 micro-batches: the epoch ends with a one-micro-batch step
        pytest.param(12, 1, id="no-accumulation"),
    ],
)
def test_steps_are_stored_where_the_trainer_is_with_their_own_waits(tmp_path: Path, n: int, accum: int) -> None:
    logged = _run(tmp_path / "autolog", n, accum, autolog=True)
    explicit = _run(tmp_path / "explicit", n, accum, autolog=False)
    micro = math.ceil(n / 4)
    steps = math.ceil(micro / accum)
    assert len(logged) == len(explicit) == 2 * steps
    assert _positions(logged) == _positions(explicit)
    last = [min((s + 1) * accum, micro) - 1 for s in range(steps)]
    assert _positions(logged) == [(e, b) for e in range(2) for b in last]
    for i, record in enumerate(logged):
        s = i % steps
        samples = min((s + 1) * accum * 4, n) - s * accum * 4  # the step's own rows
        waited = record.values.get("data_time", math.nan)
        assert waited >= samples * SLEEP, (i, waited, samples)  # NaN (no wait stored) fails too


SCRIPT = """
import sys, time
import batchtap as bt
sink_path = sys.argv[1]
bt.autolog(sinks=[bt.sinks.SQLite(sink_path)], flush_every=4)
import transformers as tf  # imports accelerate after autolog: its prepared loader is wrapped on import
sys.path.insert(0, sys.argv[2])
from tests.integrations.test_transformers import _args, _bert, _Data
from pathlib import Path
trainer = tf.Trainer(model=_bert(), args=_args(Path(sys.argv[3])), train_dataset=_Data(20, lm=False))
trainer.model_accepts_loss_kwargs = False
trainer.train()
"""


def test_accelerate_imported_after_autolog_is_watched_too(tmp_path: Path) -> None:
    assert "accelerate.data_loader" in sys.modules  # this process imported it first: a fresh one is needed
    db = tmp_path / "runs.db"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(db), str(ROOT), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT DISTINCT step, epoch, batch FROM metrics ORDER BY step").fetchall()
    assert [(epoch, batch) for _, epoch, batch in rows] == [(e, b) for e in range(2) for b in (1, 3, 4)]


def test_the_prepared_loader_and_the_import_system_are_left_as_they_were() -> None:
    from accelerate.data_loader import DataLoaderShard

    original, finders = DataLoaderShard.__iter__, list(sys.meta_path)
    with autologged(ListSink()):
        assert DataLoaderShard.__iter__ is not original  # wrapped while autolog runs
    assert DataLoaderShard.__iter__ is original
    assert sys.meta_path == finders
