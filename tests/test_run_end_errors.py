"""An error only the values reveal, found in the run's last blocks, fails the run and is raised when
the run ends, instead of being lost with the run stored as ``finished`` (issue 29, item 1)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import batchtap as bt
import batchtap.store as store
from tests.conftest import ListSink


def _steps(tap: bt.Tap, n: int, bad_step: int) -> None:
    g = torch.Generator().manual_seed(0)
    for step in range(n):
        logits = torch.randn(4, 6, generator=g)
        targets = torch.randint(0, 6, (4,), generator=g)
        if step == bad_step:
            targets[2] = -1  # nanoGPT's padding value, which Accuracy() does not ignore
        tap.step(loss=torch.tensor(1.0), outputs=logits, targets=targets)


def test_a_short_run_whose_only_block_holds_a_bad_target_fails_at_its_end() -> None:
    sink = ListSink()
    tap = bt.Tap([bt.metrics.Loss(), bt.metrics.Accuracy()], [sink], flush_every=50)
    with tap, pytest.raises(bt.InputError, match=r"^step 1: targets hold class indices outside \[0, 6\)"):
        with tap.run(name="short"):
            _steps(tap, 6, bad_step=1)  # 6 steps, one block: handed over only when the run ends
    (ended,) = sink.ended
    assert ended.status is bt.RunStatus.FAILED and (ended.stop_reason or "").startswith("InputError: step 1")
    assert [r.step for r in sink.records] == list(range(6))  # every step stored
    assert math.isnan(sink.records[1].values["accuracy"])
    assert [(e.step, e.metric) for e in sink.events if e.kind is bt.EventKind.ANOMALY] == [(1, "accuracy")]


@pytest.mark.parametrize("pipeline", ["thread", "process"])
def test_the_failed_status_reaches_the_store(tmp_path: Path, pipeline: str) -> None:
    db = tmp_path / "runs.db"
    tap = bt.Tap([bt.metrics.Loss(), bt.metrics.Accuracy()], [bt.sinks.SQLite(db)], flush_every=50, pipeline=pipeline)
    with tap, pytest.raises(bt.InputError, match=r"^step 4: "):
        with tap.run(name="short"):
            _steps(tap, 6, bad_step=4)
    with store.open(db) as st:
        (run,) = st.runs()
        assert run.status is bt.RunStatus.FAILED and "step 4" in (run.stop_reason or "")
        assert run.steps == 6


def test_a_clean_short_run_still_finishes() -> None:
    sink = ListSink()
    tap = bt.Tap([bt.metrics.Loss(), bt.metrics.Accuracy()], [sink], flush_every=50)
    with tap, tap.run(name="clean"):
        _steps(tap, 6, bad_step=-1)
    assert sink.ended[0].status is bt.RunStatus.FINISHED
