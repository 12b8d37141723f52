"""Two jobs (different runs, one writer each) write one PostgreSQL store at once: neither blocks
the other (each waits, mid-run, for the other's first half to be stored) and nothing is lost."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pipeline.test_distributed import ROOT
from tests.store._helpers import PG_DSN, pg_schema_fixture


@pytest.fixture
def pg_schema() -> Iterator[str]:
    yield from pg_schema_fixture()


def test_two_jobs_write_one_store_at_once_without_loss(tmp_path: Path, pg_schema: str) -> None:
    import psycopg

    flags = [tmp_path / "a.half", tmp_path / "b.half"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    jobs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.pipeline.pg_job_worker", PG_DSN, pg_schema, name, str(mine), str(other)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, mine, other in (("job-a", flags[0], flags[1]), ("job-b", flags[1], flags[0]))
    ]
    logs = [job.communicate(timeout=180)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], logs
    with psycopg.connect(PG_DSN) as conn:
        rows = conn.execute(
            f'SELECT r.name, r.status, count(m.step), min(m.step), max(m.step) FROM "{pg_schema}".runs r '
            f'JOIN "{pg_schema}".metrics m ON m.run_id = r.id GROUP BY r.name, r.status ORDER BY r.name'
        ).fetchall()
    assert rows == [("job-a", "finished", 60, 0, 59), ("job-b", "finished", 60, 0, 59)]


def test_many_writers_creating_one_new_schema_at_once_all_succeed(pg_schema: str) -> None:
    # CREATE SCHEMA IF NOT EXISTS is not atomic: two sessions racing can both see no schema, and
    # the loser gets a unique violation. Every writer must open the store anyway.
    import threading

    from batchtap.store.connect import connect_postgres

    for attempt in range(5):
        schema = f"{pg_schema}_{attempt}"
        barrier = threading.Barrier(6)
        errors: list[BaseException] = []

        def open_store() -> None:
            barrier.wait()
            try:
                connect_postgres(PG_DSN, schema=schema, create=True, purpose="the two-writer test").close()
            except BaseException as exc:  # noqa: BLE001 - inspected below
                errors.append(exc)

        threads = [threading.Thread(target=open_store) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        import psycopg

        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        assert errors == [], errors
