"""One rank of the Accelerate test: ``python -m tests.integrations.accelerate_worker OUT_DIR``.

Launched by ``test_accelerate.py`` as real processes with RANK/WORLD_SIZE/MASTER_ADDR/PORT in the
environment (what ``accelerate launch`` sets); Accelerate makes the gloo process group on the CPU.
Writes ``OUT_DIR/rank{R}.json`` with the step losses it read with .item(): the test's reference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator

import batchtap as bt
from batchtap.integrations.accelerate import BatchtapTracker


def main(out: Path) -> None:
    tracker = BatchtapTracker(
        bt.Tap([bt.metrics.Loss()], [bt.sinks.JSONL(out / "metrics.jsonl")], flush_every=3), run_name="ddp"
    )
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, log_with=tracker)
    accelerator.init_trackers("ddp", config={"ranks": accelerator.num_processes})
    torch.manual_seed(0)  # the same weights on every rank (DDP also broadcasts them)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = accelerator.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=8))
    tap = tracker.tap  # every rank starts its run here
    steps: list[float] = []
    micro: list[float] = []
    for _ in range(2):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                tap.accumulate(loss=loss, batch_size=len(y))
                micro.append(loss.item())
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
            if accelerator.sync_gradients:
                tap.step()
                steps.append(sum(micro) / len(micro))
                micro.clear()
        accelerator.log({"rank_loss": torch.tensor(steps[-1])})
    tracker.finish()  # every rank: end_training() finishes trackers on the main process only
    accelerator.end_training()
    tap.close()
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps({"steps": steps}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
