"""Every user-controlled string is text in the page, even with the Content-Security-Policy off.

Metric names, a run name, config keys and values and event messages made of ``<img>``, ``<svg>``,
``<a>`` and ``<style>`` are stored by the real SQLite sink; the runs table, the sweep view, a run's
page and the comparison are opened in Chromium with the CSP bypassed (so a handler that became
HTML would run), every chart's hover tooltip is opened, and the whole DOM (shadow roots too) is
searched for an element the strings would have made.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("bokeh")

import batchtap.ui  # noqa: E402
from batchtap.records import Event, EventKind, Record, RunInfo, RunStatus  # noqa: E402
from batchtap.sinks.sqlite import SQLite  # noqa: E402

READY = "body[data-ready='1']"

#: Each one would make an element with an id starting "pwn" (and run a handler, or fetch /x) as HTML.
PAYLOADS = {
    "img": '<img id=pwn-img src=x onerror="window.__ran.push(`img`)">',
    "svg": '<svg id=pwn-svg onload="window.__ran.push(`svg`)"><circle r=9></circle></svg>',
    "a": "<a id=pwn-a href=/x>click</a>",
    "style": "<style id=pwn-style>body { display: none }</style>",
}
RUN_NAME = PAYLOADS["img"] + " run " + PAYLOADS["style"]
CONFIG = {PAYLOADS["a"]: PAYLOADS["svg"], "lr": 0.1, "opt": PAYLOADS["style"]}

# Every element (through shadow roots, where Bokeh draws its tooltips) whose id starts with "pwn".
_INJECTED = """() => {
    const found = [];
    const walk = (root) => {
        for (const el of root.querySelectorAll('*')) {
            if (String(el.id || '').startsWith('pwn')) found.push(el.tagName + '#' + el.id);
            if (el.shadowRoot) walk(el.shadowRoot);
        }
    };
    walk(document);
    return found;
}"""

# The text of every open Bokeh tooltip, and the elements in it that the strings could have made.
_TOOLTIPS = """() => {
    const tips = [];
    const walk = (root) => {
        for (const el of root.querySelectorAll('*')) {
            if (!el.shadowRoot) continue;
            const content = el.shadowRoot.querySelector('.bk-tooltip-content');
            if (content && content.textContent) tips.push({
                text: content.textContent,
                tags: [...content.querySelectorAll('img, svg, a, style, script, iframe')].map(e => e.tagName),
            });
            walk(el.shadowRoot);
        }
    };
    walk(document);
    return tips;
}"""


def write_run(sink: SQLite, run_id: str, name: str, seed: int) -> None:
    metrics = tuple(PAYLOADS.values())
    config = {**CONFIG, PAYLOADS["a"]: f"{PAYLOADS['svg']} {seed}", "seed": seed}  # a key that varies: an axis
    sink.start_run(RunInfo(run_id, name, config, started_at=1000.0, metrics=("loss", *metrics)))
    records = [
        Record(
            run_id,
            step=s,
            epoch=s // 20,
            batch=s % 20,
            rank=0,
            wall_time=1000.0 + s,
            values={"loss": 2.0 - s * 0.01 + seed, **{m: 1.0 + s * (i + 1) for i, m in enumerate(metrics)}},
        )
        for s in range(60)
    ]
    events = [
        Event(run_id, 30, EventKind.ANOMALY, f"{m} is out of range at step 30 {m}", 1030.0, metric=m, raw_value=-1.0)
        for m in metrics
    ] + [Event(run_id, 31, EventKind.ACTION, f"stop requested by {PAYLOADS['a']}", 1031.0)]
    sink.write(records, events)
    sink.end_run(RunInfo(run_id, name, config, started_at=1000.0, status=RunStatus.FINISHED, ended_at=1060.0))


@pytest.fixture(scope="module")
def hostile_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("safe") / "hostile.db"
    sink = SQLite(db)
    write_run(sink, "hostile1", RUN_NAME, 1)
    write_run(sink, "hostile2", PAYLOADS["svg"], 2)
    sink.close()
    return db


@pytest.fixture
def no_csp_page(browser: Any) -> Iterator[Any]:
    """A page with the server's Content-Security-Policy bypassed: only the page's own care is left."""
    context = browser.new_context(viewport={"width": 1400, "height": 900}, bypass_csp=True)
    pg = context.new_page()
    pg.requests = []  # type: ignore[attr-defined]
    pg.errors = []  # type: ignore[attr-defined]
    pg.on("request", lambda r: pg.requests.append(r.url))  # type: ignore[attr-defined]
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))  # type: ignore[attr-defined]
    pg.add_init_script("window.__ran = []; window.alert = (m) => window.__ran.push(m);")
    yield pg
    context.close()


def assert_nothing_became_html(pg: Any) -> None:
    assert pg.evaluate(_INJECTED) == []
    assert pg.evaluate("() => window.__ran") == []
    assert pg.evaluate("() => getComputedStyle(document.body).display") != "none"  # no <style> applied
    assert not any(u.endswith("/x") for u in pg.requests)  # no <img src=x> loaded, no <a href=/x> followed
    assert not pg.errors


def hover_every_chart(pg: Any) -> list[dict[str, Any]]:
    """Sweep the pointer over each chart's plot (the lines rise left to right) and collect the tooltips."""
    seen: list[dict[str, Any]] = []
    for plot in pg.locator(".chart .plot").all():
        box = plot.bounding_box()
        if box is None:
            continue
        for i in range(1, 40):
            fraction = i / 40
            pg.mouse.move(box["x"] + box["width"] * fraction, box["y"] + box["height"] * (1 - fraction * 0.9))
            tips = pg.evaluate(_TOOLTIPS)
            if tips:
                seen += tips
                break
    pg.mouse.move(0, 0)
    return seen


