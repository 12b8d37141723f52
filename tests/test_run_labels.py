"""``tap.run(tags=, notes=)``: stored with the run from its start, read back by the store's reader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import batchtap as bt
import batchtap.store
from batchtap.errors import InputError


def test_tags_and_notes_are_stored_from_the_runs_start(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    with bt.Tap(metrics=[bt.metrics.Loss()], sinks=[bt.sinks.SQLite(db)]) as tap:
        with tap.run(name="sweep-1", tags=["sweep", "lr-0.01", "sweep"], notes="first try") as info:
            tap.step(loss=torch.tensor(0.5))
            with batchtap.store.open(db) as store:  # the run's row is written before training starts
                live = store.run(info.id)
                assert live.status == "running"
                assert live.tags == ("sweep", "lr-0.01") and live.notes == "first try"
    with batchtap.store.open(db) as store:
        done = store.run(info.id)
        assert done.status == "finished" and done.tags == ("sweep", "lr-0.01") and done.notes == "first try"


def test_a_run_without_labels_has_none(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    with bt.Tap(metrics=[bt.metrics.Loss()], sinks=[bt.sinks.SQLite(db)]) as tap, tap.run() as info:
        tap.step(loss=torch.tensor(0.5))
    with batchtap.store.open(db) as store:
        assert store.run(info.id).tags == () and store.run(info.id).notes is None


@pytest.mark.parametrize(
    ("tags", "notes", "says"),
    [
        pytest.param("sweep", None, "tags must be a list of strings", id="one-string"),
        pytest.param(["sweep", 3], None, "tags must be a list of strings", id="not-a-string"),
        pytest.param([], 42, "notes must be a string", id="notes-not-a-string"),
    ],
)
def test_bad_labels_are_refused_before_the_run_starts(tmp_path: Path, tags: object, notes: object, says: str) -> None:
    db = tmp_path / "runs.db"
    with bt.Tap(metrics=[bt.metrics.Loss()], sinks=[bt.sinks.SQLite(db)]) as tap:
        with pytest.raises(InputError, match=says):
            tap.start(tags=tags, notes=notes)  # type: ignore[arg-type]
        assert tap.run_info is None  # nothing half-started: the next run opens normally
        with tap.run(tags=["ok"]):
            tap.step(loss=torch.tensor(0.5))
