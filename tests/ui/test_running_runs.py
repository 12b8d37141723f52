"""A running run's runs-table figures are read incrementally (batchtap/ui/running.py): a poll after N
new steps fetches about N rows per metric, and what it gives equals a full read of the store, when a
metric is written a flush late, when a block is delivered twice, when a row lands below what was
read, when a rollback undoes steps, when a value is logged with ``Tap.log()``, and on PostgreSQL.
Real stores written by the real sinks; the memory bounds are in tests/ui/test_memory_bound.py."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")

from batchtap.records import Event, EventKind, Record, RunInfo, RunStatus  # noqa: E402
from batchtap.sinks.sqlite import SQLite  # noqa: E402
from batchtap.ui.data import ReadOnlyStore  # noqa: E402
from tests.store._helpers import PG_DSN, pg_schema_fixture  # noqa: E402

RUN = "live0000cccc"
METRICS = ("loss", "accuracy", "lr")


def _records(steps: range, metrics: tuple[str, ...] = METRICS, *, scale: float = 1.0) -> list[Record]:
    return [
        Record(
            RUN,
            step=s,
            epoch=s // 100,
            batch=s % 100,
            rank=0,
            wall_time=1000.0 + s,
            values={m: scale * (1.0 + ((s * 7 + i) % 13) / (s + 1)) for i, m in enumerate(metrics)},
        )
        for s in steps
    ]


def _start(sink: Any) -> None:
    sink.start_run(RunInfo(RUN, "live", {"lr": 0.1}, started_at=1000.0, metrics=METRICS))


def _full(store: ReadOnlyStore) -> dict[str, Any]:
    """The running run as a full read of the store gives it (what the view did on every poll)."""
    return store._summarise(store.reader.run(RUN))


def _polled(store: ReadOnlyStore) -> dict[str, Any]:
    return {r["id"]: r for r in store.runs()}[RUN]


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[SQLite, ReadOnlyStore]]:
    db = tmp_path / "s.db"
    sink = SQLite(db)
    _start(sink)
    sink.write(_records(range(0, 1000)))
    store = ReadOnlyStore(db, verify_s=1e9)
    try:
        yield sink, store
    finally:
        store.close()
        sink.close()


def test_a_poll_after_n_new_steps_fetches_about_n_rows_per_metric(live: tuple[SQLite, ReadOnlyStore]) -> None:
    sink, store = live
    assert _polled(store) == _full(store) and store.running.builds == 1
    for _ in range(3):
        sink.write(_records(range(store.running._runs[RUN].last + 1, store.running._runs[RUN].last + 51)))
        before = store.rows_read
        got = _polled(store)
        fetched = store.rows_read - before
        # 50 new steps: one row per step for each of the 3 metrics, 50 rows of the main line, and a
        # few dozen rows of the runs table, names, ranks and events; a full read would be 3,000+
        assert 200 <= fetched <= 260, fetched
        assert got == _full(store)
    assert store.running.builds == 1
    assert _polled(store)["steps"] == 1150 and _polled(store)["last_step"] == 1149


def test_a_poll_does_work_in_proportion_to_the_new_rows_not_to_the_run(tmp_path: Path) -> None:
    """What the database does for a poll, counted in SQLite virtual-machine instructions (its
    progress handler): a run of 20,000 steps read in full once, then polls of 50 new steps."""
    db = tmp_path / "s.db"
    sink = SQLite(db)
    _start(sink)
    for start in range(0, 20_000, 5000):
        sink.write(_records(range(start, start + 5000)))
    store = ReadOnlyStore(db, connections=1, idle_s=1e9, verify_s=1e9)
    work = [0]

    def count() -> int:
        work[0] += 1
        return 0

    try:
        with store.reader._pool.connection() as conn:  # the one connection every read takes
            conn.set_progress_handler(count, 100)
        _polled(store)
        built = work[0]
        for start in range(20_000, 20_150, 50):
            sink.write(_records(range(start, start + 50)))
            work[0] = 0
            assert _polled(store) == {**_full(store), "duration": _polled(store)["duration"]}
        work[0] = 0
        _polled(store)
        sink.write(_records(range(20_150, 20_200)))
        work[0] = 0
        _polled(store)
        assert work[0] * 20 < built, (work[0], built)
    finally:
        store.close()
        sink.close()


def test_a_metric_written_a_flush_late_and_one_that_appears_mid_run_count_each_step_once(
    live: tuple[SQLite, ReadOnlyStore],
) -> None:
    sink, store = live
    _polled(store)
    sink.write(_records(range(1000, 1100), ("loss", "lr")))  # accuracy comes a flush later
    assert _polled(store) == _full(store)
    sink.write(_records(range(1000, 1100), ("accuracy",)) + _records(range(1100, 1120)))
    assert _polled(store) == _full(store)
    # a metric that starts at step 1050 (steps it has are already counted) and one step only it has
    sink.write(_records(range(1050, 1125), ("grad_norm",)))
    got = _polled(store)
    assert got == _full(store) and got["steps"] == 1125
    assert store.running.builds == 1


def test_a_block_delivered_twice_changes_nothing_and_a_row_below_the_mark_is_picked_up(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    sink = SQLite(db)
    _start(sink)
    sink.write(_records(range(0, 500)))
    store = ReadOnlyStore(db, verify_s=0.0)  # count the rows below the marks on every poll
    try:
        _polled(store)
        sink.write(_records(range(100, 200)))  # a spool replay: the same rows again
        assert _polled(store) == _full(store) and store.running.builds == 1
        # a row that lands below what was read (a writer out of step order): seen, read again
        sink.write(_records(range(600, 610)))
        _polled(store)
        sink.write([Record(RUN, step=550, epoch=5, batch=50, rank=0, wall_time=1e9, values={"loss": -5.0})])
        got = _polled(store)
        assert store.running.builds == 2
        assert got == _full(store) and got["steps"] == 511 and got["min_value"] == -5.0
        assert got["last_wall"] == 1e9
    finally:
        store.close()
        sink.close()


def test_a_rollback_and_a_tap_log_value_mid_run_match_a_full_read(live: tuple[SQLite, ReadOnlyStore]) -> None:
    sink, store = live
    _polled(store)
    sink.write(_records(range(1000, 1050)))
    sink.write([], [Event(RUN, 1049, EventKind.ACTION, "rollback: undone steps 1020..1049", 2049.0)])
    sink.write(_records(range(1050, 1060), scale=0.001))
    got = _polled(store)
    assert got == _full(store) and got["rolled_back"] == [[1020, 1049]]
    # an evaluation value logged with Tap.log() at a step of its own: not a step of the run
    sink.write([Record(RUN, step=5000, epoch=0, batch=-1, rank=0, wall_time=3000.0, values={"val": 0.5}, sparse=True)])
    sink.write(_records(range(1060, 1070)))
    got = _polled(store)
    assert got == _full(store) and got["last_step"] == 1069 and got["steps"] == 1070
    # a rollback's event stored before the rows of the steps it undid (read after it, left out)
    sink.write([], [Event(RUN, 1069, EventKind.ACTION, "rollback: undone steps 1070..1079", 2069.0)])
    _polled(store)
    sink.write(_records(range(1070, 1080), scale=0.0001) + _records(range(1080, 1085), scale=1000.0))
    got = _polled(store)
    assert got == _full(store) and got["rolled_back"] == [[1020, 1049], [1070, 1079]]


def test_polls_from_many_threads_while_the_run_is_written_end_equal_to_a_full_read(
    live: tuple[SQLite, ReadOnlyStore],
) -> None:
    sink, store = live
    stop = threading.Event()
    errors: list[BaseException] = []

    def poll() -> None:
        while not stop.is_set():
            try:
                store.runs()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return

    threads = [threading.Thread(target=poll) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for start in range(1000, 2000, 20):
            sink.write(_records(range(start, start + 20)))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors
    assert _polled(store) == _full(store) and _polled(store)["steps"] == 2000
    # it ends: read once in full and kept with the ended runs
    sink.end_run(RunInfo(RUN, "live", {}, started_at=1000.0, status=RunStatus.FINISHED, ended_at=3000.0))
    assert _polled(store)["status"] == "finished" and RUN not in store.running and RUN in store.ended


@pytest.fixture
def pg_schema() -> Iterator[str]:
    yield from pg_schema_fixture()


def test_postgresql_running_run_is_read_incrementally(pg_schema: str) -> None:
    from batchtap.sinks.postgres import Postgres

    sink = Postgres(PG_DSN, schema=pg_schema)
    store = None
    try:
        _start(sink)
        sink.write(_records(range(0, 300)))
        store = ReadOnlyStore(PG_DSN, schema=pg_schema, verify_s=0.0)
        assert _polled(store) == _full(store)
        sink.write(_records(range(300, 350), ("loss",)) + _records(range(250, 260)))
        before = store.rows_read
        got = _polled(store)
        assert store.rows_read - before < 300 and got == _full(store) and got["steps"] == 350
        assert store.running.builds == 1
    finally:
        if store is not None:
            store.close()
        sink.close()


def test_a_running_runs_epochs_are_read_incrementally(tmp_path: Path) -> None:
    """Epochs (x by epoch; a live page asks every 5 s): equal to the full aggregate, and the
    database's work for a read after 30 new steps (SQLite VM instructions) a small part of it."""
    db = tmp_path / "s.db"
    sink = SQLite(db)
    _start(sink)
    sink.write(_records(range(0, 10_000)))
    store = ReadOnlyStore(db, connections=1, idle_s=1e9, verify_s=1e9)
    work = [0]

    def count() -> int:
        work[0] += 1
        return 0

    def full() -> list[list[int]]:
        rows = store._all(
            "SELECT epoch, MIN(step), MAX(step) FROM metrics WHERE run_id = ? AND metric = 'loss' AND rank = 0"
            " GROUP BY epoch ORDER BY MIN(step)",
            (RUN,),
        )
        return [list(r) for r in rows]

    try:
        with store.reader._pool.connection() as conn:
            conn.set_progress_handler(count, 100)
        assert store.epochs(RUN) == full() and len(full()) == 100  # epochs of 100 steps
        for start in (10_000, 10_030, 10_100):  # within epoch 100, then on into epoch 101
            sink.write(_records(range(start, start + 30)))
            work[0] = 0
            full()
            whole = work[0]
            work[0] = 0
            got = store.epochs(RUN)
            assert work[0] * 5 < whole, (work[0], whole)
            assert got == full()
        assert store.epochs(RUN)[-1] == [101, 10_100, 10_129]
    finally:
        store.close()
        sink.close()


