"""Screenshots of `batchtap ui` for the docs, taken by the browser the UI's tests drive.

Trains two short real runs (the demo's CNN on the bundled digits: one with a loss spike that the
rules roll back, one with a NaN that stops it) into a fresh store, serves it with ``bt.ui.start``
and saves ``docs/img/ui-runs.png`` (the runs table), ``docs/img/ui-sweep.png`` (the runs table
with the parallel-coordinates view of every run), ``docs/img/ui-run.png`` (a run page),
``docs/img/ui-compare.png`` (two runs compared) and ``docs/img/ui-run-layers.png`` (a small
language model's run page: throughput beside the step time and the per-layer charts; its MFU
uses a nominal ``peak_flops`` since a CPU has no entry in the peak table) with Debian's
``chromium`` driven by Playwright.

Run: ``.venv/bin/python tools/ui_screenshots.py`` (needs ``apt-get install -y chromium`` and
``pip install -e '.[dev]'``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "img"


def layers_run(db: Path) -> None:
    """A tiny language model (embedding, 6 blocks, head) on a repeating token sequence, 3 epochs:
    per-layer norms and update ratios every 2 steps, histograms every 5, MFU and tokens/s."""
    sys.path.insert(0, str(ROOT / "src"))
    import torch
    import torch.nn as nn

    import batchtap as bt

    torch.manual_seed(0)
    vocab, width, seq = 64, 64, 32
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(6)]
    model = nn.Sequential(nn.Embedding(vocab, width), *blocks, nn.Linear(width, vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    text = torch.arange(4096) * 7 % vocab
    metrics = [
        bt.metrics.Loss(),
        bt.metrics.StepTime(),
        bt.metrics.MFU(peak_flops=2e11),  # a nominal CPU peak: the table knows GPUs only
        bt.metrics.Layers(model, every=2),
        bt.metrics.Histograms(model, every=5, bins=32),
    ]
    tap = bt.Tap(metrics, [bt.sinks.SQLite(db)], flush_every=10)
    with tap, tap.run(name="tiny-lm-layers", config={"lr": 3e-3, "blocks": 6}):
        for epoch in range(3):
            for batch in range(40):
                at = torch.randint(0, len(text) - seq - 1, (16,))
                x = torch.stack([text[i : i + seq] for i in at])
                y = torch.stack([text[i + 1 : i + seq + 1] for i in at])
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                opt.step()
                tap.step(loss=loss, targets=y, epoch=epoch, batch=batch)


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="bt-ui-shots-"))
    db = folder / "batchtap.db"
    demo = [sys.executable, "-m", "batchtap.cli.main", "demo", "--out", str(folder), "--db", str(db), "--epochs", "3"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run(
        [*demo, "--name", "spike-rollback", "--inject-spike-at", "60"], check=True, env=env, capture_output=True
    )
    subprocess.run(
        [*demo, "--name", "nan-stop", "--inject-nan-at", "90", "--lr", "0.1", "--seed", "1"],
        check=True,
        env=env,
        capture_output=True,
    )
    for lr, seed in (("0.02", "2"), ("0.2", "3")):
        subprocess.run(
            [*demo, "--name", f"lr-{lr}", "--lr", lr, "--seed", seed], check=True, env=env, capture_output=True
        )
    layers_db = folder / "layers.db"  # its own store: the runs table and the sweep show the demo's runs
    layers_run(layers_db)
    sys.path.insert(0, str(ROOT / "src"))
    from playwright.sync_api import sync_playwright

    import batchtap.store
    import batchtap.ui

    with batchtap.store.open(db) as st:
        spike = st.run("spike-rollback").id
        ids = [r.id for r in st.runs()]
        baseline = st.run("lr-0.02").id
    OUT.mkdir(parents=True, exist_ok=True)
    with batchtap.ui.start(db) as srv, sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium")
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(srv.url)
        page.wait_for_selector("body[data-ready='1']")
        page.screenshot(path=str(OUT / "ui-runs.png"))
        for run_id in ids:
            page.check(f"#runs tr[data-id='{run_id}'] input[type=checkbox]")
        page.click("#parallel-toggle")
        page.wait_for_function(f"() => bt.parallel && bt.parallel.lines === {len(ids)}")
        page.wait_for_timeout(500)
        page.screenshot(path=str(OUT / "ui-sweep.png"), full_page=True)
        page.goto(f"{srv.base}/run/{spike}")
        page.wait_for_selector("body[data-ready='1']")
        page.screenshot(path=str(OUT / "ui-run.png"), full_page=False)
        page.goto(f"{srv.base}/compare?runs={spike},{baseline}")
        page.wait_for_selector("body[data-ready='1']")
        page.select_option("#align", "epoch")  # the two runs aligned by epoch
        page.wait_for_function("() => bt.ready && bt.charts.loss.xMode === 'epoch'")
        page.wait_for_timeout(500)
        page.screenshot(path=str(OUT / "ui-compare.png"), full_page=False)
        browser.close()
    with batchtap.ui.start(layers_db) as srv, sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium")
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(f"{srv.base}/run/tiny-lm-layers")
        page.wait_for_selector("body[data-ready='1']")
        page.wait_for_function("() => window.bt.layersDrawn === true")
        page.wait_for_timeout(500)
        page.screenshot(
            path=str(OUT / "ui-run-layers.png"), full_page=True, clip={"x": 0, "y": 0, "width": 1400, "height": 1330}
        )
        browser.close()
    names = ("ui-runs.png", "ui-sweep.png", "ui-run.png", "ui-run-layers.png", "ui-compare.png")
    print(f"wrote {', '.join(str(OUT / n) for n in names)}")


if __name__ == "__main__":
    main()
