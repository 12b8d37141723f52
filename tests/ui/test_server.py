"""The UI's server without a browser: read-only store access, decimation, the API, tokens, streams.

Stores are made by real training runs (tests/cli/_train.py) or written by the SQLite/PostgreSQL
sinks; the server is the real one (uvicorn in a thread, or ``batchtap ui`` as a process).
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("bokeh")

import batchtap.store  # noqa: E402
import batchtap.ui  # noqa: E402
from batchtap.records import Event, EventKind, Record, RunInfo, RunStatus  # noqa: E402
from batchtap.sinks.sqlite import SQLite  # noqa: E402
from batchtap.store import StoreError  # noqa: E402
from batchtap.store.schema import SQLITE  # noqa: E402
from batchtap.ui.data import ReadOnlyStore, SeriesKey, clean  # noqa: E402
from batchtap.ui.decimate import POSTGRES_BUCKETS  # noqa: E402
from tests.cli.conftest import cli_env  # noqa: E402
from tests.store._helpers import PG_DSN, make_store_at_version, pg_schema_fixture  # noqa: E402
from tests.ui.conftest import HOSTILE, Runs  # noqa: E402

SPIKE_AT = 12_345


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
            return (
                r.status,
                json.loads(body) if r.headers.get_content_type() == "application/json" else body,
                dict(r.headers),
            )
    except urllib.error.HTTPError as exc:
        body = exc.read()
        return (
            exc.code,
            json.loads(body) if exc.headers.get_content_type() == "application/json" else body,
            dict(exc.headers),
        )


def write_long_run(sink: Any, run_id: str = "long0001", steps: int = 20_000) -> None:
    """A run of ``steps`` steps with one spike and one NaN, through a real sink."""
    sink.start_run(RunInfo(run_id, "long", {"lr": 0.01}, started_at=1000.0, metrics=("loss",)))
    records = [
        Record(
            run_id,
            step=s,
            epoch=0,
            batch=s,
            rank=0,
            wall_time=1000.0 + s,
            values={"loss": 100.0 if s == SPIKE_AT else (float("nan") if s == 500 else 1.0 + (s % 7) * 0.01)},
        )
        for s in range(steps)
    ]
    for i in range(0, steps, 5000):
        sink.write(records[i : i + 5000])
    sink.write([], [Event(run_id, 500, EventKind.ANOMALY, "loss=nan at step 500", 1500.0, "loss", float("nan"))])
    sink.end_run(
        RunInfo(run_id, "long", {"lr": 0.01}, started_at=1000.0, status=RunStatus.FINISHED, ended_at=1000.0 + steps)
    )
    sink.close()


@pytest.fixture(scope="module")
def long_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("long") / "long.db"
    write_long_run(SQLite(db))
    return db


@pytest.fixture
def pg_schema() -> Iterator[str]:
    yield from pg_schema_fixture()


# -- reading ------------------------------------------------------------------------------------
def test_runs_match_the_store(runs: Runs) -> None:
    ro = ReadOnlyStore(runs.db)
    try:
        listed = {r["id"]: r for r in ro.runs()}
        with batchtap.store.open(runs.db) as st:
            for run in st.runs():
                got = listed[run.id]
                assert (got["name"], got["status"], got["steps"], got["config"]) == (
                    run.name,
                    run.status.value,
                    run.steps,
                    run.config,
                )
                assert got["anomalies"] == sum(e.kind is EventKind.ANOMALY for e in st.events(run.id))
                assert got["last_value"] == clean(st.series(run.id, "loss")[-1].value)
        assert listed[runs.stopped]["status"] == "stopped" and listed[runs.hostile]["name"] == HOSTILE
        assert listed[runs.anomalies]["anomalies"] >= 1
    finally:
        ro.close()


def test_the_store_is_opened_read_only(runs: Runs) -> None:
    ro = ReadOnlyStore(runs.db)
    try:
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            ro._all("DELETE FROM runs")
    finally:
        ro.close()


def test_decimation_keeps_a_one_step_spike_and_gives_detail_when_zoomed(long_db: Path) -> None:
    ro = ReadOnlyStore(long_db)
    try:
        whole = ro.series("long0001", "loss", width=500)
        assert whole["mode"] == "minmax" and len(whole["step"]) <= 2 * 500
        assert max(v for v in whole["value"] if v is not None) == 100.0  # never averaged away
        spike_point = whole["value"].index(100.0)
        assert whole["lo"][spike_point] <= SPIKE_AT <= whole["hi"][spike_point]
        zoomed = ro.series("long0001", "loss", start=SPIKE_AT - 100, end=SPIKE_AT + 100, width=500)
        assert zoomed["mode"] == "raw" and zoomed["step"] == list(range(SPIKE_AT - 100, SPIKE_AT + 101))
        assert zoomed["value"][100] == 100.0
        nan = ro.series("long0001", "loss", start=490, end=510, width=500)
        assert nan["value"][10] is None  # NaN travels as null (JSON has no NaN)
    finally:
        ro.close()


def test_sqlite_bucket_ranges_agree_with_one_group_by(long_db: Path) -> None:
    """The SQLite path (a correlated key-range aggregate per bucket) against PostgreSQL's GROUP BY
    statement run on the same SQLite store."""
    ro = ReadOnlyStore(long_db)
    try:
        key = SeriesKey("long0001", "loss", 0)
        grouped = ro._all(POSTGRES_BUCKETS, (0, 47, 47.0, "long0001", "loss", 0, 0, 19_999))
        ranged = ro.buckets(key, 0, 19_999, 47)
        want = [(int(b) * 47, lo, hi, wall) for b, lo, hi, _, _, wall in grouped if lo is not None]
        assert [(b0, lo, hi, wall) for b0, lo, hi, _, wall in ranged] == want
        means = [part * 47 / count for _, lo, _, part, count, _ in grouped if lo is not None]
        assert [mean for _, _, _, mean, _ in ranged] == pytest.approx(means, rel=1e-12)
    finally:
        ro.close()


def test_postgresql_store_reads_as_sqlite_does(long_db: Path, pg_schema: str) -> None:
    from batchtap.sinks.postgres import Postgres

    write_long_run(Postgres(PG_DSN, schema=pg_schema))
    pg = ReadOnlyStore(PG_DSN, schema=pg_schema)
    lite = ReadOnlyStore(long_db)
    try:
        for kwargs in ({"width": 300}, {"start": 100, "end": 400, "width": 300}):
            a, b = pg.series("long0001", "loss", **kwargs), lite.series("long0001", "loss", **kwargs)
            assert a["mode"] == b["mode"] and a["step"] == b["step"]
            assert a["value"] == pytest.approx(b["value"])
        assert [r["steps"] for r in pg.runs()] == [r["steps"] for r in lite.runs()]
        assert pg.events("long0001") == lite.events("long0001")
        with pytest.raises(Exception, match="read-only"):
            pg._all("DELETE FROM runs")
    finally:
        pg.close()
        lite.close()


def test_an_older_store_is_refused_not_migrated(tmp_path: Path) -> None:
    db = tmp_path / "v1.db"
    conn = sqlite3.connect(db, isolation_level=None)
    make_store_at_version(conn, SQLITE, 1)
    conn.close()
    before = db.read_bytes()
    with pytest.raises(StoreError, match=r"schema version 1.*does not migrate.*batchtap runs"):
        ReadOnlyStore(db)
    assert db.read_bytes() == before


def test_a_missing_store_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no batchtap store.*fix"):
        ReadOnlyStore(tmp_path / "nope.db")
    assert not (tmp_path / "nope.db").exists()


# -- the API ------------------------------------------------------------------------------------
def test_api_refuses_bad_parameters_and_unknown_runs(server: Any, runs: Runs) -> None:
    status, body, _ = get(f"{server.base}/api/runs/{runs.anomalies}/series?metric=loss&start=1;DROP%20TABLE%20runs")
    assert status == 400 and "'start' must be an integer" in body["error"]
    status, body, _ = get(f"{server.base}/api/runs/{runs.anomalies}/series")
    assert status == 400 and "metric" in body["error"]
    status, body, _ = get(f"{server.base}/api/runs/nope")
    assert status == 404 and "no run" in body["error"]
    # a name full of SQL is only ever a parameter
    status, body, _ = get(f"{server.base}/api/runs/{runs.anomalies}/series?metric=loss'%20OR%201=1--")
    assert status == 200 and body["step"] == []


def test_page_carries_a_content_security_policy(server: Any) -> None:
    status, _, headers = get(server.base + "/")
    csp = {k.lower(): v for k, v in headers.items()}["content-security-policy"]
    assert status == 200 and "script-src 'self'" in csp and "connect-src 'self'" in csp


def test_bokehjs_is_served_from_the_installed_package(server: Any) -> None:
    import bokeh

    status, body, _ = get(server.base + "/bokeh/js/bokeh.min.js")
    shipped = Path(bokeh.__file__).parent / "server" / "static" / "js" / "bokeh.min.js"
    assert status == 200 and body == shipped.read_bytes()


def test_token_is_required_on_every_request(runs: Runs) -> None:
    with batchtap.ui.start(runs.db, token="s3cret-token") as srv:
        for path in ("/", "/api/runs", f"/api/runs/{runs.anomalies}/live", "/static/app.js", "/bokeh/js/bokeh.min.js"):
            assert get(srv.base + path)[0] == 401, path
            assert get(srv.base + path + ("&" if "?" in path else "?") + "token=wrong")[0] == 401, path
        status, body, headers = get(srv.base + "/api/runs?token=s3cret-token")
        assert status == 200 and len(body["runs"]) == 3
        cookie = headers["set-cookie"].split(";")[0]
        assert "HttpOnly" in headers["set-cookie"] and "SameSite=Strict" in headers["set-cookie"]
        assert get(srv.base + "/api/runs", {"Cookie": cookie})[0] == 200
        assert get(srv.base + "/api/runs", {"Authorization": "Bearer s3cret-token"})[0] == 200


def test_without_a_token_only_loopback_host_names_are_answered(server: Any) -> None:
    assert get(server.base + "/api/runs")[0] == 200
    assert get(server.base + "/api/runs", {"Host": "evil.example:8080"})[0] == 403  # DNS rebinding


def test_live_stream_sends_the_rest_and_ends_for_a_finished_run(server: Any, runs: Runs) -> None:
    with urllib.request.urlopen(f"{server.base}/api/runs/{runs.anomalies}/live?after=30", timeout=30) as r:
        text = r.read().decode()
    events = [block for block in text.split("\n\n") if block.startswith("event:")]
    update = json.loads(events[0].split("data: ", 1)[1])
    assert update["status"] == "finished" and update["lines"]["loss"]["step"] == [31, 32, 33, 34, 35]
    assert events[-1].startswith("event: end")


def test_cli_serves_the_store_and_stops_at_once_with_a_page_streaming(tmp_path: Path) -> None:
    """`batchtap ui --db` as a process, a live stream held open on a running run, then SIGINT:
    the server exits without waiting for the stream."""
    db = tmp_path / "bt.db"
    sink = SQLite(db)
    sink.start_run(RunInfo("run00001", "open", {}, started_at=1.0))
    sink.write([Record("run00001", step=0, epoch=0, batch=0, rank=0, wall_time=1.0, values={"loss": 1.0})])
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchtap.cli.main", "ui", "--db", str(db), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "(read-only) at http://127.0.0.1:" in line, line + proc.stderr.read() if proc.stderr else ""
        base = line.split(" at ", 1)[1].strip().rstrip("/")
        stream = urllib.request.urlopen(f"{base}/api/runs/run00001/live?after=-1", timeout=30)
        assert stream.readline().startswith(b"retry:")
        proc.send_signal(2)
        assert proc.wait(timeout=20) in (0, 130)  # 130: ended by SIGINT, as Ctrl-C ends any command
    finally:
        proc.kill() if proc.poll() is None else None
        sink.close()


def test_cli_reports_a_bad_store_as_a_user_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "batchtap.cli.main", "ui", "--db", str(tmp_path / "missing.db"), "--port", "0"],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=60,
        check=False,
    )
    assert done.returncode == 1 and "no batchtap store" in done.stderr


def test_non_loopback_host_generates_and_prints_a_token(runs: Runs) -> None:
    with batchtap.ui.start(runs.db, host="0.0.0.0") as srv:
        assert srv.token and srv.url.endswith(f"?token={srv.token}")
        local = srv.base.replace("0.0.0.0", "127.0.0.1")
        assert get(local + "/api/runs")[0] == 401
        assert get(local + f"/api/runs?token={srv.token}")[0] == 200


def test_rank_spread_names_the_slowest_rank_per_step(tmp_path: Path) -> None:
    """Rows as a 2-rank run with per_rank_rows stores them: reduced (-1) and each rank's own."""
    sink = SQLite(tmp_path / "ranks.db")
    sink.start_run(RunInfo("rk000001", "ranks", {}, started_at=0.0, world_size=2))
    times = {0: [0.10, 0.10, 0.10, 0.40], 1: [0.20, 0.30, 0.10, 0.10]}
    records = [
        Record("rk000001", step=s, epoch=0, batch=s, rank=r, wall_time=float(s), values={"step_time": times[r][s]})
        for s in range(4)
        for r in (0, 1)
    ] + [
        Record(
            "rk000001",
            step=s,
            epoch=0,
            batch=s,
            rank=-1,
            wall_time=float(s),
            values={"step_time": max(times[0][s], times[1][s])},
        )
        for s in range(4)
    ]
    sink.write(records)
    sink.close()
    ro = ReadOnlyStore(tmp_path / "ranks.db")
    try:
        run = ro.run("rk000001")
        assert run is not None and run["ranks"]["step_time"] == [-1, 0, 1]
        assert ro.series("rk000001", "step_time")["rank"] == -1  # the reduced line is the one shown
        spread = ro.rank_spread("rk000001", "step_time")
        assert spread["slowest"] == [1, 1, 0, 0] and spread["ranks"] == [0, 1]
        assert spread["spread"] == pytest.approx([0.1, 0.2, 0.0, 0.3])
    finally:
        ro.close()


