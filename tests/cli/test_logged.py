"""Values logged with ``tap.log()`` (sparse records) and skipped steps in every store-reading command:
show, plot, compare, export, tensorboard, tail, runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

import batchtap.store
from batchtap.records import Event, EventKind, Record, RunInfo, RunStatus
from batchtap.sinks.csv import part_paths, read_events, read_records, read_sparse_records
from batchtap.sinks.sqlite import SQLite
from tests.cli.conftest import Runs, cli
from tests.cli.test_tail import STEP, TIMEOUT, Lines, _steps, tail_proc, writer_proc

T0 = 1_700_000_000.0
ORANGE = (0xFF, 0x7F, 0x0E)  # matplotlib's C1: batchtap.cli._plotting.LOGGED_COLOR


@dataclass(frozen=True)
class Logged:
    db: Path
    run: str
    other: str
    steps: list[Record]
    sparse: list[Record]


def _run(db: Path, name: str, run_id: str, seed: int) -> tuple[list[Record], list[Record]]:
    """30 steps (3 epochs of 10) with loss, accuracy, AMP's loss_scale/amp_skipped; val_loss and
    val_acc logged after each epoch (the first in the same block as steps, like a flush); a new
    name, test_acc, once at the end; skipped optimizer steps 1 and 2."""
    rng = np.random.default_rng(seed)
    info = RunInfo(run_id, name, {"lr": 0.1}, T0, metrics=("loss", "accuracy", "loss_scale", "amp_skipped"))
    steps = [
        Record(run_id, s, s // 10, s % 10, 0, T0 + s, {
            "loss": float(rng.uniform(0.5, 2.0)), "accuracy": float(rng.uniform(0, 1)),
            "loss_scale": 65536.0 / (4 if s >= 2 else 2 ** s), "amp_skipped": float(s in (1, 2)),
        })
        for s in range(30)
    ]  # fmt: skip
    sparse = [
        Record(
            run_id,
            s,
            s // 10,
            -1,
            0,
            T0 + s + 0.5,
            {"val_loss": float(rng.uniform(0.2, 1)), "val_acc": float(rng.uniform(0.5, 1))},
            sparse=True,
        )
        for s in (9, 19, 29)
    ]
    sparse.append(Record(run_id, 29, 2, -1, 0, T0 + 40.0, {"test_acc": 0.875}, sparse=True))
    skips = [
        Event(run_id, s, EventKind.SKIP, f"step {s}: the AMP GradScaler skipped the optimizer step", T0 + s)
        for s in (1, 2)
    ]
    sink = SQLite(db)
    sink.start_run(info)
    sink.write([*steps[:10], sparse[0]], skips)
    sink.write(steps[10:20])
    sink.write([sparse[1]])
    sink.write([*steps[20:], sparse[2], sparse[3]])
    sink.end_run(replace(info, status=RunStatus.FINISHED, ended_at=T0 + 41.0))
    sink.close()
    return steps, sparse


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> Logged:
    db = tmp_path_factory.mktemp("logged") / "batchtap.db"
    steps, sparse = _run(db, "evals", "e" * 32, 0)
    _run(db, "evals-2", "f" * 32, 1)
    return Logged(db, "e" * 32, "f" * 32, steps, sparse)


def _png(path: Path) -> np.ndarray:
    mpimg = pytest.importorskip("matplotlib.image")
    assert path.is_file()
    return mpimg.imread(path)[:, :, :3]


def _pixels(img: np.ndarray, rgb: tuple[int, int, int]) -> int:
    return int(np.all(np.abs(img - np.array(rgb) / 255) < 0.02, axis=2).sum())


def test_show_lists_logged_values_apart_with_their_last_value_and_count(logged: Logged) -> None:
    done = cli("show", "evals", "--db", str(logged.db))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "steps        30 (steps 0..29)" in out
    metrics = out.split("\nmetrics\n")[1].split("\nlogged values (tap.log)\n")[0].splitlines()
    assert [line.split()[0] for line in metrics[1:]] == ["loss", "accuracy", "loss_scale", "amp_skipped"]
    section = out.split("\nlogged values (tap.log)\n")[1].split("\nevents:")[0].splitlines()
    assert section[0].split() == ["name", "at", "step", "last", "min", "max", "values"]
    rows = {line.split()[0]: line.split()[1:] for line in section[1:]}
    assert list(rows) == ["test_acc", "val_acc", "val_loss"]
    assert rows["test_acc"] == ["29", "87.50%", "87.50%", "87.50%", "1"]  # a fraction shown as the console shows it
    last = logged.sparse[2].values["val_loss"]
    assert rows["val_loss"][0] == "29" and float(rows["val_loss"][1]) == pytest.approx(last, rel=1e-3)
    assert rows["val_loss"][-1] == "3"
    assert "events: 0 anomalies, 0 actions, 0 warnings, 0 notes, 2 skipped steps" in out
    assert sum(line.split()[1:2] == ["skip"] for line in out.splitlines()) == 2


def test_runs_counts_steps_without_the_logged_values(logged: Logged) -> None:
    done = cli("runs", "--db", str(logged.db))
    assert done.returncode == 0, done.stderr
    row = next(line.split() for line in done.stdout.splitlines() if line.startswith("evals "))
    assert row[3] == "30" and row[-1] == "0"  # steps; anomalies: skipped steps are none


def test_plot_draws_logged_values_as_dots(logged: Logged, tmp_path: Path) -> None:
    out = tmp_path / "eval.png"
    done = cli("plot", "evals", "--db", str(logged.db), "-m", "loss", "-m", "val_loss", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "2 panels (loss, val_loss), 33 points" in done.stdout
    assert "logged values (tap.log) drawn as dots, unsmoothed: val_loss (3)" in done.stdout
    assert _pixels(_png(out), ORANGE) > 100  # three dots and the line joining them
    only = tmp_path / "only.png"
    done = cli("plot", "evals", "--db", str(logged.db), "-m", "test_acc", "-o", str(only))
    assert done.returncode == 0 and "1 points" in done.stdout, done.stderr
    assert _pixels(_png(only), ORANGE) > 20  # a single point is still drawn


def test_compare_overlays_logged_values(logged: Logged, tmp_path: Path) -> None:
    out = tmp_path / "cmp.png"
    done = cli("compare", "evals", "evals-2", "--db", str(logged.db), "-m", "val_acc", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "2 runs, 1 panels (val_acc)" in done.stdout
    img = _png(out)
    assert _pixels(img, (0x1F, 0x77, 0xB4)) > 50 and _pixels(img, ORANGE) > 50


def test_csv_export_puts_logged_values_in_a_long_form_sidecar(logged: Logged, tmp_path: Path) -> None:
    out = tmp_path / "evals.csv"
    done = cli("export", "evals", "--db", str(logged.db), "-f", "csv", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert (
        f"wrote 30 records and 2 events to {out} (4 records of tap.log() values in {tmp_path / 'evals.sparse.csv'})"
        in done.stderr
    )
    assert [p.name for p in part_paths(out)] == ["evals.csv"]
    assert (
        out.read_text().splitlines()[0] == "run_id,step,epoch,batch,rank,wall_time,loss,accuracy,loss_scale,amp_skipped"
    )
    assert read_records(out) == logged.steps
    assert read_sparse_records(out) == logged.sparse  # exact, one record per log() call
    assert [(e.step, e.kind) for e in read_events(out)] == [(1, EventKind.SKIP), (2, EventKind.SKIP)]
    again = cli("export", "evals", "--db", str(logged.db), "-f", "csv", "-o", str(out))
    assert again.returncode == 1 and "--force" in again.stderr
    out.unlink()
    again = cli("export", "evals", "--db", str(logged.db), "-f", "csv", "-o", str(out))
    assert again.returncode == 1 and "evals.events.csv exists" in again.stderr  # the sidecars count too
    forced = cli("export", "evals", "--db", str(logged.db), "-f", "csv", "-o", str(out), "--force")
    assert forced.returncode == 0 and read_sparse_records(out) == logged.sparse  # replaced, not appended


def test_csv_export_to_stdout_says_where_the_logged_values_are(logged: Logged) -> None:
    done = cli("export", "evals", "--db", str(logged.db), "-f", "csv")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 31 and "val_loss" not in done.stdout
    assert "tap.log() values are not in CSV on stdout; use -o FILE to get FILE.sparse.csv" in done.stderr


def test_jsonl_export_has_logged_records_after_their_step(logged: Logged) -> None:
    done = cli("export", "evals", "--db", str(logged.db), "-f", "jsonl")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    records = [x for x in lines if x["type"] == "record"]
    assert len(records) == 34
    marked = [(r["step"], r.get("sparse", False)) for r in records]
    assert marked == sorted(marked)  # a step's logged values follow its step record
    sparse = [r for r in records if r.get("sparse")]
    assert [{k: v for k, v in r.items() if k != "type"} for r in sparse] == [r.to_dict() for r in logged.sparse]
    picked = cli("export", "evals", "--db", str(logged.db), "-f", "jsonl", "-m", "val_loss")
    rows = [json.loads(line) for line in picked.stdout.splitlines() if '"record"' in line]
    assert [(r["step"], r["sparse"], set(r) - {"type", "run_id", "step", "epoch", "batch", "rank", "wall_time", "sparse"}) for r in rows] == [
        (9, True, {"val_loss"}), (19, True, {"val_loss"}), (29, True, {"val_loss"}),
    ]  # fmt: skip


def test_tensorboard_writes_logged_values_under_their_own_names(logged: Logged, tmp_path: Path) -> None:
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    done = cli("tensorboard", "evals", "--db", str(logged.db), "--logdir", str(tmp_path / "tb"))
    assert done.returncode == 0, done.stderr
    acc = ea_mod.EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert {"val_loss", "val_acc", "test_acc", "train/loss"} <= set(acc.Tags()["scalars"])
    assert [(e.step, e.wall_time) for e in acc.Scalars("val_loss")] == [
        (r.step, r.wall_time) for r in logged.sparse[:3]
    ]
    assert [e.value for e in acc.Scalars("test_acc")] == [0.875]
    assert [t.step for t in acc.Tensors("events/skip/text_summary")] == [1, 2]


def test_tail_of_an_ended_run_prints_logged_values_after_their_step(logged: Logged) -> None:
    done = cli("tail", "evals", "--db", str(logged.db), "-n", "12", "-m", "loss")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert _steps(lines) == list(range(18, 30))
    assert not any(line.startswith("eval ") for line in lines)  # -m loss: the loss column, no logged value
    done = cli("tail", "evals", "--db", str(logged.db), "-n", "12")
    lines = done.stdout.splitlines()
    evals = [i for i, line in enumerate(lines) if line.startswith("eval ")]
    assert [lines[i].split()[:3] for i in evals] == [
        ["eval", "step=19", "epoch=1"],
        ["eval", "step=29", "epoch=2"],
        ["eval", "step=29", "epoch=2"],
    ]  # fmt: skip (step 9 is before the last 12 steps)
    assert lines[evals[0] - 1].startswith("step=19 ") and lines[evals[0] + 1].startswith("step=20 ")
    assert lines[evals[2]].endswith(" test_acc=0.875")
    assert "val_loss=" in lines[evals[0]] and "val_acc=" in lines[evals[0]] and "val_loss" not in lines[evals[0] - 1]
    # -m picks logged values too: they stay eval lines, never a column of the step lines
    done = cli("tail", "evals", "--db", str(logged.db), "-n", "30", "-m", "loss", "-m", "val_loss")
    lines = done.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("eval ")] == ["step=9", "step=19", "step=29"]
    assert all(line.count("=") == 4 for line in lines if STEP.match(line))


def test_tail_live_table_shows_the_latest_logged_values_and_skips(logged: Logged) -> None:
    import os
    import pty

    from tests.cli.conftest import popen

    master, slave = pty.openpty()
    proc = popen(
        [sys.executable, "-m", "batchtap.cli.main", "tail", "evals", "--db", str(logged.db), "-n", "5"],
        stdout=slave,
        stderr=subprocess.PIPE,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=TIMEOUT) == 0
    os.close(master)
    screen = b"".join(chunks).decode()
    assert re.search(r"step\s+epoch\s+batch\s+loss\s+accuracy\s*\x1b", screen)  # no logged column
    assert re.search(
        r"logged  val_acc \S+ \(step 29\)  val_loss \S+ \(step 29\)  test_acc 0\.875 \(step 29\)", screen
    ), screen
    assert "anomalies 0  actions 0  warnings 0  notes 0  skipped steps 2" in screen


def test_tail_shows_logged_values_as_a_training_process_logs_them(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    db = tmp_path / "live.db"
    name = f"tail-{uuid.uuid4().hex[:8]}"
    tail = tail_proc(db, name, "--wait", str(TIMEOUT))
    procs.append(tail)
    Lines(tail.stderr).wait_for("waiting up to")
    out = Lines(tail.stdout)
    writer = writer_proc(db, name, "--sleep", "0.02", "--log-eval")
    procs.append(writer)
    assert writer.wait(timeout=TIMEOUT) == 0, writer.stderr.read() if writer.stderr else ""
    lines = out.rest()
    assert tail.wait(timeout=TIMEOUT) == 0
    assert _steps(lines) == list(range(36)), lines
    evals = [i for i, line in enumerate(lines) if line.startswith("eval ")]
    assert [lines[i].split()[1] for i in evals] == ["step=11", "step=23", "step=35", "step=35"], lines
    for i in evals[:3]:
        assert "val_loss=" in lines[i] and "val_acc=" in lines[i]
        assert lines[i - 1].startswith(f"{lines[i].split()[1]} ")  # right after the step it names
    assert lines[evals[3]].endswith("test_acc=0.5")
    with batchtap.store.open(db) as st:
        run = st.run(name)
        assert run.steps == 36 and st.sparse_names(run.id) == ["test_acc", "val_acc", "val_loss"]


def test_the_cli_store_runs_have_no_logged_values(runs: Runs) -> None:
    # the shared store of the other CLI tests: show has no logged section and counts no skips
    done = cli("show", "cli-base", "--db", str(runs.db))
    assert "logged values" not in done.stdout and "0 skipped steps" in done.stdout
