"""Keras 3 ``fit()`` with BatchtapCallback, on the TensorFlow and the torch backends.

Each backend runs in a subprocess (tests/integrations/keras_worker.py): Keras picks its backend
once per process, and this process never imports TensorFlow. For 64 batches every stored value
(loss, accuracy, lr under an ExponentialDecay schedule, gradient norm) is compared with an
independent float64 numpy reference of the same training, with ``jit_compile`` off and on and
``steps_per_execution`` 1 and 10 (TensorFlow; the torch backend allows 1 only); a NaN at batch 20
stops training there; host reads are counted against the same fit without batchtap.
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
    pytest.mark.timeout(900),  # a worker subprocess trains many fits; slow on a loaded 2-core machine
    pytest.mark.keras,
    pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="needs batchtap[keras] (keras)"),
]

WORKER = Path(__file__).with_name("keras_worker.py")
BACKENDS = ("tensorflow", "torch")
VALUES = ("loss", "accuracy", "lr", "grad_norm")


def _run(backend: str, tmp: Path) -> dict[str, Any]:
    if backend == "tensorflow" and importlib.util.find_spec("tensorflow") is None:
        pytest.skip("needs batchtap[keras] (tensorflow-cpu)")
    out = tmp / f"{backend}.json"
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.fixture(scope="module", params=BACKENDS)
def worker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(request.param, tmp_path_factory.mktemp("keras"))


def _cases(result: dict[str, Any], prefix: str) -> list[str]:
    return [key for key in result if key.startswith(prefix)]


def test_every_batch_value_equals_the_reference(worker: dict[str, Any]) -> None:
    cases = _cases(worker, "exact")
    assert len(cases) >= (6 if worker["backend"] == "tensorflow" else 4), cases
    for case in cases:
        result = worker[case]
        rows, reference = result["rows"], result["reference"]
        assert [r["step"] for r in rows] == list(range(64)), case  # one row per batch, spe=10 too
        assert [(r["epoch"], r["batch"]) for r in rows] == [(k // 32, k % 32) for k in range(64)], case
        for row in rows:
            expected = reference[row["step"]]
            for name in VALUES:
                assert row[name] == pytest.approx(expected[name], rel=2e-5, abs=1e-7), (case, row["step"], name)
            # Keras' own logs hold running means: a per-batch value differs from them (not checked here)
        with_time = [r for r in rows if "step_time" in r]
        assert len(with_time) >= 63 and all(r["step_time"] > 0 and r["throughput"] > 0 for r in with_time), case
        assert result["status"] == "finished", case


def test_validation_results_are_stored_as_sparse_values(worker: dict[str, Any]) -> None:
    logged = worker["exact-jit0-spe1"]["logged"]
    assert len(logged) == 2  # one per epoch
    assert all(set(v) == {"val_loss", "val_accuracy"} for v in logged)
    assert worker["exact-jit0-spe1"]["logged_at"] == [[0, 31], [1, 63]]  # each epoch's last step, with its epoch


def test_a_nan_at_batch_k_stops_training_there(worker: dict[str, Any]) -> None:
    for case in _cases(worker, "nan"):
        result = worker[case]
        assert result["steps"] == list(range(21)), case  # nothing recorded after the NaN batch 20
        assert result["status"] == "stopped" and "non-finite loss" in result["reason"], case
        # steps 0..20 updated the weights (as Keras would at 20); at most one more (k + 1)
        assert 21 <= result["iterations"] <= 22, case


def test_batchtap_adds_no_host_read_per_step(worker: dict[str, Any]) -> None:
    reads = worker["reads-jit0"]
    added = reads["with"] - reads["without"]
    flushes = reads["steps"] // 16 + 3  # flush_every=16, one per epoch end, one at the run's end
    if worker["backend"] == "tensorflow":
        # exactly the ring reads the callback made itself: two per flush, none per step
        assert added == reads["batchtap_reads"], reads
        assert added <= 2 * flushes, reads
    else:
        # the Tap's own flush reads its CPU ring into numpy (once per flush); nothing per step
        assert reads["batchtap_reads"] == 0
        assert 0 <= added <= flushes, reads


# ---------------------------------------------------------------------- model shapes (keras_shapes.py)

SHAPES = Path(__file__).with_name("keras_shapes.py")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case of keras_shapes.py on TensorFlow, each next to its GradientTape truth."""
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("needs batchtap[keras] (tensorflow-cpu)")
    out = tmp_path_factory.mktemp("shapes") / "shapes.json"
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(SHAPES), str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _equal_to_truth(case: dict[str, Any], names: tuple[str, ...]) -> None:
    rows, truth = case["rows"], case["truth"]
    assert [r["step"] for r in rows] == list(range(len(truth)))
    for row in rows:
        for name in names:
            expected = truth[row["step"]][name]
            assert row[name] == pytest.approx(expected, rel=2e-5, abs=1e-6), (row["step"], name)
    assert case["status"] == "finished"


