"""One rank of ``test_transformers_ddp.py``: ``torchrun ... transformers_ddp_worker.py MODEL OUT_DIR [autolog]``.

``BatchtapTrainer`` on 2 gloo ranks (torchrun sets RANK/WORLD_SIZE/MASTER_*; the Trainer's Accelerate
makes the process group on the CPU), accumulation 2. ``MODEL`` is ``gpt2`` (a causal LM that divides
by the count of all ranks' tokens) or ``bert`` (takes ``**kwargs``, ignores the count). Writes
``OUT_DIR/micro{RANK}.json``: each training micro-batch's ``.item()`` truth, (CE sum, kept targets)
for GPT-2 and (CE mean, rows) for BERT. With ``autolog`` the script is the plain ``transformers.Trainer``
under ``bt.autolog()`` (what ``batchtap run`` records of it) instead of ``BatchtapTrainer``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a file by torchrun: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F

import batchtap as bt
from batchtap.integrations.transformers import BatchtapTrainer
from tests.integrations.test_transformers import _args, _bert, _Data, _gpt2


def main(kind: str, out: Path, autolog: bool = False) -> None:
    import transformers as tf

    torch.set_num_threads(1)
    lm = kind == "gpt2"
    micro: list[tuple[float, int]] = []
    base: Any = tf.Trainer if autolog else BatchtapTrainer

    class Trainer(base):  # type: ignore[misc, valid-type]
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):  # type: ignore[no-untyped-def]
            labels = inputs["labels"].clone()
            loss, outputs = super().compute_loss(
                model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
            )
            if model.training:
                logits = outputs["logits"].detach().float()
                if lm:  # logits at t predict label t + 1; the sum over kept targets
                    logits, labels = logits[:, :-1], labels[:, 1:]
                    flat = logits.reshape(-1, logits.shape[-1])
                    ce = F.cross_entropy(flat, labels.reshape(-1), reduction="sum").item()
                    micro.append((ce, int((labels != -100).sum())))
                else:
                    micro.append((F.cross_entropy(logits, labels).item(), len(labels)))
            return (loss, outputs) if return_outputs else loss

    model = _gpt2() if lm else _bert()
    if lm:
        model.loss_type = "ForCausalLM"  # the Trainer's count then skips each row's first label, as the loss does
    rank = int(os.environ["RANK"])
    args = _args(out / f"trainer{rank}", gradient_accumulation_steps=2, num_train_epochs=1)
    if autolog:
        bt.autolog(sinks=[bt.sinks.SQLite(str(out / "store.db"))], flush_every=3)
        try:
            Trainer(model=model, args=args, train_dataset=_Data(32, lm=lm)).train()
        finally:
            bt.autolog(enabled=False)
    else:
        tap = bt.Tap(sinks=[bt.sinks.SQLite(str(out / "store.db"))], flush_every=3)
        Trainer(model=model, args=args, train_dataset=_Data(32, lm=lm), tap=tap).train()
        tap.close()
    (out / f"micro{rank}.json").write_text(json.dumps(micro))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), autolog=sys.argv[3:] == ["autolog"])
