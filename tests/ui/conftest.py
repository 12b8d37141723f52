"""Fixtures of the UI tests: stores made by real short training runs, a server, a real browser.

The browser is Debian's ``chromium`` (``apt-get install -y chromium``, what .ci/run does) driven by
Playwright with ``executable_path``: no ``playwright install``, no network. Without it the browser
tests skip and the run ends with one loud line; with ``CI=true`` they fail instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.cli import _train

CHROMIUM = os.environ.get("BATCHTAP_TEST_CHROMIUM", "/usr/bin/chromium")
_BROWSER_SKIPS: list[str] = []


def browser_problem() -> str | None:
    """Why the browser tests cannot run here, or ``None`` when they can."""
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)) and not shutil.which("chromium"):
        return f"no Chromium at {CHROMIUM} (install it with: apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[dev]')"
    return None


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _BROWSER_SKIPS:
        terminalreporter.write_line(
            f"BROWSER TESTS DID NOT RUN: {len(_BROWSER_SKIPS)} skipped: {_BROWSER_SKIPS[0]}", red=True, bold=True
        )


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    problem = browser_problem()
    if problem is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the browser tests cannot run: {problem}")
        _BROWSER_SKIPS.append(problem)
        pytest.skip(problem)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM if os.path.isfile(CHROMIUM) else shutil.which("chromium"))
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh page that records every request it makes and every script error."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    pg = context.new_page()
    pg.requests = []  # type: ignore[attr-defined]
    pg.errors = []  # type: ignore[attr-defined]
    pg.dialogs = []  # type: ignore[attr-defined]
    pg.on("request", lambda r: pg.requests.append(r.url))  # type: ignore[attr-defined]
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))  # type: ignore[attr-defined]

    def on_dialog(d: Any) -> None:
        pg.dialogs.append(d.message)  # type: ignore[attr-defined]
        d.dismiss()

    pg.on("dialog", on_dialog)
    yield pg
    context.close()


HOSTILE = "<img src=x onerror=alert(1)><script>alert(2)</script>"


@dataclass(frozen=True)
class Runs:
    """The session store and its runs, all made by real training runs."""

    db: Path
    anomalies: str  #: 3 epochs x 12 steps, NaN loss at step 7 (anomaly, alert), tap.log() values
    stopped: str  #: NaN loss at step 20 with the stop action: stopped, with an action event
    hostile: str  #: named HOSTILE


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    db = tmp_path_factory.mktemp("uistore") / "batchtap.db"
    anomalies = _train.main(["--db", str(db), "--name", "ui-anomalies", "--nan-at", "7", "--log-eval"])
    stopped = _train.main(
        ["--db", str(db), "--name", "ui-stopped", "--nan-at", "20", "--nan-action", "stop", "--seed", "1"]
    )
    hostile = _train.main(["--db", str(db), "--name", HOSTILE, "--seed", "2", "--epochs", "1"])
    return Runs(db, anomalies, stopped, hostile)


@pytest.fixture
def server(runs: Runs) -> Iterator[Any]:
    import batchtap.ui

    with batchtap.ui.start(runs.db) as srv:
        yield srv


def own_requests_only(pg: Any, base: str) -> None:
    """Every request the page made went to its own server."""
    foreign = [u for u in pg.requests if not (u.startswith(base + "/") or u == base)]
    assert not foreign, f"the page requested outside its server: {foreign}"


def store_steps(db: Path | str, run_id: str, metric: str, rank: int = 0, schema: str | None = None) -> list[int]:
    import batchtap.store

    with batchtap.store.open(db, schema=schema) as st:
        return [p.step for p in st.series(run_id, metric, rank=rank)]


def train_process(*args: str) -> subprocess.Popen[str]:
    """tests/cli/_train.py in its own process: the "other process" that writes while the page is open."""
    import sys

    from tests.cli.conftest import cli_env

    return subprocess.Popen(
        [sys.executable, str(Path(_train.__file__)), *args], stdout=subprocess.PIPE, text=True, env=cli_env()
    )
