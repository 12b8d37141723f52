"""The host cost of one ``tap.step()`` inside a real training loop, next to the same call alone (issue 13).

``../shared/tools/stepcost.py`` times ``tap.step()`` in a tight loop on fixed tensors, where every
line of it stays in the CPU's caches. In a training loop the model's own step runs between two calls
and pushes them out, so the same call costs several times more. This script times each call right
after a real optimizer step of the digits CNN (the demo's model, batch 32), and the same call alone,
side by side in one process:

* ``tap.step`` with the default metrics (loss, top-1 accuracy, step/data time, throughput);
* ``tap.step`` with the loss only;
* the per-step ``.item()`` recipe: ``loss.item()`` and ``(outputs.argmax(1) == y).sum().item()``;
* the model's step itself (forward, backward, optimizer), for scale.

The calls take turns, one per training step (each follows a model step, none follows another
measured call). Reported: median µs per call in the loop and alone, and their ratio. On a CUDA device
(``--device cuda``) the times are host times: the work the call adds to the launch queue's critical
path, not device time; the recipe then also waits for the device at each ``.item()``.

Run: ``.venv/bin/python bench/inloop.py`` (about 30 s on 2 cores); ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import _harness as H
import batchtap as bt


def _median_us(samples: list[int]) -> float:
    return statistics.median(samples) / 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200, help="timed training steps (default 1200)")
    parser.add_argument("--alone", type=int, default=3000, help="timed calls alone, per variant (default 3000)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--quick", action="store_true", help="smoke run: few steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.alone = 80, 200
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

    calls: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]] = {
        "tap.step, default metrics": default_call,
        "tap.step, loss only": loss_call,
        "per-step .item() recipe": recipe_call,
    }
    in_loop: dict[str, list[int]] = {name: [] for name in calls}
    model_step: list[int] = []
    names = list(calls)
    with default_tap, default_tap.run(name="inloop-default"), loss_tap, loss_tap.run(name="inloop-loss"):
        for i, (x, y) in enumerate(batches):
            t0 = perf()
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
