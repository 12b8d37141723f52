"""Issue 15 §2: one unstorable value must not poison a run, the spool, or the next run."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

import batchtap as bt
from batchtap.errors import InputError
from batchtap.records import Event, Record, RunInfo, RunStart, Write
from batchtap.sinks.base import Sink
from batchtap.sinks.resilient import ResilientSink, SpoolEntry, encode_entry
from tests.conftest import ListSink
from tests.store._helpers import PG_DSN, make_records, make_run, pg_schema_fixture

psycopg = pytest.importorskip("psycopg")

NUL = "bad\x00name"


@pytest.fixture
def schema() -> Iterator[str]:
    yield from pg_schema_fixture()


def _pg(schema: str, sql: str, params: tuple[object, ...] = ()) -> list[tuple]:
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{schema}"')
        return conn.execute(sql, params).fetchall()


@pytest.mark.parametrize(
    "where",
    [
        pytest.param(lambda tap: tap.run(name=NUL).__enter__(), id="run-name"),
        pytest.param(lambda tap: tap.run(resume=NUL).__enter__(), id="resume-id"),
        pytest.param(lambda tap: (tap.start(), tap.step(loss=torch.tensor(1.0), extra={NUL: 1.0})), id="extra-name"),
        pytest.param(lambda tap: (tap.start(), tap.step(loss=torch.tensor(1.0)), tap.log({NUL: 1.0})), id="log-name"),
        pytest.param(
            lambda tap: (tap.start(), tap.step(loss=torch.tensor(1.0), extra={"lone\ud800": 1.0})), id="lone-surrogate"
        ),
    ],
)
def test_unstorable_names_are_refused_where_they_enter(where, tmp_path: Path) -> None:
    sink = ListSink()
    tap = bt.Tap(sinks=[sink], flush_every=2)
    with pytest.raises(InputError, match="cannot be stored") as err:
        where(tap)
    assert "fix:" in str(err.value)
    if tap.run_info is not None:
        tap.step(loss=torch.tensor(2.0))  # what was recorded before, and the run, go on
        tap.finish()
    tap.close()


def test_postgres_stores_the_rest_of_a_block_and_reports_the_refused_rows(schema: str) -> None:
    import random

    run = make_run()
    records = make_records(run.id, range(20), ["loss", NUL], random.Random(3))
    events = [Event(run.id, 5, bt.records.EventKind.WARNING, "message with a \x00 inside", 1.0)]
    sink = bt.sinks.Postgres(PG_DSN, schema=schema)
    sink.start_run(run)
    sink.write(records, events)  # must not raise: the connection is fine, a name is not
    reports = sink.take_events()
    sink.close()
    stored = _pg(
        schema, "SELECT step, value FROM metrics WHERE run_id = %s AND metric = 'loss' ORDER BY step", (run.id,)
    )
    assert [s for s, _ in stored] == list(range(20))
    assert [v for _, v in stored] == [r.values["loss"] for r in records]
    assert _pg(schema, "SELECT message FROM events") == [("message with a \\x00 inside",)]
    assert len(reports) == 1 and "refused 20 of" in reports[0].message and "bad\\x00name" in reports[0].message


def _spool_with(path: Path, entries: Sequence[SpoolEntry]) -> None:
    path.write_text("".join(encode_entry(entry) + "\n" for entry in entries), encoding="utf-8")


def test_a_poisoned_spool_left_behind_is_replayed_into_postgres_not_retried_forever(
    schema: str, tmp_path: Path
) -> None:
    import random

    spool = tmp_path / "pg.spool.jsonl"
    rng = random.Random(4)
    poisoned, clean = make_run(), make_run()
    _spool_with(
        spool,
        [
            RunStart(poisoned),
            Write(make_records(poisoned.id, range(10), ["loss", NUL], rng)),
            RunStart(clean),
            Write(make_records(clean.id, range(10), ["loss"], rng)),
        ],
    )
    sink = ResilientSink(bt.sinks.Postgres(PG_DSN, schema=schema), spool_path=spool, retry_initial=0.0)
    sink.flush()
    events = sink.take_events()
    sink.close()
    assert not sink.pending and not spool.exists()
    for run in (poisoned, clean):
        steps = _pg(schema, "SELECT step FROM metrics WHERE run_id = %s AND metric = 'loss'", (run.id,))
        assert sorted(s for (s,) in steps) == list(range(10))
    assert any("refused 10 of" in e.message for e in events), [e.message for e in events]


class _RefusesPoison(Sink):
    """A sink of one's own that refuses (ValueError) every block holding a NUL name, every time."""

    def __init__(self) -> None:
        self.got: list[Record] = []
        self.calls = 0

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        self.calls += 1
        if any("\x00" in name for r in records for name in r.values):
            raise ValueError("cannot hold NUL in a name")
        self.got.extend(records)

    def start_run(self, run: RunInfo) -> None:
        pass


def test_a_refused_spooled_block_is_quarantined_after_bounded_tries_and_the_rest_flows(tmp_path: Path) -> None:
    import random

    spool = tmp_path / "s.jsonl"
    rng = random.Random(5)
    bad, good = make_run(), make_run()
    bad_block = make_records(bad.id, range(5), ["loss", NUL], rng)
    good_block = make_records(good.id, range(5), ["loss"], rng)
    _spool_with(spool, [Write(bad_block), Write(good_block)])
    inner = _RefusesPoison()
    sink = ResilientSink(inner, spool_path=spool, retry_initial=0.0, retry_max=0.0)
    for _ in range(10):  # bounded: far fewer tries than this are needed
        if not sink.pending:
            break
        sink.flush()
    messages = [e.message for e in sink.take_events()]
    sink.write(make_records(good.id, range(5, 8), ["loss"], rng))  # a new block goes straight through
    sink.close()
    assert not sink.pending
    assert [r.step for r in inner.got] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert inner.calls <= 3 + 2
    quarantine = tmp_path / "s.jsonl.quarantine.jsonl"
    lines = quarantine.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1 and bad.id in lines[0]
    assert any("set aside" in m and str(quarantine) in m for m in messages), messages


def test_a_block_refused_live_is_set_aside_at_once_and_never_blocks_the_next(tmp_path: Path) -> None:
    import random

    rng = random.Random(6)
    inner = _RefusesPoison()
    sink = ResilientSink(inner, spool_path=tmp_path / "s.jsonl", retry_initial=0.0)
    run = make_run()
    sink.write(make_records(run.id, range(3), ["loss", NUL], rng))
    sink.write(make_records(run.id, range(3, 6), ["loss"], rng))
    assert not sink.pending
    assert [r.step for r in inner.got] == [3, 4, 5]
    assert (tmp_path / "s.jsonl.quarantine.jsonl").exists()
    sink.close()
