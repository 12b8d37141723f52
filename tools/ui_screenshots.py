"""Screenshots of `batchtap ui` for the docs, taken by the browser the UI's tests drive.

Trains two short real runs (the demo's CNN on the bundled digits: one with a loss spike that the
rules roll back, one with a NaN that stops it) into a fresh store, serves it with ``bt.ui.start``
and saves ``docs/img/ui-runs.png`` (the runs table), ``docs/img/ui-sweep.png`` (the runs table
with the parallel-coordinates view of every run), ``docs/img/ui-run.png`` (a run page) and
``docs/img/ui-compare.png`` (two runs compared) with Debian's ``chromium`` driven by Playwright.

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
        page.screenshot(path=str(OUT / "ui-compare.png"), full_page=False)
        browser.close()
    print(f"wrote {', '.join(str(OUT / n) for n in ('ui-runs.png', 'ui-sweep.png', 'ui-run.png', 'ui-compare.png'))}")


if __name__ == "__main__":
    main()
