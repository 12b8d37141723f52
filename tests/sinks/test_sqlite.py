"""``bt.sinks.SQLite``: read back with the sqlite3 module."""

from __future__ import annotations

import math
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from batchtap.errors import SinkError
from batchtap.records import Event, EventKind, Record, RunStatus
from batchtap.sinks.sqlite import SQLite
from tests.store._helpers import ODD_NAMES, make_events, make_records, make_run, make_skips, make_sparse, same_float


def _rows(path: Path, sql: str, params: tuple[object, ...] = ()) -> list[tuple]:
    with sqlite3.connect(path) as conn:
        return conn.execute(sql, params).fetchall()


def test_values_are_stored_long_form_exactly_with_nan_as_null(tmp_path: Path) -> None:
    path = tmp_path / "bt.db"
    rng = random.Random(10)
    run = make_run()
    records = make_records(run.id, range(40), ["loss", "acc", "lr"], rng, nan_every=9)
    sink = SQLite(path)
    sink.start_run(run)
    sink.write(records[:20])
    sink.write(records[20:])
    sink.close()
    rows = _rows(
        path, "SELECT metric, step, rank, epoch, batch, wall_time, value FROM metrics WHERE run_id = ?", (run.id,)
    )
    assert len(rows) == 40 * 3
    got = {(m, s): (rank, e, b, w, v) for m, s, rank, e, b, w, v in rows}
    for r in records:
        for m, v in r.values.items():
            rank, e, b, w, stored = got[(m, r.step)]
            assert (rank, e, b, w) == (r.rank, r.epoch, r.batch, r.wall_time)
            assert stored is None if math.isnan(v) else stored == v


def test_writing_a_block_twice_stores_it_once_and_last_write_wins(tmp_path: Path) -> None:
    path = tmp_path / "bt.db"
    run = make_run()
    block = make_records(run.id, range(10), ["loss"], random.Random(11))
    sink = SQLite(path)
    sink.write(block, make_events(run.id))
    sink.write(block, make_events(run.id))  # a replay
    changed = [replace(block[0], values={"loss": 42.0})]
    sink.write(changed)
    sink.close()
    assert _rows(path, "SELECT COUNT(*) FROM metrics")[0][0] == 10
    assert _rows(path, "SELECT COUNT(*) FROM events")[0][0] == len(make_events(run.id))
    assert _rows(path, "SELECT value FROM metrics WHERE step = 0")[0][0] == 42.0


def test_a_failing_block_leaves_nothing_partial(tmp_path: Path) -> None:
    path = tmp_path / "bt.db"
    run = make_run()
    sink = SQLite(path)
    sink.write(make_records(run.id, range(5), ["loss"], random.Random(12)))
    bad_event = Event(run.id, 7, EventKind.WARNING, None, 0.0)  # type: ignore[arg-type] - violates NOT NULL
    with pytest.raises(SinkError, match=r"not stored \(nothing partial\)"):
        sink.write(make_records(run.id, range(5, 10), ["loss"], random.Random(13)), [bad_event])
    sink.close()
    assert [r[0] for r in _rows(path, "SELECT step FROM metrics ORDER BY step")] == list(range(5))


def test_odd_metric_names_are_stored_verbatim(tmp_path: Path) -> None:
    path = tmp_path / "bt.db"
    run = make_run()
    records = make_records(run.id, range(3), list(ODD_NAMES), random.Random(14))
    sink = SQLite(path)
    sink.write(records)
    sink.close()
    names = {r[0] for r in _rows(path, "SELECT DISTINCT metric FROM metrics")}
    assert names == set(ODD_NAMES)
    for name in ODD_NAMES:
        values = [r[0] for r in _rows(path, "SELECT value FROM metrics WHERE metric = ? ORDER BY step", (name,))]
        assert values == [r.values[name] for r in records]


