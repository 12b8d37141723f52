"""DeepSpeed ZeRO (stages 2 and 3) where it runs here: its CPU accelerator, gloo, one process,
under ``bt.autolog()`` with DeepSpeed's own ``gradient_clipping`` (``deepspeed_worker.py``), each
stored value against the ``.item()`` truth of the same run.

ZeRO clips its flat fp32 gradient partitions inside its own optimizer's ``step``, before the
wrapped torch optimizer steps, with no clipping call to observe: the stored norm must still be
the pre-clip one (``engine.get_global_grad_norm()``), not the clipped 0.05.
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


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def zero(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict:
    out = tmp_path_factory.mktemp("deepspeed") / f"zero{request.param}.json"
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
        [sys.executable, "-m", "tests.realloops.deepspeed_worker", str(out), str(request.param)],
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


def test_deepspeed_zero_loss_under_autolog(zero: dict) -> None:
    rows, refs = zero["rows"], zero["refs"]
    assert [r["step"] for r in rows] == list(range(len(refs)))
    for row, ref in zip(rows, refs):
        assert row["values"]["loss"] == pytest.approx(ref["loss"], rel=F32_REL), row["step"]


def test_deepspeed_zero_grad_norm_is_the_pre_clip_norm(zero: dict) -> None:
    for row, ref in zip(zero["rows"], zero["refs"]):
        assert ref["grad_norm"] > 0.3
        assert row["values"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=F32_REL), row["step"]