# -- one reader: the UI and the CLI agree ---------------------------------------------------------
ROLLBACK_MESSAGE = (
    "rollback 1: divergence at step 8 (loss spike); restored the snapshot of step 4 at step 9, "
    "undone steps 5..8, lr x0.5, skipping the next 0 batches"
)


def _dead_pid() -> int:
    """The pid of a process that has ended and been reaped (what a process-group kill leaves)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def write_mixed_store(db: Path) -> dict[str, str]:
    """Runs of every kind through the real SQLite sink: finished, rolled back (its abandoned
    trajectory reached loss 0.0), killed (running, its process gone), running (this process),
    failed with only NaN losses. Returns name -> id."""
    import socket

    from batchtap._stale import process_started

    sink = SQLite(db)
    ids = {"fin": "f1" * 16, "rolled": "r0" * 16, "killed": "k1" * 16, "live": "11" * 16, "nans": "a0" * 16}
    here = {"host": socket.gethostname()}
    envs = {
        "fin": {},
        "rolled": {},
        "killed": {**here, "pid": _dead_pid(), "pid_started": "x/1"},
        "live": {**here, "pid": __import__("os").getpid(), "pid_started": process_started()},
        "nans": {},
    }
    for i, (name, rid) in enumerate(ids.items()):
        sink.start_run(
            RunInfo(rid, name, {"lr": 0.1 / (i + 1)}, started_at=100.0 + i, metrics=("loss",), environment=envs[name])
        )
        if name == "nans":
            values = [float("nan")] * 4
        elif name == "rolled":
            values = [1.0, 0.9, 0.8, 0.7, 0.6, 0.3, 0.1, 0.0, 5e30, 0.65, 0.62, 0.61]
        else:
            values = [1.0 - 0.05 * s for s in range(10)]
        sink.write(
            [
                Record(rid, step=s, epoch=0, batch=s, rank=0, wall_time=200.0 + s, values={"loss": v})
                for s, v in enumerate(values)
            ],
            [Event(rid, 9, EventKind.ACTION, ROLLBACK_MESSAGE, 209.5)] if name == "rolled" else [],
        )
        if name in ("fin", "rolled", "nans"):
            status = RunStatus.FAILED if name == "nans" else RunStatus.FINISHED
            sink.end_run(RunInfo(rid, name, {"lr": 0.1 / (i + 1)}, started_at=100.0 + i, status=status, ended_at=300.0))
    sink.close()
    return ids


def _show_figures(db: Path, run_id: str) -> tuple[str, int, str, str]:
    """status, steps, min and last of loss as `batchtap show` prints them."""
    done = subprocess.run(
        [sys.executable, "-m", "batchtap.cli.main", "show", run_id[:8], "--db", str(db)],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    status = next(ln.split()[1] for ln in lines if ln.startswith("  status "))
    steps = int(next(ln.split()[1] for ln in lines if ln.startswith("  steps ")))
    loss = next(ln.split() for ln in lines if ln.split()[:1] == ["loss"])
    return status, steps, loss[2], loss[1]


def agree_with_show(db: Path) -> dict[str, Any]:
    """Every run of the store as /api/runs gives it, each checked against `batchtap show`."""
    from batchtap._units import format_value

    with batchtap.ui.start(db) as srv:
        status, body, _ = get(f"{srv.base}/api/runs")
    assert status == 200
    for ui in body["runs"]:
        # JSON has no NaN: a last value that failed validation is null with its step given
        main = ui["main"]
        last = (
            "nan" if ui["last_value"] is None and ui["last_step"] is not None else format_value(main, ui["last_value"])
        )
        figures = (ui["status"], ui["steps"], format_value(main, ui["best_value"]), last)
        assert figures == _show_figures(db, ui["id"]), ui["name"]
    return {r["name"]: r for r in body["runs"]}


def test_the_ui_api_and_batchtap_show_agree_on_every_run(tmp_path: Path) -> None:
    db = tmp_path / "mixed.db"
    ids = write_mixed_store(db)
    listed = agree_with_show(db)
    assert {n: listed[n]["status"] for n in ids} == {
        "fin": "finished",
        "rolled": "finished",
        "killed": "killed",
        "live": "running",
        "nans": "failed",
    }
    assert all(r["main"] == "loss" and r["higher_is_better"] is False for r in listed.values())
    rolled = listed["rolled"]
    # the abandoned trajectory's 0.0 (and its 5e30) are not the run's best, min or max
    assert rolled["best_value"] == 0.6 and rolled["max_value"] == 1.0 and rolled["rolled_back"] == [[5, 8]]
    assert listed["nans"]["best_value"] is None and listed["killed"]["stop_reason"].startswith("the training process")
    with batchtap.store.open(db) as st:
        frame = st.frame(ids["rolled"])
        assert list(frame.index) == [0, 1, 2, 3, 4, 9, 10, 11] and frame.attrs["rolled_back"] == [(5, 8)]
        assert len(st.frame(ids["rolled"], rolled_back=True)) == 12


def test_the_ui_api_and_batchtap_show_agree_on_real_training_runs(runs: Runs) -> None:
    listed = agree_with_show(runs.db)
    assert listed["ui-stopped"]["status"] == "stopped" and len(listed) == 3


def test_a_short_id_or_name_finds_a_run_on_every_route(tmp_path: Path) -> None:
    db = tmp_path / "mixed.db"
    ids = write_mixed_store(db)
    with batchtap.ui.start(db) as srv:
        for ref in (ids["fin"][:8], "fin", ids["fin"]):
            status, body, _ = get(f"{srv.base}/api/runs/{ref}")
            assert status == 200 and body["id"] == ids["fin"], ref
            status, line, _ = get(f"{srv.base}/api/runs/{ref}/series?metric=loss")
            assert status == 200 and line["step"] == list(range(10)), ref
        status, body, _ = get(f"{srv.base}/api/runs/zzzz")
        assert status == 404 and "no run 'zzzz'" in body["error"]


@pytest.mark.parametrize(
    ("query", "names"),
    [
        pytest.param("lr<0.03 and status=running", ["live"], id="and"),
        pytest.param("status=killed or status=failed", ["nans", "killed"], id="or"),
        pytest.param("name~ROL", ["rolled"], id="contains"),
        pytest.param("best<0.62", ["rolled", "killed", "live", "fin"], id="best-kept-trajectory"),
    ],
)
def test_runs_filter_is_parsed_on_the_server(tmp_path: Path, query: str, names: list[str]) -> None:
    db = tmp_path / "mixed.db"
    write_mixed_store(db)
    with batchtap.ui.start(db) as srv:
        status, body, _ = get(f"{srv.base}/api/runs?q={urllib.request.quote(query)}")
    assert status == 200 and sorted(r["name"] for r in body["runs"]) == sorted(names)


@pytest.mark.parametrize(
    ("query", "said"),
    [
        pytest.param("lr<", "expected a clause", id="no-value"),
        pytest.param("lr<0.1 and", "ends after", id="dangling-and"),
        pytest.param("x'; DROP TABLE runs; --", "expected a clause", id="sql"),
        pytest.param("lrr<0.1", "no run has 'lrr'", id="typo"),
    ],
)
def test_a_bad_runs_filter_is_a_400_naming_the_fix(tmp_path: Path, query: str, said: str) -> None:
    db = tmp_path / "mixed.db"
    write_mixed_store(db)
    before = db.read_bytes()
    with batchtap.ui.start(db) as srv:
        status, body, _ = get(f"{srv.base}/api/runs?q={urllib.request.quote(query)}")
        live_status, _, _ = get(f"{srv.base}/api/runs/live?q={urllib.request.quote(query)}")
    assert status == 400 and said in body["error"] and "e.g." in body["error"] or "fix" in body["error"]
    assert live_status == 400 and db.read_bytes() == before


def test_the_live_runs_stream_sends_a_run_started_after_it_opened(tmp_path: Path) -> None:
    db = tmp_path / "mixed.db"
    write_mixed_store(db)
    with batchtap.ui.start(db) as srv:
        with urllib.request.urlopen(f"{srv.base}/api/runs/live", timeout=30) as stream:
            first = _next_sse(stream, "runs")
            assert first["first"] and {r["name"] for r in first["runs"]} >= {"fin", "killed", "live"}
            sink = SQLite(db)
            sink.start_run(RunInfo("new0" * 8, "newcomer", {"lr": 1.0}, started_at=400.0))
            sink.close()
            # every later message has the running run; wait (bounded by the timeout) for the newcomer
            for _ in range(20):
                update = _next_sse(stream, "runs")
                if any(r["name"] == "newcomer" for r in update["runs"]):
                    break
            else:
                raise AssertionError("the new run never came")
            assert next(r for r in update["runs"] if r["name"] == "newcomer")["status"] == "running"


def _next_sse(stream: Any, event: str) -> Any:
    kind = None
    for raw in stream:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            kind = line[len("event: ") :]
        elif line.startswith("data: ") and kind == event:
            return json.loads(line[len("data: ") :])
    raise AssertionError(f"the stream ended before a {event!r} message")


FD_LIMIT_SCRIPT = r"""
import resource, sys, threading, urllib.request, json
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
import batchtap.ui
from batchtap.ui.data import ReadOnlyStore

