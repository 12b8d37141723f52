"""Helpers shared by the storage tests: record factories, the PostgreSQL server, a TCP proxy."""

from __future__ import annotations

import os
import random
import socket
import threading
import uuid
from collections.abc import Iterator, Sequence

import pytest

from batchtap.records import Event, EventKind, Record, RunInfo
from batchtap.store.schema import MIGRATIONS, Dialect

PG_DSN = os.environ.get("BATCHTAP_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")

#: Names a user might give metrics; every storage backend must keep them exactly.
ODD_NAMES = (
    "loss/train",
    "with space",
    'it\'s "quoted"',
    "semi;colon -- DROP TABLE metrics",
    "unicodé ✓ λ 損失",
    "comma,separated",
    "new\nline",
    "percent %s %(x)s ?",
    "back\\slash\ttab",
)


def make_records(
    run_id: str,
    steps: Sequence[int] | range,
    metrics: Sequence[str],
    rng: random.Random,
    *,
    rank: int = 0,
    nan_every: int = 0,
    t0: float = 1_700_000_000.0,
) -> list[Record]:
    """Records with fresh random values (NaN at every ``nan_every``-th step when > 0)."""
    out = []
    for s in steps:
        values = {m: rng.uniform(-10, 10) for m in metrics}
        if nan_every and s % nan_every == 0:
            values[metrics[0]] = float("nan")
        out.append(
            Record(
                run_id,
                step=s,
                epoch=s // 100,
                batch=s % 100,
                rank=rank,
                wall_time=t0 + s * 0.01 + rng.random() * 1e-3,
                values=values,
            )
        )
    return out


def make_sparse(
    run_id: str,
    steps: Sequence[int],
    rng: random.Random,
    *,
    names: Sequence[str] = ("val_loss", "val_acc"),
    rank: int = 0,
    t0: float = 1_700_000_000.0,
) -> list[Record]:
    """Sparse records as ``Tap.log()`` makes them: only the names logged together, batch -1, a wall
    time just after the step they name."""
    return [
        Record(
            run_id,
            step=s,
            epoch=s // 100,
            batch=-1,
            rank=rank,
            wall_time=t0 + s * 0.01 + 0.005 + rng.random() * 1e-3,
            values={n: rng.uniform(0, 1) for n in names},
            sparse=True,
        )
        for s in steps
    ]


def make_skips(run_id: str, steps: Sequence[int], *, t0: float = 1_700_000_000.0) -> list[Event]:
    """SKIP events as the decoder reports an AMP GradScaler's skipped optimizer steps."""
    return [
        Event(
            run_id,
            s,
            EventKind.SKIP,
            f"step {s}: the AMP GradScaler skipped the optimizer step (inf/NaN gradients; the loss scale is "
            "lowered); gradient values of this step are left out",
            t0 + s * 0.01,
        )
        for s in steps
    ]


def make_run(run_id: str | None = None, name: str = "test-run", started_at: float = 1_700_000_000.0) -> RunInfo:
    return RunInfo(
        id=run_id or uuid.uuid4().hex,
        name=name,
        config={"lr": 0.1, "layers": [3, 4], "note": "ünïcode"},
        started_at=started_at,
        world_size=1,
        environment={
            "host": "box",
            "pid": 123,
            "python": "3.11.7",
            "torch": "2.13.0",
            "cuda": None,
            "git_commit": "abc123",
        },
        metrics=("loss", "acc"),
    )


def make_events(run_id: str) -> list[Event]:
    return [
        Event(run_id, 3, EventKind.ANOMALY, "acc 1.5 outside [0, 1]", 1_700_000_000.03, metric="acc", raw_value=1.5),
        Event(run_id, 4, EventKind.ANOMALY, "loss is NaN", 1_700_000_000.04, metric="loss", raw_value=float("nan")),
        Event(run_id, 5, EventKind.ANOMALY, "loss is inf", 1_700_000_000.05, metric="loss", raw_value=float("-inf")),
        Event(run_id, 6, EventKind.ACTION, "stop: loss diverged", 1_700_000_000.06),
    ]


def make_store_at_version(conn: object, dialect: Dialect, version: int) -> None:
    """Make the store a batchtap with schema ``version`` would have made: the released migrations
    up to it, verbatim, so a test can check that a newer batchtap opens and migrates it.
    ``conn`` is an autocommit sqlite3 or psycopg connection on an empty database or schema."""
    execute = conn.execute  # type: ignore[attr-defined]
    execute(
        dialect.ddl(
            "CREATE TABLE schema_version (version {INT} PRIMARY KEY, applied_at {REAL} NOT NULL, description {TEXT} NOT NULL)"
        )
    )
    for migration in MIGRATIONS:
        if migration.version > version:
            break
        for statement in migration.statements:
            execute(dialect.ddl(statement))
        execute(dialect.q("INSERT INTO schema_version VALUES (?, 0, ?)"), (migration.version, migration.description))


def same_float(a: float, b: float) -> bool:
    return (a != a and b != b) or a == b


def pg_available() -> bool:
    psycopg = pytest.importorskip("psycopg")
    try:
        psycopg.connect(PG_DSN, connect_timeout=2).close()
        return True
    except psycopg.Error:
        return False


def require_pg() -> None:
    """Skip when the test server is unreachable, except in CI (CI=true), where that is a failure."""
    if not pg_available():
        msg = f"PostgreSQL test server unreachable at {PG_DSN}"
        if os.environ.get("CI") == "true":
            pytest.fail(msg + " (CI=true: the server must be running)")
        pytest.skip(msg)


def pg_schema_fixture() -> Iterator[str]:
    """A fresh PostgreSQL schema name, dropped afterwards."""
    require_pg()
    import psycopg

    name = "bt_test_" + uuid.uuid4().hex[:12]
    yield name
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


class TcpProxy:
    """A loopback TCP forwarder that can be taken down and brought back on the same port,
    to make a real PostgreSQL server unreachable for one client and then reachable again."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(16)
        self._listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        """Refuse new connections and cut the open ones (the server 'goes away')."""
        if self._listener is not None:
            # shutdown wakes the thread blocked in accept(); close alone would leave it listening.
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
