"""`batchtap plot` and `compare`: real PNGs, their size, content and anomaly marks."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.cli.conftest import Runs, cli

mpimg = pytest.importorskip("matplotlib.image")

ANOMALY_RGB = (1.0, 0.0, 0.0)  # batchtap.cli._plotting.ANOMALY_COLOR


def _png(path: Path) -> np.ndarray:
    assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return mpimg.imread(path)[:, :, :3]


def _red_pixels(img: np.ndarray) -> int:
    return int(np.all(np.abs(img - np.array(ANOMALY_RGB)) < 0.02, axis=2).sum())


def test_plot_writes_a_png_of_the_requested_size_with_anomalies_marked(runs: Runs, tmp_path: Path) -> None:
    out = tmp_path / "loss.png"
    done = cli(
        "plot",
        "cli-stop",
        "--db",
        str(runs.db),
        "-m",
        "loss",
        "-m",
        "accuracy",
        "--smooth",
        "0.9",
        "-o",
        str(out),
        "--size",
        "900x600",
    )
    assert done.returncode == 0, done.stderr
    img = _png(out)
    assert img.shape[:2] == (600, 900)
    assert img.std() > 0.05  # not blank
    marked = re.search(r"(\d+) anomalies marked, (\d+) actions marked", done.stdout)
    assert marked, done.stdout
    assert (int(marked[1]), int(marked[2])) == (1, 1)  # one NaN step; one stop (requested + taken)
    assert _red_pixels(img) > 20


def test_a_run_without_anomalies_has_no_anomaly_marks(runs: Runs, tmp_path: Path) -> None:
    out = tmp_path / "clean.png"
    done = cli("plot", "cli-clean", "--db", str(runs.db), "-o", str(out), "--x", "time", "--smooth", "0")
    assert done.returncode == 0, done.stderr
    assert "0 anomalies marked, 0 actions marked" in done.stdout
    img = _png(out)
    assert img.shape[:2] == (700, 1200) and img.std() > 0.05
    assert _red_pixels(img) == 0


def test_plot_default_output_is_named_after_the_run(runs: Runs, tmp_path: Path) -> None:
    done = cli("plot", runs.base[:8], "--db", str(runs.db), "-m", "grad_norm", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "cli-base.png").is_file()
    # loss is not on a panel: its anomaly is marked at the top of the grad_norm panel
    assert "1 anomalies marked" in done.stdout


def test_plot_unknown_metric_exits_1_naming_the_metrics_there_are(runs: Runs, tmp_path: Path) -> None:
    done = cli("plot", "cli-base", "--db", str(runs.db), "-m", "los", "-o", str(tmp_path / "x.png"))
    assert done.returncode == 1 and "'los'" in done.stderr and "loss" in done.stderr
    assert not (tmp_path / "x.png").exists()


def test_compare_overlays_runs(runs: Runs, tmp_path: Path) -> None:
    out = tmp_path / "cmp.png"
    done = cli(
        "compare",
        "cli-base",
        "cli-clean",
        runs.stopped[:10],
        "--db",
        str(runs.db),
        "-m",
        "loss",
        "-m",
        "accuracy",
        "-o",
        str(out),
        "--size",
        "1000x500",
    )
    assert done.returncode == 0, done.stderr
    assert "3 runs, 2 panels (loss, accuracy), 2 anomalies marked" in done.stdout
    img = _png(out)
    assert img.shape[:2] == (500, 1000) and img.std() > 0.05 and _red_pixels(img) > 20
    # a run's colour is on the picture: C0, C1, C2 of matplotlib's default cycle
    for rgb in ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E), (0x2C, 0xA0, 0x2C)):
        assert np.all(np.abs(img - np.array(rgb) / 255) < 0.02, axis=2).sum() > 50


def test_compare_unknown_run_exits_1(runs: Runs, tmp_path: Path) -> None:
    done = cli("compare", "cli-base", "nope-run", "--db", str(runs.db), "-o", str(tmp_path / "c.png"))
    assert done.returncode == 1 and "no run 'nope-run'" in done.stderr
