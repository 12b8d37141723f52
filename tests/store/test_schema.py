"""The shared schema: creation, version checks, migrations, foreign stores, URLs."""

from __future__ import annotations

import math
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import batchtap.store
from batchtap.errors import SinkError
from batchtap.sinks.sqlite import SQLite
from batchtap.store import SCHEMA_VERSION, StoreError, parse_url, redact_dsn
from batchtap.store.schema import MIGRATIONS, POSTGRES, SQLITE
from tests.store._helpers import PG_DSN, pg_schema_fixture


@pytest.fixture
def pg_schema() -> Iterator[str]:
    yield from pg_schema_fixture()


def _tables(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def test_new_sqlite_store_has_every_table_and_the_current_version(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "bt.db"
    SQLite(path).close()
    assert {"runs", "metrics", "events", "schema_version"} <= _tables(path)
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_opening_twice_applies_nothing_twice(tmp_path: Path) -> None:
    path = tmp_path / "bt.db"
    SQLite(path).close()
    SQLite(path).close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == len(MIGRATIONS)


def test_missing_migrations_are_applied_on_open(tmp_path: Path) -> None:
    # A store at version 0: the version table exists, no migration has run yet.
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.execute(
            SQLITE.ddl(
                "CREATE TABLE schema_version (version {INT} PRIMARY KEY, applied_at {REAL} NOT NULL, description {TEXT} NOT NULL)"
            )
        )
    SQLite(path).close()
    assert {"runs", "metrics", "events"} <= _tables(path)


def test_concurrent_creation_of_one_store_creates_it_once(tmp_path: Path) -> None:
    path = tmp_path / "race.db"
    errors: list[BaseException] = []

    def open_it() -> None:
        try:
            SQLite(path).close()
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == len(MIGRATIONS)


def _bump_version(path: Path, version: int) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO schema_version VALUES (?, 0, 'from the future')", (version,))


def test_newer_schema_version_is_refused_by_sink_and_reader(tmp_path: Path) -> None:
    path = tmp_path / "future.db"
    SQLite(path).close()
    _bump_version(path, SCHEMA_VERSION + 98)
    with pytest.raises(SinkError, match=rf"schema version {SCHEMA_VERSION + 98}.*newer batchtap.*upgrade"):
        SQLite(path)
    with pytest.raises(StoreError, match=r"schema version .*upgrade"):
        batchtap.store.open(path)


def test_sqlite_file_of_another_application_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE customers (id INTEGER)")
    with pytest.raises(StoreError, match=r"not a batchtap store.*customers"):
        SQLite(path)
    with pytest.raises(StoreError, match=r"not a batchtap store"):
        batchtap.store.open(path)
    assert _tables(path) == {"customers"}  # untouched


def test_a_file_that_is_not_a_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_bytes(b"these are not the bytes of a SQLite database\n" * 200)
    with pytest.raises(StoreError, match=r"notes\.db"):
        SQLite(path)
    with pytest.raises(StoreError, match=r"notes\.db"):
        batchtap.store.open(path)


def test_reader_never_creates_a_store(tmp_path: Path) -> None:
    path = tmp_path / "nothing.db"
    with pytest.raises(StoreError, match=r"does not exist"):
        batchtap.store.open(path)
    assert not path.exists()


def test_unwritable_path_fails_at_construction_naming_it(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(SinkError, match=r"a-file.*fix"):
        SQLite(blocker / "sub" / "bt.db")


def test_postgres_newer_schema_version_is_refused(pg_schema: str) -> None:
    from batchtap.sinks.postgres import Postgres

    Postgres(PG_DSN, schema=pg_schema).close()
    import psycopg

    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f'INSERT INTO "{pg_schema}".schema_version VALUES (%s, 0, %s)', (SCHEMA_VERSION + 1, "future"))
    with pytest.raises(SinkError, match=rf"schema version {SCHEMA_VERSION + 1}.*upgrade"):
        Postgres(PG_DSN, schema=pg_schema)
    with pytest.raises(StoreError, match=r"newer batchtap"):
        batchtap.store.open(PG_DSN, schema=pg_schema)


def test_postgres_schema_with_clashing_tables_is_refused(pg_schema: str) -> None:
    import psycopg

    from batchtap.sinks.postgres import Postgres

    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{pg_schema}"')
        conn.execute(f'CREATE TABLE "{pg_schema}".runs (x int)')
    with pytest.raises(StoreError, match=r"not a batchtap store.*runs"):
        Postgres(PG_DSN, schema=pg_schema)


def test_reader_does_not_create_a_postgres_store(pg_schema: str) -> None:
    with pytest.raises(StoreError, match=r"empty"):
        batchtap.store.open(PG_DSN, schema=pg_schema)


@pytest.mark.parametrize(
    ("url", "kind", "target"),
    [
        pytest.param("runs/bt.db", "sqlite", "runs/bt.db", id="plain-relative"),
        pytest.param("/abs/bt.db", "sqlite", "/abs/bt.db", id="plain-absolute"),
        pytest.param("sqlite:///runs/bt.db", "sqlite", "runs/bt.db", id="sqlite-url-relative"),
        pytest.param("sqlite:////abs/bt.db", "sqlite", "/abs/bt.db", id="sqlite-url-absolute"),
        pytest.param("postgresql://u:p@h/db", "postgresql", "postgresql://u:p@h/db", id="postgresql"),
        pytest.param("postgres://h/db", "postgresql", "postgres://h/db", id="postgres-alias"),
    ],
)
def test_parse_url(url: str, kind: str, target: str) -> None:
    loc = parse_url(url)
    assert (loc.kind, loc.target) == (kind, target)


def test_unknown_scheme_is_refused_without_showing_a_password() -> None:
    with pytest.raises(StoreError, match=r"unsupported store URL") as info:
        parse_url("mysql://root:hunter2@db/x")
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    ("dsn", "secret"),
    [
        pytest.param("postgresql://bob:hunter2@db:5432/x", "hunter2", id="url-userinfo"),
        pytest.param("postgresql://bob@db/x?password=hunter2&sslmode=off", "hunter2", id="url-query"),
        pytest.param("host=db user=bob password=hunter2 dbname=x", "hunter2", id="kv"),
        pytest.param("host=db password='hun ter2' dbname=x", "hun ter2", id="kv-quoted"),
    ],
)
def test_redact_dsn_hides_the_password(dsn: str, secret: str) -> None:
    shown = redact_dsn(dsn)
    assert secret not in shown
    assert "***" in shown and "db" in shown


def test_dialects_render_the_same_statement() -> None:
    sql = "SELECT value FROM metrics WHERE run_id = ? AND metric = ?"
    assert SQLITE.q(sql) == sql
    assert POSTGRES.q(sql) == "SELECT value FROM metrics WHERE run_id = %s AND metric = %s"


@pytest.mark.parametrize(
    "value",
    [0.1, -2.5e-300, 1e308, math.inf, -math.inf, 0.0, None],
    ids=["0.1", "tiny", "huge", "inf", "-inf", "zero", "none"],
)
def test_float_text_round_trips_exactly(value: float | None) -> None:
    from batchtap.store.schema import float_to_text, text_to_float

    assert text_to_float(float_to_text(value)) == value
    nan = text_to_float(float_to_text(math.nan))
    assert nan is not None and math.isnan(nan)


def test_dedupe_returns_the_rows_themselves_without_duplicates_and_the_last_row_per_key_with_them() -> None:
    from batchtap.store.schema import dedupe_metric_rows

    rows = [("r", "loss", s, 0, 0, s, 0.0, float(s)) for s in range(3)] + [("r", "acc", 0, 0, 0, 0, 0.0, 0.5)]
    assert dedupe_metric_rows(rows) is rows  # the common case costs no copy
    again = [*rows, ("r", "loss", 1, 0, 0, 1, 9.0, 7.0), ("r", "loss", 1, 1, 0, 1, 0.0, 8.0)]
    assert dedupe_metric_rows(again) == [rows[0], again[4], rows[2], rows[3], again[5]]
