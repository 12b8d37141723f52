"""``batchtap.store.open``: reading runs, series and events back, on SQLite and PostgreSQL."""

from __future__ import annotations

import math
import random
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

import batchtap.store
from batchtap.records import ALL_RANKS, RunStatus
from batchtap.sinks.base import Sink
from batchtap.sinks.sqlite import SQLite
from batchtap.store import MetricNotFound, RunNotFound, Store
from tests.store._helpers import PG_DSN, make_events, make_records, make_run, pg_schema_fixture, same_float

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


def test_runs_report_status_steps_and_timings(backend: Backend) -> None:
    make_sink, open_store = backend
    rng = random.Random(0)
    a = make_run("aaaa1111", name="alpha", started_at=100.0)
    b = make_run("bbbb2222", name="beta", started_at=200.0)
    sink = make_sink()
    sink.start_run(a)
    sink.write(make_records(a.id, range(0, 30), ["loss", "acc"], rng, t0=100.0))
    sink.end_run(replace(a, status=RunStatus.STOPPED, ended_at=150.0, stop_reason="SIGTERM"))
    sink.start_run(b)
    sink.write(make_records(b.id, range(0, 5), ["loss"], rng, t0=200.0))
    sink.close()
    with open_store() as st:
        runs = st.runs()
        assert [r.id for r in runs] == [a.id, b.id]
        ra, rb = runs
        assert (ra.status, ra.stop_reason, ra.ended_at, ra.steps, ra.first_step, ra.last_step) == (
            RunStatus.STOPPED, "SIGTERM", 150.0, 30, 0, 29,
        )  # fmt: skip
        assert ra.duration == 50.0
        assert ra.config == a.config and ra.metrics == ("loss", "acc")
        assert ra.environment["host"] == "box" and ra.environment["git_commit"] == "abc123"
        assert rb.status is RunStatus.RUNNING and rb.ended_at is None and rb.steps == 5
        assert rb.last_wall_time is not None and rb.duration == pytest.approx(rb.last_wall_time - 200.0)


def test_series_round_trips_values_exactly_nan_included(backend: Backend) -> None:
    make_sink, open_store = backend
    rng = random.Random(1)
    run = make_run()
    records = make_records(run.id, range(50), ["loss", "acc"], rng, nan_every=7)
    sink = make_sink()
    sink.start_run(run)
    for i in range(0, 50, 10):
        sink.write(records[i : i + 10])
    sink.close()
    with open_store() as st:
        series = st.series(run.id, "loss")
    assert [p.step for p in series] == list(range(50))
    for p, r in zip(series, records):
        assert same_float(p.value, r.values["loss"]), (p, r)
        assert (p.wall_time, p.epoch, p.batch) == (r.wall_time, r.epoch, r.batch)
    assert sum(math.isnan(p.value) for p in series) == len(range(0, 50, 7))


def test_iter_metrics_yields_every_stored_value_by_metric_step_and_rank(backend: Backend) -> None:
    """The streamed read (one connection held while the rows are read) gives every value once."""
    make_sink, open_store = backend
    rng = random.Random(11)
    run = make_run()
    written = [
        *make_records(run.id, range(20), ["loss", "acc"], rng, nan_every=6),
        *make_records(run.id, range(20), ["loss"], rng, rank=1),
    ]
    sink = make_sink()
    sink.start_run(run)
    sink.write(written)
    sink.close()
    expected = sorted((m, r.step, r.rank, v) for r in written for m, v in r.values.items())
    with open_store() as st:
        got = list(st.iter_metrics(run.id))
    assert [(m, s, r) for m, s, r, _ in got] == [(m, s, r) for m, s, r, _ in expected]
    assert all(same_float(g[3], e[3]) for g, e in zip(got, expected))


def test_series_prefers_the_reduced_rank_then_the_lowest(backend: Backend) -> None:
    make_sink, open_store = backend
    rng = random.Random(2)
    run = make_run()
    sink = make_sink()
    sink.write(make_records(run.id, range(3), ["loss"], rng, rank=1))
    sink.write(make_records(run.id, range(3), ["loss"], rng, rank=0))
    sink.write(make_records(run.id, range(3), ["loss", "only_rank_1"], rng, rank=ALL_RANKS))
    sink.write(make_records(run.id, range(3), ["only_rank_1"], rng, rank=1))
    sink.close()
    with open_store() as st:
        reduced = st.series(run.id, "loss", rank=ALL_RANKS)
        assert st.series(run.id, "loss") == reduced
        assert st.series(run.id, "loss", rank=1) != reduced
        assert len(st.series(run.id, "loss", rank=0)) == 3
        with pytest.raises(MetricNotFound, match="no metric 'no such metric'"):  # issue 29: not []
            st.series(run.id, "no such metric")


def test_metric_names_declared_order_first(backend: Backend) -> None:
    make_sink, open_store = backend
    run = replace(make_run(), metrics=("zeta", "alpha"))
    sink = make_sink()
    sink.start_run(run)
    sink.write(make_records(run.id, range(2), ["alpha", "zeta", "mid", "b/extra"], random.Random(3)))
    sink.close()
    with open_store() as st:
        assert st.metric_names(run.id) == ["zeta", "alpha", "b/extra", "mid"]
        with pytest.raises(RunNotFound, match="no run 'unknown-run'"):  # issue 29: not []
            st.metric_names("unknown-run")


