"""RankAgreement on its own, over a real gloo group of two processes (no Tap, no pipeline)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.pipeline.test_distributed import ROOT, _free_port


def test_every_rank_agrees_on_the_stop_and_the_verdicts_one_flush_later(tmp_path: Path) -> None:
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.pipeline.agreement_worker", str(tmp_path)],
            cwd=ROOT,
            env=dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                WORLD_SIZE="2",
                PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # each exchange completes the one issued a flush earlier: the verdicts every rank has (the fewest,
    # rank 0's: one per flush) are applied one flush late, by both ranks alike
    assert [f["agreed"] for f in zero] == [f["agreed"] for f in one] == [0, 0, 1, 1, 1]
    assert [f["taken"] for f in zero] == [f["taken"] for f in one] == [0, 0, 1, 1, 1]
    # rank 1 asked at flush 1: both stop at flush 2, each knowing whose reason it is
    assert [f["stop"] for f in one] == [None, None, *["rank one's reason"] * 3]
    assert [f["stop"] for f in zero] == [None, None, *["rank 1 asked every rank to stop"] * 3]
