"""The host cost of one ``tap.step()`` inside a real training loop, next to the same call alone (issue 13).

``../shared/tools/stepcost.py`` times ``tap.step()`` in a tight loop on fixed tensors, where every
line of it stays in the CPU's caches. In a training loop the model's own step runs between two calls
and pushes them out, so the same call costs several times more. This script times each call right
after a real optimizer step of the digits CNN (the demo's model, batch 32), and the same call alone,
side by side in one process:

* ``tap.step`` with the default metrics (loss, top-1 accuracy, step/data time, throughput);
* ``tap.step`` with the loss only;
* the per-step ``.item()`` recipe: ``loss.item()`` and ``(outputs.argmax(1) == y).sum().item()``;
* the floor: the three device ops ``tap.step`` issues per step with the default metrics (the
  loss's copy into its ring cell, the argmax, the eq that marks hits and padding), into
  preallocated buffers, in one function, with none of the bookkeeping (slot, timing, NaN check,
  host facts, flush). No capture that writes exact per-step values with device ops costs less;
  on the CPU it costs a little less than the recipe, where ``.item()`` waits for nothing;
* the model's step itself (forward, backward, optimizer), for scale.

The calls take turns, one per training step (each follows a model step, none follows another
measured call). Reported: median µs per call in the loop and alone, and their ratio. On a CUDA device
(``--device cuda``) the times are host times: the work the call adds to the launch queue's critical
path, not device time; the recipe then also waits for the device at each ``.item()``.

``--flush-ab`` adds a second table: whole-loop µs per step over the bare loop, with the pipeline
flushing as configured by default (every 50 steps) and with a ring large enough that nothing is
flushed before the run ends (interleaved repetitions, medians): the difference is what the pipeline
thread's work on the flushed blocks costs the training thread on this machine.

Run: ``.venv/bin/python bench/inloop.py`` (about 10 s on 2 cores; ``--flush-ab`` about 2 min);
``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable

import _harness as H
import torch
import torch.nn.functional as F

import batchtap as bt


def _median_us(samples: list[int]) -> float:
    return statistics.median(samples) / 1e3


def _model_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One plain training step; returns (outputs, loss)."""
    out = model(x)
    loss = F.cross_entropy(out, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return out, loss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200, help="timed training steps (default 1200)")
    parser.add_argument("--alone", type=int, default=3000, help="timed calls alone, per variant (default 3000)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--flush-ab", action="store_true", help="also: whole loop with and without flushes")
    parser.add_argument("--reps", type=int, default=7, help="--flush-ab repetitions (default 7)")
    parser.add_argument("--quick", action="store_true", help="smoke run: few steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.alone, args.reps = 80, 200, 1
    torch.set_num_threads(1)
    device = torch.device(args.device)
    wl = H.digits_workload(device)
    model = wl.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=wl.lr, momentum=0.9)
    warmup = 20
    batches = [b for epoch in wl.epochs(args.steps + warmup) for b in epoch][: args.steps + warmup]
    default_tap, loss_tap = bt.Tap(sinks=[]), bt.Tap(sinks=[])
    perf = time.perf_counter_ns
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def default_call(loss: torch.Tensor, out: torch.Tensor, y: torch.Tensor) -> None:
        default_tap.step(loss=loss, outputs=out, targets=y)

    def loss_call(loss: torch.Tensor, out: torch.Tensor, y: torch.Tensor) -> None:
        loss_tap.step(loss=loss)

    def recipe_call(loss: torch.Tensor, out: torch.Tensor, y: torch.Tensor) -> None:
        loss.item()
        (out.argmax(1) == y).sum().item()

    floor_call = _device_ops_floor(batches[0][1], device)
    calls: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]] = {
        "tap.step, default metrics": default_call,
        "tap.step, loss only": loss_call,
        "per-step .item() recipe": recipe_call,
        FLOOR: floor_call,
    }
    in_loop: dict[str, list[int]] = {name: [] for name in calls}
    model_step: list[int] = []
    names = list(calls)
    with default_tap, default_tap.run(name="inloop-default"), loss_tap, loss_tap.run(name="inloop-loss"):
        for i, (x, y) in enumerate(batches):
            t0 = perf()
            out, loss = _model_step(model, opt, x, y)
            t1 = perf()
            name = names[i % len(names)]
            if i < warmup:
                for call in calls.values():  # every path built and warm before timing
                    call(loss, out, y)
                continue
            sync()  # so the recipe's .item() does not also pay for the model step's device work
            t2 = perf()
            calls[name](loss, out, y)
            in_loop[name].append(perf() - t2)
            model_step.append(t1 - t0)
        # the same calls alone, on the last step's tensors (each call right after the previous one)
        alone: dict[str, list[int]] = {}
        for name, call in calls.items():
            samples = []
            for _ in range(args.alone):
                t0 = perf()
                call(loss, out, y)
                samples.append(perf() - t0)
            alone[name] = samples
    print(f"{H.machine_lines(device)[0]}")
    print(f"digits-cnn, batch 32, {device.type}; {args.steps} training steps, the calls taking turns; medians")
    print()
    print("| call | in the loop, µs | alone, µs | in the loop / alone |")
    print("|---|---|---|---|")
    for name in calls:
        loop_us, alone_us = _median_us(in_loop[name]), _median_us(alone[name])
        print(f"| {name} | {loop_us:.1f} | {alone_us:.1f} | {loop_us / alone_us:.1f}x |")
    print(f"| (the model's step: forward, backward, SGD) | {_median_us(model_step):.1f} | — | — |")
    if args.flush_ab:
        print()
        _flush_ab(wl, args.steps // 3, args.reps)
    return 0


FLOOR = "floor: the default metrics' 3 device ops alone"


def _device_ops_floor(
    targets: torch.Tensor, device: torch.device
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """The device ops of a default-metrics ``tap.step`` (see ``Loss.row_writer`` and
    ``Accuracy.row_writer``) on buffers made once, grad mode off as batchtap switches it."""
    cell = torch.zeros((), dtype=torch.float32, device=device)
    pair = torch.full((2, *targets.shape), -100, dtype=torch.int64, device=device)
    predicted = pair.select(0, 0)
    hits = torch.empty(pair.shape, dtype=torch.bool, device=device)
    set_grad_enabled = torch._C._set_grad_enabled

    def call(loss: torch.Tensor, out: torch.Tensor, y: torch.Tensor) -> None:
        set_grad_enabled(False)
        cell.fill_(loss)
        torch.argmax(out, 1, out=predicted)
        torch.eq(pair, y, out=hits)
        set_grad_enabled(True)

    return call


def _flush_ab(wl: H.Workload, steps: int, reps: int) -> None:
    """Whole-loop µs per step over bare: default flushing vs none within the run."""
    configs: dict[str, dict[str, object] | None] = {
        "bare": None,
        "default flushing (every 50 steps)": {},
        "no flush within the run": {"flush_every": 1024, "capacity": 2048, "flush_seconds": 1e6},
    }
    warmup = 10
    batches = [b for epoch in wl.epochs(steps + warmup) for b in epoch][: steps + warmup]

    def loop(config: dict[str, object] | None, loss_only: bool) -> float:
        model = wl.make_model()
        opt = torch.optim.SGD(model.parameters(), lr=wl.lr, momentum=0.9)
        tap = bt.Tap(sinks=[], **config) if config is not None else None  # type: ignore[arg-type]
        with contextlib.ExitStack() as stack:
            if tap is not None:
                stack.enter_context(tap)
                stack.enter_context(tap.run(name="flush-ab"))
            start = 0.0
            for i, (x, y) in enumerate(batches):
                if i == warmup:
                    start = time.perf_counter()
                out, loss = _model_step(model, opt, x, y)
                if tap is not None:
                    if loss_only:
                        tap.step(loss=loss)
                    else:
                        tap.step(loss=loss, outputs=out, targets=y)
            return (time.perf_counter() - start) / steps * 1e6

    print(f"whole loop, µs per step over bare; {steps} steps per run, {reps} interleaved reps, medians")
    print()
    print("| metrics | " + " | ".join(name for name in configs if name != "bare") + " |")
    print("|---|---|---|")
    for loss_only in (False, True):
        runs: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(reps):
            for name, config in configs.items():
                runs[name].append(loop(config, loss_only))
        bare = statistics.median(runs["bare"])
        cells = [f"+{statistics.median(runs[name]) - bare:.0f}" for name in configs if name != "bare"]
        print(f"| {'loss only' if loss_only else 'default'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
