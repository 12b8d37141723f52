"""``ResilientSink``: failures are spooled, retried with backoff and replayed in order, once."""

from __future__ import annotations

import json
import math
import random
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchtap.errors import ConfigError, SinkError
from batchtap.records import Event, EventKind, Record, RunEnd, RunInfo, RunStatus, Write
from batchtap.sinks.base import Sink
from batchtap.sinks.resilient import ResilientSink, decode_entry, encode_entry
from batchtap.sinks.sqlite import SQLite
from tests.store._helpers import make_events, make_records, make_run


class Switchable(Sink):
    """Delegates to a real sink, but raises while ``down`` is true (or until ``until`` on the clock)."""

    def __init__(self, inner: Sink, *, until: float | None = None) -> None:
        self.inner = inner
        self.down = False
        self.until = until
        self.attempts = 0

    def _check(self) -> None:
        self.attempts += 1
        if self.down or (self.until is not None and time.monotonic() < self.until):
            raise ConnectionError("store is away")

    def start_run(self, run: RunInfo) -> None:
        self._check()
        self.inner.start_run(run)

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        self._check()
        self.inner.write(records, events)

    def end_run(self, run: RunInfo) -> None:
        self._check()
        self.inner.end_run(run)

    def close(self) -> None:
        self.inner.close()


class Collect(Sink):
    def __init__(self) -> None:
        self.ops: list[tuple[str, object]] = []

    def start_run(self, run: RunInfo) -> None:
        self.ops.append(("start_run", run.id))

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        self.ops.append(("write", [r.step for r in records]))

    def end_run(self, run: RunInfo) -> None:
        self.ops.append(("end_run", run.status.value))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _steps(db: Path) -> list[int]:
    with sqlite3.connect(db) as conn:
        return [r[0] for r in conn.execute("SELECT step FROM metrics WHERE metric = 'loss' ORDER BY step")]


def test_a_sink_failing_for_3_seconds_loses_nothing(tmp_path: Path) -> None:
    db = tmp_path / "bt.db"
    flaky = Switchable(SQLite(db), until=time.monotonic() + 3.0)
    sink = ResilientSink(flaky, spool_path=tmp_path / "spool.jsonl", retry_initial=0.05, retry_max=0.5)
    rng = random.Random(50)
    run = make_run()
    sink.start_run(run)
    step = 0
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:  # blocks keep coming, as from a training run
        sink.write(make_records(run.id, range(step, step + 10), ["loss", "acc"], rng))
        step += 10
        time.sleep(0.02)
    sink.end_run(replace(run, status=RunStatus.FINISHED, ended_at=run.started_at + 4))
    sink.close()
    assert not sink.pending
    assert sink.spooled > 0 and sink.replayed >= sink.spooled  # it really was down
    assert _steps(db) == list(range(step))
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT COUNT(*) FROM metrics").fetchone()[0] == 2 * step
        assert conn.execute("SELECT status FROM runs").fetchall() == [("finished",)]
    kinds = {e.kind for e in sink.take_events()}
    assert kinds == {EventKind.WARNING}


def test_order_is_kept_while_down_and_after_recovery(tmp_path: Path) -> None:
    inner = Collect()
    flaky = Switchable(inner)
    clock = Clock()
    sink = ResilientSink(flaky, spool_path=tmp_path / "s.jsonl", retry_initial=1.0, retry_max=8.0, clock=clock)
    run = make_run("r1")
    sink.start_run(run)
    sink.write(make_records("r1", [0], ["loss"], random.Random(51)))
    flaky.down = True
    for s in range(1, 6):
        sink.write(make_records("r1", [s], ["loss"], random.Random(s)))
        clock.now += 0.3
    flaky.down = False
    clock.now += 10
    sink.write(make_records("r1", [6], ["loss"], random.Random(52)))
    sink.end_run(replace(run, status=RunStatus.FINISHED))
    assert inner.ops == [("start_run", "r1"), *[("write", [s]) for s in range(7)], ("end_run", "finished")]
    assert not sink.pending


