"""Start real worker processes the way torchrun does (MASTER_ADDR/PORT, RANK, WORLD_SIZE), gloo on
loopback, each importing the batchtap under test (wherever this test imported it from: the
source tree, a snapshot, or an installed copy), never a fixed path's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import batchtap

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_pythonpath() -> str:
    """``PYTHONPATH`` for a worker: the package's own parent first (the tree under test), then the
    repository root for ``tests.*``."""
    package_parent = Path(batchtap.__file__).resolve().parents[1]
    return os.pathsep.join(dict.fromkeys([str(package_parent), str(ROOT)]))


def launch(module: str, out: Path, world: int, *, timeout: float = 120) -> list[str]:
    """Run ``python -m module out`` as ``world`` ranks; returns their logs. Fails with a rank's log
    when it wrote no ``out/rank{R}.json``."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            PYTHONPATH=worker_pythonpath(),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", module, str(out)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, log in enumerate(logs):
        assert (out / f"rank{rank}.json").exists(), f"rank {rank} exited with {procs[rank].returncode}:\n{log}"
    return logs
