"""The loud GPU-skip summary and the failure where a GPU is expected, on a small suite of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SUITE = {
    "test_model_gpu.py": (
        "import pytest\n"
        "pytestmark = pytest.mark.skipif(True, reason='needs a CUDA device')\n"
        "def test_a(): pass\n"
        "def test_b(): pass\n"
    ),
    "test_cpu.py": (
        "import pytest\n"
        "def test_runs(): pass\n"
        "@pytest.mark.skip(reason='needs CUDA graphs')\n"
        "def test_cuda_only(): pass\n"
        "@pytest.mark.skip(reason='slow')\n"
        "def test_unrelated_skip(): pass\n"
    ),
}


def _pytest(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    for name, text in SUITE.items():
        (tmp_path / name).write_text(text)
    environ = {k: v for k, v in os.environ.items() if k != "BATCHTAP_REQUIRE_GPU"}
    environ.update(env, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests._gpu_skips", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_cpu_run_says_loudly_that_the_gpu_tests_did_not_run(tmp_path: Path) -> None:
    proc = _pytest(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    (loud,) = [line for line in lines if "GPU TESTS DID NOT RUN" in line]
    assert "3 skipped (no CUDA device) in test_cpu.py, test_model_gpu.py" in loud
    assert any("bash bench/gpu_check.sh" in line for line in lines)


def test_where_a_gpu_is_expected_a_skipped_gpu_test_fails(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, BATCHTAP_REQUIRE_GPU="1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 passed, 1 skipped, 3 errors" in proc.stdout  # a skip at set-up becomes a set-up error
    assert "GPU test skipped where a GPU is expected" in proc.stdout
    assert "GPU TESTS DID NOT RUN" not in proc.stdout
