"""Sparse values (``Tap.log()``) and skipped steps in a store, on SQLite and PostgreSQL: written by
the SQL sinks, read back with ``batchtap.store.open``; stores written before schema version 2
open and migrate."""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

import batchtap.store
from batchtap.records import EventKind, Record, RunInfo
from batchtap.sinks.base import Sink
from batchtap.sinks.sqlite import SQLite
from batchtap.store import SCHEMA_VERSION, RunNotFound, Store
from batchtap.store.schema import POSTGRES, SQLITE
from tests.store._helpers import (
    PG_DSN,
    make_records,
    make_run,
    make_skips,
    make_sparse,
    make_store_at_version,
    pg_schema_fixture,
)

Backend = tuple[Callable[[], Sink], Callable[[], Store]]


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "sqlite":
        path = tmp_path / "bt.db"
        yield (lambda: SQLite(path)), (lambda: batchtap.store.open(f"sqlite:///{path}"))
        return
    from batchtap.sinks.postgres import Postgres

    for schema in pg_schema_fixture():
        yield (lambda: Postgres(PG_DSN, schema=schema)), (lambda: batchtap.store.open(PG_DSN, schema=schema))


def _write_run(sink: Sink, run: RunInfo, rng: random.Random) -> tuple[list[Record], list[Record]]:
    """30 steps of loss/acc; evaluations at steps 9 (mixed into a block of steps), 19 (a block of its
    own) and a new name first seen at step 29; two skipped steps."""
    steps = make_records(run.id, range(30), ["loss", "acc"], rng)
    sparse = [
        *make_sparse(run.id, [9, 19], rng),
        *make_sparse(run.id, [29], rng, names=("bleu",)),
    ]
    sink.start_run(run)
    sink.write([*steps[:10], sparse[0], *steps[10:20]])
    sink.write([sparse[1]])
    sink.write([*steps[20:], sparse[2]], make_skips(run.id, [3, 4]))
    return steps, sparse


def test_sparse_values_read_back_as_logged_and_listed_apart(backend: Backend) -> None:
    make_sink, open_store = backend
    run = make_run()
    sink = make_sink()
    _, sparse = _write_run(sink, run, random.Random(60))
    sink.close()
    with open_store() as st:
        assert st.sparse_names(run.id) == ["bleu", "val_acc", "val_loss"]
        # declared step metrics first, sparse names last
        assert st.metric_names(run.id) == ["loss", "acc", "bleu", "val_acc", "val_loss"]
        assert st.sparse_records(run.id) == sparse  # exact floats, steps, epochs, wall times, batch -1
        assert st.sparse_records(run.id, names=["bleu"]) == sparse[2:]
        assert st.sparse_records(run.id, rank=1) == []
        points = st.series(run.id, "val_loss")
        assert [(p.step, p.value, p.batch) for p in points] == [(r.step, r.values["val_loss"], -1) for r in sparse[:2]]
        with pytest.raises(RunNotFound, match="no run 'unknown-run'"):  # issue 29: not []
            st.sparse_names("unknown-run")
        with pytest.raises(RunNotFound, match="no run 'unknown-run'"):
            st.sparse_records("unknown-run")


def test_step_figures_and_resume_point_leave_sparse_values_out(backend: Backend) -> None:
    make_sink, open_store = backend
    rng = random.Random(61)
    run = make_run()
    sink = make_sink()
    _write_run(sink, run, rng)
    # log(step=...) may name any step: one beyond the last captured step, and a sparse-only run
    sink.write(make_sparse(run.id, [500], rng))
    only = make_run(name="eval-only", started_at=1_700_000_100.0)
    sink.start_run(only)
    sink.write(make_sparse(only.id, [7], rng))
    assert sink.last_step(run.id) == 29
    assert sink.last_step(only.id) is None
    sink.close()
    with open_store() as st:
        got = st.run(run.id)
        assert (got.steps, got.first_step, got.last_step) == (30, 0, 29)
        assert [(r.steps, r.last_step) for r in st.runs()] == [(30, 29), (0, None)]
        assert st.sparse_names(only.id) == ["val_acc", "val_loss"]


