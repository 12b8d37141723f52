"""A training script with the process pipeline, ended in one of several ways:
``python -m tests.pipeline.process_worker HOW OUT_DIR``.

Writes ``OUT_DIR/pids.json`` (its own pid and its pipeline process's) once the run started, and
its sink's calls to ``OUT_DIR/sink.pkl`` (see ``process_sinks.FileListSink``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

import batchtap as bt
from tests.pipeline.process_sinks import FileListSink

STEPS = 40
FLUSH_EVERY = 5
KILL_AFTER = 25  # steps; the flush at step 24 handed rows 0..24 over before the kill


def main(how: str, out: Path) -> None:
    tap = bt.Tap(
        sinks=[FileListSink(out / "sink.pkl")], flush_every=FLUSH_EVERY, flush_seconds=3600, pipeline="process"
    )
    if how == "exit_open":
        tap.start(name=how)
        _train(tap, how, out)
    else:
        with tap.run(name=how):
            _train(tap, how, out)
    if how == "close":
        tap.close()
    # "no_close": the Tap is never closed; interpreter exit must not leave its process behind


def _train(tap: bt.Tap, how: str, out: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pipeline_pid = tap._pipeline.link.process.pid  # type: ignore[attr-defined]
    (out / "pids.json").write_text(json.dumps({"worker": os.getpid(), "pipeline": pipeline_pid}))
    for step in range(STEPS):
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        out_ = model(x)
        loss = torch.nn.functional.cross_entropy(out_, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        tap.step(loss=loss, outputs=out_, targets=y)
        if step + 1 == KILL_AFTER:
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            if how == "raise":
                raise RuntimeError("the training loop failed")
            if how == "exit_open":
                sys.exit(0)  # start() without finish() or close(): ended at interpreter exit


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
