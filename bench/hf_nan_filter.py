"""What the Hugging Face Trainer's ``logging_nan_inf_filter`` costs, and what BatchtapTrainer adds.

Three variants of the same ``Trainer.train()`` on a tiny GPT-2 built from a config (random weights,
random token ids, gradient accumulation 2), run in one process, repetitions interleaved (rep r runs
the variants in an order rotated by r), medians over reps:

* ``filter on``  — ``Trainer``, ``logging_nan_inf_filter=True`` (the default): ``torch.isnan(loss) or
  torch.isinf(loss)`` after every micro-batch, i.e. a host read (a device sync on a GPU) each time;
* ``filter off`` — ``Trainer``, ``logging_nan_inf_filter=False``;
* ``batchtap``   — ``BatchtapTrainer`` (filter off) storing every optimizer step to SQLite.

Time per optimizer step: the median over the steps after a warm-up of the host clock between
``on_step_end`` callbacks. Host reads per optimizer step are counted in separate runs (the counter
slows every op, so timed runs never carry it) with ``bench/_hostreads.py``.

On the CPU a host read costs no device wait, so the CPU figures show the reads, not the GPU cost of
the syncs (reported around 7 % of step time in transformers#33693); the GPU figure is owed.

    .venv/bin/python bench/hf_nan_filter.py [--reps 5] [--steps 60] [--threads 1]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from _hostreads import HostReadCounter

VARIANTS = ("filter on", "filter off", "batchtap")


class _Clock:
    """A TrainerCallback-shaped object timing optimizer steps with the host clock."""

    def __init__(self, tf: Any) -> None:
        parent = self

        class Clock(tf.TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                parent.ends.append(time.perf_counter())

        self.callback = Clock()
        self.ends: list[float] = []


def _run(variant: str, steps: int, warmup: int, count_reads: bool, tmp: Path) -> tuple[float, float]:
    import transformers as tf

    import batchtap as bt
    from batchtap.integrations.transformers import BatchtapTrainer

    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=256, n_embd=64, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    model = tf.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 256, (8 * 2 * (steps + warmup), 64), generator=g)
    data = [{"input_ids": r, "labels": r} for r in rows]
    args = tf.TrainingArguments(
        output_dir=str(tmp / "out"),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=steps + warmup,
        logging_steps=10**6,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_nan_inf_filter=variant == "filter on",
        dataloader_num_workers=0,
    )
    clock = _Clock(tf)
    tap = None
    if variant == "batchtap":
        tap = bt.Tap(sinks=[bt.sinks.SQLite(str(tmp / f"bt-{time.monotonic_ns()}.db"))])
        trainer: Any = BatchtapTrainer(model=model, args=args, train_dataset=data, callbacks=[clock.callback], tap=tap)
    else:
        trainer = tf.Trainer(model=model, args=args, train_dataset=data, callbacks=[clock.callback])
    reads = HostReadCounter()
    if count_reads:
        with reads:
            trainer.train()
    else:
        trainer.train()
    if tap is not None:
        tap.close()
    gaps = [b - a for a, b in zip(clock.ends[warmup:], clock.ends[warmup + 1 :])]
    return statistics.median(gaps), reads.count / (steps + warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    logging.getLogger("batchtap").setLevel(logging.ERROR)  # the NaN-filter advice, once per run
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(opts.reps):
            order = VARIANTS[rep % 3 :] + VARIANTS[: rep % 3]
            for variant in order:
                times[variant].append(_run(variant, opts.steps, opts.warmup, False, Path(tmp))[0])
        reads = {v: _run(v, 8, 2, True, Path(tmp))[1] for v in VARIANTS}
    off = statistics.median(times["filter off"])
    print(f"torch {torch.__version__}, threads {opts.threads}, {opts.reps} reps x {opts.steps} steps (CPU)")
    print(f"{'variant':<12} {'ms/step':>8} {'min-max':>15} {'vs off':>7} {'host reads/step':>16}")
    for v in VARIANTS:
        ms = [t * 1e3 for t in times[v]]
        print(
            f"{v:<12} {statistics.median(ms):8.2f} {min(ms):7.2f}-{max(ms):<7.2f} "
            f"{statistics.median(times[v]) / off:7.3f} {reads[v]:16.1f}"
        )


if __name__ == "__main__":
    main()