def test_run_life_cycle_is_stored(tmp_path: Path) -> None:
    path = tmp_path / "bt.db"
    run = make_run(started_at=500.0)
    sink = SQLite(path)
    sink.start_run(run)
    assert _rows(path, "SELECT status, ended_at FROM runs")[0] == ("running", None)
    sink.end_run(replace(run, status=RunStatus.FAILED, ended_at=510.0, stop_reason="ValueError: boom"))
    # A resumed run starts again later: still the original start time, running again.
    sink.start_run(replace(run, started_at=600.0))
    sink.close()
    cols = "name, status, started_at, ended_at, stop_reason, host, pid, python_version, torch_version, cuda_version, git_commit, config"
    name, status, started, ended, reason, host, pid, py, torch_v, cuda, git, config = _rows(
        path, f"SELECT {cols} FROM runs"
    )[0]
    assert (name, status, started, ended, reason) == ("test-run", "running", 500.0, None, None)
    assert (host, pid, py, torch_v, cuda, git) == ("box", 123, "3.11.7", "2.13.0", None, "abc123")
    assert '"lr": 0.1' in config


def test_failed_status_and_reason(tmp_path: Path) -> None:
    path = tmp_path / "bt.db"
    run = make_run()
    sink = SQLite(path)
    sink.start_run(run)
    sink.end_run(replace(run, status=RunStatus.FAILED, ended_at=2e9, stop_reason="ValueError: boom"))
    sink.close()
    assert _rows(path, "SELECT status, ended_at, stop_reason FROM runs")[0] == ("failed", 2e9, "ValueError: boom")


def test_records_without_start_run_still_get_a_run_row(tmp_path: Path) -> None:
    path = tmp_path / "bt.db"
    sink = SQLite(path)
    sink.write([Record("orphan", step=3, epoch=0, batch=3, rank=0, wall_time=77.0, values={"loss": 1.0})])
    sink.close()
    assert _rows(path, "SELECT id, name, status, started_at FROM runs") == [("orphan", "orphan", "running", 77.0)]


def test_events_keep_raw_values_exactly(tmp_path: Path) -> None:
    path = tmp_path / "bt.db"
    run = make_run()
    events = make_events(run.id)
    sink = SQLite(path)
    sink.write([], events)
    sink.close()
    rows = _rows(path, "SELECT step, kind, metric, raw_value, message FROM events ORDER BY step")
    assert [(s, k, m, msg) for s, k, m, _, msg in rows] == [(e.step, e.kind.value, e.metric, e.message) for e in events]
    for (_, _, _, raw, _), e in zip(rows, events):
        assert (raw is None and e.raw_value is None) or same_float(float(raw), e.raw_value)  # type: ignore[arg-type]


def test_database_passes_integrity_check_after_many_blocks(tmp_path: Path) -> None:
    path = tmp_path / "bt.db"
    run = make_run()
    rng = random.Random(15)
    sink = SQLite(path)
    for start in range(0, 500, 50):
        sink.write(make_records(run.id, range(start, start + 50), ["a", "b", "c"], rng))
    sink.close()
    assert _rows(path, "PRAGMA integrity_check") == [("ok",)]
    assert _rows(path, "SELECT COUNT(*) FROM metrics")[0][0] == 1500


def test_sqlite_url_form_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "u.db"
    SQLite(f"sqlite:///{path}").close()
    assert path.exists()


def test_postgres_url_is_refused_with_a_pointer(tmp_path: Path) -> None:
    with pytest.raises(SinkError, match=r"bt.sinks.Postgres"):
        SQLite("postgresql://u:secret@h/db")


def test_writing_after_close_is_an_error(tmp_path: Path) -> None:
    sink = SQLite(tmp_path / "bt.db")
    sink.close()
    sink.close()  # idempotent
    with pytest.raises(SinkError, match=r"closed"):
        sink.write(make_records("r", range(1), ["loss"], random.Random(16)))


_WRITER = """
import random, sys
from batchtap.records import Record
from batchtap.sinks.sqlite import SQLite
sink = SQLite(sys.argv[1])
rng = random.Random(0)
step = 0
while True:
    block = [Record("killed", step=s, epoch=0, batch=s, rank=0, wall_time=float(s),
                    values={f"m{i}": rng.random() for i in range(20)}) for s in range(step, step + 50)]
    sink.write(block)
    step += 50
"""