db, run_id = sys.argv[1], sys.argv[2]
ro = ReadOnlyStore(db, idle_s=0.5)
errors = []

def read():
    try:
        ro.summary(ro.reader.run(run_id))
        ro.series(run_id, "loss", width=50)
    except Exception as exc:  # noqa: BLE001 - counted and printed below
        errors.append(repr(exc))

# Three bursts of 120 fresh threads each, as a server's worker threads come and go between bursts:
# a connection per thread kept for the thread's life would need 360 descriptors here.
peak = 0
for burst in range(3):
    threads = [threading.Thread(target=read) for _ in range(120)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    peak = max(peak, ro.reader.open_connections)
# closed when idle: wait for the pool's timer (bounded), not a fixed sleep
import time
deadline = time.monotonic() + 30
while ro.reader.open_connections and time.monotonic() < deadline:
    time.sleep(0.05)
idle = ro.reader.open_connections
ro.close()

codes = []
with batchtap.ui.start(db) as srv:
    def fetch():
        try:
            with urllib.request.urlopen(f"{srv.base}/api/runs", timeout=60) as r:
                codes.append(r.status)
        except Exception as exc:  # noqa: BLE001
            codes.append(repr(exc))
    for burst in range(3):
        threads = [threading.Thread(target=fetch) for _ in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
print(json.dumps({"errors": errors[:3], "n_errors": len(errors), "peak": peak, "idle": idle,
                  "codes": sorted(set(map(str, codes)))}))
"""


def test_bursts_of_requests_under_a_256_descriptor_limit_leak_no_connection(tmp_path: Path) -> None:
    db = tmp_path / "mixed.db"
    ids = write_mixed_store(db)
    done = subprocess.run(
        [sys.executable, "-c", FD_LIMIT_SCRIPT, str(db), ids["fin"]],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["n_errors"] == 0, got["errors"]
    assert 1 <= got["peak"] <= 4 and got["idle"] == 0
    assert got["codes"] == ["200"]


def test_a_stream_opened_far_behind_catches_up_in_bounded_steps(tmp_path: Path, monkeypatch: Any) -> None:
    import batchtap.ui.live

    monkeypatch.setattr(batchtap.ui.live, "CATCH_UP", 7)
    db = tmp_path / "mixed.db"
    ids = write_mixed_store(db)  # "live": running (this process), 10 steps
    with batchtap.ui.start(db) as srv:
        with urllib.request.urlopen(f"{srv.base}/api/runs/{ids['live'][:8]}/live?after=-1", timeout=30) as stream:
            got: list[int] = []
            while len(got) < 10:
                update = _next_sse(stream, "update")
                steps = update.get("lines", {}).get("loss", {}).get("step", [])
                assert len(steps) <= 7
                got += steps
    assert got == list(range(10))
