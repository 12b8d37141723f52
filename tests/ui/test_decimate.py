"""Min/max decimation in the database (SQLite and PostgreSQL) and the lines the server keeps.

Every store is written by the real sinks; every expectation is computed here from the rows
written (a plain Python reference), not from the code under test.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")

from batchtap.records import Record, RunInfo, RunStatus  # noqa: E402
from batchtap.sinks.sqlite import SQLite  # noqa: E402
from batchtap.ui.data import ReadOnlyStore  # noqa: E402
from batchtap.ui.decimate import SQLITE_BUCKETS, LineCache  # noqa: E402
from tests.store._helpers import PG_DSN, pg_schema_fixture  # noqa: E402

RUN = "dec00001"
STEPS = 3000
WIDTH = 20  # buckets of ceil(3000 / 20) = 150 steps
GAP = range(1000, 1400)  # no rows: buckets [1050, 1199] and [1200, 1349] are empty
NAN = range(1500, 1701)  # bucket [1500, 1649] holds NaN only
SPIKES = {300: 1000.0, 749: 999.0, 2222: -1000.0}  # first step of a bucket, last step of one, a dip
HUGE = {2500: 1.0994021643521015e276, 2501: -2.5e200}  # SQLite's %!.17g text of these is inexact


def value_at(step: int) -> float:
    if step in SPIKES:
        return SPIKES[step]
    if step in HUGE:
        return HUGE[step]
    if step in NAN:
        return float("nan")
    return 1.0 + (step % 13) * 0.125


def steps_written() -> list[int]:
    return [s for s in range(STEPS) if s not in GAP]


def write_run(sink: Any, run_id: str = RUN, *, finish: bool = True, steps: list[int] | None = None) -> None:
    info = RunInfo(run_id, "decimate", {}, started_at=0.0, metrics=("loss",))
    sink.start_run(info)
    records = [
        Record(run_id, step=s, epoch=0, batch=s, rank=0, wall_time=10.0 + s, values={"loss": value_at(s)})
        for s in (steps_written() if steps is None else steps)
    ]
    for i in range(0, len(records), 1000):
        sink.write(records[i : i + 1000])
    if finish:
        sink.end_run(RunInfo(run_id, "decimate", {}, started_at=0.0, status=RunStatus.FINISHED, ended_at=5000.0))
    sink.close()


def reference(width: int = WIDTH, start: int = 0, end: int = STEPS - 1) -> dict[str, list[Any]]:
    """What a decimated line must be, computed from the rows written."""
    steps = [s for s in steps_written() if start <= s <= end]
    first, last = steps[0], steps[-1]
    bucket = math.ceil((last - first + 1) / width)
    out: dict[str, list[Any]] = {"step": [], "value": [], "lo": [], "hi": [], "mean": [], "wall": []}
    for b0 in range(first, last + 1, bucket):
        b1 = min(b0 + bucket - 1, last)
        inside = [s for s in steps if b0 <= s <= b1]
        values = [value_at(s) for s in inside if not math.isnan(value_at(s))]
        if not values:
            continue
        for step, value in ((b0, min(values)), (b1, max(values))):
            out["step"].append(step)
            out["value"].append(value)
            out["lo"].append(b0)
            out["hi"].append(b1)
            out["mean"].append(sum(values) / len(values))
            out["wall"].append(10.0 + inside[0])
    return out


def assert_matches_reference(got: dict[str, Any], want: dict[str, list[Any]]) -> None:
    assert got["mode"] == "minmax"
    for column in ("step", "lo", "hi", "value", "wall"):
        assert got[column] == want[column], column  # min and max exactly: nothing rounded away
    assert got["mean"] == pytest.approx(want["mean"], rel=1e-12)


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("decimate") / "decimate.db"
    write_run(SQLite(path))
    return path


@pytest.fixture
def ro(db: Path) -> Iterator[ReadOnlyStore]:
    store = ReadOnlyStore(db)
    yield store
    store.close()


def test_every_bucket_is_its_exact_min_and_max_with_spikes_at_bucket_edges(ro: ReadOnlyStore) -> None:
    got = ro.series(RUN, "loss", width=WIDTH)
    want = reference()
    assert_matches_reference(got, want)
    assert got["bucket"] == 150 and len(got["step"]) <= 2 * WIDTH
    for step, value in SPIKES.items():  # each one-step spike is a point of its bucket
        i = got["value"].index(value)
        assert got["lo"][i] <= step <= got["hi"][i]
    assert got["value"].count(HUGE[2500]) == 1 and got["value"].count(HUGE[2501]) == 1  # exact past 1e100


def test_buckets_tile_the_steps_without_overlap(ro: ReadOnlyStore) -> None:
    for width in (10, 17, 20, 33):
        got = ro.series(RUN, "loss", width=width)
        spans = sorted(set(zip(got["lo"], got["hi"])))
        assert len(spans) <= width
        assert all(hi - lo + 1 == got["bucket"] for lo, hi in spans[:-1])  # equal spans, the last one clipped
        assert all(a_hi < b_lo for (_, a_hi), (b_lo, _) in zip(spans, spans[1:]))
        assert spans[-1][1] == STEPS - 1 and spans[0][0] == 0
        assert_matches_reference(got, reference(width))


def test_gaps_and_nan_only_buckets_have_no_point(ro: ReadOnlyStore) -> None:
    got = ro.series(RUN, "loss", width=WIDTH)
    spans = set(zip(got["lo"], got["hi"]))
    assert (1050, 1199) not in spans and (1200, 1349) not in spans  # no rows at all
    assert (1500, 1649) not in spans  # NaN only: the anomaly markers show those steps
    assert (1650, 1799) in spans  # NaN then values: the values' min, max and mean
    i = got["lo"].index(1650)
    assert got["mean"][i] == pytest.approx(sum(value_at(s) for s in range(1701, 1800)) / 99)
    assert None not in got["value"]


def test_a_zoomed_window_is_decimated_within_itself_or_sent_raw(ro: ReadOnlyStore) -> None:
    got = ro.series(RUN, "loss", start=200, end=899, width=10)
    assert_matches_reference(got, reference(10, 200, 899))
    raw = ro.series(RUN, "loss", start=740, end=755, width=10)
    assert raw["mode"] == "raw" and raw["step"] == list(range(740, 756)) and raw["value"][9] == SPIKES[749]


def test_sqlite_decimation_reads_the_primary_key_once_without_sorting(ro: ReadOnlyStore) -> None:
    plan = ro._all("EXPLAIN QUERY PLAN " + SQLITE_BUCKETS, (0, 150, STEPS - 1, RUN, "loss", 0))
    details = [str(row[-1]) for row in plan]
    searches = [d for d in details if d.startswith("SEARCH metrics")]
    assert len(searches) == 2 and all(
        "USING PRIMARY KEY (run_id=? AND metric=? AND step>? AND step<?)" in d for d in searches
    )
    assert not any("TEMP B-TREE" in d for d in details), details
    assert not any(d.startswith("SCAN metrics") for d in details), details


def test_the_line_of_one_rank_ignores_the_other_ranks_rows(tmp_path: Path) -> None:
    sink = SQLite(tmp_path / "ranks.db")
    sink.start_run(RunInfo("rk", "ranks", {}, started_at=0.0, world_size=2))
    sink.write(
        [
            Record("rk", step=s, epoch=0, batch=s, rank=r, wall_time=float(s), values={"loss": float(s * 10 + r + 1)})
            for s in range(200)
            for r in (-1, 0, 1)
        ]
    )
    sink.close()
    store = ReadOnlyStore(tmp_path / "ranks.db")
    try:
        for rank in (-1, 0, 1):
            got = store.series("rk", "loss", rank=rank, width=10)
            assert got["mode"] == "minmax" and got["rank"] == rank
            assert got["value"][:2] == [float(rank + 1), float(19 * 10 + rank + 1)]
    finally:
        store.close()


def test_decimating_leaves_the_store_file_unchanged(db: Path) -> None:
    before = hashlib.sha256(db.read_bytes()).hexdigest(), db.stat().st_mtime_ns
    store = ReadOnlyStore(db)
    try:
        store.series(RUN, "loss", width=WIDTH)
        store.series(RUN, "loss", start=10, end=2000, width=WIDTH)
    finally:
        store.close()
    assert (hashlib.sha256(db.read_bytes()).hexdigest(), db.stat().st_mtime_ns) == before


# -- the lines kept in memory --------------------------------------------------------------------
def test_a_finished_runs_line_is_read_once_then_kept(ro: ReadOnlyStore) -> None:
    ro.lines.clear()
    first = ro.series(RUN, "loss", width=WIDTH)
    misses, hits = ro.lines.misses, ro.lines.hits
    again = ro.series(RUN, "loss", width=WIDTH)
    assert again == first and ro.lines.hits == hits + 1 and ro.lines.misses == misses


def test_a_running_runs_line_is_read_again_and_shows_new_steps(tmp_path: Path) -> None:
    path = tmp_path / "live.db"
    write_run(SQLite(path), "live0001", finish=False, steps=list(range(1000)))
    store = ReadOnlyStore(path)
    try:
        before = store.series("live0001", "loss", width=WIDTH)
        assert before["hi"][-1] == 999 and len(store.lines) == 0  # nothing kept while it runs
        sink = SQLite(path)
        sink.write([Record("live0001", step=1000, epoch=0, batch=1000, rank=0, wall_time=1.0, values={"loss": 5000.0})])
        sink.end_run(RunInfo("live0001", "decimate", {}, started_at=0.0, status=RunStatus.FINISHED, ended_at=9.0))
        sink.close()
        after = store.series("live0001", "loss", width=WIDTH)
        assert after["hi"][-1] == 1000 and max(after["value"]) == 5000.0
        assert len(store.lines) == 1  # finished now: kept
    finally:
        store.close()


def test_one_line_asked_for_at_once_is_computed_once() -> None:
    cache = LineCache(points=4, scans=2)
    calls: list[int] = []

    def slow() -> str:
        calls.append(1)
        time.sleep(0.2)
        return "line"

    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(cache.get("k", slow, keep=True))) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["line"] * 5 and len(calls) == 1
    for i in range(6):
        cache.get(i, lambda i=i: i, keep=True)
    assert len(cache) == 4  # the least recently used dropped
    assert cache.get(5, lambda: "again", keep=True) == 5  # still kept
    cache.get("big", lambda: {"step": [0, 1, 2]}, keep=True)  # 3 points: only one small line fits beside it
    assert len(cache) == 2 and cache.get(5, lambda: "read again", keep=True) == 5


def test_a_failed_read_is_not_kept_and_is_tried_again() -> None:
    cache = LineCache()

    def boom() -> str:
        raise RuntimeError("store went away")

    with pytest.raises(RuntimeError):
        cache.get("k", boom, keep=True)
    assert cache.get("k", lambda: "line", keep=True) == "line"


# -- PostgreSQL ------------------------------------------------------------------------------------
@pytest.fixture
def pg_schema() -> Iterator[str]:
    yield from pg_schema_fixture()


def test_postgresql_gives_the_same_points_as_sqlite(db: Path, pg_schema: str) -> None:
    from batchtap.sinks.postgres import Postgres

    write_run(Postgres(PG_DSN, schema=pg_schema))
    pg = ReadOnlyStore(PG_DSN, schema=pg_schema)
    lite = ReadOnlyStore(db)
    try:
        for kwargs in ({"width": WIDTH}, {"width": 33}, {"start": 200, "end": 899, "width": 10}):
            a, b = pg.series(RUN, "loss", **kwargs), lite.series(RUN, "loss", **kwargs)
            for column in ("mode", "bucket", "step", "lo", "hi", "value", "wall"):
                assert a[column] == b[column], (kwargs, column)
            assert a["mean"] == pytest.approx(b["mean"], rel=1e-12)
        assert_matches_reference(pg.series(RUN, "loss", width=WIDTH), reference())
    finally:
        pg.close()
        lite.close()


# -- edges where a wrong comparison would still pass the tests above --------------------------------
EDGE = "edge0001"
EDGE_STEPS = 1000
EDGE_SPIKE = {90: 77.0, 745: 5000.0}  # a bucket of one step at a window's end; a spike past a window
HUGE_DIP = {500: -1.0994021643521015e276}  # alone in its bucket: SQLite's %!.17g text of it is inexact


def edge_value(step: int) -> float:
    return HUGE_DIP.get(step, EDGE_SPIKE.get(step, 1.0 + (step % 7) * 0.125))


def write_edge_run(sink: Any) -> None:
    sink.start_run(RunInfo(EDGE, "edges", {}, started_at=0.0, metrics=("loss",)))
    sink.write(
        [
            Record(EDGE, step=s, epoch=0, batch=s, rank=0, wall_time=10.0 + s, values={"loss": edge_value(s)})
            for s in range(EDGE_STEPS)
        ]
    )
    sink.end_run(RunInfo(EDGE, "edges", {}, started_at=0.0, status=RunStatus.FINISHED, ended_at=2000.0))
    sink.close()


@pytest.fixture(scope="module")
def edge_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("edges") / "edges.db"
    write_edge_run(SQLite(path))
    return path


def assert_edges(store: ReadOnlyStore) -> None:
    """The three edges, on any store holding the edge run."""
    # Exactly two points per pixel is still sent raw; one more is decimated.
    raw = store.series(EDGE, "loss", start=100, end=119, width=10)
    assert raw["mode"] == "raw" and raw["step"] == list(range(100, 120))
    assert store.series(EDGE, "loss", start=100, end=120, width=10)["mode"] == "minmax"
    # A huge negative minimum, alone in its bucket, comes back exact (read again past 1e100).
    whole = store.series(EDGE, "loss", width=10)
    assert whole["bucket"] == 100
    i = whole["lo"].index(500)
    assert whole["value"][i] == HUGE_DIP[500] and whole["hi"][i] == 599
    # A window that is not a multiple of the bucket: its last bucket is clipped at the window's end,
    # so the spike at step 745, outside the window, is not drawn.
    clipped = store.series(EDGE, "loss", start=0, end=740, width=10)
    assert clipped["mode"] == "minmax" and clipped["bucket"] == 75
    assert clipped["hi"][-1] == 740 and max(clipped["step"]) == 740
    assert EDGE_SPIKE[745] not in clipped["value"]
    assert max(clipped["value"]) == max(edge_value(s) for s in range(741))
    # A last bucket that starts on the window's last step (91 steps in buckets of 10) is kept.
    single = store.series(EDGE, "loss", start=0, end=90, width=10)
    assert single["bucket"] == 10 and single["lo"][-1] == 90 and single["hi"][-1] == 90
    assert single["value"][-2:] == [EDGE_SPIKE[90], EDGE_SPIKE[90]]


def test_decimation_edges_on_sqlite(edge_db: Path) -> None:
    store = ReadOnlyStore(edge_db)
    try:
        assert_edges(store)
    finally:
        store.close()


def test_decimation_edges_on_postgresql(pg_schema: str) -> None:
    from batchtap.sinks.postgres import Postgres

    write_edge_run(Postgres(PG_DSN, schema=pg_schema))
    store = ReadOnlyStore(PG_DSN, schema=pg_schema)
    try:
        assert_edges(store)
    finally:
        store.close()
