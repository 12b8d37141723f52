"""``python -m tests.realloops.deepspeed_worker OUT STAGE``: a DeepSpeed ZeRO loop on the CPU
(DeepSpeed's CPU accelerator, gloo, one process) under ``bt.autolog()``, with DeepSpeed's own
``gradient_clipping``. Writes ``OUT``: the stored rows and the ``.item()`` truth of every step (the
loss, and ``engine.get_global_grad_norm()``, the norm before DeepSpeed clipped)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import batchtap as bt
from tests.conftest import ListSink

STEPS = 6


def main(out: Path, stage: int) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    sink = ListSink()
    bt.autolog(sinks=[sink], name=f"zero{stage}", flush_every=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config = {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.05,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    refs = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        refs.append({"loss": loss.item(), "grad_norm": float(engine.get_global_grad_norm())})
    bt.autolog(enabled=False)
    rows = [{"step": r.step, "values": dict(r.values)} for r in sink.records if not r.sparse]
    out.write_text(json.dumps({"rows": rows, "refs": refs}))


if __name__ == "__main__":
    os.environ.update(
        {k: v for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")) if k not in os.environ}
    )
    main(Path(sys.argv[1]), int(sys.argv[2]))