def test_the_runs_table_and_the_sweep_view_show_every_string_as_text(no_csp_page: Any, hostile_db: Path) -> None:
    pg = no_csp_page
    with batchtap.ui.start(hostile_db) as srv:
        pg.goto(srv.url)
        pg.wait_for_selector(READY)
        body = pg.inner_text("main")
        assert RUN_NAME in body and PAYLOADS["svg"] in body and PAYLOADS["a"] in body  # name, config key, value
        pg.fill("#filter", "pwn-img")
        assert pg.locator("#runs tbody tr").count() == 1
        pg.fill("#filter", "")
        for run_id in ("hostile1", "hostile2"):
            pg.check(f"#runs tr[data-id='{run_id}'] input[type=checkbox]")
        pg.click("#parallel-toggle")
        pg.wait_for_function("() => bt.parallel && bt.parallel.lines === 2")
        assert PAYLOADS["a"] in pg.evaluate("() => bt.parallel.axes.join(' ')")  # an axis label, on the canvas
        tip = pg.evaluate("() => bt.parallel.source.data.name.join(' ')")
        assert RUN_NAME in tip
        assert_nothing_became_html(pg)


def test_a_run_page_shows_every_string_as_text_in_tooltips_legends_axes_and_tables(
    no_csp_page: Any, hostile_db: Path
) -> None:
    pg = no_csp_page
    with batchtap.ui.start(hostile_db) as srv:
        pg.goto(f"{srv.base}/run/hostile1")
        pg.wait_for_selector(READY)
        assert pg.title() == f"batchtap: {RUN_NAME}"
        assert pg.locator("#run-name").inner_text().startswith(RUN_NAME)
        assert set(pg.evaluate("() => Object.keys(bt.charts)")) == {"loss", *PAYLOADS.values()}
        for payload in PAYLOADS.values():
            # the chart's title (HTML text), its axis label (canvas text), its event markers' messages
            assert pg.locator(f".chart[data-metric='{payload}'] h3").inner_text() == payload
            label = pg.evaluate("(m) => bt.charts[m].plot.left[0].axis_label", payload)
            assert label == payload
            tip = pg.evaluate("(m) => { const c = bt.charts[m]; return c.tip(c.lines[0], 5).textContent; }", payload)
            assert payload in tip
            event_tip = pg.evaluate("(m) => bt.charts[m].eventTip(0).textContent", payload)
            assert f"{payload} is out of range" in event_tip
        assert pg.locator("#events-table tbody tr").count() == 5
        assert PAYLOADS["a"] in pg.inner_text("#events-table")
        assert PAYLOADS["svg"] in pg.inner_text("main")  # the config value in the config table
        tips = hover_every_chart(pg)
        assert tips, "no hover tooltip opened on any chart"
        assert all(t["tags"] == [] for t in tips), tips
        shown = " ".join(t["text"] for t in tips)
        assert sum(payload in shown for payload in PAYLOADS.values()) >= 3  # most charts' names, as text
        assert_nothing_became_html(pg)


def test_the_comparison_shows_every_string_as_text(no_csp_page: Any, hostile_db: Path) -> None:
    pg = no_csp_page
    with batchtap.ui.start(hostile_db) as srv:
        pg.goto(f"{srv.base}/compare?runs=hostile1,hostile2")
        pg.wait_for_selector(READY)
        legend = pg.inner_text("#compare-runs")
        assert RUN_NAME in legend and PAYLOADS["svg"] in legend
        for payload in PAYLOADS.values():
            tip = pg.evaluate("(m) => { const c = bt.charts[m]; return c.tip(c.lines[1], 5).textContent; }", payload)
            assert payload in tip and PAYLOADS["svg"] in tip  # the metric and the run, as text
        tips = hover_every_chart(pg)
        assert tips and all(t["tags"] == [] for t in tips), tips
        assert_nothing_became_html(pg)