@pytest.mark.parametrize("kind", ["dict", "list"])
def test_two_output_models_store_every_head_exact(shapes: dict[str, Any], kind: str) -> None:
    case = shapes[kind]
    _equal_to_truth(case, ("loss", "loss/head_a", "loss/head_b", "accuracy/head_a", "grad_norm", "lr"))
    assert "accuracy" not in case["metrics"] and "accuracy/head_b" not in case["metrics"]  # a regression head
    for row in case["rows"][1:]:  # 16 samples a step, not one per head (the first call includes tracing)
        assert row["throughput"] * row["step_time"] == pytest.approx(16, rel=1e-6)
    assert any("mae" in e["message"] and e["kind"] == "info" for e in case["events"])  # named, not stored: a note


@pytest.mark.parametrize("case", ["class_weight", "labels_n1"])
def test_class_weights_weight_the_loss_and_n1_labels_score_right(shapes: dict[str, Any], case: str) -> None:
    _equal_to_truth(shapes[case], ("loss", "accuracy", "grad_norm"))


def test_embedding_grad_norm_is_the_dense_gradients_norm(shapes: dict[str, Any]) -> None:
    _equal_to_truth(shapes["embedding"], ("loss", "grad_norm"))


def test_loss_scale_skips_from_the_first_step_are_skip_events(shapes: dict[str, Any]) -> None:
    case = shapes["loss_scale"]
    assert case["status"] == "finished", case["reason"]
    assert [r["step"] for r in case["rows"]] == list(range(16))
    skips = {e["step"] for e in case["events"] if e["kind"] == "skip"}
    assert 0 in skips and len(skips) < 16
    assert not [e for e in case["events"] if e["kind"] == "anomaly"]
    for row in case["rows"]:
        assert ("grad_norm" in row) == (row["step"] not in skips), row


def test_a_nan_gradient_with_a_finite_loss_stops_the_run_there(shapes: dict[str, Any]) -> None:
    case = shapes["nan_grad"]
    assert case["status"] == "stopped" and "gradient norm" in case["reason"]
    assert [r["step"] for r in case["rows"]] == [0, 1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in case["rows"])
    anomalies = [e for e in case["events"] if e["kind"] == "anomaly"]
    assert [(e["step"], e["metric"]) for e in anomalies] == [(3, "grad_norm")]
    assert case["iterations"] == 4  # the optimizer froze in the graph after the NaN step


def test_custom_train_step_without_compute_loss(shapes: dict[str, Any]) -> None:
    _equal_to_truth(shapes["lower_level"], ("loss", "grad_norm", "lr"))  # found through its loss tracker
    case = shapes["no_loss"]
    assert case["rows"] == [] and case["status"] == "finished"
    assert case["reason"].startswith("0 steps recorded: ") and "compute_loss" in case["reason"]
    assert [e for e in case["events"] if e["kind"] == "warning" and "compute_loss" in e["message"]]


def test_any_tap_works_on_tensorflow(shapes: dict[str, Any]) -> None:
    case = shapes["any_tap"]
    assert case["status"] == "finished" and len(case["rows"]) == 16
    assert {"loss", "accuracy", "step_time", "throughput"} <= set(case["rows"][3])
    warnings = [e["message"] for e in case["events"] if e["kind"] == "warning"]
    assert any("memory_allocated" in w for w in warnings), warnings  # said once, not refused
    assert [(v["epoch"], v["step"]) for v in case["logged"]] == [(0, 7), (1, 15)]  # val_* with their epoch
    env = case["environment"]
    assert env["keras_backend"] == "tensorflow" and env["steps_per_execution"] == 1 and not env["jit_compile"]
    assert env["keras"] and env["tensorflow"] and "torch" not in env and env["device"] == "tensorflow:CPU"


def test_tf_capture_loss_only_steps_and_epochs(shapes: dict[str, Any]) -> None:
    case = shapes["tf_capture"]
    rows = case["rows"]
    assert [(r["epoch"], r["batch"]) for r in rows] == [(e, b) for e in range(2) for b in range(5)]
    assert [r["loss"] for r in rows] == pytest.approx(case["losses"], rel=1e-6)
    assert all("throughput" not in r and "accuracy" not in r for r in rows)
    assert "AutoGraph" not in case["tf_log"] and case["status"] == "finished"


def test_ring_overrun_keeps_the_newest_rows_in_order_once(shapes: dict[str, Any]) -> None:
    case = shapes["overrun"]
    capacity = case["capacity"]
    assert case["taken"] == capacity
    steps = [r["step"] for r in case["rows"]]
    assert steps == list(range(20 - capacity, 20))  # the lost steps keep their numbers: a gap, no repeat
    assert [r["loss"] for r in case["rows"]] == [s + 1.0 for s in steps]
    assert any("overwritten" in e["message"] for e in case["events"])
