"""Issue 15 §5: ``batchtap export`` never destroys the store it reads, nor another database."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch

import batchtap as bt
from tests.faults._procs import cli


@pytest.fixture
def store(tmp_path: Path) -> Path:
    db = tmp_path / "bt.db"
    with bt.Tap(sinks=[bt.sinks.SQLite(db)]) as tap, tap.run(name="keep"):
        for i in range(5):
            tap.step(loss=torch.tensor(float(i)))
    return db


def _steps(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM metrics WHERE metric = 'loss'").fetchone()[0])


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_export_onto_the_store_being_read_is_refused_even_with_force(store: Path, fmt: str) -> None:
    before = store.read_bytes()
    done = cli("export", "keep", "--format", fmt, "-o", str(store), "--force", "--db", str(store))
    assert done.returncode != 0
    assert "store being read" in done.stderr and "Traceback" not in done.stderr
    assert store.read_bytes() == before and _steps(store) == 5


def test_export_onto_another_database_needs_an_explicit_flag(store: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE precious (x)")
    conn.close()
    before = other.read_bytes()
    done = cli("export", "keep", "--format", "csv", "-o", str(other), "--force", "--db", str(store))
    assert done.returncode != 0 and "--overwrite-database" in done.stderr
    assert other.read_bytes() == before
    done = cli(
        "export", "keep", "--format", "csv", "-o", str(other), "--force", "--overwrite-database", "--db", str(store)
    )
    assert done.returncode == 0, done.stderr
    assert other.read_text().startswith("run_id,")


def test_export_to_a_directory_is_a_clear_error(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "exports"
    out.mkdir()
    done = cli("export", "keep", "--format", "csv", "-o", str(out), "--db", str(store))
    assert done.returncode != 0
    assert "is a directory" in done.stderr and "fix:" in done.stderr and "Traceback" not in done.stderr
