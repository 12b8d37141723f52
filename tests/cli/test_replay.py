"""Issue 29 item 7: a spool waiting for replay is shown by ``batchtap runs``/``show``, and
``batchtap replay SPOOL_DIR`` delivers it now. A real SQLite store held locked by another
connection for the whole run, as a long backup or a stuck writer would."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest
import torch

import batchtap as bt
import batchtap.store
from batchtap.cli.main import main


def _has(text: str, needle: str) -> bool:
    """``needle`` in ``text`` wherever the terminal wrapping broke the line (a long path mid-word)."""
    return re.sub(r"\s+", "", needle) in re.sub(r"\s+", "", text)


def _run_under_a_lock(tmp_path: Path) -> tuple[Path, Path, str]:
    db, spool = tmp_path / "bt.db", tmp_path / "spool"
    tap = bt.Tap([bt.metrics.Loss()], [bt.sinks.SQLite(db, busy_timeout_s=0.05)], spool_dir=spool, flush_every=2)
    holder = sqlite3.connect(db, timeout=0.05)
    with tap:
        with tap.run(name="locked") as run:
            tap.step(loss=torch.tensor(0.0))
            tap.step(loss=torch.tensor(1.0))
            tap.flush()  # steps 0 and 1 reach the store
            holder.execute("BEGIN EXCLUSIVE")  # the lock outlasts the run
            for step in range(2, 8):
                tap.step(loss=torch.tensor(float(step)))
    holder.rollback()
    holder.close()
    return db, spool, run.id


def test_a_pending_spool_is_shown_and_replay_delivers_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db, spool, run_id = _run_under_a_lock(tmp_path)
    with batchtap.store.open(db) as st:
        before = st.run(run_id)
    assert before.status is bt.RunStatus.RUNNING and before.steps == 2  # what the store holds so far
    capsys.readouterr()

    assert main(["runs", "--db", str(db)]) == 0
    listing = capsys.readouterr().out.replace("\n    ", "")  # a long path is wrapped to the terminal
    assert "running+spool" in listing
    assert "pending spools" in listing and "00-sqlite.rank0.jsonl" in listing and "steps 2..7" not in listing

    assert main(["show", "locked", "--db", str(db)]) == 0
    shown = capsys.readouterr().out
    assert "spool        pending:" in shown and "steps 2..7 of this run, its end" in shown
    assert _has(shown, f"batchtap replay {spool}")

    assert main(["replay", str(spool), "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "replayed" in out and "00-sqlite.rank0.jsonl" in out
    with batchtap.store.open(db) as st:
        after = st.run(run_id)
        losses = [p.value for p in st.series(run_id, "loss")]
    assert after.status is bt.RunStatus.FINISHED and after.steps == 8
    assert losses == [float(s) for s in range(8)]
    assert not any(p.stat().st_size for p in spool.glob("*.jsonl"))

    assert main(["runs", "--db", str(db)]) == 0
    assert "+spool" not in capsys.readouterr().out


def test_replay_of_a_directory_without_spools_and_of_a_missing_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", str(tmp_path), "--db", str(tmp_path / "x.db")]) == 0
    assert "no pending spools" in capsys.readouterr().out
    assert main(["replay", str(tmp_path / "nope")]) == 1
    assert "spool directory" in capsys.readouterr().err


def test_replay_refuses_while_the_runs_process_may_still_be_spooling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db, spool = tmp_path / "bt.db", tmp_path / "spool"
    tap = bt.Tap([bt.metrics.Loss()], [bt.sinks.SQLite(db, busy_timeout_s=0.05)], spool_dir=spool, flush_every=2)
    holder = sqlite3.connect(db, timeout=0.05)
    with tap, tap.run(name="live"):
        tap.step(loss=torch.tensor(0.0))
        tap.flush()
        holder.execute("BEGIN EXCLUSIVE")
        for step in range(1, 5):
            tap.step(loss=torch.tensor(float(step)))
        tap.flush()
        holder.rollback()
        capsys.readouterr()
        assert main(["replay", str(spool), "--db", str(db)]) == 1  # this process is still in the run
        assert "still says 'running'" in capsys.readouterr().err


def test_replay_refuses_a_store_that_does_not_exist_unless_create(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db, spool, run_id = _run_under_a_lock(tmp_path)
    spooled = {p.name: p.read_bytes() for p in spool.glob("*.jsonl")}
    typo = tmp_path / "bt.bd"
    assert main(["replay", str(spool), "--db", str(typo)]) == 1
    err = capsys.readouterr().err
    assert _has(err, f"no store at {typo}") and "--create" in err
    assert not typo.exists() and not list(tmp_path.glob("bt.bd*"))  # nothing created there
    assert {p.name: p.read_bytes() for p in spool.glob("*.jsonl")} == spooled  # the spool is untouched

    fresh = tmp_path / "fresh.db"
    assert main(["replay", str(spool), "--db", str(fresh), "--create"]) == 0
    with batchtap.store.open(fresh) as st:
        assert [p.step for p in st.series(run_id, "loss")] == list(range(2, 8))


def test_damaged_spool_lines_are_kept_in_a_rejected_file_and_replay_exits_non_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db, spool, run_id = _run_under_a_lock(tmp_path)
    (path,) = spool.glob("*.jsonl")
    lines = path.read_text().splitlines(keepends=True)
    garbage = '{"kind": "write", "records": [{"oops"\n'
    path.write_text("".join([*lines[:2], garbage, *lines[2:], '{"cut short']))  # the last one: killed mid-line
    capsys.readouterr()
    assert main(["replay", str(spool), "--db", str(db)]) == 1
    out = capsys.readouterr().out
    rejected = path.with_name(path.name + ".rejected")
    assert "2 damaged line(s)" in out and _has(out, str(rejected))
    assert rejected.read_text() == garbage + '{"cut short\n'  # kept as read, never deleted
    with batchtap.store.open(db) as st:  # every readable line still delivered
        assert [p.step for p in st.series(run_id, "loss")] == list(range(8))
        assert st.run(run_id).status is bt.RunStatus.FINISHED
    assert not path.exists() or path.stat().st_size == 0


def test_a_run_only_in_its_spool_is_shown_by_runs_and_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The store was locked from before the run started: its start, steps and end are all spooled."""
    db, spool = tmp_path / "bt.db", tmp_path / "spool"
    bt.sinks.SQLite(db).close()  # the store exists, with its tables
    holder = sqlite3.connect(db, timeout=0.05)
    holder.execute("BEGIN EXCLUSIVE")
    tap = bt.Tap([bt.metrics.Loss()], [bt.sinks.SQLite(db, busy_timeout_s=0.05)], spool_dir=spool, flush_every=2)
    with tap, tap.run(name="never-stored") as run:
        for step in range(4):
            tap.step(loss=torch.tensor(float(step)))
    holder.rollback()
    holder.close()
    capsys.readouterr()
    assert main(["runs", "--db", str(db)]) == 0
    listing = capsys.readouterr().out.replace("\n    ", "")  # a long path is wrapped to the terminal
    assert "'never-stored'" in listing and run.id[:8] in listing and "only in a pending spool" in listing
    assert _has(listing, f"batchtap replay {spool}")
    assert main(["show", "never-stored", "--db", str(db)]) == 1
    shown = capsys.readouterr().out
    assert "only in a pending spool (steps 0..3)" in shown
    assert main(["show", run.id[:8], "--db", str(db)]) == 1
    assert "only in a pending spool" in capsys.readouterr().out
