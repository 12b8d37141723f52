"""``tap.run(resume=<short id>)``: the 8-character id ``batchtap runs`` prints (any unique id prefix)
continues that run; an ambiguous prefix is an error naming the runs it matches; an unknown one says
no sink holds it. Real SQLite and PostgreSQL stores, read back."""

from __future__ import annotations

import collections
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import batchtap as bt
import batchtap.store

PG = "postgresql://postgres@127.0.0.1:5432/test"


def _pg_schema() -> Iterator[str]:
    psycopg = pytest.importorskip("psycopg")
    schema = f"bt_resume_{uuid.uuid4().hex[:8]}"
    try:
        with psycopg.connect(PG, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE SCHEMA "{schema}"')
    except psycopg.OperationalError as exc:
        if os.environ.get("CI") == "true":  # in CI a skip would look like a pass
            raise
        pytest.skip(f"no PostgreSQL at {PG}: {exc}")
    yield schema
    with psycopg.connect(PG, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.fixture(params=["sqlite", "postgres"])
def store_sink(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[object, str, str | None]]:
    """A fresh store: (sink factory, where to read it, schema)."""
    if request.param == "sqlite":
        db = str(tmp_path / "runs.db")
        yield (lambda: bt.sinks.SQLite(db)), db, None
    else:
        for schema in _pg_schema():
            yield (lambda: bt.sinks.Postgres(PG, schema=schema)), PG, schema


def _steps(tap: bt.Tap, n: int) -> None:
    for i in range(n):
        tap.step(loss=torch.tensor(float(i)))


def test_a_short_id_resumes_that_run(store_sink: tuple) -> None:
    make, where, schema = store_sink
    with bt.Tap(None, [make()]) as tap:
        with tap.run(name="first") as first:
            _steps(tap, 5)
        with tap.run(name="other"):
            _steps(tap, 2)
        with tap.run(resume=first.id[:8]) as resumed:  # what `batchtap runs` shows
            _steps(tap, 3)
    assert resumed.id == first.id and resumed.name == "first"
    with batchtap.store.open(where, schema=schema) as store:
        assert len(store.runs()) == 2  # continued, not a third run
        assert [p.step for p in store.series(first.id, "loss")] == list(range(8))


def test_an_ambiguous_prefix_names_its_runs_and_an_unknown_one_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    ids: list[str] = []
    with bt.Tap(None, [bt.sinks.SQLite(db)]) as tap:
        for i in range(17):  # 17 ids over 16 hex digits: two share their first character
            with tap.run(name=f"r{i}") as info:
                _steps(tap, 1)
            ids.append(info.id)
        first = collections.Counter(i[0] for i in ids).most_common(1)[0][0]
        sharing = sorted(i for i in ids if i[0] == first)
        with pytest.raises(bt.ConfigError, match="matches") as caught:
            with tap.run(resume=first):
                pass
        message = str(caught.value)
        assert all(run_id in message for run_id in sharing), message
        assert "more characters" in message
        unknown = "zz"  # never a hex id's prefix
        with pytest.raises(bt.ConfigError, match=f"cannot resume run '{unknown}'"):
            with tap.run(resume=unknown):
                pass
    with batchtap.store.open(db) as store:
        assert len(store.runs()) == 17  # neither error made a run
