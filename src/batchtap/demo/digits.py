"""The demo's model and training loop; ``batchtap demo`` (:mod:`batchtap.cli.demo`) parses the options
and calls :func:`train`. Kept apart so that importing the command line does not import torch; the
benchmarks train :class:`DigitsCNN` on :func:`load_digits` too.

The loop is the one a user writes: ``tap.watch(loader)``, ``tap.step(loss=, outputs=, targets=)``,
``if tap.should_stop: break``, with a NaN rule, a spike rule that rolls back, and three sinks.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import batchtap as bt
from batchtap._defaults import DEFAULT_DB
from batchtap._optional import require

__all__ = ["DigitsCNN", "load_digits", "train", "evaluate"]


class DigitsCNN(nn.Module):
    """Two conv layers and a small head for 1x8x8 inputs, 10 classes."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * width * 16, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def load_digits(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's digits as (train, test) tensor datasets: 80/20 split, pixels scaled to [0, 1]."""
    datasets = require("sklearn.datasets", extra="demo", purpose="batchtap demo")
    digits = datasets.load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def _setup_distributed(device_arg: str) -> tuple[torch.device, int, int]:
    """Join the process group torchrun describes in the environment, if any: (device, rank, world)."""
    use_cuda = torch.cuda.is_available() and device_arg in ("auto", "cuda")
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return torch.device("cuda" if use_cuda else ("cpu" if device_arg == "auto" else device_arg)), 0, 1
    dist.init_process_group("nccl" if use_cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return device, dist.get_rank(), dist.get_world_size()


def train(args: argparse.Namespace) -> int:
    """Train with the options ``demo.add_arguments`` defines; returns the exit status."""
    torch.manual_seed(args.seed)
    device, rank, world = _setup_distributed(args.device)
    say = print if rank == 0 else (lambda *a, **k: None)
    train, test = load_digits(args.seed)
    sampler: DistributedSampler[Any] | None = DistributedSampler(train, seed=args.seed) if world > 1 else None
    loader = DataLoader(
        train,
        batch_size=args.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        generator=torch.Generator().manual_seed(args.seed),
    )
    model: nn.Module = DigitsCNN().to(device)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))
    criterion = nn.CrossEntropyLoss()

    out = Path(args.out)
    jsonl_path = out / args.name / "metrics.jsonl"
    db = args.db or str(out / "batchtap.db")
    store: bt.sinks.Sink = bt.sinks.Postgres(db) if db.startswith("postgres") else bt.sinks.SQLite(db)
    sinks: list[bt.sinks.Sink] = [bt.sinks.Console(every=args.print_every), bt.sinks.JSONL(jsonl_path), store]
    rollback = bt.Rollback(model, optimizer, scheduler, every=10, keep=2, lr_factor=0.5, skip_batches=3, max_retries=3)
    rules = [
        bt.NonFinite("loss", action="stop"),
        # min_excess: late in training a batch loss of 0.3 is 4x a 0.08 average, and not a divergence
        bt.Spike("loss", ratio=4.0, min_excess=1.0, window=20, patience=1, warmup=30, action="rollback"),
    ]
    tap = bt.Tap(
        metrics=[
            bt.metrics.Loss(),
            bt.metrics.Accuracy(topk=(1, 5)),
            bt.metrics.LearningRate(optimizer),
            bt.metrics.GradNorm(model),
            bt.metrics.StepTime(),
            bt.metrics.DataTime(),
            bt.metrics.Throughput(),
            bt.metrics.Memory(),
        ],
        sinks=sinks,
        rules=rules,
        rollback=rollback,
        flush_every=args.flush_every,
        flush_seconds=0.5,
        spool_dir=out / "spool",
    )
    config = {k: v for k, v in vars(args).items() if k != "func"}
    started = time.perf_counter()
    step = 0
    with tap, tap.run(name=args.name, config=config) as run:
        say(
            f"batchtap demo: training DigitsCNN on {device} for {args.epochs} epochs "
            f"({len(loader)} batches each{f', {world} ranks' if world > 1 else ''}), run id {run.id}"
        )
        for epoch in range(args.epochs):
            model.train()
            if sampler is not None:
                sampler.set_epoch(epoch)
            for inputs, targets in tap.watch(loader, epoch=epoch):
                inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
                outputs = model(inputs)
                loss = criterion(outputs, targets)
                if step == args.inject_nan_at:
                    loss = loss * math.nan  # what a diverging step looks like
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if step == args.inject_spike_at:
                    with torch.no_grad():  # what a bad update looks like: the next loss explodes
                        for p in model.parameters():
                            p.mul_(30.0)
                tap.step(loss=loss, outputs=outputs, targets=targets)  # records the lr this step used
                scheduler.step()
                step += 1
                if tap.should_stop:
                    break
            if tap.should_stop:
                say(f"batchtap demo: stopped at step {step - 1}: {tap.stop_reason}")
                break
            test_accuracy = evaluate(model, test, device)
            tap.log({"test_accuracy": test_accuracy})  # stored with the run, beside the per-step values
            # sync: once per epoch, outside the training steps, to print it
            say(f"batchtap demo: epoch {epoch} test accuracy {test_accuracy.item():.2%}")
    show_db = "" if db == DEFAULT_DB else f" --db {db}"
    say(
        f"batchtap demo: {step} steps in {time.perf_counter() - started:.1f} s; values stored as NaN "
        f"(out of their domain): {sum(tap.anomaly_counts.values())}; `batchtap show {args.name}{show_db}` lists every event"
    )
    say(f"batchtap demo: metrics stored in {db} (run {run.id[:8]}) and {jsonl_path}")
    if world > 1:
        dist.destroy_process_group()
    return 0


@torch.no_grad()
def evaluate(model: nn.Module, data: TensorDataset, device: torch.device) -> torch.Tensor:
    """Accuracy on ``data`` as a 0-dim device tensor (nothing read on the host)."""
    model.eval()
    x, y = data.tensors
    correct = (model(x.to(device)).argmax(1) == y.to(device)).sum()
    return correct / len(y)
