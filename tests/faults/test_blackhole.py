"""Issue 15 §1: a PostgreSQL server that keeps the socket open but stops answering (a "black hole"
proxy of our own in front of the real server) must hang neither training nor the end of the run."""

from __future__ import annotations

import inspect
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import batchtap as bt
from tests.conftest import ListSink
from tests.faults._proxy import BlackHoleProxy
from tests.store._helpers import PG_DSN, pg_schema_fixture

psycopg = pytest.importorskip("psycopg")

STEPS = 300
HOLE_AT = 100
# Generous: a hang is what is tested, never a duration. The fixed code ends in seconds.
HANG = 240.0


@pytest.fixture
def schema() -> Iterator[str]:
    yield from pg_schema_fixture()


@pytest.fixture
def proxy() -> Iterator[BlackHoleProxy]:
    url = urllib.parse.urlsplit(PG_DSN)
    p = BlackHoleProxy(url.hostname or "127.0.0.1", url.port or 5432)
    yield p
    p.close()  # wakes anything still blocked on the hole


def _via(proxy: BlackHoleProxy) -> str:
    url = urllib.parse.urlsplit(PG_DSN)
    netloc = f"{url.username + '@' if url.username else ''}127.0.0.1:{proxy.port}"
    return urllib.parse.urlunsplit((url.scheme, netloc, url.path, url.query, ""))


def _kw(fn: Any, **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments ``fn`` accepts (so the test also runs, and hangs, on code without them)."""
    accepted = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in accepted}


def _train(tap: bt.Tap, proxy: BlackHoleProxy, box: dict[str, Any]) -> None:
    try:
        with tap, tap.run(name="blackhole") as info:
            box["run_id"] = info.id
            for i in range(STEPS):
                if i == HOLE_AT:
                    proxy.black_hole()
                tap.step(loss=torch.tensor(1.0 + i / STEPS))
                box["steps"] = i + 1
        box["returned"] = True
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        box["error"] = exc


def _run_in_thread(tap: bt.Tap, proxy: BlackHoleProxy) -> dict[str, Any]:
    box: dict[str, Any] = {"steps": 0}
    t = threading.Thread(target=_train, args=(tap, proxy, box), daemon=True)
    t.start()
    t.join(HANG)
    assert not t.is_alive(), f"training or leaving run() hung on the black hole (at step {box['steps']} of {STEPS})"
    assert "error" not in box, box["error"]
    assert box.get("returned")
    return box


def _stored_steps(schema: str, run_id: str) -> list[int]:
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{schema}"')
        rows = conn.execute("SELECT step FROM metrics WHERE run_id = %s AND metric = 'loss' ORDER BY step", (run_id,))
        return [int(r[0]) for r in rows]


def _status(schema: str, run_id: str) -> str | None:
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{schema}"')
        row = conn.execute("SELECT status FROM runs WHERE id = %s", (run_id,)).fetchone()
        return None if row is None else str(row[0])


def _postgres(dsn: str, schema: str) -> bt.sinks.Postgres:
    return bt.sinks.Postgres(dsn, schema=schema, connect_timeout_s=1, **_kw(bt.sinks.Postgres, timeout_s=1.0))


def test_black_hole_with_spool_hangs_nothing_and_loses_nothing(
    schema: str, proxy: BlackHoleProxy, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    tap = bt.Tap(
        sinks=[_postgres(_via(proxy), schema)],
        spool_dir=spool,
        queue_size=2,  # the setting that stopped the training thread
        flush_every=10,
        **_kw(bt.Tap, end_timeout=30.0),
    )
    box = _run_in_thread(tap, proxy)
    assert box["steps"] == STEPS
    run_id = box["run_id"]
    assert len(_stored_steps(schema, run_id)) < STEPS  # the hole really held blocks back
    assert any(spool.iterdir()), "the blocks the black hole swallowed were not spooled"
    # The server answers again (a new connection, not through the dead one): a new Tap on the same
    # spool replays what the hole held back.
    with bt.Tap(sinks=[_postgres(PG_DSN, schema)], spool_dir=spool):
        pass
    assert _stored_steps(schema, run_id) == list(range(STEPS))
    assert _status(schema, run_id) == "finished"


def test_black_hole_without_spool_counts_exactly_what_was_lost(schema: str, proxy: BlackHoleProxy) -> None:
    seen = ListSink()
    tap = bt.Tap(
        sinks=[_postgres(_via(proxy), schema), seen],
        queue_size=2,
        flush_every=10,
        **_kw(bt.Tap, end_timeout=30.0),
    )
    box = _run_in_thread(tap, proxy)
    assert box["steps"] == STEPS
    stored = _stored_steps(schema, box["run_id"])
    assert len(seen.records) == STEPS  # the healthy sink was never held up
    reports = [e.message for e in seen.events if "failed to store" in e.message]
    assert len(reports) == 1, [e.message for e in seen.events]
    lost = int(reports[0].split("failed to store ")[1].split()[0])
    # every step is stored or counted lost (a block whose commit went through just before the
    # hole opened, its answer swallowed, may be both)
    assert STEPS - len(stored) <= lost <= STEPS
    assert lost > 0
