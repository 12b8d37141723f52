"""Fixtures of the CLI tests: a store written by real short training runs, and a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cli import _train

REPO = Path(__file__).resolve().parents[2]
TRAIN = Path(_train.__file__)


@dataclass(frozen=True)
class Runs:
    """The session store and the ids of its runs."""

    db: Path
    base: str  #: 3 epochs x 12 steps, NaN loss recorded at step 7 (anomaly, alert only)
    stopped: str  #: NaN loss at step 20 with the stop action: anomaly + actions, status stopped
    clean: str  #: no anomaly at all


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    db = tmp_path_factory.mktemp("store") / "batchtap.db"
    base = _train.main(["--db", str(db), "--name", "cli-base", "--nan-at", "7"])
    stopped = _train.main(
        ["--db", str(db), "--name", "cli-stop", "--nan-at", "20", "--nan-action", "stop", "--seed", "1"]
    )
    clean = _train.main(["--db", str(db), "--name", "cli-clean", "--seed", "2"])
    return Runs(db, base, stopped, clean)


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHTAP_DB")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def cli(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``batchtap ARGS`` as a user would: a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "batchtap.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=cwd,
        env=env or cli_env(),
    )


def popen(argv: Sequence[str], **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen(list(argv), text=True, env=cli_env(), **kwargs)  # type: ignore[call-overload]


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts; any still running at its end is killed (only these, by handle)."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait()
