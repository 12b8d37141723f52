"""batchtap side by side with what users would pick instead, on the CPU (issue 7).

Workloads: the demo's ``DigitsCNN`` on scikit-learn digits, and a 3-block CNN on random 3x32x32 data
whose CPU step takes 10-30 ms. Variants, in one process, interleaved repetitions, medians:

1. bare PyTorch loop;
2. the per-step ``.item()`` recipe, a line every 10 batches;
3. batchtap with its default metrics (no sink);
4. batchtap with SQLite + TensorBoard sinks (skipped while those sinks cannot be imported), with
   the pipeline in a thread (the default) and in its own process (``pipeline="process"``);
5. a Lightning ``Trainer``: ``self.log(on_step=True)`` of the loss and a TorchMetrics ``Accuracy``,
   ``CSVLogger`` (skipped when lightning/torchmetrics are not installed);
6. an HF-Trainer-style loop: loss accumulated on the device, read every ``logging_steps=10``.

Reported: ms/step, ratio to bare (median of per-rep ratios), host reads per step (counted with
``_hostreads.HostReadCounter`` in a separate run), and the NaN stop latency in steps (a separate run
per variant with the loss of step 5 made NaN; epochs of the workload's length, which matters for
Lightning, whose stop is checked at epoch end).

7. (issue 26) the same loop with autolog's metric set three ways: the explicit API, the unmodified
   loop under ``bt.autolog()``, and under ``batchtap run``'s machinery; batches from a DataLoader.

Run: ``.venv/bin/python bench/peers.py`` (about 5-6 minutes on 2 cores); ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import _harness as H
import torch

# ---------------------------------------------------------------------- issue 26: autolog rows
# The same loop three ways with the same metrics (loss, accuracy, lr, grad norm, step and data time,
# throughput, memory), its batches from a DataLoader: the explicit API (tap.watch + tap.step), the
# unmodified loop under bt.autolog(), and the unmodified loop run as a script the way `batchtap run`
# runs it (runpy, argv and environment as config). Compare the three rows' ratios with each other.


def _plain_loop(wl: H.Workload, spec: H.Spec, out: H.Outcome, tap: object = None) -> None:
    """The loop with batches from a DataLoader; ``tap``: the explicit API's Tap, None: unmodified."""
    import math

    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    model = wl.make_model()
    opt, window, i = H._optimizer(model, wl.lr), H.Window(wl.device, spec.counter, out), 0
    if tap is not None:
        import batchtap as bt

        explicit = bt.Tap(  # autolog's metric set, written out
            [
                bt.metrics.Loss(nonnegative=False),
                bt.metrics.Accuracy(),
                bt.metrics.LearningRate(opt),
                bt.metrics.GradNorm(model),
                bt.metrics.StepTime(),
                bt.metrics.DataTime(),
                bt.metrics.Throughput(),
                bt.metrics.Memory(),
            ],
            [],
        )
        explicit.start(name=f"bench-{wl.name}")
    for epoch, batches in enumerate(wl.epochs(spec.warmup + spec.steps, spec.epoch_len)):
        loader = DataLoader(batches, batch_size=None, collate_fn=lambda b: b)
        for x, y in explicit.watch(loader, epoch=epoch) if tap is not None else loader:
            if i == spec.warmup:
                window.start()
            outputs = model(x)
            loss = F.cross_entropy(outputs, y)
            if i == spec.nan_at:
                loss = loss * math.nan
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if tap is not None:
                explicit.step(loss=loss, outputs=outputs, targets=y)
            i += 1
    window.stop(i - spec.warmup)
    if tap is not None:
        explicit.finish()
        explicit.close()


class ExplicitSameMetrics(H.Variant):
    name = "batchtap explicit API, autolog's metrics"

    def run(self, wl: H.Workload, spec: H.Spec) -> H.Outcome:
        out = H.Outcome()
        _plain_loop(wl, spec, out, tap=True)
        return out


class Autolog(H.Variant):
    name = "bt.autolog(), unmodified loop"

    def run(self, wl: H.Workload, spec: H.Spec) -> H.Outcome:
        import batchtap as bt

        out = H.Outcome()
        bt.autolog(sinks=[], name=f"bench-{wl.name}")
        try:
            _plain_loop(wl, spec, out)
        finally:
            bt.autolog(enabled=False)
        return out


class BatchtapRun(H.Variant):
    """``batchtap run``'s machinery in this process: autolog with argv/environment config, the loop
    run as a script by ``runpy`` (``cli/run.py: run_script``), the run ended with its status."""

    name = "batchtap run script.py"

    def run(self, wl: H.Workload, spec: H.Spec) -> H.Outcome:
        from batchtap.autolog import active_session, autolog
        from batchtap.cli.run import run_script, training_environment

        out = H.Outcome()
        script = spec.tmp / "train.py"
        script.write_text("import _harness\n_harness.autolog_bench_loop()\n")
        H.autolog_bench_loop = lambda: _plain_loop(wl, spec, out)  # type: ignore[attr-defined]
        config = {"script": str(script), "argv": [str(script)], "environment": training_environment()}
        autolog(sinks=[], name=f"bench-{wl.name}", config=config)
        session = active_session()
        code, status, reason = run_script(script)
        assert session is not None and code == 0, reason
        session.end(status, reason)
        return out


def autolog_variants() -> list[H.Variant]:
    """Issue 26's rows: the explicit API and autolog with the same metrics, side by side."""
    return [ExplicitSameMetrics(), Autolog(), BatchtapRun()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions (default 5)")
    parser.add_argument("--digits-steps", type=int, default=300, help="timed steps per digits run (default 300)")
    parser.add_argument("--cnn-steps", type=int, default=60, help="timed steps per CNN run (default 60)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per run (default 10)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1; 0 keeps torch's default)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 reps, few steps")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--autolog-only", action="store_true", help="only bare and the three autolog rows of issue 26")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.digits_steps, args.cnn_steps, args.warmup = 2, 40, 10, 5
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    started = time.perf_counter()

    workloads = [H.digits_workload(device), H.cnn32_workload(device)]
    steps = {workloads[0].name: args.digits_steps, workloads[1].name: args.cnn_steps}
    variants = [H.Bare(), *autolog_variants()] if args.autolog_only else H.peer_variants() + autolog_variants()
    rows = H.run_suite(
        workloads,
        variants,
        reps=args.reps,
        steps=steps,
        warmup=args.warmup,
        count_steps=min(50, max(steps.values())),
        nan_at=5,
    )
    print()
    print("## batchtap and its peers on the CPU (bench/peers.py)")
    print()
    for line in H.machine_lines(device):
        print(line)
    for wl in workloads:
        print(
            f"{wl.name}: {wl.description}; {steps[wl.name]} timed steps (+{args.warmup} warm-up) per run; "
            f"NaN runs: epochs of {wl.epoch_len} batches"
        )
    print(f"{args.reps} interleaved reps; medians")
    print()
    print(H.format_table(rows, nan_at=5))
    print()
    for r in rows:
        if r.reads_by_op:
            print(f"reads by kind, {r.workload} / {r.variant}: {r.reads_by_op}")
    print(f"\n(total bench time {time.perf_counter() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
