"""The hand-written-loop front-ends (explicit ``bt.Tap``, ``bt.autolog()``, ``batchtap run``): one
process in this one (counting host reads), or real subprocesses (``batchtap run``; 2 gloo ranks)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conformance.compare import Outcome, combine_ranks
from tests.conformance.loops import OPTIONS

__all__ = ["run_raw"]

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_worker.py")
TIMEOUT = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _command(frontend: str, scenarios: list[str], out: Path) -> list[str]:
    command = [str(WORKER), frontend, ",".join(scenarios), str(out)]
    if frontend == "run":
        return [sys.executable, "-m", "batchtap", "run", "--db", str(out / "store.db"), "--flush-every", "3", *command]
    return [sys.executable, *command]


def _launch(frontend: str, scenarios: list[str], out: Path, world: int) -> None:
    """Start ``world`` processes (gloo ranks on loopback when more than one) and wait for them."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    if world > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world))
    procs = []
    for rank in range(world):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank)) if world > 1 else env
        procs.append(
            subprocess.Popen(
                _command(frontend, scenarios, out),
                cwd=out,
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
        )
    try:
        logs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{log[-4000:]}"


def _truths(out: Path, world: int) -> list[dict]:
    errors = [f.read_text() for f in sorted(out.glob("error*.txt"))]
    assert not errors, f"the loop raised:\n{errors[0][-3000:]}"
    return [json.loads((out / f"truth{rank}.json").read_text()) for rank in range(world)]


#: the CPU distributed scenarios one process pair runs for a front-end (a process start per cell saved)
_DIST = [name for name, o in OPTIONS.items() if o.dist != "none" and o.world == 2 and o.device == "cpu"]
_launched: dict[str, Path] = {}


def _distributed(frontend: str, scenario: str, workdir: Path) -> Path:
    """The cell's output directory; explicit and autolog run every distributed scenario in one launch."""
    opts = OPTIONS[scenario]
    if frontend == "run" or scenario not in _DIST:
        _launch(frontend, [scenario], workdir, opts.world)
        return workdir
    if frontend not in _launched:
        shared = workdir.parent / f"dist-{frontend}"
        shared.mkdir(exist_ok=True)
        own = [s for s in _DIST if frontend == "explicit" or OPTIONS[s].norm_as == "returned"]  # see MARKS
        _launch(frontend, own, shared, 2)
        _launched[frontend] = shared
    return _launched[frontend] / scenario


def _in_process_run(scenario: str, workdir: Path) -> None:
    """``batchtap run`` through the command's ``main`` in this process (the subprocess path is the
    distributed cells'); ``BATCHTAP_DB`` as the command leaves it is restored."""
    from batchtap.cli.main import main as cli_main

    saved = os.environ.get("BATCHTAP_DB")
    try:
        command = ["run", "--db", str(workdir / "store.db"), "--flush-every", "3", str(WORKER)]
        code = cli_main([*command, "run", scenario, str(workdir), "--count-reads"])
    finally:
        if saved is None:
            os.environ.pop("BATCHTAP_DB", None)
        else:
            os.environ["BATCHTAP_DB"] = saved
    assert code == 0, f"batchtap run exited with {code}"


def run_raw(frontend: str, scenario: str, workdir: Path) -> Outcome:
    from tests.conformance._worker import run_cell

    opts = OPTIONS[scenario]
    if opts.device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA (a GPU cell: bench/gpu_check.sh runs it)")
    if opts.dist != "none":
        out = _distributed(frontend, scenario, workdir)
        return Outcome(combine_ranks(_truths(out, opts.world)), None, out / "store.db", data_time=True, step_time=True)
    bare = run_cell("bare", scenario, workdir / "bare", count_reads=True)["reads"]
    if frontend == "run":
        _in_process_run(scenario, workdir)
        result = _truths(workdir, 1)[0]
    else:
        result = run_cell(frontend, scenario, workdir, count_reads=True)
    added = [on - off for on, off in zip(result["reads"], bare)]  # the loop's own reads (GradScaler) taken out
    return Outcome(result["steps"], added, workdir / "store.db", data_time=True, step_time=True)
