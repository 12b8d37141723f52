"""The browser view's per-layer endpoints over a real SQLite store written by a real run:
/api/runs/{id}/layers groups Layers' values by layer (largest gradient norm first, top-k), and
/api/runs/{id}/histograms gives each layer's stored histograms as steps x bins; the page loads
static/layers.js."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import batchtap as bt


@pytest.fixture
def db(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "ui.db"
    metrics = [bt.metrics.Loss(), bt.metrics.Layers(model, every=2), bt.metrics.Histograms(model, every=3, bins=4)]
    tap = bt.Tap(metrics, [bt.sinks.SQLite(path)], flush_every=3)
    with tap, tap.run(name="layers-ui"):
        for _ in range(7):
            opt.zero_grad()
            loss = model(torch.randn(4, 6)).pow(2).mean()
            loss.backward()
            opt.step()
            tap.step(loss=loss)
    return path


def test_layers_and_histograms_endpoints(db: Path) -> None:
    from starlette.testclient import TestClient

    from batchtap.ui.app import make_app
    from batchtap.ui.data import ReadOnlyStore

    store = ReadOnlyStore(db)
    try:
        client = TestClient(make_app(store), base_url="http://127.0.0.1")
        layers = client.get("/api/runs/layers-ui/layers?top=2").json()
        assert {e["layer"] for e in layers["layers"]} == {"0", "2", "4"}
        norms = [e["grad_norm"] for e in layers["layers"]]
        assert norms == sorted(norms, reverse=True) and len(layers["top"]) == 2
        assert all(e["step"] == 6 and e["update_ratio"] > 0 and e["weight_norm"] > 0 for e in layers["layers"])
        stored = {r[0]: r[1] for r in store.reader.query(
            "SELECT metric, value FROM metrics WHERE metric LIKE 'grad_norm/%' AND step = 6", ()
        )}  # fmt: skip
        assert {f"grad_norm/{e['layer']}": e["grad_norm"] for e in layers["layers"]} == stored
        hist = client.get("/api/runs/layers-ui/histograms").json()["histograms"]
        assert [(h["kind"], h["layer"]) for h in hist] == [
            (k, la) for k in ("grad", "weight") for la in ("0", "2", "4")
        ]
        for h in hist:
            assert h["steps"] == [0, 3, 6] and all(len(c) == 4 for c in h["counts"])
            assert all(lo <= hi for lo, hi in zip(h["low"], h["high"]))
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
    header, *rows = [line for line in layers_part.splitlines()[1:] if line.startswith("  ")][:4]
    assert header.split() == ["layer", "grad_norm", "weight_norm", "update_ratio"]
    assert sorted(r.split()[0] for r in rows[:3]) == ["0", "2", "4"]


def test_run_page_draws_the_layers_section_in_a_real_browser(db: Path) -> None:
    import os
    import shutil

    chromium = os.environ.get("BATCHTAP_TEST_CHROMIUM", "/usr/bin/chromium")
    if not os.path.isfile(chromium):
        chromium = shutil.which("chromium") or ""
    if not chromium:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but no Chromium for the browser test (apt-get install -y chromium)")
        pytest.skip("no Chromium (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    import batchtap.ui

    with batchtap.ui.start(db) as server, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url.rstrip("/") + "/run/layers-ui")
            page.wait_for_function("() => window.bt && window.bt.layersDrawn === true", timeout=60_000)
            section = page.locator("#bt-layers")
            assert section.locator("table tr").count() == 1 + 3  # header + the three layers
            assert section.locator("canvas.bt-heatmap").count() == 6  # grad and weight x 3 layers
            captions = section.locator("figcaption").all_text_contents()
            assert "weight histogram: 0" in captions and "grad histogram: 4" in captions
            assert errors == []
        finally:
            browser.close()
