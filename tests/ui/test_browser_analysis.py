"""The browser view as a place to analyse in, in a real headless Chromium: curves a spike cannot
flatten (robust y range, log toggle, units), x by wall time, CSV and PNG per chart, legends off the
data, one rollback as one story, a live runs table with a query filter and the sweep view.

Stores are made by real training runs (``batchtap demo --inject-spike-at`` in its own process, and
``tests/cli/_train.py``); what a user sees is read from the page's DOM and its charts' data.
"""

from __future__ import annotations

import csv
import io
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("bokeh")

import batchtap.store  # noqa: E402
import batchtap.ui  # noqa: E402
from batchtap._units import format_value  # noqa: E402
from tests.cli.conftest import cli_env  # noqa: E402
from tests.ui.conftest import Runs, own_requests_only, store_steps, train_process  # noqa: E402

READY = "body[data-ready='1']"
SPIKE_AT = 50


@pytest.fixture(scope="module")
def spike_db(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``batchtap demo --inject-spike-at 50``: the weights blown up at step 50, rolled back."""
    out = tmp_path_factory.mktemp("spike")
    done = subprocess.run(
        [sys.executable, "-m", "batchtap.cli.main", "demo", "--inject-spike-at", str(SPIKE_AT), "--epochs", "2"]
        + ["--out", str(out), "--name", "spiky", "--print-every", "1000"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    db = out / "batchtap.db"
    with batchtap.store.open(db) as st:
        (run,) = st.runs()
    return db, run.id


@pytest.fixture
def spike_server(spike_db: tuple[Path, str]) -> Any:
    with batchtap.ui.start(spike_db[0]) as srv:
        yield srv


def loss_values(db: Path, run_id: str) -> list[float]:
    with batchtap.store.open(db) as st:
        return [p.value for p in st.series(run_id, "loss")]


def test_a_spike_does_not_flatten_the_loss_chart_and_is_marked(
    page: Any, spike_server: Any, spike_db: tuple[Path, str]
) -> None:
    db, run_id = spike_db
    values = [v for v in loss_values(db, run_id) if math.isfinite(v)]
    assert max(values) > 1e4  # the spike is in the store: a plain autoscale would run to it
    bulk = sorted(values)[len(values) // 10 : -len(values) // 10]
    page.goto(f"{spike_server.base}/run/{run_id}")
    page.wait_for_selector(READY)
    y = page.evaluate("() => { const r = bt.charts.loss.plot.y_range; return [r.start, r.end]; }")
    assert all(math.isfinite(v) for v in y)
    assert y[0] <= min(bulk) and y[1] >= max(bulk)  # the bulk is inside
    assert y[1] - y[0] < 10 * (max(bulk) - min(bulk))  # and fills the chart
    marked = page.evaluate("() => Array.from(bt.charts.loss.outliers.data.step)")
    spikes = [s for s, v in zip(store_steps(db, run_id, "loss"), loss_values(db, run_id)) if v > y[1]]
    assert spikes and sorted(marked) == spikes  # every point above the range is marked at the edge
    assert "outside the y range" in page.locator(".chart[data-metric='loss'] .clip-note").inner_text()
    # The steps the rollback undid are shaded (the server's rolled_back spans).
    undone = page.evaluate("() => bt.run.rolled_back")
    boxes = page.evaluate("() => bt.charts.loss.boxes.map(b => [b.left + 0.5, b.right - 0.5])")
    assert undone and boxes == undone and all(a <= SPIKE_AT + 1 <= b for a, b in undone)
    # The smoothed line goes on through the spike instead of leaving the chart for dozens of steps.
    smooth = page.evaluate("() => Array.from(bt.charts.loss.lines[0].source.data.smooth)")
    assert all(y[0] <= v <= y[1] for v in smooth if v is not None and math.isfinite(v))
    # Log scale per chart: the loss chart alone switches, its range stays around the bulk.
    page.check(".chart[data-metric='loss'] .log-toggle")
    scales = page.evaluate("() => [bt.charts.loss.plot.y_scale.type, bt.charts.accuracy.plot.y_scale.type]")
    assert scales == ["LogScale", "LinearScale"]
    y_log = page.evaluate("() => { const r = bt.charts.loss.plot.y_range; return [r.start, r.end]; }")
    assert 0 < y_log[0] <= min(bulk) and max(bulk) <= y_log[1] < 100 * max(bulk)
    page.uncheck(".chart[data-metric='loss'] .log-toggle")
    assert page.evaluate("() => bt.charts.loss.plot.y_scale.type") == "LinearScale"
    own_requests_only(page, spike_server.base)
    assert not page.errors


def test_one_rollback_is_one_story_in_the_events_table(
    page: Any, spike_server: Any, spike_db: tuple[Path, str]
) -> None:
    db, run_id = spike_db
    with batchtap.store.open(db) as st:
        events = st.events(run_id)
    assert len(events) >= 3  # the anomaly, the rollback, its skipped batches (and what it ignored)
    page.goto(f"{spike_server.base}/run/{run_id}")
    page.wait_for_selector(READY)
    rows = page.locator("#events-table tbody tr")
    assert rows.count() == 1
    text = rows.first.inner_text()
    assert "rollback" in text and "restored the snapshot" in text and "skipped batches" in text
    assert f"{len(events)} events" in text  # every stored event under the story's details
    page.click("#events-table details.story summary")
    assert page.locator("#events-table details.story li").count() == len(events)


def test_units_on_the_axes_and_in_the_tooltips(page: Any, spike_server: Any, spike_db: tuple[Path, str]) -> None:
    page.goto(f"{spike_server.base}/run/{spike_db[1]}")
    page.wait_for_selector(READY)
    labels = page.evaluate(
        "() => Object.fromEntries(Object.entries(bt.charts).map(([m, c]) => [m, c.plot.left[0].axis_label]))"
    )
    with batchtap.store.open(spike_db[0]) as st:
        times = sorted(p.value for p in st.series(spike_db[1], "step_time"))
    unit = "ms" if times[(len(times) - 1) // 2] < 1 else "s"  # milliseconds unless the median step takes 1 s
    assert labels["accuracy"] == "accuracy (%)" and labels["step_time"] == f"step_time ({unit})"
    assert labels["loss"] == "loss" and labels["throughput"] == "throughput (/s)"
    accuracy = page.evaluate("() => Array.from(bt.charts.accuracy.lines[0].source.data.value)")
    stored = page.evaluate("() => Array.from(bt.charts.accuracy.lines[0].source.data.stored)")
    assert max(accuracy) > 1 and accuracy == pytest.approx([v * 100 for v in stored])  # shown %, stored 0-1
    tip = page.evaluate("() => bt.charts.accuracy.tip(bt.charts.accuracy.lines[0], 3).textContent")
    assert format_value("accuracy", stored[3]) in tip
    step_time = page.evaluate("() => bt.charts.step_time.lines[0].source.data.stored[3]")
    tip = page.evaluate("() => bt.charts.step_time.tip(bt.charts.step_time.lines[0], 3).textContent")
    assert format_value("step_time", step_time) in tip  # as the console prints it


VALUES = [
    ("loss", 0.42131),
    ("loss", 7.465e29),
    ("loss", 2e-6),
    ("accuracy", 0.9125),
    ("accuracy", 1.0),
    ("val_acc", 0.9),
    ("val_acc", 90.5),
    ("step_time", 0.0016341),
    ("step_time", 12.5),
    ("data_time", 0.0),
    ("throughput", 5496.2),
    ("lr", 2.437e-06),
    ("lr", 0.05),
    ("lr", 12345.6),
    ("lr", 123456.0),
    ("lr", -0.25),
    ("memory_allocated", 3 * 2**30),
    ("memory_reserved", 12 * 2**30),
    ("step_time_spread", 2.561),
    ("gpu0_util", 87.0),
    ("gpu0_power", 250.4),
    ("slowest_rank", 3.0),
    ("grad_norm", float("inf")),
]


def test_the_page_formats_every_value_as_the_console_does(page: Any, server: Any) -> None:
    """One convention: the page applies batchtap._units' table and gives its exact text."""
    page.goto(server.url)
    page.wait_for_selector(READY)
    got = page.evaluate("(pairs) => pairs.map(([n, v]) => fmtUnit(n, v))", [[n, v] for n, v in VALUES])
    assert got == [format_value(n, v) for n, v in VALUES]


def test_x_by_wall_time_and_csv_and_png_per_chart(page: Any, spike_server: Any, spike_db: tuple[Path, str]) -> None:
    db, run_id = spike_db
    page.goto(f"{spike_server.base}/run/{run_id}")
    page.wait_for_selector(READY)
    page.select_option("#xaxis", "wall")
    xs = page.evaluate("() => Array.from(bt.charts.loss.lines[0].source.data.x)")
    assert xs == sorted(xs) and 0 <= xs[0] < xs[-1] < 600  # seconds since the run started
    assert page.evaluate("() => bt.charts.loss.plot.below[0].axis_label") == "seconds since the run started"
    page.select_option("#xaxis", "step")
    assert page.evaluate("() => Array.from(bt.charts.loss.lines[0].source.data.x)") == store_steps(db, run_id, "loss")
    with page.expect_download() as got:
        page.click(".chart[data-metric='accuracy'] button.csv")
    rows = list(csv.DictReader(io.StringIO(Path(got.value.path()).read_text())))
    assert [int(r["step"]) for r in rows] == store_steps(db, run_id, "accuracy")
    with batchtap.store.open(db) as st:
        want = [p.value for p in st.series(run_id, "accuracy")]
    assert [float(r["value"]) if r["value"] else math.nan for r in rows] == pytest.approx(want, nan_ok=True)
    assert {r["metric"] for r in rows} == {"accuracy"} and {r["run_id"] for r in rows} == {run_id}
    with page.expect_download() as got:
        page.click(".chart[data-metric='loss'] button.png")
    assert got.value.suggested_filename.endswith(".png")
    assert Path(got.value.path()).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not page.errors


def test_legends_never_cover_the_data(page: Any, server: Any, runs: Runs) -> None:
    for path in (f"/run/{runs.anomalies}", f"/compare?runs={runs.anomalies},{runs.stopped}"):
        page.goto(server.base + path)
        page.wait_for_selector(READY)
        inside = page.evaluate(
            "() => Object.values(bt.charts).flatMap(c => c.plot.center.filter(m => m.type === 'Legend')).length"
        )
        assert inside == 0  # no legend drawn inside a plot: they are HTML above it
    assert page.locator("#compare-runs li").count() == 2
    assert not page.errors


def test_compare_has_smoothing_event_markers_log_and_csv(page: Any, server: Any, runs: Runs) -> None:
    page.goto(f"{server.base}/compare?runs={runs.anomalies},{runs.stopped}")
    page.wait_for_selector(READY)
    assert page.locator("h1").inner_text() == "compare 2 runs"
    smooth = page.evaluate(
        "() => bt.charts.loss.lines.map(l => Array.from(l.source.data.smooth).filter(Number.isFinite).length)"
    )
    assert all(n > 0 for n in smooth)
    before = page.evaluate("() => bt.charts.loss.lines[0].source.data.smooth[5]")
    page.fill("#smoothing", "0")
    page.dispatch_event("#smoothing", "input")
    after = page.evaluate(
        "() => [bt.charts.loss.lines[0].source.data.smooth[5], bt.charts.loss.lines[0].source.data.value[5]]"
    )
    assert after[0] == after[1] != before  # smoothing 0: the line itself
    markers = page.evaluate(
        "() => bt.charts.loss.events.data.step.map((s, i) => [s, bt.charts.loss.events.data.kind[i], bt.charts.loss.events.data.run[i]])"
    )
    with batchtap.store.open(runs.db) as st:
        anomalies = {e.step for e in st.events(runs.anomalies) if e.kind.value == "anomaly" and e.metric == "loss"}
        actions = {e.step for e in st.events(runs.stopped) if e.kind.value == "action"}
    assert {s for s, k, r in markers if k == "anomaly" and r.startswith("ui-anomalies")} == anomalies
    assert {s for s, k, r in markers if k == "action" and r.startswith("ui-stopped")} == actions
    page.check(".chart[data-metric='loss'] .log-toggle")
    assert page.evaluate("() => bt.charts.loss.plot.y_scale.type") == "LogScale"
    with page.expect_download() as got:
        page.click(".chart[data-metric='loss'] button.csv")
    rows = list(csv.DictReader(io.StringIO(Path(got.value.path()).read_text())))
    assert {r["run_id"] for r in rows} == {runs.anomalies, runs.stopped}
    assert not page.errors


# -- the runs table -----------------------------------------------------------------------------
def _wait_for_rows(page: Any, ids: set[str]) -> None:
    """Wait until the runs table shows exactly the runs ``ids`` (a server-side query's answer)."""
    want = ",".join(sorted(ids))
    page.wait_for_function(
        "(want) => [...document.querySelectorAll('#runs tbody tr')].map(r => r.dataset.id).sort().join() === want",
        arg=want,
    )


def test_runs_table_query_filter_and_counts(page: Any, server: Any, runs: Runs) -> None:
    page.goto(server.url)
    page.wait_for_selector(READY)
    assert page.locator("#runs-count").inner_text() == "3 runs"
    # a query is matched by the server (/api/runs?q=): wait for its answer to reach the table
    page.fill("#filter", "seed>=1 and status=stopped")
    _wait_for_rows(page, {runs.stopped})
    assert page.locator("#runs-count").inner_text() == "1 of 3 runs"
    page.fill("#filter", "status=stopped or seed>=2")  # the server's language: 'or' too, as in runs --where
    _wait_for_rows(page, {runs.stopped, runs.hostile})
    page.fill("#filter", "seed<2")
    _wait_for_rows(page, {runs.anomalies, runs.stopped})
    assert page.locator("#runs-count").inner_text() == "2 of 3 runs"
    page.fill("#filter", "nosuchkey=1")
    page.wait_for_function("() => document.getElementById('query-error').textContent !== ''")
    assert page.locator("#runs tbody tr").count() == 0
    assert "no run has 'nosuchkey'" in page.locator("#query-error").inner_text()
    page.fill("#filter", "ui-anom")  # free text, matched in the page
    assert page.locator("#runs tbody tr").count() == 1
    assert page.locator("#query-error").inner_text() == ""
    # The compare button counts the selected runs the filter shows.
    page.fill("#filter", "")
    page.check(f"#runs tr[data-id='{runs.anomalies}'] input[type=checkbox]")
    page.check(f"#runs tr[data-id='{runs.stopped}'] input[type=checkbox]")
    assert page.locator("#compare").inner_text() == "compare selected (2)"
    page.fill("#filter", "status=stopped")
    _wait_for_rows(page, {runs.stopped})
    assert page.locator("#compare").inner_text() == "compare selected (1)"
    assert not page.errors


def test_parallel_coordinates_draw_one_line_per_selected_run(page: Any, server: Any, runs: Runs) -> None:
    page.goto(server.url)
    page.wait_for_selector(READY)
    for run_id in (runs.anomalies, runs.stopped, runs.hostile):
        page.check(f"#runs tr[data-id='{run_id}'] input[type=checkbox]")
    page.click("#parallel-toggle")
    page.wait_for_function("() => bt.parallel && bt.parallel.lines === 3")
    axes = page.evaluate("() => bt.parallel.axes")
    assert axes[:-1] == ["epochs", "seed"] and axes[-1].startswith("best")  # the config keys that vary, the metric
    ids = page.evaluate("() => Array.from(bt.parallel.source.data.id)")
    assert sorted(ids) == sorted([runs.anomalies, runs.stopped, runs.hostile])
    page.uncheck(f"#runs tr[data-id='{runs.hostile}'] input[type=checkbox]")
    page.wait_for_function("() => bt.parallel && bt.parallel.lines === 2")
    page.select_option("#pc-metric", "last_value")
    page.wait_for_function("() => bt.parallel && bt.parallel.axes[bt.parallel.axes.length - 1].startsWith('final')")
    assert not page.errors


@pytest.mark.parametrize("width, scrolls", [(1280, False), (800, True)], ids=["fits-1280", "scrolls-800"])
def test_runs_table_columns_fit_at_1280_and_scroll_at_800(
    browser: Any, server: Any, runs: Runs, width: int, scrolls: bool
) -> None:
    context = browser.new_context(viewport={"width": width, "height": 800})
    try:
        pg = context.new_page()
        pg.goto(server.url)
        pg.wait_for_selector(READY)
        got = pg.evaluate(
            "() => { const w = document.getElementById('runs-wrap'); return [w.scrollWidth, w.clientWidth, "
            "getComputedStyle(w).overflowX, document.documentElement.scrollWidth, window.innerWidth]; }"
        )
        scroll_width, client_width, overflow, page_width, inner = got
        assert page_width <= inner  # the page itself never scrolls sideways
        assert overflow == "auto"
        assert (scroll_width > client_width) is scrolls, got
    finally:
        context.close()


def test_a_run_started_while_the_runs_table_is_open_appears_and_moves(page: Any, tmp_path: Path) -> None:
    from tests.cli import _train

    db = tmp_path / "live-runs.db"
    first = _train.main(["--db", str(db), "--name", "already-there", "--epochs", "1"])
    go = tmp_path / "go"
    with batchtap.ui.start(db) as srv:
        page.goto(srv.url)
        page.wait_for_selector(READY)
        page.evaluate("() => { window.__sameDocument = true; }")
        assert page.locator("#runs tbody tr").count() == 1 and first
        proc = train_process(
            "--db", str(db), "--name", "started-later", "--epochs", "3", "--go-file", str(go), "--sleep", "0.01"
        )
        try:
            assert proc.stdout is not None
            run_id = proc.stdout.readline().strip()
            assert proc.stdout.readline().strip() == "paused"  # epoch 0 stored, the run is running
            # The page reads the runs again every 1-2 s (stream or poll); generous under load.
            row = f"#runs tr[data-id='{run_id}']"
            page.wait_for_selector(row, timeout=30_000)
            assert "running" in page.locator(row).inner_text()
            first_duration = page.locator(f"{row} .duration").inner_text()
            page.wait_for_function(
                "([sel, d]) => { const c = document.querySelector(sel + ' .duration'); return c && c.textContent !== d; }",
                arg=[row, first_duration],
                timeout=30_000,
            )  # the duration of a running run moves
            go.touch()
            assert proc.wait(120) == 0
            page.wait_for_function(
                "(sel) => document.querySelector(sel) && document.querySelector(sel).innerText.includes('finished')",
                arg=row,
                timeout=30_000,
            )
            assert page.evaluate("() => window.__sameDocument") is True  # no reload
            assert page.locator("#runs-count").inner_text() == "2 runs"
            assert not page.errors
        finally:
            go.touch()
            if proc.poll() is None:
                proc.kill()
