"""Issue 15 §4: no secret is written anywhere — not in the stored argv, config or environment,
not in what the CLI shows, not in error messages, whatever characters the password holds."""

from __future__ import annotations

import json
import sqlite3
import string
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchtap.errors import SinkError
from batchtap.store.url import redact_dsn
from tests.faults._procs import cli, python

SECRET = "Zq7sEcReT9"

TRAIN = """
import sys, torch, batchtap as bt
db = sys.argv[sys.argv.index("--store") + 1]
config = {"db_url": "postgresql://trainer:%(s)s@db.example:5432/runs", "api_key": "%(s)s-key",
          "nested": {"hf_token": "%(s)s-hf"}, "lr": 0.1}
with bt.Tap(sinks=[bt.sinks.SQLite(db)]) as tap, tap.run(name="secrets", config=config):
    for _ in range(3):
        tap.step(loss=torch.tensor(0.5))
""" % {"s": SECRET}


def test_secrets_on_the_command_line_and_in_the_config_are_never_stored_or_shown(tmp_path: Path) -> None:
    db = tmp_path / "bt.db"
    argv = [
        "--store",
        str(db),
        "--dsn",
        f"postgresql://bob:{SECRET}@db.example/x",
        "--password",
        f"{SECRET}-pw",
        f"--token={SECRET}-tok",
        f"db.password={SECRET}-hydra",
        f"host=db password={SECRET}-kv user=bob",
        "--lr",
        "0.1",
    ]
    done = python(TRAIN, argv)
    assert done.returncode == 0, done.stderr
    with sqlite3.connect(db) as conn:
        config, environment = conn.execute("SELECT config, environment FROM runs").fetchone()
    stored_argv = json.loads(environment)["argv"]
    assert stored_argv[-2:] == ["--lr", "0.1"] and "--password" in stored_argv  # kept, minus secrets
    assert SECRET not in config and SECRET not in environment
    assert json.loads(config)["lr"] == 0.1
    conn.close()
    # nowhere in the file, in any form (journal and WAL included)
    for f in tmp_path.iterdir():
        assert SECRET.encode() not in f.read_bytes(), f
    shown = cli("show", "secrets", "--db", str(db))
    assert shown.returncode == 0, shown.stderr
    assert SECRET not in shown.stdout + shown.stderr


PASSWORDS = [pytest.param(f"Pw{ch}{SECRET}{ch}x", id=f"char-{ord(ch)}") for ch in string.punctuation + " "]


def _forms(password: str) -> list[str]:
    quoted = urllib.parse.quote(password, safe="")
    kv = password.replace("\\", "\\\\").replace("'", "\\'")
    return [
        f"postgresql://bob:{password}@127.0.0.1:1/x",  # as typed, unencoded
        f"postgresql://bob:{quoted}@127.0.0.1:1/x?sslmode=disable",  # percent-encoded, as libpq wants
        f"postgresql:///x?host=/tmp&password={quoted}",
        f"host=127.0.0.1 port=1 user=bob password='{kv}' dbname=x",
    ]


@pytest.mark.parametrize("password", PASSWORDS)
def test_dsn_redaction_hides_a_password_with_any_special_character(password: str) -> None:
    for dsn in _forms(password):
        shown = redact_dsn(dsn)
        assert SECRET not in shown, (dsn, shown)
        assert "***" in shown, (dsn, shown)
        assert shown.startswith(dsn[:12]), (dsn, shown)  # the rest is kept: postgresql:/// stays


def test_dsn_redaction_keeps_the_socket_form_whole() -> None:
    assert redact_dsn("postgresql:///x?host=/var/run/postgresql") == "postgresql:///x?host=/var/run/postgresql"


@pytest.mark.parametrize(
    "password", [p for p in PASSWORDS if p.id in ("char-47", "char-35", "char-63", "char-64", "char-39")]
)
def test_connection_errors_never_show_the_password(password: object) -> None:
    pytest.importorskip("psycopg")
    from batchtap.sinks.postgres import Postgres

    assert isinstance(password, str)
    for dsn in _forms(password):
        with pytest.raises(SinkError) as err:
            Postgres(dsn, connect_timeout_s=1)  # nothing listens on port 1 / that socket
        assert SECRET not in str(err.value), str(err.value)


@pytest.mark.parametrize("ch", ["@", "/", "@@", " ", "[", "]", "%40"])
def test_a_password_is_never_read_as_part_of_the_host_name(ch: str) -> None:
    """libpq ends the user info at the first '@': an unencoded '@' in the password sent a piece of
    it to the name resolver as the host ("failed to resolve host 'cret@db'")."""
    psycopg = pytest.importorskip("psycopg")
    from batchtap.store.url import resolvable_dsn

    dsn = f"postgresql://bob:Pw{ch}{SECRET}@127.0.0.1:5432/x?sslmode=disable"
    parsed = psycopg.conninfo.conninfo_to_dict(resolvable_dsn(dsn))
    assert parsed["host"] == "127.0.0.1" and parsed["user"] == "bob" and parsed["dbname"] == "x"
    assert parsed["password"] == urllib.parse.unquote(f"Pw{ch}{SECRET}")


@pytest.fixture
def pg_schema() -> Iterator[str]:
    from tests.store._helpers import pg_schema_fixture

    yield from pg_schema_fixture()


def test_a_store_url_with_an_at_sign_in_its_password_reaches_the_real_server(pg_schema: str) -> None:
    pytest.importorskip("psycopg")
    from batchtap.sinks.postgres import Postgres
    from tests.store._helpers import PG_DSN

    parts = urllib.parse.urlsplit(PG_DSN)
    if parts.password or not parts.username:
        pytest.skip("the test server's DSN already carries a password")
    # the test server trusts loopback: the password is not checked, only where the host name comes from
    dsn = PG_DSN.replace(f"//{parts.username}@", f"//{parts.username}:s@{SECRET}@", 1)
    sink = Postgres(dsn, schema=pg_schema, connect_timeout_s=5)
    sink.close()
    assert SECRET not in sink.dsn