def test_retries_back_off_exponentially_up_to_the_cap(tmp_path: Path) -> None:
    flaky = Switchable(Collect())
    flaky.down = True
    clock = Clock()
    sink = ResilientSink(flaky, spool_path=tmp_path / "s.jsonl", retry_initial=1.0, retry_max=4.0, clock=clock)
    attempts_at: list[float] = []
    start = clock.now
    for i in range(160):  # a block every 0.25 s (exact in binary) for 40 s
        clock.now = start + i * 0.25
        before = flaky.attempts
        sink.write(make_records("r", [0], ["loss"], random.Random(53)))
        if flaky.attempts > before:
            attempts_at.append(clock.now - start)
    gaps = [b - a for a, b in zip(attempts_at, attempts_at[1:])]
    assert gaps[:3] == [1.0, 2.0, 4.0]
    assert set(gaps[3:]) == {4.0}
    # While waiting, blocks are only spooled: the failing sink is not hammered.
    assert flaky.attempts == len(attempts_at)


def test_spool_left_at_close_is_replayed_by_the_next_sink(tmp_path: Path) -> None:
    db = tmp_path / "bt.db"
    spool = tmp_path / "s.jsonl"
    flaky = Switchable(SQLite(db))
    flaky.down = True
    sink = ResilientSink(flaky, spool_path=spool, retry_initial=0.01)
    run = make_run()
    records = make_records(run.id, range(30), ["loss"], random.Random(54), nan_every=5)
    sink.start_run(run)
    sink.write(records[:15], make_events(run.id))
    sink.write(records[15:])
    sink.end_run(replace(run, status=RunStatus.STOPPED, stop_reason="SIGTERM"))
    sink.close()
    assert spool.exists() and any("still failing at close" in e.message for e in sink.take_events())

    # Next start: a healthy sink on the same spool gets everything at construction.
    again = ResilientSink(SQLite(db), spool_path=spool)
    assert not spool.exists()
    again.close()
    import batchtap.store

    with batchtap.store.open(db) as st:
        r = st.run(run.id)
        assert (r.status, r.stop_reason, r.steps) == (RunStatus.STOPPED, "SIGTERM", 30)
        series = st.series(run.id, "loss")
        assert [p.step for p in series] == list(range(30))
        assert all(math.isnan(p.value) == math.isnan(rec.values["loss"]) for p, rec in zip(series, records))
        assert len(st.events(run.id)) == len(make_events(run.id))


def test_partial_replay_keeps_only_the_undelivered_tail(tmp_path: Path) -> None:
    spool = tmp_path / "s.jsonl"

    class FailsOnStep(Collect):
        def __init__(self, bad: int) -> None:
            super().__init__()
            self.bad = bad

        def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
            if records[0].step == self.bad:
                raise OSError("still broken")
            super().write(records, events)

    flaky = Switchable(Collect())
    flaky.down = True
    first = ResilientSink(flaky, spool_path=spool)
    for s in range(5):
        first.write(make_records("r", [s], ["loss"], random.Random(s)))
    first._spool.close()  # the process ends without close(): the spool stays as written
    second_inner = FailsOnStep(bad=3)
    second = ResilientSink(second_inner, spool_path=spool, retry_initial=0.0)
    assert second_inner.ops == [("write", [0]), ("write", [1]), ("write", [2])]
    assert len(spool.read_text().splitlines()) == 2
    second_inner.bad = -1
    second.flush()
    assert second_inner.ops == [("write", [s]) for s in range(5)]
    assert not spool.exists()


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path: Path) -> None:
    spool = tmp_path / "s.jsonl"
    good = encode_entry(Write(make_records("r", [0], ["loss"], random.Random(55))))
    torn = encode_entry(Write(make_records("r", [1], ["loss"], random.Random(56))))[:40]
    spool.write_text(good + "\n" + "{not json}\n" + torn)
    inner = Collect()
    sink = ResilientSink(inner, spool_path=spool)
    assert inner.ops == [("write", [0])]
    messages = [e.message for e in sink.take_events()]
    assert any("line 2 is damaged" in m for m in messages)
    assert any("line 3 is incomplete" in m for m in messages)
    assert not spool.exists()


