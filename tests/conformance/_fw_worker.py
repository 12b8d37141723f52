"""A framework's distributed cell: its launch (:func:`launch`, in the test's process) and one rank of it
(``python -m torch.distributed.run --standalone --nproc-per-node 2 _fw_worker.py FRONTEND SCENARIO OUT_DIR``).

The ranks are started by ``torchrun`` (``torch.distributed.run``), the launcher the frameworks document
for a multi-process run: Lightning finds its environment (``TorchElasticEnvironment``) and starts no
processes of its own, the HF Trainer and Accelerate read ``RANK``/``WORLD_SIZE``/``MASTER_*`` and make
the gloo group on the CPU themselves (what ``accelerate launch`` sets for them). Each rank runs the
front-end's own runner of ``frameworks.py`` and writes ``OUT_DIR/truth{RANK}.json``: the ``.item()``
truth of its optimizer steps; the test's process combines the ranks' (``compare.combine_ranks``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file by torchrun: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.conformance.compare import Outcome, combine_ranks
from tests.conformance.loops import OPTIONS

__all__ = ["TIMEOUT", "launch"]

ROOT = Path(__file__).resolve().parents[2]
#: seconds for the whole launch: two processes import torch and a framework on a shared 2-core machine
TIMEOUT = 300


def launch(frontend: str, scenario: str, workdir: Path) -> Outcome:
    """Run ``frontend``'s ``scenario`` on its ranks under torchrun; the global truth of every step."""
    world = OPTIONS[scenario].world
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # torchrun sets them for each rank
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a rendezvous on a free local port
        f"--nproc-per-node={world}",
        str(Path(__file__).resolve()),
        frontend,
        scenario,
        str(workdir),
    ]
    # a session of its own: on a timeout the whole group goes (torchrun and the ranks it started)
    proc = subprocess.Popen(
        command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        log = proc.communicate(timeout=TIMEOUT)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0]
        raise AssertionError(f"torchrun ran past {TIMEOUT} s; its ranks were killed:\n{log[-5000:]}") from None
    assert proc.returncode == 0, f"torchrun exited with {proc.returncode}:\n{log[-5000:]}"
    ranks = [json.loads((workdir / f"truth{rank}.json").read_text()) for rank in range(world)]
    return Outcome(
        combine_ranks(ranks), None, workdir / "store.db", data_time=ranks[0]["data_time"], step_time=True
    )  # fmt: skip


def main() -> None:
    """``FRONTEND SCENARIO OUT_DIR``: this rank's run of the cell; its truth to ``OUT_DIR/truth{RANK}.json``."""
    import torch

    from tests.conformance.frameworks import RUNNERS

    frontend, scenario, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)
    outcome = RUNNERS[frontend](scenario, out)
    result = {"steps": outcome.steps, "data_time": outcome.data_time}
    (out / f"truth{os.environ['RANK']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
