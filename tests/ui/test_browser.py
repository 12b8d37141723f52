"""The UI in a real headless Chromium (Debian's ``chromium`` driven by Playwright), on stores made
by real training runs: what a user sees is read from the page's DOM and its charts' data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("bokeh")

import batchtap.store  # noqa: E402
import batchtap.ui  # noqa: E402
from tests.store._helpers import PG_DSN, pg_schema_fixture  # noqa: E402
from tests.ui.conftest import HOSTILE, Runs, own_requests_only, store_steps, train_process  # noqa: E402

READY = "body[data-ready='1']"


def chart_steps(pg: Any, metric: str, line: int = 0) -> list[int]:
    return pg.evaluate("([m, i]) => Array.from(bt.charts[m].lines[i].source.data.step)", [metric, line])


def test_runs_table_lists_every_run(page: Any, server: Any, runs: Runs) -> None:
    page.goto(server.url)
    page.wait_for_selector(READY)
    rows = page.locator("#runs tbody tr")
    assert rows.count() == 3
    ids = {rows.nth(i).get_attribute("data-id") for i in range(3)}
    assert ids == {runs.anomalies, runs.stopped, runs.hostile}
    stopped = page.locator(f"#runs tr[data-id='{runs.stopped}']")
    assert "stopped" in stopped.inner_text() and "ui-stopped" in stopped.inner_text()
    headers = page.locator("#runs th").all_inner_texts()
    assert {"lr", "epochs", "seed"} <= {h.strip() for h in headers}  # one column per config key
    page.fill("#filter", "ui-stopped")
    assert page.locator("#runs tbody tr").count() == 1
    page.fill("#filter", "")
    page.click("#runs th:has-text('seed')")
    seeds = [page.locator("#runs tbody tr").nth(i).get_attribute("data-id") for i in range(3)]
    assert seeds == [runs.anomalies, runs.stopped, runs.hostile]  # seeds 0, 1, 2 ascending
    own_requests_only(page, server.base)
    assert not page.errors


def test_run_page_draws_every_metric_with_its_points_and_the_anomaly_markers(
    page: Any, server: Any, runs: Runs
) -> None:
    page.goto(f"{server.base}/run/{runs.anomalies}")
    page.wait_for_selector(READY)
    with batchtap.store.open(runs.db) as st:
        names = st.metric_names(runs.anomalies)
        sparse = set(st.sparse_names(runs.anomalies))
        anomalies = [e for e in st.events(runs.anomalies) if e.kind.value == "anomaly"]
    charts = page.evaluate("() => Object.keys(bt.charts)")
    assert set(charts) == set(names) - {"data_time"}  # data_time is drawn inside the step_time chart
    for name in names:
        chart, line = ("step_time", 1) if name == "data_time" else (name, 0)
        assert chart_steps(page, chart, line) == store_steps(runs.db, runs.anomalies, name), name
    assert sparse == {"val_loss", "val_acc", "test_acc"}
    assert page.evaluate("() => bt.charts.step_time.lines.map(l => l.name)") == ["step_time", "data_time"]
    markers = page.evaluate(
        "() => ({steps: Array.from(bt.charts.loss.events.data.step), kinds: Array.from(bt.charts.loss.events.data.kind)})"
    )
    assert sorted(markers["steps"]) == sorted(e.step for e in anomalies) and set(markers["kinds"]) == {"anomaly"}
    assert markers["steps"] and all(s == 7 for s in markers["steps"])
    table = page.locator("#events-table tbody tr")
    assert table.count() == len(anomalies) and "7" in table.first.inner_text()
    assert page.locator("#run-name").inner_text().startswith("ui-anomalies")
    own_requests_only(page, server.base)
    assert not page.errors
    # The run, its events, its epochs and every line were asked for once, by early.js (before BokehJS ran),
    # and each of those responses was taken by the page (none asked for again, none left over).
    # (layers.js reads the run's layers and histograms once the page is drawn: not counted here)
    api = [u for u in page.requests if "/api/" in u and not u.endswith(("/layers", "/histograms"))]
    assert len(api) == len(set(api)) == len(names) + 3, api
    assert sum(u.endswith("/epochs") for u in api) == 1
    assert page.evaluate("() => window.btEarly.responses.size") == 0


def test_rule_actions_are_drawn_on_the_curves(page: Any, server: Any, runs: Runs) -> None:
    page.goto(f"{server.base}/run/{runs.stopped}")
    page.wait_for_selector(READY)
    with batchtap.store.open(runs.db) as st:
        actions = sorted(e.step for e in st.events(runs.stopped) if e.kind.value == "action")
    assert actions
    got = page.evaluate(
        "() => bt.charts.accuracy.events.data.kind.map((k, i) => [k, bt.charts.accuracy.events.data.step[i]])"
    )
    assert sorted(s for k, s in got if k == "action") == actions
    assert "stopped" in page.locator("#status").inner_text()
    assert page.locator("#stop-reason").count() == 1


def test_zoom_asks_the_server_for_detail(page: Any, runs: Runs, tmp_path: Path) -> None:
    """A long run is sent decimated; zoomed in, the chart holds every step of the window."""
    from batchtap.sinks.sqlite import SQLite
    from tests.ui.test_server import SPIKE_AT, write_long_run

    db = tmp_path / "long.db"
    write_long_run(SQLite(db))
    with batchtap.ui.start(db) as srv:
        page.goto(f"{srv.base}/run/long0001")
        page.wait_for_selector(READY)
        assert page.evaluate("() => bt.charts.loss.lines[0].mode") == "minmax"
        assert (
            page.evaluate("() => Math.max(...bt.charts.loss.lines[0].source.data.value.filter(Number.isFinite))")
            == 100.0
        )
        page.evaluate(
            f"() => {{ const r = bt.charts.loss.plot.x_range; r.setv({{start: {SPIKE_AT - 200}, end: {SPIKE_AT + 200}}}); }}"
        )
        page.wait_for_function("() => bt.charts.loss.lines[0].mode === 'raw'", polling=100)
        steps = chart_steps(page, "loss")
        assert set(range(SPIKE_AT - 200, SPIKE_AT + 201)) <= set(steps)
        assert len(steps) < 1000


def test_hostile_run_name_is_shown_as_text_and_runs_no_script(page: Any, server: Any, runs: Runs) -> None:
    page.add_init_script("window.__ran = []; window.alert = (m) => window.__ran.push(m);")
    for path in ("/", f"/run/{runs.hostile}", f"/compare?runs={runs.hostile},{runs.anomalies}"):
        page.goto(server.base + path)
        page.wait_for_selector(READY)
        assert page.get_by_text(HOSTILE, exact=True).count() >= 1 or HOSTILE in page.inner_text("body")
        assert page.evaluate("() => window.__ran") == []
        assert page.locator("main img").count() == 0 and page.locator("main script").count() == 0
    assert not page.dialogs
    assert page.locator("#run-name").count() == 0 or True
    page.goto(f"{server.base}/run/{runs.hostile}")
    page.wait_for_selector(READY)
    assert page.locator("#run-name").inner_text().startswith(HOSTILE)
    assert page.title() == f"batchtap: {HOSTILE}"
    assert not any(u.endswith("/x") for u in page.requests)  # the <img src=x> never loaded
    own_requests_only(page, server.base)


def test_compare_overlays_the_selected_runs(page: Any, server: Any, runs: Runs) -> None:
    page.goto(server.url)
    page.wait_for_selector(READY)
    page.check(f"#runs tr[data-id='{runs.anomalies}'] input[type=checkbox]")
    page.check(f"#runs tr[data-id='{runs.stopped}'] input[type=checkbox]")
    page.click("#compare")
    page.wait_for_url("**/compare?runs=*")
    page.wait_for_selector(READY)
    lines = page.evaluate("() => bt.charts.loss.sources.map(s => Array.from(s.data.step))")
    assert sorted(lines, key=len) == sorted(
        [store_steps(runs.db, runs.anomalies, "loss"), store_steps(runs.db, runs.stopped, "loss")], key=len
    )
    page.evaluate("() => { document.body.dataset.ready = ''; }")
    page.select_option("#align", "wall")
    page.wait_for_selector(READY)
    xs = page.evaluate("() => bt.charts.loss.sources.map(s => s.data.x[0])")
    assert all(0 <= x < 60 for x in xs)  # seconds since each run started
    own_requests_only(page, server.base)
    assert not page.errors


def test_token_is_refused_then_accepted(page: Any, runs: Runs) -> None:
    with batchtap.ui.start(runs.db, token="tok-123") as srv:
        response = page.goto(srv.base + "/")
        assert response.status == 401 and "token is required" in page.inner_text("body")
        page.goto(srv.base + "/?token=nope")
        assert "token is required" in page.inner_text("body")
        page.goto(srv.url)
        page.wait_for_selector(READY)
        assert page.locator("#runs tbody tr").count() == 3
        page.goto(f"{srv.base}/run/{runs.anomalies}")  # the cookie carries it from here on
        page.wait_for_selector(READY)
        own_requests_only(page, srv.base)


def test_live_run_grows_while_training_writes_and_ends_in_place(page: Any, tmp_path: Path) -> None:
    db = tmp_path / "live.db"
    go = tmp_path / "go"
    proc = train_process(
        "--db",
        str(db),
        "--name",
        "ui-live",
        "--epochs",
        "3",
        "--batches",
        "12",
        "--go-file",
        str(go),
        "--nan-at",
        "20",
        "--sleep",
        "0.02",
    )
    try:
        assert proc.stdout is not None
        run_id = proc.stdout.readline().strip()
        assert proc.stdout.readline().strip() == "paused"  # epoch 0 stored, training waits
        with batchtap.ui.start(db) as srv:
            page.goto(f"{srv.base}/run/{run_id}")
            page.wait_for_selector(READY)
            assert chart_steps(page, "loss") == list(range(12))
            assert page.locator("#status").inner_text() == "running"
            go.touch()
            page.wait_for_function("() => bt.charts.loss.lines[0].lastStep >= 20", polling=50, timeout=60_000)
            page.wait_for_function("() => document.getElementById('status').textContent === 'finished'", timeout=60_000)
            assert proc.wait(60) == 0
            assert chart_steps(page, "loss") == store_steps(db, run_id, "loss") == list(range(36))
            assert page.evaluate("() => bt.updates") >= 2  # pushed in more than one piece, no reload
            assert 20 in page.evaluate("() => Array.from(bt.charts.loss.events.data.step)")  # the anomaly arrived live
            own_requests_only(page, srv.base)
            assert not page.errors
    finally:
        go.touch()
        if proc.poll() is None:
            proc.kill()


def test_postgresql_store_in_the_browser(page: Any) -> None:
    from tests.cli import _train

    for schema in pg_schema_fixture():
        run_id = _train.main(["--db", PG_DSN, "--schema", schema, "--name", "ui-pg", "--nan-at", "5", "--epochs", "2"])
        with batchtap.ui.start(PG_DSN, schema=schema) as srv:
            page.goto(srv.url)
            page.wait_for_selector(READY)
            assert page.locator(f"#runs tr[data-id='{run_id}']").count() == 1
            page.goto(f"{srv.base}/run/{run_id}")
            page.wait_for_selector(READY)
            assert chart_steps(page, "loss") == store_steps(PG_DSN, run_id, "loss", schema=schema) == list(range(24))
            assert 5 in page.evaluate("() => Array.from(bt.charts.loss.events.data.step)")
            epochs = page.evaluate(f"() => fetch('/api/runs/{run_id}/epochs').then((r) => r.json())")
            assert epochs == {"epochs": [[0, 0, 11], [1, 12, 23]]}  # the x axis by epoch, on PostgreSQL too
            own_requests_only(page, srv.base)
