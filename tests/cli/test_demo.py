"""`batchtap demo` as a user runs it: a subprocess, reading its files back."""

from __future__ import annotations

import json
import subprocess
import sys


def _demo(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "batchtap.cli.main", "demo", "--out", str(tmp_path), "--epochs", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


def test_demo_trains_and_stores_metrics(tmp_path) -> None:
    done = _demo(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "epoch 1 batch 40: loss=" in done.stderr
    assert f"metrics stored in {tmp_path / 'batchtap.db'}" in done.stdout
    rows = [json.loads(line) for line in (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in rows if r["type"] == "record" and not r.get("sparse")]
    assert len(records) == 2 * 45
    logged = [r for r in rows if r["type"] == "record" and r.get("sparse")]
    assert [set(r) & {"test_accuracy", "loss"} for r in logged] == [{"test_accuracy"}] * 2, logged
    assert records[-1]["accuracy"] > 0.5 and rows[-1]["status"] == "finished"
    assert {"loss", "accuracy", "accuracy_top5", "lr", "grad_norm", "step_time", "data_time", "throughput"} <= set(
        records[-1]
    )


def test_demo_inject_nan_stops_at_once(tmp_path) -> None:
    done = _demo(tmp_path, "--inject-nan-at", "30")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in rows if r["type"] == "record" and not r.get("sparse")]
    assert records[-1]["step"] <= 32 and records[-1]["loss"] == "nan"
    assert rows[-1]["status"] == "stopped" and "nonfinite(loss) at step 30" in rows[-1]["stop_reason"]
    assert "stopped at step" in done.stdout


def test_demo_inject_spike_rolls_back_and_recovers(tmp_path) -> None:
    done = _demo(tmp_path, "--inject-spike-at", "50", "--epochs", "3")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()]
    actions = [r["message"] for r in rows if r["type"] == "event" and r["kind"] == "action"]
    assert any("restored" in m for m in actions), actions
    assert any("skipped batches" in m for m in actions)
    records = [r for r in rows if r["type"] == "record" and not r.get("sparse")]
    assert rows[-1]["status"] == "finished" and records[-1]["loss"] < 1.0
    import sqlite3

    with sqlite3.connect(tmp_path / "batchtap.db") as conn:
        kinds = {k for (k,) in conn.execute("SELECT kind FROM events")}
    assert {"action", "anomaly"} <= kinds


def test_cli_without_command_prints_usage() -> None:
    done = subprocess.run([sys.executable, "-m", "batchtap.cli.main"], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "demo" in done.stdout