def test_sigkill_during_writes_leaves_whole_blocks_and_a_sound_file(tmp_path: Path) -> None:
    path = tmp_path / "bt.db"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], env=env)
    try:
        rows = 0
        for _ in range(600):  # until a few blocks are in (bounded wait, no timing asserted)
            time.sleep(0.05)
            if path.exists():
                try:
                    rows = _rows(path, "SELECT COUNT(*) FROM metrics")[0][0]
                except sqlite3.OperationalError:
                    continue
                if rows >= 5 * 50 * 20:
                    break
        assert rows > 0, "the writer never committed a block"
        time.sleep(random.Random(17).uniform(0.0, 0.2))  # land somewhere inside a later write
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert _rows(path, "PRAGMA integrity_check") == [("ok",)]
    steps = [r[0] for r in _rows(path, "SELECT DISTINCT step FROM metrics ORDER BY step")]
    assert steps == list(range(len(steps))) and len(steps) % 50 == 0
    assert _rows(path, "SELECT COUNT(*) FROM metrics")[0][0] == len(steps) * 20
    # The store still takes writes after the crash, and a replay of the last block adds nothing.
    sink = SQLite(path)
    last = [
        Record("killed", step=s, epoch=0, batch=s, rank=0, wall_time=float(s), values={"m0": 0.5}) for s in steps[-50:]
    ]
    sink.write(last)
    sink.close()
    assert _rows(path, "SELECT COUNT(*) FROM metrics")[0][0] == len(steps) * 20


def test_sparse_records_are_metric_rows_and_their_names_are_noted(tmp_path: Path) -> None:
    path = tmp_path / "bt.db"
    rng = random.Random(70)
    run = make_run()
    steps = make_records(run.id, range(20), ["loss", "acc"], rng)
    evals = make_sparse(run.id, [9, 19], rng)
    late = make_sparse(run.id, [19], rng, names=("bleu",))
    sink = SQLite(path)
    sink.start_run(run)
    sink.write([*steps[:10], evals[0], *steps[10:]], make_skips(run.id, [2]))  # mixed in one block
    sink.write([evals[1], late[0]])  # sparse only, a name first seen now
    sink.close()
    rows = _rows(
        path, "SELECT metric, step, epoch, batch, wall_time, value FROM metrics WHERE batch = -1 ORDER BY step, metric"
    )
    want = sorted(
        ((m, r.step, r.epoch, -1, r.wall_time, v) for r in [*evals, *late] for m, v in r.values.items()),
        key=lambda x: (x[1], x[0]),
    )
    assert rows == want
    assert _rows(path, "SELECT run_id, metric FROM sparse_metrics ORDER BY metric") == [
        (run.id, "bleu"), (run.id, "val_acc"), (run.id, "val_loss"),
    ]  # fmt: skip
    assert _rows(path, "SELECT COUNT(*) FROM metrics WHERE batch >= 0") == [(40,)]
    assert _rows(path, "SELECT metric_names FROM runs") == [('["loss", "acc"]',)]  # the declared step metrics
    assert _rows(path, "SELECT step, kind FROM events") == [(2, "skip")]


def test_a_sparse_value_logged_again_at_its_step_is_updated_in_place(tmp_path: Path) -> None:
    path = tmp_path / "bt.db"
    run = make_run()
    first = make_sparse(run.id, [9], random.Random(71))[0]
    again = replace(first, wall_time=first.wall_time + 2.0, values={"val_loss": 0.125})
    sink = SQLite(path)
    sink.write([first])
    sink.write([first, again])
    sink.close()
    assert _rows(path, "SELECT metric, step, wall_time, value FROM metrics WHERE metric = 'val_loss'") == [
        ("val_loss", 9, again.wall_time, 0.125)
    ]
    assert _rows(path, "SELECT COUNT(*) FROM sparse_metrics") == [(2,)]
