"""Real processes for the fault tests: the CLI and small training scripts, run as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def env(**extra: str) -> dict[str, str]:
    """The environment of a child process: this checkout importable (after any PYTHONPATH given)."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("BATCHTAP_DB")}
    out["PYTHONPATH"] = os.pathsep.join(
        p for p in [os.environ.get("PYTHONPATH", ""), str(REPO / "src"), str(REPO)] if p
    )
    out.update(extra)
    return out


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``batchtap ARGS`` in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "batchtap.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env(),
    )


def python(code: str, argv: Sequence[str] = (), *, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``python -c CODE ARGV...`` in a fresh process (``sys.argv[1:]`` is ``argv``)."""
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout, check=False, env=env()
    )
