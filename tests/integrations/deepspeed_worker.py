"""One DeepSpeed ZeRO run on the CPU accelerator: ``python -m tests.integrations.deepspeed_worker MODE STAGE OUT``.

A single rank (gloo on loopback, ``DS_ACCELERATOR=cpu``), ZeRO stage ``STAGE``, SGD with a WarmupLR
schedule, ``gradient_clipping`` 0.05 (every step clips). ``MODE`` is ``explicit`` (a ``bt.Tap``
given DeepSpeed's own pre-clip norm and the lr the step used) or ``autolog`` (``bt.autolog()`` over
the unmodified loop). Writes ``OUT/truth.json``: every step's ``.item()`` truth, the gradient norm
from ``deepspeed.utils.safe_get_full_grad`` before the step (ZeRO keeps no ``param.grad``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.nn.functional as F

import batchtap as bt

STEPS = 6


def main(mode: str, stage: int, out: Path) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.05,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 4},
        },
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # torch's SGD: DeepSpeed's own optimizers compile C++ ops
    }
    db = str(out / "store.db")
    tap = bt.autolog(sinks=[bt.sinks.SQLite(db)], name="ds", flush_every=2) if mode == "autolog" else None
    deepspeed.init_distributed(dist_backend="gloo")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if mode == "explicit":
        tap = bt.Tap(sinks=[bt.sinks.SQLite(db)], flush_every=2)
        tap.start(name="ds")
    g = torch.Generator().manual_seed(1)
    truth = []
    for step in range(STEPS):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        out_ = engine(x)
        loss = F.cross_entropy(out_, y)
        engine.backward(loss)
        norm = math.sqrt(sum(float(safe_get_full_grad(p).double().pow(2).sum()) for p in engine.module.parameters()))
        lr = engine.get_lr()[0]  # the rate this step uses: the scheduler moves inside engine.step()
        engine.step()
        if mode == "explicit":
            tap.step(loss=loss, outputs=out_, targets=y, grad_norm=engine.get_global_grad_norm(), extra={"lr": lr})
        truth.append(
            {"loss": loss.item(), "accuracy": (out_.argmax(1) == y).float().mean().item(), "lr": lr, "grad_norm": norm}
        )
    if mode == "explicit":
        tap.finish()
        tap.close()
    else:
        bt.autolog(enabled=False)
    (out / "truth.json").write_text(json.dumps(truth))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
