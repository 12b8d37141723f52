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
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
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
