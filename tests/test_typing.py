"""The public API is typed: mypy is clean on src/ (skipped when mypy is not installed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "batchtap"


def test_mypy_is_clean_on_src() -> None:
    pytest.importorskip("mypy")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", str(SRC), "--ignore-missing-imports", "--no-incremental"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:]
