"""One process of a matrix cell: ``python tests/conformance/_worker.py FRONTEND SCENARIO OUT_DIR``.

Runs the scenario's loop through ``explicit`` (a ``bt.Tap`` driven by the loop) or ``autolog``
(``bt.autolog()`` first); under ``batchtap run`` (front-end ``run``) the command has already turned
autolog on, so the loop runs with no hook at all. In a process group (``RANK``/``WORLD_SIZE`` in the
environment, gloo on loopback, as torchrun starts it) each rank runs the same loop on its own data.
Writes ``OUT_DIR/truth{RANK}.json``: the ``.item()`` truth of every optimizer step, and the host reads
per step where this process counted them. The store is ``OUT_DIR/store.db``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

if __name__ == "__main__":  # run as a file (batchtap run): the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

from tests.conformance.loops import OPTIONS, Hooks, train


def run_cell(frontend: str, scenario: str, out: Path, *, count_reads: bool) -> dict:
    """Run one cell's loop in this process; returns (and writes) its truth file's content.

    Front-end ``bare`` runs the loop with no batchtap at all: its host reads are the loop's own
    (a ``GradScaler.step`` reads ``found_inf``), which the other front-ends' counts are taken against.
    """
    import batchtap as bt
    from tests.conformance.hooks import ExplicitHooks, ReadCounting

    opts = OPTIONS[scenario]
    out.mkdir(parents=True, exist_ok=True)
    db = out / "store.db"
    hooks: Hooks
    if frontend == "bare":
        hooks = ReadCounting(count_reads=count_reads)
    elif frontend == "explicit":
        hooks = ExplicitHooks(db, count_reads=count_reads)
    elif frontend == "autolog":
        hooks = ReadCounting(count_reads=count_reads)
        bt.autolog(sinks=[bt.sinks.SQLite(str(db))], name=scenario, flush_every=3)
    elif frontend == "run":
        hooks = ReadCounting(count_reads=count_reads)  # batchtap run turned autolog on before this script
    else:
        raise SystemExit(f"unknown front-end {frontend!r}: bare, explicit, autolog or run")
    try:
        truths = train(opts, hooks)
    except Exception as exc:
        hooks.fail(exc)
        raise
    finally:
        if frontend == "autolog":
            bt.autolog(enabled=False)
    steps = [{"epoch": t.epoch, "batch": t.batch, **t.values(), **t.counts()} for t in truths]
    result = {"steps": steps, "reads": hooks.reads}
    rank = dist.get_rank() if dist.is_initialized() else 0
    (out / f"truth{rank}.json").write_text(json.dumps(result))
    return result


def main() -> None:
    """``FRONTEND SCENARIO[,SCENARIO...] OUT_DIR [--count-reads]``: several scenarios run one after the
    other in one process (``OUT_DIR/SCENARIO/``), which saves a process start per cell; ``batchtap run``
    records one run per script, so it is given one scenario."""
    frontend, scenarios, out = sys.argv[1], sys.argv[2].split(","), Path(sys.argv[3])
    if "WORLD_SIZE" in os.environ:
        cuda = {OPTIONS[s].device for s in scenarios} == {"cuda"}
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=timedelta(seconds=60))
        torch.set_num_threads(1)
    for scenario in scenarios:
        cell_out = out / scenario if len(scenarios) > 1 else out
        try:
            run_cell(frontend, scenario, cell_out, count_reads="--count-reads" in sys.argv)
        except Exception:
            if len(scenarios) == 1:
                raise
            # the next scenario still runs (every rank raised at the same point: the loops are symmetric)
            rank = dist.get_rank() if dist.is_initialized() else 0
            (cell_out / f"error{rank}.txt").write_text(traceback.format_exc())
    if dist.is_initialized():
        dist.destroy_process_group()  # under batchtap run, autolog ends the run before the group goes


if __name__ == "__main__":
    main()
