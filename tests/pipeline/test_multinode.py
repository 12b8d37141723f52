"""Two "nodes" on this machine, as a multi-node job starts: two ``torchrun`` launchers with
``--nnodes=2``, 2 processes each, c10d rendezvous on loopback; rank 0's stored records are checked
against the union of all 4 ranks' own values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.pipeline.test_distributed import ROOT, _free_port, _records, assert_union_reference


def test_two_torchrun_nodes_of_two_processes_reduce_to_the_union_reference(tmp_path: Path) -> None:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    launchers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=2",
                f"--node-rank={node}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=batchtap-multinode",
                "--max-restarts=0",
                "-m",
                "tests.pipeline.dist_worker",
                "reduce",
                str(tmp_path),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    logs = [p.communicate(timeout=240)[0] for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], "\n".join(log[-3000:] for log in logs)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    assert {r["world"] for r in results} == {4}
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    records = _records(lines)
    assert [r["step"] for r in records] == list(range(40))
    assert {r["rank"] for r in records} == {-1}  # reduced rows only, written once, by rank 0
    assert sum(1 for r in lines if r["type"] == "run_start") == 1
    assert_union_reference(records, results)
    assert all(r["step"] == 0 or r["throughput"] > 0 for r in records)  # step 0 has no measured time