def test_events_round_trip_with_raw_values(backend: Backend) -> None:
    make_sink, open_store = backend
    run = make_run()
    events = make_events(run.id)
    sink = make_sink()
    sink.start_run(run)
    sink.write(make_records(run.id, range(8), ["loss"], random.Random(4)), events)
    sink.write([], events)  # the same events again: stored once
    sink.close()
    with open_store() as st:
        got = st.events(run.id)
    assert len(got) == len(events)
    for g, e in zip(got, events):
        assert (g.step, g.kind, g.message, g.metric, g.wall_time, g.rank) == (
            e.step,
            e.kind,
            e.message,
            e.metric,
            e.wall_time,
            e.rank,
        )
        assert (g.raw_value is None and e.raw_value is None) or same_float(g.raw_value, e.raw_value)  # type: ignore[arg-type]


def test_run_lookup_by_id_prefix_and_name(backend: Backend) -> None:
    make_sink, open_store = backend
    sink = make_sink()
    old = make_run("abc123old", name="resnet", started_at=1.0)
    new = make_run("abd456new", name="resnet", started_at=2.0)
    other = make_run("ffff0000", name="transformer", started_at=3.0)
    for r in (old, new, other):
        sink.start_run(r)
    sink.close()
    with open_store() as st:
        assert st.run("abc123old").id == old.id
        assert st.run("resnet").id == new.id  # the latest of that name
        assert st.run("abd").id == new.id  # unique prefix
        assert st.run("ff").id == other.id
        with pytest.raises(RunNotFound, match=r"ambiguous.*abc123old.*abd456new"):
            st.run("ab")
        with pytest.raises(RunNotFound, match=r"no run 'resnt'.*closest: 'resnet'") as info:
            st.run("resnt")
        assert info.value.candidates[0] == "resnet"
        with pytest.raises(LookupError):
            st.run("zzzzzz")


def test_reader_follows_a_writer_holding_a_write_transaction(tmp_path: Path) -> None:
    path = tmp_path / "live.db"
    run = make_run()
    sink = SQLite(path)
    sink.start_run(run)
    sink.write(make_records(run.id, range(10), ["loss"], random.Random(5)))
    # Another process is in the middle of writing a block (the write lock is held) ...
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    other.execute("INSERT INTO metrics VALUES (?, 'loss', 99, 0, 0, 99, 0.0, 1.0)", (run.id,))
    # ... and a reader still reads every committed block, without waiting.
    with batchtap.store.open(path) as st:
        assert [p.step for p in st.series(run.id, "loss")] == list(range(10))
        other.execute("COMMIT")
        assert [p.step for p in st.series(run.id, "loss")] == [*range(10), 99]
    other.close()
    sink.close()


def test_summaries_leave_a_rollbacks_undone_steps_out(backend: Backend) -> None:
    from batchtap.records import Event, EventKind, Record

    make_sink, open_store = backend
    run = make_run("r011back", name="rolled", started_at=100.0)
    losses = [1.0, 0.8, 0.6, 0.0, -5.0, float("nan"), 0.7, 0.65]  # steps 3..5: the abandoned trajectory
    sink = make_sink()
    sink.start_run(run)
    sink.write(
        [Record(run.id, step=s, epoch=0, batch=s, rank=0, wall_time=101.0 + s, values={"loss": v, "acc": 0.5 + s / 100})
         for s, v in enumerate(losses)],
        [Event(run.id, 6, EventKind.ACTION, "rollback 1: divergence at step 5 (nan); restored the snapshot of "
               "step 2 at step 6, undone steps 3..5, lr x0.5, skipping the next 0 batches", 107.5)],
    )  # fmt: skip
    sink.end_run(replace(run, status=RunStatus.FINISHED, ended_at=110.0))
    sink.close()
    with open_store() as st:
        assert st.rolled_back("rolled") == (range(3, 6),)
        loss = st.summary("rolled", "loss")
        assert (loss.count, loss.nans, loss.min, loss.max, loss.best, loss.last, loss.last_step) == (
            5, 0, 0.6, 1.0, 0.6, 0.65, 7,
        )  # fmt: skip
        acc = st.summary(run.id[:5], "acc")
        assert acc.higher_is_better and acc.best == acc.max == pytest.approx(0.57)
        assert st.status(run.id)[0] is RunStatus.FINISHED
        with pytest.raises(MetricNotFound):
            st.summary(run.id, "los")


def test_connections_are_pooled_bounded_and_closed_when_idle(tmp_path: Path) -> None:
    import threading
    import time

    path = tmp_path / "bt.db"
    sink = SQLite(path)
    sink.start_run(make_run("p001"))
    sink.close()
    with batchtap.store.open(path, connections=3, idle_s=0.2) as st:
        inside = threading.Barrier(3)

        def read() -> None:
            with st._pool.connection():
                inside.wait(timeout=30)  # three callers hold a connection at once
            st.runs()

        threads = [threading.Thread(target=read) for _ in range(3)] + [
            threading.Thread(target=st.runs) for _ in range(40)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert 1 <= st.open_connections <= 3
        deadline = time.monotonic() + 30
        while st.open_connections and time.monotonic() < deadline:
            time.sleep(0.02)  # the pool's timer closes idle connections
        assert st.open_connections == 0
        assert [r.id for r in st.runs()] == ["p001"]  # and opens one again when asked


def test_a_read_only_reader_refuses_writes_and_older_stores(tmp_path: Path) -> None:
    from batchtap.store.schema import SQLITE
    from tests.store._helpers import make_store_at_version

    path = tmp_path / "bt.db"
    sink = SQLite(path)
    sink.start_run(make_run("ro01"))
    sink.close()
    with batchtap.store.open(path, migrate=False) as st:
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            st.query("DELETE FROM runs")
    old = tmp_path / "v1.db"
    conn = sqlite3.connect(old, isolation_level=None)
    make_store_at_version(conn, SQLITE, 1)
    conn.close()
    with pytest.raises(batchtap.store.StoreError, match="does not migrate"):
        batchtap.store.open(old, migrate=False)