def test_a_line_of_the_spool_format_before_the_codec_is_set_aside_and_the_rest_delivered(tmp_path: Path) -> None:
    spool = tmp_path / "s.jsonl"
    old = (
        '{"v":1,"op":"write","records":[{"run_id":"r","step":0,"epoch":0,"batch":0,"rank":0,"wall_time":1.0,'
        '"values":{"loss":0.5}}],"events":[]}'
    )
    new = encode_entry(Write(make_records("r", [1], ["loss"], random.Random(60))))
    spool.write_text(old + "\n" + new + "\n")
    inner = Collect()
    sink = ResilientSink(inner, spool_path=spool)
    assert inner.ops == [("write", [1])] and not spool.exists()
    quarantine = tmp_path / "s.jsonl.quarantine.jsonl"
    assert quarantine.read_text() == old + "\n" and sink.quarantined == 1  # kept, not dropped
    messages = [e.message for e in sink.take_events()]
    assert any("line 1 is not delivered" in m and "spool format 1 of an older batchtap" in m and str(quarantine) in m
               for m in messages), messages  # fmt: skip


def test_unwritable_spool_location_fails_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    flaky = Switchable(Collect())
    flaky.down = True
    with pytest.raises(SinkError, match=r"spool .*a-file.*fix"):
        ResilientSink(flaky, spool_path=blocker / "spool.jsonl")


def test_spool_that_becomes_unwritable_while_the_sink_fails_is_an_error(tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    flaky = Switchable(Collect())
    flaky.down = True
    sink = ResilientSink(flaky, spool_path=spool_dir / "spool.jsonl")
    spool_dir.rmdir()
    spool_dir.write_text("now a file")
    with pytest.raises(SinkError, match=r"spool .*cannot be written either.*fix"):
        sink.write(make_records("r", [0], ["loss"], random.Random(57)))


@pytest.mark.parametrize(
    ("initial", "maximum"),
    [
        pytest.param(-1.0, 5.0, id="negative"),
        pytest.param(2.0, 1.0, id="max-below-initial"),
        pytest.param(0.1, math.inf, id="infinite"),
    ],
)
def test_bad_retry_settings_are_refused(tmp_path: Path, initial: float, maximum: float) -> None:
    with pytest.raises(ConfigError, match=r"retry_initial"):
        ResilientSink(Collect(), spool_path=tmp_path / "s", retry_initial=initial, retry_max=maximum)


def test_warning_event_names_sink_error_and_spool(tmp_path: Path) -> None:
    flaky = Switchable(Collect())
    flaky.down = True
    sink = ResilientSink(flaky, spool_path=tmp_path / "s.jsonl", name="postgres")
    sink.write(make_records("run-7", [12], ["loss"], random.Random(58)))
    (event,) = sink.take_events()
    assert (event.run_id, event.step, event.kind) == ("run-7", 12, EventKind.WARNING)
    assert "postgres" in event.message and "store is away" in event.message and "s.jsonl" in event.message
    assert sink.take_events() == []


# -- exact round trip through the spool encoding ------------------------------------------------
_floats = st.floats(allow_nan=True, allow_infinity=True, width=64)
_names = st.text(min_size=1, max_size=12)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    values=st.dictionaries(_names, _floats, min_size=1, max_size=6),
    wall=st.floats(min_value=0, max_value=4e9),
    step=st.integers(min_value=0, max_value=2**40),
    raw=st.one_of(st.none(), _floats),
    message=st.text(max_size=30),
)
def test_spool_entries_round_trip_exactly(
    values: dict[str, float], wall: float, step: int, raw: float | None, message: str
) -> None:
    rec = Record("rün", step=step, epoch=1, batch=2, rank=-1, wall_time=wall, values=values)
    ev = Event("rün", step, EventKind.ANOMALY, message, wall, metric=next(iter(values)), raw_value=raw, rank=3)
    line = encode_entry(Write([rec], [ev]))
    json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    entry = decode_entry(line)
    assert isinstance(entry, Write)
    (back,) = entry.records
    assert (back.run_id, back.step, back.epoch, back.batch, back.rank, back.wall_time) == ("rün", step, 1, 2, -1, wall)
    assert list(back.values) == list(values)
    for k, v in values.items():
        got = back.values[k]
        assert (math.isnan(v) and math.isnan(got)) or (got == v and math.copysign(1, got) == math.copysign(1, v))
    (eb,) = entry.events
    assert (eb.message, eb.metric, eb.rank, eb.kind) == (message, ev.metric, 3, EventKind.ANOMALY)
    assert (
        (raw is None and eb.raw_value is None) or (math.isnan(raw) and math.isnan(eb.raw_value)) or eb.raw_value == raw
    )  # type: ignore[arg-type]