def test_a_sparse_name_logged_twice_at_one_step_keeps_the_last_value(backend: Backend) -> None:
    make_sink, open_store = backend
    rng = random.Random(62)
    run = make_run()
    first = make_sparse(run.id, [9], rng)[0]
    again = replace(first, wall_time=first.wall_time + 1.0, values={"val_loss": 0.25})
    sink = make_sink()
    sink.start_run(run)
    sink.write(make_records(run.id, range(10), ["loss"], rng))
    sink.write([first])
    sink.write([first, again])  # a replayed block and a second log() at the same step, in one block
    sink.write([again])
    sink.close()
    with open_store() as st:
        assert st.sparse_names(run.id) == ["val_acc", "val_loss"]
        assert [(p.step, p.value, p.wall_time) for p in st.series(run.id, "val_loss")] == [(9, 0.25, again.wall_time)]
        assert [(p.step, p.value) for p in st.series(run.id, "val_acc")] == [(9, first.values["val_acc"])]


def test_skipped_steps_are_events_of_their_own_kind(backend: Backend) -> None:
    make_sink, open_store = backend
    run = make_run()
    sink = make_sink()
    _write_run(sink, run, random.Random(63))
    sink.write([], make_skips(run.id, [3]))  # the same event again: stored once
    sink.close()
    with open_store() as st:
        events = st.events(run.id)
    assert [(e.step, e.kind) for e in events] == [(3, EventKind.SKIP), (4, EventKind.SKIP)]
    assert "GradScaler skipped" in events[0].message


def _old_rows(run_id: str) -> tuple[list[tuple[object, ...]], tuple[object, ...]]:
    """Rows a version-1 batchtap stored: loss at steps 0..4, val_loss from Tap.log() (batch -1)
    at step 4, and a step metric with a batch -1 row among others (not a sparse name)."""
    metrics: list[tuple[object, ...]] = [(run_id, "loss", s, 0, 0, s, 100.0 + s, 1.0 / (s + 1)) for s in range(5)]
    metrics.append((run_id, "val_loss", 4, 0, 0, -1, 104.5, 0.5))
    metrics += [(run_id, "odd", s, 0, 0, s - 1, 100.0 + s, 2.0) for s in range(2)]
    run = (
        run_id,
        "old-run",
        "finished",
        100.0,
        110.0,
        None,
        "{}",
        1,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        '["loss", "odd"]',
        "{}",
    )
    return metrics, run


def _check_migrated(st: Store, run_id: str) -> None:
    assert st.sparse_names(run_id) == ["val_loss"]
    assert st.metric_names(run_id) == ["loss", "odd", "val_loss"]
    got = st.run("old-run")
    assert (got.steps, got.last_step) == (5, 4)
    [record] = st.sparse_records(run_id)
    assert (record.step, record.batch, dict(record.values)) == (4, -1, {"val_loss": 0.5})


def test_a_version_1_sqlite_store_opens_and_migrates(tmp_path: Path) -> None:
    path = tmp_path / "v1.db"
    metrics, run = _old_rows("r-old")
    conn = sqlite3.connect(path, isolation_level=None)
    make_store_at_version(conn, SQLITE, 1)
    conn.executemany("INSERT INTO metrics VALUES (?, ?, ?, ?, ?, ?, ?, ?)", metrics)
    conn.execute(f"INSERT INTO runs VALUES ({', '.join('?' * len(run))})", run)
    conn.close()
    with batchtap.store.open(path) as st:  # a reader applies the missing migration
        _check_migrated(st, "r-old")
    with sqlite3.connect(path) as conn:
        versions = [r[0] for r in conn.execute("SELECT version FROM schema_version ORDER BY version")]
        assert versions == list(range(1, SCHEMA_VERSION + 1))
    # and a sink goes on writing it
    sink = SQLite(path)
    sink.write(make_sparse("r-old", [5], random.Random(64), names=("val_acc",)))
    sink.close()
    with batchtap.store.open(path) as st:
        assert st.sparse_names("r-old") == ["val_acc", "val_loss"]


def test_a_version_1_postgres_store_opens_and_migrates() -> None:
    for schema in pg_schema_fixture():
        import psycopg

        from batchtap.sinks.postgres import Postgres

        metrics, run = _old_rows("r-old")
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{schema}"')
            conn.execute(f'SET search_path TO "{schema}"')
            make_store_at_version(conn, POSTGRES, 1)
            with conn.cursor() as cur:
                cur.executemany("INSERT INTO metrics VALUES (%s, %s, %s, %s, %s, %s, %s, %s)", metrics)
            conn.execute(f"INSERT INTO runs VALUES ({', '.join(['%s'] * len(run))})", run)
        sink = Postgres(PG_DSN, schema=schema)  # the sink applies it this time
        assert sink.last_step("r-old") == 4
        sink.close()
        with batchtap.store.open(PG_DSN, schema=schema) as st:
            _check_migrated(st, "r-old")
