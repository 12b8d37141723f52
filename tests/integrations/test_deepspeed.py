"""DeepSpeed ZeRO on this machine's CPU accelerator, a single gloo rank (docs/integrations.md says
what was tried). Skips only when ``deepspeed`` is not installed (it is not a project dependency);
where it is installed, a DeepSpeed that fails to start (its CPU communication op is compiled on first
use) is a failure, never a skip. Every stored value against the loop's ``.item()`` truth."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "deepspeed",
    reason="deepspeed is not installed (not a project dependency): "
    "pip install -c <(pip freeze | grep ^torch==) --no-build-isolation deepspeed to run this test",
)

from tests.conformance.compare import REL, stored  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _run(mode: str, stage: int, out: Path) -> list[dict[str, float]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run(
        [sys.executable, "-m", "tests.integrations.deepspeed_worker", mode, str(stage), str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "truth.json").read_text())


def _check(out: Path, truth: list[dict[str, float]], names: tuple[str, ...]) -> None:
    run, rows, _ = stored(out / "store.db")
    assert run["status"] == "finished"
    assert sorted(rows) == list(range(len(truth)))
    for step, expected in enumerate(truth):
        for name in names:
            want = expected[name]
            value = rows[step].get(name, (0, 0, None))[2]
            assert value == pytest.approx(want, rel=REL), (step, name, value, want)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_explicit_tap_with_deepspeeds_own_pre_clip_norm(tmp_path: Path, stage: int) -> None:
    """tap.step(grad_norm=engine.get_global_grad_norm(), extra={"lr": engine.get_lr()[0]} read before
    engine.step()): loss, accuracy, the lr the step used and the norm before DeepSpeed clipped."""
    _check(tmp_path, _run("explicit", stage, tmp_path), ("loss", "accuracy", "lr", "grad_norm"))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_under_autolog(tmp_path: Path, stage: int) -> None:
    """The unmodified loop: loss, accuracy, lr and the ZeRO optimizer's pre-clip norm (it clips inside
    its own step, with no clip_grad_norm_ call for autolog to see)."""
    _check(tmp_path, _run("autolog", stage, tmp_path), ("loss", "accuracy", "lr", "grad_norm"))
