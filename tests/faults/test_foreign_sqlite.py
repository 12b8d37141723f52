"""Issue 15 §6: reading never changes a file — a foreign SQLite database stays byte for byte as it
was, and a store on a read-only file system can be read by ``runs``, ``show`` and ``export``."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import batchtap as bt
import batchtap.store
from batchtap.errors import SinkError
from batchtap.store import StoreError
from tests.faults._procs import cli


@pytest.fixture
def foreign(tmp_path: Path) -> Path:
    """Another application's database: rollback journal, its own tables."""
    db = tmp_path / "app.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    conn.executemany("INSERT INTO customers (name) VALUES (?)", [(f"c{i}",) for i in range(100)])
    conn.commit()
    conn.close()
    return db


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("command", ["runs", "show", "export"])
def test_cli_readers_leave_a_foreign_database_untouched(foreign: Path, command: str) -> None:
    before = _snapshot(foreign.parent)
    args = {"runs": ["runs"], "show": ["show", "x"], "export": ["export", "x", "--format", "csv"]}[command]
    done = cli(*args, "--db", str(foreign))
    assert done.returncode != 0 and "not a batchtap store" in done.stderr, done.stderr
    after = _snapshot(foreign.parent)
    assert after == before  # header bytes 18, 19 (WAL), 27, 95 included; no -wal/-shm appeared


def test_the_sink_and_the_reader_api_refuse_it_before_writing(foreign: Path) -> None:
    before = _snapshot(foreign.parent)
    with pytest.raises(SinkError, match="not a batchtap store"):
        bt.sinks.SQLite(foreign)
    with pytest.raises(StoreError, match="not a batchtap store"):
        batchtap.store.open(foreign)
    assert _snapshot(foreign.parent) == before


def test_a_store_is_read_without_being_changed(tmp_path: Path) -> None:
    db = tmp_path / "bt.db"
    with bt.Tap(sinks=[bt.sinks.SQLite(db)]) as tap, tap.run(name="r"):
        tap.step(loss=torch.tensor(1.0))
    before = db.read_bytes()
    for args in (["runs"], ["show", "r"], ["export", "r", "--format", "jsonl"]):
        done = cli(*args, "--db", str(db))
        assert done.returncode == 0, done.stderr
    # the database itself is unchanged (a WAL reader may leave SQLite's empty -shm/-wal beside it)
    assert db.read_bytes() == before


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder on a file system mounted read-only (a tmpfs remounted ro; needs root), or, for
    another user, a folder without write permission."""
    where = tmp_path / "ro"
    where.mkdir()
    if os.geteuid() != 0:
        yield where
        return
    if (
        shutil.which("mount") is None
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)], capture_output=True
        ).returncode
    ):
        pytest.skip("cannot mount a tmpfs here (root without CAP_SYS_ADMIN)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _make_read_only(where: Path) -> None:
    if os.geteuid() != 0:
        for p in where.iterdir():
            p.chmod(0o444)
        where.chmod(0o555)
    else:
        subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True, capture_output=True)


def test_a_store_on_a_read_only_file_system_is_readable(read_only_dir: Path) -> None:
    db = read_only_dir / "bt.db"
    with bt.Tap(sinks=[bt.sinks.SQLite(db)]) as tap, tap.run(name="ro-run"):
        for i in range(4):
            tap.step(loss=torch.tensor(float(i)))
    _make_read_only(read_only_dir)
    try:
        runs = cli("runs", "--db", str(db))
        assert runs.returncode == 0 and "ro-run" in runs.stdout, runs.stderr
        show = cli("show", "ro-run", "--db", str(db))
        assert show.returncode == 0, show.stderr
        export = cli("export", "ro-run", "--format", "csv", "--db", str(db))
        assert export.returncode == 0, export.stderr
        assert len(export.stdout.strip().splitlines()) == 1 + 4
    finally:
        if os.geteuid() != 0:
            read_only_dir.chmod(0o755)


@pytest.fixture
def foreign_wal(tmp_path: Path) -> Path:
    """Another application's database in WAL mode, closed cleanly (no -wal / -shm beside it)."""
    db = tmp_path / "app.db"
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    conn.executemany("INSERT INTO customers (name) VALUES (?)", [(f"c{i}",) for i in range(100)])
    conn.commit()
    conn.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]
    return db


def test_a_foreign_wal_file_is_refused_with_nothing_created_beside_it(foreign_wal: Path) -> None:
    before = _snapshot(foreign_wal.parent)
    with pytest.raises(SinkError, match="not a batchtap store"):
        bt.sinks.SQLite(foreign_wal)
    assert _snapshot(foreign_wal.parent) == before  # before: app.db-wal and app.db-shm appeared
    with pytest.raises(StoreError, match="not a batchtap store"):
        batchtap.store.open(foreign_wal)
    assert _snapshot(foreign_wal.parent) == before
    done = cli("runs", "--db", str(foreign_wal))
    assert done.returncode != 0 and "not a batchtap store" in done.stderr, done.stderr
    assert _snapshot(foreign_wal.parent) == before


def test_a_batchtap_store_in_wal_mode_closed_cleanly_still_opens(tmp_path: Path) -> None:
    db = tmp_path / "bt.db"
    with bt.Tap(sinks=[bt.sinks.SQLite(db)]) as tap, tap.run(name="r"):
        tap.step(loss=torch.tensor(0.5))
    for side in ("-wal", "-shm"):
        assert not (tmp_path / f"bt.db{side}").exists()
    with batchtap.store.open(db) as st:
        assert [r.name for r in st.runs()] == ["r"]
    with bt.Tap(sinks=[bt.sinks.SQLite(db)]) as tap, tap.run(name="again"):
        tap.step(loss=torch.tensor(0.5))
