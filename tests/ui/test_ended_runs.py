"""The browser view keeps the rows and summaries of runs that have ended (a listing of a large store
scans every value), reads a running run's new rows each time (tests/ui/test_running_runs.py), and
resolves ids without a scan."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")

from batchtap.records import Event, EventKind, Record, RunInfo, RunStatus  # noqa: E402
from batchtap.sinks.sqlite import SQLite  # noqa: E402
from batchtap.ui.data import ReadOnlyStore  # noqa: E402


def _write(sink: SQLite, run_id: str, steps: range, *, end: bool) -> None:
    info = RunInfo(run_id, run_id[:4], {}, started_at=100.0, metrics=("loss",))
    if steps.start == 0:
        sink.start_run(info)
    sink.write(
        [
            Record(run_id, step=s, epoch=0, batch=s, rank=0, wall_time=100.0 + s, values={"loss": 1.0 / (s + 1)})
            for s in steps
        ]
    )
    if end:
        sink.end_run(RunInfo(run_id, run_id[:4], {}, started_at=100.0, status=RunStatus.FINISHED, ended_at=200.0))


class _Counting:
    """Counts the reader's full run reads (the scans of a run's values)."""

    def __init__(self, store: ReadOnlyStore) -> None:
        self.reads: list[str] = []
        original = store.reader._one_run

        def one_run(run_id: str) -> Any:
            self.reads.append(run_id)
            return original(run_id)

        store.reader._one_run = one_run  # type: ignore[method-assign]


def test_an_ended_run_is_read_once_and_again_only_when_it_moves(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    sink = SQLite(db)
    _write(sink, "done0000aaaa", range(0, 50), end=True)
    _write(sink, "live0000bbbb", range(0, 20), end=False)
    store = ReadOnlyStore(db)
    counted = _Counting(store)
    try:
        first = {r["id"]: r for r in store.runs()}
        assert first["done0000aaaa"]["steps"] == 50 and first["live0000bbbb"]["steps"] == 20
        # the ended run read in full, the running one's figures built once (ui/running.py)
        assert counted.reads == ["done0000aaaa"] and store.running.builds == 1
        counted.reads.clear()

        _write(sink, "live0000bbbb", range(20, 30), end=False)
        again = {r["id"]: r for r in store.runs()}
        assert counted.reads == [] and store.running.builds == 1  # kept; the running one's new rows read
        assert again["live0000bbbb"]["steps"] == 30 and again["done0000aaaa"] == first["done0000aaaa"]
        assert again["live0000bbbb"]["last_value"] == pytest.approx(1 / 30)

        _write(sink, "live0000bbbb", range(30, 31), end=True)  # it ends: read once in full, then kept
        ended = {r["id"]: r for r in store.runs()}
        assert counted.reads == ["live0000bbbb"] and "live0000bbbb" not in store.running
        assert ended["live0000bbbb"]["steps"] == 31 and ended["live0000bbbb"]["status"] == "finished"
        counted.reads.clear()

        # an event stored after the end (a webhook failure at the run's end) moves its fingerprint
        sink.write([], [Event("done0000aaaa", 49, EventKind.WARNING, "late", 201.0)])
        counted.reads.clear()
        moved = {r["id"]: r for r in store.runs()}
        assert "done0000aaaa" in counted.reads and moved["done0000aaaa"]["events"] == {"warning": 1}

        # callers may change what they get: the kept summary stays as read
        store.run("done0000")["steps"] = -1  # type: ignore[index]
        assert {r["id"]: r for r in store.runs()}["done0000aaaa"]["steps"] == 50
    finally:
        store.close()
        sink.close()


@pytest.fixture
def one_ended_run(tmp_path: Path) -> Iterator[tuple[ReadOnlyStore, _Counting]]:
    """A store holding one ended 10-step run ``done0000aaaa``, opened by the UI, its scans counted."""
    db = tmp_path / "s.db"
    sink = SQLite(db)
    _write(sink, "done0000aaaa", range(0, 10), end=True)
    store = ReadOnlyStore(db)
    try:
        yield store, _Counting(store)
    finally:
        store.close()
        sink.close()


def test_the_live_runs_table_reads_an_ended_run_once(one_ended_run: tuple[ReadOnlyStore, _Counting]) -> None:
    store, counted = one_ended_run
    seen: dict[str, tuple[Any, ...]] = {}
    moved, _ = store.changes(seen)
    assert [store.summary(r)["steps"] for r in moved] == [10]
    store.runs()
    store.run("done0000")
    assert counted.reads == ["done0000aaaa"]


def test_a_short_id_or_name_resolves_without_reading_the_runs_values(
    one_ended_run: tuple[ReadOnlyStore, _Counting],
) -> None:
    store, counted = one_ended_run
    assert store.resolve("done0000") == "done0000aaaa"
    assert store.resolve("done") == "done0000aaaa"  # the run's name (its first four characters here)
    assert store.resolve("nope") is None
    assert counted.reads == []
