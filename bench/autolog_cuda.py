"""The char-level GPT example under ``batchtap run`` on CUDA, with the CUDA sync debugger armed
(``torch.cuda.set_sync_debug_mode("error")``) from the second optimizer step to the last: any
host-device sync that autolog (or the Tap) adds inside a step raises. Part of bench/gpu_check.sh.

    python bench/autolog_cuda.py                 # CUDA
    python bench/autolog_cuda.py --device cpu    # dry run (nothing to arm)
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--iters", type=int, default=60)
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("autolog_cuda: no CUDA device", file=sys.stderr)
        return 1
    steps = [0]

    def arm(optimizer: object, a: object, k: object) -> None:
        steps[0] += 1
        if cuda and steps[0] == 2:  # the first step builds the ring and the script prints once
            torch.cuda.set_sync_debug_mode("error")

    def disarm(optimizer: object, a: object, k: object) -> None:
        if cuda and steps[0] == args.iters:  # the run's end flushes (a labelled sync) after this
            torch.cuda.set_sync_debug_mode(0)

    handles = [register_optimizer_step_pre_hook(arm), register_optimizer_step_post_hook(disarm)]
    from batchtap.cli.main import main as cli

    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "autolog.db"
        script = ROOT / "examples" / "autolog" / "char_gpt.py"
        try:
            code = cli(
                ["run", "--db", str(db), "--flush-every", "10", str(script), "--max_iters", str(args.iters),
                 "--log_interval", "1000000", "--device", args.device]
            )  # fmt: skip
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
            for handle in handles:
                handle.remove()
        with sqlite3.connect(db) as conn:
            status = conn.execute("SELECT status, stop_reason FROM runs").fetchone()
            rows = conn.execute("SELECT COUNT(*) FROM metrics WHERE metric = 'loss'").fetchone()[0]
            names = [r[0] for r in conn.execute("SELECT DISTINCT metric FROM metrics ORDER BY metric")]
    armed = f"sync debugger armed for steps 2..{args.iters}" if cuda else "CPU dry run, nothing armed"
    print(f"autolog_cuda: {args.device}, {armed}: exit {code}, run {status}, {rows} rows of {args.iters}; {names}")
    ok = code == 0 and status[0] == "finished" and rows == args.iters
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
