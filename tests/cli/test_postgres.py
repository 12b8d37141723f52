"""`batchtap runs`, `show` and `tail` against the real PostgreSQL test server (a fresh schema each).

Skipped when the server is unreachable, except with CI=true, where that fails (see
tests/store/_helpers.py).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from tests.cli import _train
from tests.cli.conftest import cli, cli_env
from tests.cli.test_tail import follow_from_before_the_run
from tests.store._helpers import PG_DSN, pg_schema_fixture

pytest.importorskip("psycopg")


@pytest.fixture
def schema() -> Iterator[str]:
    yield from pg_schema_fixture()


def test_runs_and_show_read_a_postgresql_store(schema: str) -> None:
    run_id = _train.main(["--db", PG_DSN, "--schema", schema, "--name", "pg-run", "--epochs", "1", "--nan-at", "3"])
    done = cli("runs", "--db", PG_DSN, "--schema", schema)
    assert done.returncode == 0, done.stderr
    row = next(line.split() for line in done.stdout.splitlines() if line.startswith("pg-run"))
    assert row[1:3] == [run_id[:8], "finished"] and row[3] == "12" and row[-1] == "2"
    # the schema may also come from the environment
    shown = cli("show", run_id[:6], "--db", PG_DSN, env=cli_env(BATCHTAP_DB_SCHEMA=schema))
    assert shown.returncode == 0, shown.stderr
    assert f"(id {run_id})" in shown.stdout and "events: 2 anomalies" in shown.stdout


def test_tail_follows_a_run_written_to_postgresql(schema: str, procs: list[subprocess.Popen[str]]) -> None:
    # The writer creates the schema; tail, started first, waits until it and the run exist.
    follow_from_before_the_run(PG_DSN, procs, schema=schema)


def test_an_unreachable_server_exits_1_without_the_password() -> None:
    done = cli("runs", "--db", "postgresql://bob:s3cret@127.0.0.1:1/none")
    assert done.returncode == 1
    assert "cannot connect to PostgreSQL" in done.stderr and "s3cret" not in done.stderr


def test_logged_values_are_shown_and_exported_from_postgresql(schema: str) -> None:
    run_id = _train.main(["--db", PG_DSN, "--schema", schema, "--name", "pg-eval", "--epochs", "2", "--log-eval"])
    where = ("--db", PG_DSN, "--schema", schema)
    shown = cli("show", "pg-eval", *where)
    assert shown.returncode == 0, shown.stderr
    assert "steps        24 (steps 0..23)" in shown.stdout
    section = shown.stdout.split("\nlogged values (tap.log)\n")[1].split("\nevents:")[0].splitlines()
    assert [(r.split()[0], r.split()[1], r.split()[-1]) for r in section[1:]] == [
        ("test_acc", "23", "1"), ("val_acc", "23", "2"), ("val_loss", "23", "2"),
    ]  # fmt: skip
    done = cli("export", run_id, *where, "-f", "jsonl", "-m", "val_loss", "-m", "test_acc")
    rows = [json.loads(line) for line in done.stdout.splitlines() if '"record"' in line]
    assert [(r["step"], r["sparse"], sorted(set(r) & {"val_loss", "test_acc"})) for r in rows] == [
        (11, True, ["val_loss"]), (23, True, ["val_loss"]), (23, True, ["test_acc"]),
    ]  # fmt: skip
