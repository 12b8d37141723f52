"""Running a benchmark script's ``--quick`` smoke run, as the bench smoke tests do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_quick(script: str, *args: str) -> str:
    """Run ``bench/<script> --quick`` (plus ``args``) from the repository root; its stdout, after
    checking it exited 0."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args, "--quick"],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, f"bench/{script} failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout
