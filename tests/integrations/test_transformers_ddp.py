"""``BatchtapTrainer`` under DDP (2 gloo ranks, torchrun): the stored loss of each step against the
ranks' ``.item()`` truth, whatever factor the Trainer multiplied the loss by.

``Trainer.compute_loss`` multiplies the loss by the number of processes when it passes
``num_items_in_batch`` (tokens averaged across devices). A causal LM that divides by the count of
all ranks' tokens needs that factor (the stored loss is then the step's Σ CE / N over every rank);
a BERT-like model that ignores the count only gets its mean scaled, which batchtap undoes (the
stored loss is the ranks' mean of the sum of their micro-batch means, as without DDP), and says why
the Trainer's number is accumulation x processes times the mean.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

WORKER = Path(__file__).with_name("transformers_ddp_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _launch(
    kind: str, out: Path, *, autolog: bool = False
) -> tuple[list[list[tuple[float, int]]], list[float], list[str]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # torchrun sets them for each rank
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = subprocess.run(
        [*command, str(WORKER), kind, str(out), *(["autolog"] if autolog else [])],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    ranks = [json.loads((out / f"micro{r}.json").read_text()) for r in range(2)]
    with sqlite3.connect(out / "store.db") as conn:
        losses = [
            v for (v,) in conn.execute("SELECT value FROM metrics WHERE metric = 'loss' AND rank = -1 ORDER BY step")
        ]
        warnings = [m for (m,) in conn.execute("SELECT message FROM events WHERE kind = 'warning'")]
    return ranks, losses, warnings


def test_a_causal_lm_keeps_the_factor_its_global_count_needs(tmp_path: Path) -> None:
    ranks, losses, _ = _launch("gpt2", tmp_path)
    # 32 rows over 2 ranks in micro-batches of 4: 4 micro-batches per rank, 2 steps of 2
    assert len(losses) == 2 and all(len(r) == 4 for r in ranks)
    for step, stored in enumerate(losses):
        micro = [m for r in ranks for m in r[2 * step : 2 * step + 2]]
        truth = sum(ce for ce, _ in micro) / sum(kept for _, kept in micro)
        assert stored == pytest.approx(truth, rel=1e-5)


def test_a_model_that_ignores_the_count_has_the_process_factor_undone(tmp_path: Path) -> None:
    ranks, losses, warnings = _launch("bert", tmp_path)
    assert len(losses) == 2
    for step, stored in enumerate(losses):
        # each rank's step loss: the sum of its 2 micro-batch means (what its gradients add up); ranks averaged
        per_rank = [sum(mean for mean, _ in r[2 * step : 2 * step + 2]) for r in ranks]
        assert stored == pytest.approx(sum(per_rank) / 2, rel=1e-5)
    said = [w for w in warnings if "num_items_in_batch" in w]
    assert said and "4x the step's mean loss (2 micro-batches x 2 processes)" in said[0]


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_autolog_over_the_plain_trainer_stores_what_batchtap_trainer_stores(kind: str, tmp_path: Path) -> None:
    # the same script with transformers.Trainer unmodified and bt.autolog() at its top (what batchtap run
    # records): the same truth as BatchtapTrainer's tests above, the process factor undone for BERT
    ranks, losses, _ = _launch(kind, tmp_path, autolog=True)
    assert len(losses) == 2 and all(len(r) == 4 for r in ranks)
    for step, stored in enumerate(losses):
        if kind == "bert":
            truth = sum(sum(mean for mean, _ in r[2 * step : 2 * step + 2]) for r in ranks) / 2
        else:
            micro = [m for r in ranks for m in r[2 * step : 2 * step + 2]]
            truth = sum(ce for ce, _ in micro) / sum(kept for _, kept in micro)
        assert stored == pytest.approx(truth, rel=1e-5), (step, stored, truth)
