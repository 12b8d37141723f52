"""``bt.sinks.Postgres``: read back over a real psycopg connection to the test server."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from batchtap.errors import ConfigError, SinkError
from batchtap.records import RunStatus
from batchtap.sinks.resilient import ResilientSink
from batchtap.store import StoreError
from tests.store._helpers import (
    ODD_NAMES,
    PG_DSN,
    TcpProxy,
    make_events,
    make_records,
    make_run,
    make_skips,
    make_sparse,
    pg_schema_fixture,
)

psycopg = pytest.importorskip("psycopg")
from batchtap.sinks.postgres import Postgres  # noqa: E402 - after the importorskip


@pytest.fixture
def schema() -> Iterator[str]:
    yield from pg_schema_fixture()


def _rows(schema: str, sql: str, params: tuple[object, ...] = ()) -> list[tuple]:
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{schema}"')
        return conn.execute(sql, params).fetchall()


def test_values_round_trip_exactly_with_nan_as_null(schema: str) -> None:
    rng = random.Random(20)
    run = make_run()
    records = make_records(run.id, range(60), ["loss", "acc"], rng, nan_every=11)
    sink = Postgres(PG_DSN, schema=schema)
    sink.start_run(run)
    for i in range(0, 60, 25):
        sink.write(records[i : i + 25])
    sink.end_run(replace(run, status=RunStatus.FINISHED, ended_at=run.started_at + 9))
    sink.close()
    rows = _rows(
        schema, "SELECT metric, step, epoch, batch, wall_time, value FROM metrics WHERE run_id = %s", (run.id,)
    )
    assert len(rows) == 120
    got = {(m, s): (e, b, w, v) for m, s, e, b, w, v in rows}
    for r in records:
        for m, v in r.values.items():
            e, b, w, stored = got[(m, r.step)]
            assert (e, b, w) == (r.epoch, r.batch, r.wall_time)
            assert stored is None if math.isnan(v) else stored == v
    assert _rows(schema, "SELECT status, ended_at FROM runs") == [("finished", run.started_at + 9)]


def test_replayed_blocks_and_duplicate_keys_store_once(schema: str) -> None:
    run = make_run()
    block = make_records(run.id, range(20), ["loss"], random.Random(21))
    sink = Postgres(PG_DSN, schema=schema)
    sink.write(block, make_events(run.id))
    sink.write(block, make_events(run.id))
    # The same key twice inside one block: the later value wins, as a row-by-row upsert would.
    sink.write([block[0], replace(block[0], values={"loss": -1.0})])
    sink.close()
    assert _rows(schema, "SELECT COUNT(*) FROM metrics")[0][0] == 20
    assert _rows(schema, "SELECT COUNT(*) FROM events")[0][0] == len(make_events(run.id))
    assert _rows(schema, "SELECT value FROM metrics WHERE step = 0")[0][0] == -1.0


def test_odd_metric_names_are_stored_verbatim(schema: str) -> None:
    run = make_run()
    records = make_records(run.id, range(4), list(ODD_NAMES), random.Random(22))
    sink = Postgres(PG_DSN, schema=schema)
    sink.write(records)
    sink.close()
    assert {r[0] for r in _rows(schema, "SELECT DISTINCT metric FROM metrics")} == set(ODD_NAMES)
    for name in ODD_NAMES:
        got = [r[0] for r in _rows(schema, "SELECT value FROM metrics WHERE metric = %s ORDER BY step", (name,))]
        assert got == [r.values[name] for r in records]


def test_unreachable_dsn_fails_at_start_naming_it_without_password() -> None:
    # Port 1 on loopback: nothing listens there.
    dsn = "postgresql://postgres:hunter2@127.0.0.1:1/test"
    with pytest.raises(SinkError) as info:
        Postgres(dsn, connect_timeout_s=2)
    msg = str(info.value)
    assert "hunter2" not in msg
    assert "postgresql://postgres:***@127.0.0.1:1/test" in msg
    assert "fix:" in msg
    assert isinstance(info.value, StoreError)


def test_bad_reconnect_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"reconnect_initial_s <= reconnect_max_s"):
        Postgres(PG_DSN, reconnect_initial_s=5, reconnect_max_s=1)


def _wait_until_refused(port: int) -> None:
    conn = None
    try:
        conn = psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/test", connect_timeout=2)
    except psycopg.Error:
        return
    finally:
        if conn is not None:
            conn.close()
    raise AssertionError("the proxy still accepts connections")


def test_server_going_away_and_coming_back_loses_nothing(schema: str, tmp_path: Path) -> None:
    """The server becomes unreachable (the proxied port refuses), then reachable again: every
    block written meanwhile ends up stored exactly once, in a consistent run."""
    proxy = TcpProxy("127.0.0.1", 5432)
    proxy.start()
    dsn = f"postgresql://postgres:secret-pw@127.0.0.1:{proxy.port}/test"
    inner = Postgres(dsn, schema=schema, connect_timeout_s=2, reconnect_initial_s=0.05, reconnect_max_s=0.2)
    sink = ResilientSink(inner, spool_path=tmp_path / "pg.spool.jsonl", retry_initial=0.05, retry_max=0.2)
    rng = random.Random(23)
    run = make_run()
    sink.start_run(run)
    blocks = [make_records(run.id, range(i, i + 10), ["loss", "acc"], rng) for i in range(0, 200, 10)]
    for block in blocks[:5]:
        sink.write(block)
    assert not sink.pending

    proxy.stop()
    _wait_until_refused(proxy.port)
    for block in blocks[5:12]:
        sink.write(block)
    assert sink.pending
    warnings = sink.take_events()
    assert warnings and all("secret-pw" not in w.message for w in warnings)

    proxy.start()
    for block in blocks[12:]:
        sink.write(block)
        time.sleep(0.03)  # let the backoff delay pass between blocks, as real flush intervals do
    sink.end_run(replace(run, status=RunStatus.FINISHED, ended_at=run.started_at + 5))
    sink.close()
    proxy.stop()

    assert not sink.pending
    steps = [r[0] for r in _rows(schema, "SELECT DISTINCT step FROM metrics ORDER BY step")]
    assert steps == list(range(200))
    assert _rows(schema, "SELECT COUNT(*) FROM metrics")[0][0] == 400
    assert _rows(schema, "SELECT status FROM runs") == [("finished",)]
    assert any("recovered" in e.message for e in sink.take_events())


def test_tables_live_in_the_requested_schema(schema: str) -> None:
    Postgres(PG_DSN, schema=schema).close()
    tables = {
        r[0]
        for r in _rows(schema, "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", (schema,))
    }
    assert {"runs", "metrics", "events", "schema_version"} <= tables


def test_sparse_records_are_metric_rows_and_their_names_are_noted(schema: str) -> None:
    rng = random.Random(72)
    run = make_run()
    steps = make_records(run.id, range(20), ["loss", "acc"], rng)
    evals = make_sparse(run.id, [9, 19], rng)
    late = make_sparse(run.id, [19], rng, names=("bleu",))
    again = replace(evals[0], wall_time=evals[0].wall_time + 2.0, values={"val_loss": 0.125})
    sink = Postgres(PG_DSN, schema=schema)
    sink.start_run(run)
    sink.write([*steps[:10], evals[0], *steps[10:]], make_skips(run.id, [2]))  # mixed in one block
    sink.write([evals[1], late[0]])  # sparse only, a name first seen now
    sink.write([evals[0], again])  # replayed, then logged again at step 9: one COPY block, last wins
    sink.close()
    rows = _rows(
        schema,
        "SELECT metric, step, epoch, batch, wall_time, value FROM metrics WHERE batch = -1 ORDER BY step, metric",
    )
    latest = {
        (m, r.step): (m, r.step, r.epoch, -1, r.wall_time, v)
        for r in [*evals, *late, again]
        for m, v in r.values.items()
    }
    assert rows == sorted(latest.values(), key=lambda x: (x[1], x[0]))
    assert ("val_loss", 9, 0, -1, again.wall_time, 0.125) in rows
    assert _rows(schema, "SELECT run_id, metric FROM sparse_metrics ORDER BY metric") == [
        (run.id, "bleu"), (run.id, "val_acc"), (run.id, "val_loss"),
    ]  # fmt: skip
    assert _rows(schema, "SELECT COUNT(*) FROM metrics WHERE batch >= 0") == [(40,)]
    assert _rows(schema, "SELECT metric_names FROM runs") == [('["loss", "acc"]',)]
    assert _rows(schema, "SELECT step, kind FROM events") == [(2, "skip")]