def test_nan_and_infinite_values_of_a_running_run_count_as_a_full_read_counts_them(
    live: tuple[SQLite, ReadOnlyStore],
) -> None:
    sink, store = live
    _polled(store)
    odd = {1000: math.nan, 1001: math.inf, 1002: -math.inf, 1003: -1e300, 1004: 1e300}
    sink.write(
        [
            Record(RUN, step=s, epoch=10, batch=s % 100, rank=0, wall_time=2000.0 + s, values={"loss": v})
            for s, v in odd.items()
        ]
    )
    got = _polled(store)
    assert got == _full(store) and got["min_value"] == -1e300 and got["max_value"] == 1e300
    sink.write([Record(RUN, step=1005, epoch=10, batch=5, rank=0, wall_time=3005.0, values={"loss": math.nan})])
    got = _polled(store)
    assert got == _full(store) and got["last_value"] is None and got["last_step"] == 1005
    assert store.running.builds == 1


def test_a_lower_rank_appearing_mid_run_and_a_wall_clock_going_back_match_a_full_read(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    sink = SQLite(db)
    _start(sink)
    one = [Record(RUN, step=s, epoch=0, batch=s, rank=1, wall_time=1000.0 + s, values={"loss": 2.0}) for s in range(50)]
    sink.write(one)
    store = ReadOnlyStore(db, verify_s=1e9)
    try:
        assert _polled(store) == _full(store) and _polled(store)["best_value"] == 2.0
        # rank 0 starts storing (its line is the one summed up from now on: the lowest rank)
        sink.write(
            [
                Record(RUN, step=s, epoch=0, batch=s, rank=0, wall_time=500.0, values={"loss": 1.0})
                for s in range(50, 60)
            ]
        )
        got = _polled(store)
        assert got == _full(store) and got["best_value"] == 1.0 and got["last_wall"] == 1049.0  # clock went back
    finally:
        store.close()
        sink.close()


def test_a_row_below_the_epochs_mark_is_picked_up_at_the_next_count(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    sink = SQLite(db)
    _start(sink)
    sink.write(_records(range(0, 300)))
    store = ReadOnlyStore(db, verify_s=0.0)
    try:
        assert [e[0] for e in store.epochs(RUN)] == [0, 1, 2]
        sink.write([Record(RUN, step=-5, epoch=-1, batch=0, rank=0, wall_time=999.0, values={"loss": 1.0})])
        assert store.epochs(RUN)[0] == [-1, -5, -5] and len(store.epochs(RUN)) == 4
    finally:
        store.close()
        sink.close()
