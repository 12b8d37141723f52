"""Keras 3 ``fit()`` with BatchtapCallback on the torch backend as on TensorFlow: per-output values,
the stop at a NaN gradient's own step, and a pipeline process that loads neither torch nor TensorFlow.

keras.io-style scripts (a functional two-output model, ``model.fit``) from
tests/integrations/keras_shapes.py, run in a subprocess per backend (Keras picks its backend once
per process). Each stored per-batch value is held to a twin model trained by a plain loop in the
same process (``torch.autograd.grad`` on the torch backend, ``GradientTape`` on TensorFlow) with
Keras' own loss functions and a Keras accuracy metric reset every batch. The TensorFlow side of the
first two lives in test_keras.py (its ``shapes`` fixture runs every case there).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.timeout(900),  # a subprocess trains several fits; slow on a loaded machine
    pytest.mark.keras,
    pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="needs batchtap[keras] (keras)"),
]

SHAPES = Path(__file__).with_name("keras_shapes.py")


def _shapes(backend: str, out: Path, cases: tuple[str, ...]) -> dict[str, Any]:
    if backend == "tensorflow" and importlib.util.find_spec("tensorflow") is None:
        pytest.skip("needs batchtap[keras] (tensorflow-cpu)")
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(SHAPES), str(out), *cases], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    assert result["backend"] == backend
    return result


@pytest.fixture(scope="module")
def torch_shapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("torch-shapes") / "shapes.json"
    return _shapes("torch", out, ("dict", "list", "nan_grad", "process_pipeline", "planted_accuracy"))


@pytest.fixture(scope="module")
def tf_pipeline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("tf-pipeline") / "shapes.json"
    return _shapes("tensorflow", out, ("process_pipeline",))


def _equal_to_truth(case: dict[str, Any], names: tuple[str, ...]) -> None:
    rows, truth = case["rows"], case["truth"]
    assert [r["step"] for r in rows] == list(range(len(truth)))
    for row in rows:
        for name in names:
            expected = truth[row["step"]][name]
            assert name in row, (row["step"], name)
            assert row[name] == pytest.approx(expected, rel=2e-5, abs=1e-6), (row["step"], name)
    assert case["status"] == "finished", case["reason"]


@pytest.mark.parametrize("kind", ["dict", "list"])
def test_torch_backend_two_output_models_store_every_head_exact(torch_shapes: dict[str, Any], kind: str) -> None:
    case = torch_shapes[kind]
    _equal_to_truth(case, ("loss", "loss/head_a", "loss/head_b", "accuracy/head_a", "grad_norm", "lr"))
    # no pooled accuracy over both heads, none for the regression head
    assert "accuracy" not in case["metrics"] and "accuracy/head_b" not in case["metrics"]
    for row in case["rows"][1:]:  # 16 samples a step, not one per head
        assert row["throughput"] * row["step_time"] == pytest.approx(16, rel=1e-6)


def test_torch_backend_per_head_accuracy_is_held_to_its_domain(torch_shapes: dict[str, Any]) -> None:
    """``accuracy/head_a`` is an accuracy of the run (as on TensorFlow), not a plain extra: a value
    outside [0, 1] (planted at the third step) is an anomaly of that step and that value."""
    case = torch_shapes["planted_accuracy"]
    anomalies = [(e["step"], e["metric"]) for e in case["events"] if e["kind"] == "anomaly"]
    assert anomalies == [(2, "accuracy/head_a")], case["events"]
    for row in case["rows"]:  # stored as NaN at that step; Keras' own per-batch accuracy elsewhere
        expected = math.nan if row["step"] == 2 else case["truth"][row["step"]]["accuracy/head_a"]
        assert row["accuracy/head_a"] == pytest.approx(expected, rel=2e-5, abs=1e-6, nan_ok=True), row["step"]


def test_torch_backend_nan_gradient_with_a_finite_loss_stops_at_its_step(torch_shapes: dict[str, Any]) -> None:
    case = torch_shapes["nan_grad"]
    assert case["status"] == "stopped" and "gradient norm" in case["reason"] and "step 3" in case["reason"]
    assert [r["step"] for r in case["rows"]] == [0, 1, 2, 3]  # nothing after the NaN step
    assert all(math.isfinite(r["loss"]) for r in case["rows"])  # the loss was finite: the norm said it
    anomalies = [e for e in case["events"] if e["kind"] == "anomaly"]
    assert [(e["step"], e["metric"]) for e in anomalies] == [(3, "grad_norm")]
    stops = [e for e in case["events"] if e["kind"] == "action"]
    assert [(e["step"], e["metric"]) for e in stops] == [(3, "grad_norm")]
    assert case["iterations"] == 4  # Keras ran no step after it (as on TensorFlow)


def test_the_norm_watch_sees_the_first_non_finite_norm_with_no_host_read() -> None:
    """The torch backend's NaN-gradient stop reads a host float the device writes, never a tensor."""
    import torch

    from batchtap.hostreads import HostReadCounter
    from batchtap.integrations._keras_torch import NormWatch

    watch = NormWatch()
    with HostReadCounter() as reads:
        seen = [watch.see(torch.tensor(v)) for v in (1.0, 2.0, math.nan, 3.0, math.inf)]
    assert seen == [None, None, 2, 2, 2]  # the first bad step's index, kept
    assert reads.count == 0, reads.reads


