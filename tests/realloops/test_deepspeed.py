"""DeepSpeed ZeRO (stage 2) where it runs here: its CPU accelerator, gloo, one process, under
``bt.autolog()`` with DeepSpeed's own ``gradient_clipping`` (``deepspeed_worker.py``), each stored
value against the ``.item()`` truth of the same run.

The loss is exact. The gradient norm is not yet: ZeRO clips its flat fp32 gradient partitions
inside its own optimizer's ``step`` before the wrapped torch optimizer steps, with no
``clip_grad_norm_`` call to observe, so autolog stores the clipped norm (0.05 at every step here,
against a pre-clip 0.6-0.8). That test is a strict xfail: it fails loudly the day it is fixed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.realloops._launch import ROOT, worker_pythonpath
from tests.realloops._loops import F32_REL

pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def zero2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("deepspeed") / "zero2.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PYTHONPATH=worker_pythonpath(),
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
    )
    done = subprocess.run(
        [sys.executable, "-m", "tests.realloops.deepspeed_worker", str(out), "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if not out.exists():
        pytest.fail(
            f"the DeepSpeed worker exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return json.loads(out.read_text())


def test_deepspeed_zero2_loss_under_autolog(zero2: dict) -> None:
    rows, refs = zero2["rows"], zero2["refs"]
    assert [r["step"] for r in rows] == list(range(len(refs)))
    for row, ref in zip(rows, refs):
        assert row["values"]["loss"] == pytest.approx(ref["loss"], rel=F32_REL), row["step"]


@pytest.mark.xfail(strict=True, reason="ZeRO clips inside its optimizer: autolog stores the clipped norm")
def test_deepspeed_zero2_grad_norm_is_the_pre_clip_norm(zero2: dict) -> None:
    for row, ref in zip(zero2["rows"], zero2["refs"]):
        assert ref["grad_norm"] > 0.3
        assert row["values"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=F32_REL), row["step"]
