"""The browser view of what a trainer watches when a run goes wrong, over a real SQLite store
written by a real run (bt.metrics.Layers, Histograms and MFU over 2 epochs of 7 steps):

* /api/runs/{id}/layers groups Layers' values by layer (largest gradient norm first, top-k, and
  per kind the layers by their latest value), /api/runs/{id}/histograms gives each layer's stored
  histograms as steps x bins, /api/runs/{id}/epochs each epoch's step span;
* on the run page, one chart per per-layer kind with a line per layer, the top 5 by latest value
  shown (log y), "all" shows every layer and is kept for the next page; MFU, FLOP/s and tokens/s
  drawn right after the step time, with their units; the heatmaps below;
* x by epoch (epoch + position within it) on the run page and in compare, the choice kept;
* a note (event kind ``info``) listed in neutral grey, not drawn, filterable by kind.

Uses the session's shared browser (tests/ui/conftest.py), so it passes in any order with the
other browser tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import batchtap as bt
from tests.ui.conftest import train_process

pytest.importorskip("starlette")
pytest.importorskip("bokeh")

READY = "body[data-ready='1']"
NOTE = "gradient accumulation: 1 micro-batch per step, read from the loop (a note)"
EPOCHS, PER_EPOCH = 2, 7
LAYERS = ["0", "2", "4", "6", "8", "10", "12"]  # the Linear modules of the Sequential below


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    widths = [6, 16, 16, 16, 16, 16, 16, 2]
    modules: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        modules += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*modules[:-1])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    path = tmp_path_factory.mktemp("layersui") / "ui.db"
    metrics = [
        bt.metrics.Loss(),
        bt.metrics.StepTime(),
        bt.metrics.LearningRate(opt),  # stored after step_time: the throughput charts still come first
        bt.metrics.Layers(model, every=2),
        bt.metrics.Histograms(model, every=3, bins=4),
        bt.metrics.MFU(flops_per_step=2e6, peak_flops=1e11),
    ]
    tap = bt.Tap(metrics, [bt.sinks.SQLite(path)], flush_every=3)
    with tap:
        for name in ("layers-ui", "layers-ui-2"):  # a second run for compare, the same epochs
            with tap.run(name=name):
                if name == "layers-ui":
                    tap.warn(NOTE, info=True)
                for epoch in range(EPOCHS):
                    for batch in range(PER_EPOCH):
                        opt.zero_grad()
                        loss = model(torch.randn(4, 6)).pow(2).mean()
                        loss.backward()
                        opt.step()
                        tap.step(loss=loss, tokens=32, epoch=epoch, batch=batch)
    return path


@pytest.fixture
def ui(db: Path) -> Any:
    import batchtap.ui

    with batchtap.ui.start(db) as server:
        yield server


def stored(db: Path, run: str, metric: str) -> list[tuple[int, float, int]]:
    """(step, value, epoch) of a stored line."""
    with bt.store.open(db) as st:
        return [(p.step, p.value, p.epoch) for p in st.series(run, metric)]


def epoch_x(db: Path, run: str, metric: str) -> list[float]:
    """The x a step has by epoch, computed from the stored rows: epoch + its index within the
    epoch's span of steps over the span's length."""
    rows = stored(db, run, metric)
    spans: dict[int, list[int]] = {}
    for step, _, epoch in stored(db, run, "loss"):
        spans.setdefault(epoch, []).append(step)
    return [e + (s - min(spans[e])) / (max(spans[e]) - min(spans[e]) + 1) for s, _, e in rows]


def test_layers_histograms_and_epochs_endpoints(db: Path) -> None:
    from starlette.testclient import TestClient

    from batchtap.ui.app import make_app
    from batchtap.ui.data import ReadOnlyStore

    store = ReadOnlyStore(db)
    try:
        client = TestClient(make_app(store), base_url="http://127.0.0.1")
        layers = client.get("/api/runs/layers-ui/layers?top=2").json()
        assert {e["layer"] for e in layers["layers"]} == set(LAYERS)
        norms = [e["grad_norm"] for e in layers["layers"]]
        assert norms == sorted(norms, reverse=True) and len(layers["top"]) == 2
        last = (EPOCHS * PER_EPOCH - 1) // 2 * 2  # Layers(every=2): the last captured step
        assert all(e["step"] == last and e["update_ratio"] > 0 and e["weight_norm"] > 0 for e in layers["layers"])
        rows = store.reader.query(
            "SELECT metric, value FROM metrics WHERE run_id = ? AND metric LIKE ? AND step = ?",
            (store.resolve("layers-ui"), "%/%", last),
        )
        latest = {str(m): float(v) for m, v in rows}
        assert {f"grad_norm/{e['layer']}": e["grad_norm"] for e in layers["layers"]} == {
            k: v for k, v in latest.items() if k.startswith("grad_norm/")
        }
        for kind in ("grad_norm", "weight_norm", "update_ratio"):  # per kind: largest latest value first
            want = sorted(LAYERS, key=lambda la: -latest[f"{kind}/{la}"])
            assert layers["order"][kind] == want
        hist = client.get("/api/runs/layers-ui/histograms").json()["histograms"]
        assert sorted((h["kind"], h["layer"]) for h in hist) == sorted(
            (k, la) for k in ("grad", "weight") for la in LAYERS
        )
        for h in hist:
            assert h["steps"] == [0, 3, 6, 9, 12] and all(len(c) == 4 for c in h["counts"])
            assert all(lo <= hi for lo, hi in zip(h["low"], h["high"]))
        epochs = client.get("/api/runs/layers-ui/epochs").json()["epochs"]
        assert epochs == [[e, e * PER_EPOCH, e * PER_EPOCH + PER_EPOCH - 1] for e in range(EPOCHS)]
        spans: dict[int, list[int]] = {}
        for step, _, epoch in stored(db, "layers-ui", "loss"):
            spans.setdefault(epoch, []).append(step)
        assert epochs == [[e, min(s), max(s)] for e, s in sorted(spans.items())]
        assert client.get("/api/runs/no-such-run/epochs").json() == {"epochs": []}
        page = client.get("/run/layers-ui").text
        assert '<script src="/static/layers.js" defer></script>' in page
        assert client.get("/static/layers.js").status_code == 200
    finally:
        store.close()


def test_show_groups_the_per_layer_values_by_layer(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from batchtap.cli.main import main as cli

    assert cli(["show", "layers-ui", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    metrics_part, _, layers_part = out.partition("layers (last values, largest gradient norm first)")
    assert layers_part, out
    assert "grad_norm/" not in metrics_part and "update_ratio/" not in metrics_part
    header, *rows = [line for line in layers_part.splitlines()[1:] if line.startswith("  ")][:8]
    assert header.split() == ["layer", "grad_norm", "weight_norm", "update_ratio"]
    assert sorted(r.split()[0] for r in rows[:7]) == sorted(LAYERS)


def test_per_layer_values_are_one_chart_per_kind_top_5_then_all(page: Any, ui: Any, db: Path) -> None:
    page.goto(f"{ui.base}/run/layers-ui")
    page.wait_for_selector(READY)
    charts = page.evaluate("() => Object.keys(bt.charts)")
    assert not [c for c in charts if c.split("/")[0] in ("grad_norm", "weight_norm", "update_ratio") and c[-1] != "*"]
    assert [c for c in charts if c.endswith("/*")] == ["grad_norm/*", "weight_norm/*", "update_ratio/*"]
    order = page.evaluate("() => fetch('/api/runs/layers-ui/layers').then((r) => r.json())")["order"]
    for kind in ("grad_norm", "weight_norm", "update_ratio"):
        chart = f"bt.charts['{kind}/*']"
        got = page.evaluate(f"() => ({chart}.lines.map((l) => [l.label, !l.hidden, l.source.data.step.length]))")
        assert [label for label, _, _ in got] == order[kind]  # a line per layer, largest latest value first
        assert [label for label, shown, _ in got if shown] == order[kind][:5]
        assert all(n == 0 for _, shown, n in got if not shown)  # the hidden layers are not even read
        assert page.evaluate(f"() => {chart}.log") is True  # log y by default
        legend = page.locator(f".chart[data-metric='{kind}/*'] ul.legend li:visible").all_text_contents()
        assert legend == order[kind][:5]
    page.click(".chart[data-metric='grad_norm/*'] button.all-lines")
    page.wait_for_function(
        "() => bt.charts['grad_norm/*'].lines.every((l) => !l.hidden && l.source.data.step.length > 0)"
    )
    for layer in LAYERS:
        got = page.evaluate(
            f"() => {{ const d = bt.charts['grad_norm/*'].lines.find((l) => l.label === '{layer}').source.data;"
            " return [Array.from(d.step), Array.from(d.stored)]; }"
        )
        want = stored(db, "layers-ui", f"grad_norm/{layer}")
        assert got[0] == [s for s, _, _ in want]
        assert got[1] == pytest.approx([v for _, v, _ in want])
    assert page.locator(".chart[data-metric='grad_norm/*'] ul.legend li:visible").count() == len(LAYERS)
    page.reload()  # "all" is kept for the next page
    page.wait_for_selector(READY)
    page.wait_for_function("() => bt.charts['weight_norm/*'].lines.every((l) => l.source.data.step.length > 0)")
    assert page.locator(".chart[data-metric='weight_norm/*'] button.all-lines").inner_text() == "top 5"
    # the heatmaps are still there, below the charts
    page.wait_for_function("() => window.bt && window.bt.layersDrawn === true", timeout=60_000)
    section = page.locator("#bt-layers")
    assert section.locator("canvas.bt-heatmap").count() == 2 * len(LAYERS)
    captions = section.locator("figcaption").all_text_contents()
    assert "weight histogram: 0" in captions and "grad histogram: 12" in captions
    assert not page.errors


def test_mfu_flops_and_tokens_per_second_right_after_step_time(page: Any, ui: Any, db: Path) -> None:
    page.goto(f"{ui.base}/run/layers-ui")
    page.wait_for_selector(READY)
    charts = page.evaluate("() => Object.keys(bt.charts)")
    at = charts.index("step_time")
    assert charts[at + 1 : at + 4] == ["mfu", "flops_per_second", "tokens_per_second"]
    labels = page.evaluate(
        "() => ['mfu', 'flops_per_second', 'tokens_per_second'].map((m) => bt.charts[m].plot.left[0].axis_label)"
    )
    flops = [v for _, v, _ in stored(db, "layers-ui", "flops_per_second")]
    rate = "TFLOP/s" if max(flops) >= 1e12 else "GFLOP/s"
    assert labels == ["mfu (%)", f"flops_per_second ({rate})", "tokens_per_second (tokens/s)"]
    shown = page.evaluate("() => Array.from(bt.charts.mfu.lines[0].source.data.value)")
    want = [v * 100 for _, v, _ in stored(db, "layers-ui", "mfu")]
    assert shown == pytest.approx(want)  # stored 0-1, shown in %
    # beside the step time in the run's facts: each one's median, in the chart's unit
    facts = page.locator("#throughput")
    values = sorted(v for _, v, _ in stored(db, "layers-ui", "mfu"))
    mfu = facts.locator("[data-metric='mfu'] b").inner_text()
    assert mfu.endswith("%") and float(mfu[:-1]) == pytest.approx(100 * values[(len(values) - 1) // 2], rel=1e-3)
    tokens = sorted(v for _, v, _ in stored(db, "layers-ui", "tokens_per_second"))
    shown = facts.locator("[data-metric='tokens_per_second'] b").inner_text()
    assert shown == f"{round(tokens[(len(tokens) - 1) // 2]):,} tokens/s"
    assert facts.locator("[data-metric='step_time'] b").inner_text().endswith(" ms")
    boxes = page.evaluate(
        "() => ['step_time', 'mfu'].map((m) => document.querySelector(`.chart[data-metric='${m}']`)"
        ".getBoundingClientRect().top)"
    )
    assert boxes[1] - boxes[0] < 400  # on the same row or the next one, not below the other charts
    assert not page.errors


def test_x_by_epoch_on_the_run_page_and_in_compare_is_kept(page: Any, ui: Any, db: Path) -> None:
    page.goto(f"{ui.base}/run/layers-ui")
    page.wait_for_selector(READY)
    assert page.evaluate("() => document.querySelector('#xaxis option[value=epoch]').disabled") is False
    page.select_option("#xaxis", "epoch")
    page.evaluate(  # the smoothing slider moved by hand, kept for the next page too
        "() => { const s = document.getElementById('smoothing'); s.value = '0.3';"
        " s.dispatchEvent(new Event('input')); }"
    )
    for metric in ("loss", "mfu"):
        xs = page.evaluate(f"() => Array.from(bt.charts.{metric}.lines[0].source.data.x)")
        assert xs == pytest.approx(epoch_x(db, "layers-ui", metric))
    assert page.evaluate("() => bt.charts.loss.plot.below[0].axis_label") == "epoch"
    page.reload()  # the choice is kept: the page opens by epoch
    page.wait_for_selector(READY)
    assert page.input_value("#xaxis") == "epoch" and page.input_value("#smoothing") == "0.3"
    xs = page.evaluate("() => Array.from(bt.charts['grad_norm/*'].lines[0].source.data.x)")
    first = page.evaluate("() => bt.charts['grad_norm/*'].lines[0].label")
    assert xs == pytest.approx(epoch_x(db, "layers-ui", f"grad_norm/{first}"))
    with bt.store.open(db) as st:
        ids = [st.run("layers-ui").id, st.run("layers-ui-2").id]
    page.goto(f"{ui.base}/compare?runs={','.join(ids)}")
    page.wait_for_selector(READY)
    assert page.input_value("#align") == "epoch"
    for i, run in enumerate(ids):
        xs = page.evaluate(f"() => Array.from(bt.charts.loss.lines[{i}].source.data.x)")
        assert xs == pytest.approx(epoch_x(db, run, "loss"))
    # compare groups the per-layer values too: a line per layer and run, the first run's top 5 layers
    charts = page.evaluate("() => Object.keys(bt.charts)")
    assert "grad_norm/*" in charts and not [c for c in charts if c.startswith("grad_norm/") and c != "grad_norm/*"]
    shown = page.evaluate("() => bt.charts['grad_norm/*'].shown().map((l) => [l.layer, l.runId])")
    order = page.evaluate(f"() => fetch('/api/runs/{ids[0]}/layers').then((r) => r.json())")["order"]["grad_norm"]
    assert shown == [[layer, run] for layer in order[:5] for run in ids]
    page.select_option("#align", "step")
    page.wait_for_function("() => bt.ready && bt.charts.loss.xMode === 'step'")
    assert page.evaluate("() => Array.from(bt.charts.loss.lines[1].source.data.x)") == [
        s for s, _, _ in stored(db, ids[1], "loss")
    ]
    assert not page.errors


def test_a_note_is_listed_in_grey_not_drawn_and_filterable(page: Any, ui: Any) -> None:
    page.goto(f"{ui.base}/run/layers-ui")
    page.wait_for_selector(READY)
    row = page.locator("#events-table tr[data-kind='info']")
    assert row.count() == 1 and NOTE in row.inner_text()
    colour = row.locator("td").nth(4).evaluate("(td) => getComputedStyle(td).color")
    assert colour == "rgb(107, 115, 133)"  # the page's muted grey, not a warning's colour
    drawn = page.evaluate("() => Object.values(bt.charts).flatMap((c) => Array.from(c.events.data.kind))")
    assert "info" not in drawn
    box = page.locator("#event-kinds input[value='info']")
    assert "info (notes) (1)" in page.locator("#event-kinds").inner_text()
    box.uncheck()
    assert page.locator("#events-table tr[data-kind='info']").count() == 0
    box.check()
    assert page.locator("#events-table tr[data-kind='info']").count() == 1
    assert not page.errors


def test_x_by_epoch_follows_a_live_run_to_its_end(page: Any, tmp_path: Path) -> None:
    import batchtap.ui

    db, go = tmp_path / "live.db", tmp_path / "go"
    proc = train_process(
        *("--db", str(db), "--name", "ui-live-epochs", "--epochs", "3", "--batches", "12"),
        *("--go-file", str(go), "--sleep", "0.02"),
    )
    try:
        assert proc.stdout is not None
        run_id = proc.stdout.readline().strip()
        assert proc.stdout.readline().strip() == "paused"  # epoch 0 stored, training waits
        with batchtap.ui.start(db) as srv:
            page.goto(f"{srv.base}/run/{run_id}")
            page.wait_for_selector(READY)
            page.select_option("#xaxis", "epoch")
            assert page.evaluate("() => Array.from(bt.charts.loss.lines[0].source.data.x)") == pytest.approx(
                [i / 12 for i in range(12)]
            )
            go.touch()
            page.wait_for_function("() => document.getElementById('status').textContent === 'finished'", timeout=60_000)
            assert proc.wait(60) == 0
            want = epoch_x(db, run_id, "loss")
            assert len(want) == 36 and want[-1] == pytest.approx(2 + 11 / 12)
            page.wait_for_function(
                "(n) => bt.epochsRead >= 1 && bt.charts.loss.lines[0].source.data.x.length === n",
                arg=36,
                timeout=30_000,
            )
            assert page.evaluate("() => Array.from(bt.charts.loss.lines[0].source.data.x)") == pytest.approx(want)
            assert not page.errors
    finally:
        go.touch()
        if proc.poll() is None:
            proc.kill()