def test_run_info_round_trips() -> None:
    run = replace(make_run(), status=RunStatus.FAILED, ended_at=12.5, stop_reason="boom", world_size=4)
    assert decode_entry(encode_entry(RunEnd(run))) == RunEnd(run)


def test_a_logged_record_replays_as_a_logged_record(tmp_path: Path) -> None:
    """A ``Tap.log()`` record spooled while the sink was down reaches it with ``sparse=True`` (the
    SQL sinks note its names in ``sparse_metrics`` only then)."""
    db = tmp_path / "bt.db"
    inner = Switchable(SQLite(db))
    sink = ResilientSink(inner, spool_path=tmp_path / "spool.jsonl", retry_initial=0.0001)
    run = make_run()
    sink.start_run(run)
    inner.down = True
    step = Record(run.id, 4, 0, 4, 0, 1.0, {"loss": 0.5})
    logged = Record(run.id, 4, 0, -1, 0, 1.5, {"val_acc": 0.75}, sparse=True)
    sink.write([step, logged])
    assert sink.pending
    assert decode_entry(sink.spool_path.read_text().splitlines()[-1]) == Write([step, logged], [])
    inner.down = False
    sink.close()
    assert not sink.pending
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT metric FROM sparse_metrics").fetchall() == [("val_acc",)]


def test_a_spool_left_behind_and_still_undeliverable_is_retried_after_the_initial_delay(tmp_path: Path) -> None:
    # The replay at construction is the first attempt: when it fails, the next comes after
    # retry_initial (the backoff starts from the beginning), not after a doubled delay.
    spool = tmp_path / "s.jsonl"
    first = Switchable(Collect())
    first.down = True
    old = ResilientSink(first, spool_path=spool, retry_initial=1.0, clock=Clock())
    old.write(make_records("r", [0, 1], ["loss"], random.Random(55)))
    old.close()
    assert old.pending
    flaky = Switchable(Collect())
    flaky.down = True
    clock = Clock()
    start = clock.now
    sink = ResilientSink(flaky, spool_path=spool, retry_initial=1.0, retry_max=8.0, clock=clock)
    assert flaky.attempts == 1 and sink.pending  # tried at once, still down
    attempts_at = []
    for i in range(1, 33):  # a block every 0.25 s for 8 s
        clock.now = start + i * 0.25
        before = flaky.attempts
        sink.write(make_records("r", [i + 1], ["loss"], random.Random(i)))
        if flaky.attempts > before:
            attempts_at.append(clock.now - start)
    assert attempts_at[:3] == [1.0, 3.0, 7.0]  # gaps 1, 2, 4 from the attempt at construction


def test_the_recovery_event_counts_the_blocks_replayed(tmp_path: Path) -> None:
    inner = Collect()
    flaky = Switchable(inner)
    clock = Clock()
    sink = ResilientSink(flaky, spool_path=tmp_path / "s.jsonl", retry_initial=1.0, clock=clock)
    flaky.down = True
    for s in range(3):
        sink.write(make_records("r", [s], ["loss"], random.Random(s)))  # the first fails, all are spooled
    assert sink.spooled == 3 and sink.pending
    flaky.down = False
    clock.now += 5.0
    sink.flush()  # the retry is due: the spool is replayed
    assert not sink.pending and sink.replayed == 3
    assert inner.ops == [("write", [0]), ("write", [1]), ("write", [2])]
    messages = [e.message for e in sink.take_events()]
    assert any("recovered (on flush)" in m and "replayed 3 spooled blocks" in m for m in messages), messages


def test_a_spool_travels_to_another_process_without_its_open_handle_and_appends_there(tmp_path: Path) -> None:
    """A ResilientSink (its spool with it) is pickled into the pipeline process while spooling: the
    copy leaves the open append handle behind, opens its own, and both lines end up in the file."""
    import pickle

    from batchtap.sinks.spool import Spool

    spool = Spool(tmp_path / "s.jsonl", "sqlite")
    first, second = (Write(make_records("r", [s], ["loss"], random.Random(s)), []) for s in (0, 1))
    spool.append(first)  # opens the handle
    copy = pickle.loads(pickle.dumps(spool))
    copy.append(second)
    copy.close()
    spool.close()
    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    assert [decode_entry(line) for line in lines] == [first, second]
    assert copy.pending and [entry for _, _, entry in copy.read(lambda message: None)] == [first, second]