@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_the_pipeline_process_loads_neither_torch_nor_tensorflow(backend: str, request: pytest.FixtureRequest) -> None:
    """``bt.Tap(pipeline="process")`` under ``fit()``: the TensorFlow ring's metrics (and the torch
    backend's, extras included) decode in that process as torch-free twins, and the values it stores
    are the same exact ones."""
    result = request.getfixturevalue("torch_shapes" if backend == "torch" else "tf_pipeline")
    case = result["process_pipeline"]
    _equal_to_truth(case, ("loss", "loss/head_a", "loss/head_b", "accuracy/head_a", "grad_norm", "lr"))
    seen = case["notes"]
    assert [n["call"] for n in seen][0] == "start_run" and [n["call"] for n in seen][-1] == "end_run"
    assert sum(n["call"] == "write" for n in seen) >= 2
    assert all(n["pid"] != case["pid"] for n in seen), "the sink ran in the training process"
    assert not any(n["torch"] or n["tensorflow"] for n in seen), f"the pipeline process loaded a framework: {seen}"


# ---------------------------------------------------------------------- the console beside Keras' bar

CONSOLE = Path(__file__).with_name("keras_console_script.py")


def _console_run(mode: str, tmp_path: Path, backend: str = "torch") -> tuple[list[str], list[dict[str, str]]]:
    """stdout of keras_console_script.py split into lines at ``\\n`` only (Keras redraws its bar
    with ``\\r`` / backspaces inside one line), and the run's events."""
    if backend == "tensorflow" and importlib.util.find_spec("tensorflow") is None:
        pytest.skip("needs batchtap[keras] (tensorflow-cpu)")
    out = tmp_path / "events.json"
    env = {**os.environ, "KERAS_BACKEND": backend, "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run([sys.executable, str(CONSOLE), str(out), mode], env=env, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-4000:]
    return proc.stdout.decode().split("\n"), json.loads(out.read_text())


def test_console_lines_wait_for_keras_progress_bar_any_tap(tmp_path: Path) -> None:
    """A user's Tap with a Console printing into Keras' own stdout, batches slow enough that its
    lines fall due while the bar is drawn: each epoch's bar stays one line (redrawn in place), and
    every batch's console line is printed whole, between bars."""
    lines, events = _console_run("thread", tmp_path)
    bars = [i for i, line in enumerate(lines) if "━" in line]
    assert len(bars) == 2, [line.replace("\b", "")[:60] for line in lines]  # one per epoch: never cut
    steps = [i for i, line in enumerate(lines) if line.startswith("epoch ")]
    assert [lines[i].split(":")[0] for i in steps] == [f"epoch {e} batch {b}" for e in range(2) for b in range(8)]
    assert not any(bars[0] < i < bars[1] and lines[i].startswith("epoch 1 ") for i in steps)  # after its bar
    assert all(i > bars[0] for i in steps)  # the first epoch's lines waited for its bar's end
    assert any("finished: 16 steps" in line for line in lines[bars[1] :])
    assert not [e for e in events if e["kind"] == "warning"]


def test_console_in_a_pipeline_process_is_named_as_out_of_reach(tmp_path: Path) -> None:
    """Under pipeline='process' the console prints from that process: fit() cannot hold it, and the
    run says so once, with the fix (the bar is cut there: documented in docs/keras.md)."""
    _, events = _console_run("process", tmp_path)
    said = [e["message"] for e in events if "progress bar" in e["message"]]
    assert len(said) == 1 and "pipeline='process'" in said[0] and "verbose=2" in said[0], events


@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_console_lines_wait_for_evaluates_progress_bar(tmp_path: Path, backend: str) -> None:
    """``evaluate(verbose=1, callbacks=[cb])`` outside fit(): the values a user's callback logs on
    each slow test batch, and the ``eval_*`` line, print after evaluate's bar has ended, never
    inside it; none is lost."""
    lines, _ = _console_run("evaluate", tmp_path, backend)
    bars = [i for i, line in enumerate(lines) if "━" in line]
    logged = [i for i, line in enumerate(lines) if line.startswith("eval  step")]
    assert bars and len(logged) == 9, [line.replace("\b", "")[:60] for line in lines]  # 8 probes, eval_loss
    assert max(bars) < min(logged), [line.replace("\b", "")[:60] for line in lines]
    assert sum("eval_loss" in lines[i] for i in logged) == 1  # printed by the pipeline thread: maybe later
