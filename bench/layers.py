"""Cost of per-layer signals on a nanoGPT-style CPU loop: Layers(every=10) against the same Tap
without it (goal: <= 1 % of the whole step), Layers(every=1), Histograms(every=10) and MFU measured.

Alternating pairs: every repetition runs each variant once, in an order rotated by the repetition,
from the same weights and batches; a variant's cost is its step time over the plain Tap's of the
same repetition, and the median of those ratios is reported (slow drift of a shared machine cancels).

    .venv/bin/python bench/layers.py                   # the BENCHMARKS.md figures (quiet machine)
    .venv/bin/python bench/layers.py --quick           # a smoke run
    .venv/bin/python bench/layers.py --device cuda     # the GPU cell (bench/gpu_check.sh)
    .venv/bin/python bench/layers.py --profile         # counts, not times: ops and Python calls per step

``--profile`` counts what each variant adds to the part of the step it touches (``opt.step()`` and
``tap.step()``), separately on steps that capture and steps that do not: aten ops dispatched
(a ``TorchDispatchMode``; on a GPU each is at least one kernel launch) and Python function calls
(``cProfile``). Counts do not depend on the machine's load, so they can be taken anywhere.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import batchtap as bt  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.c_attn(self.ln_1(x)).split(d, 2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """nanoGPT's shape: token + position embeddings, pre-LN blocks, a tied head."""

    def __init__(self, vocab: int, block: int, layers: int, d: int, heads: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _variants(quick: bool) -> dict[str, Callable[[nn.Module], list[bt.metrics.Metric]]]:
    base = lambda m: [bt.metrics.Loss(), bt.metrics.StepTime()]  # noqa: E731
    return {
        "tap": base,
        "layers10": lambda m: base(m) + [bt.metrics.Layers(m, every=10)],
        "layers1": lambda m: base(m) + [bt.metrics.Layers(m, every=1)],
        "hist10": lambda m: base(m) + [bt.metrics.Histograms(m, every=10)],
        "mfu": lambda m: base(m) + [bt.metrics.MFU()],
    }


def _run(make: Callable[[nn.Module], list], args: argparse.Namespace, batches: list, device: torch.device) -> float:
    """Seconds per step of one run (median over the timed window's chunks of 10 steps)."""
    torch.manual_seed(0)
    model = GPT(args.vocab, args.block, args.layers, args.d, args.heads).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tap = bt.Tap(make(model), [], flush_every=50)
    chunks: list[float] = []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with tap, tap.run(name="bench-layers"):
        start = 0.0
        for step, (x, y) in enumerate(batches):
            if step >= args.warmup and (step - args.warmup) % 10 == 0:
                sync()  # sync: the benchmark's own clock, at a chunk boundary, never in the library
                now = time.perf_counter()
                if step > args.warmup:
                    chunks.append((now - start) / 10)
                start = now
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            tap.step(loss=loss, targets=y)
    return statistics.median(chunks)


class _OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched while entered."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _profile(make: Callable[[nn.Module], list], args: argparse.Namespace, batches: list, what: str) -> dict[str, float]:
    """Per step of ``opt.step(); tap.step()``: aten ops (``what="ops"``) or Python calls
    (``"calls"``; a separate run, since the op counter's own Python would be counted), the median
    over the steps that capture (every 10th from 0) and over those that do not, after the warm-up."""
    torch.manual_seed(0)
    model = GPT(args.vocab, args.block, args.layers, args.d, args.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tap = bt.Tap(make(model), [], flush_every=50)
    counts: dict[bool, list[int]] = {True: [], False: []}
    with tap, tap.run(name="bench-layers-profile"):
        for step, (x, y) in enumerate(batches):
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if what == "ops":
                with _OpCount() as ops:
                    opt.step()
                    tap.step(loss=loss, targets=y)
                count = ops.ops
            else:
                calls = cProfile.Profile()
                calls.enable()
                opt.step()
                tap.step(loss=loss, targets=y)
                calls.disable()
                count = pstats.Stats(calls).total_calls  # type: ignore[attr-defined]
            if step >= args.warmup:
                counts[step % 10 == 0].append(count)
    return {"captured": statistics.median(counts[True]), "other": statistics.median(counts[False])}


def _print_profile(args: argparse.Namespace, batches: list, variants: dict) -> None:
    got = {
        name: {what: _profile(make, args, batches, what) for what in ("ops", "calls")}
        for name, make in variants.items()
    }
    base = got["tap"]
    print(
        f"per step of opt.step() + tap.step() (AdamW, {args.layers} blocks), median over the steps after "
        f"{args.warmup} warm-up steps; 'added': over the plain Tap ('tap')"
    )
    print(f"{'variant':<10} {'steps':<9} {'aten ops':>9} {'added':>6} {'py calls':>9} {'added':>6}")
    for name in variants:
        for kind in ("captured", "other"):
            ops, calls = got[name]["ops"][kind], got[name]["calls"][kind]
            added_ops, added_calls = ops - base["ops"][kind], calls - base["calls"][kind]
            print(f"{name:<10} {kind:<9} {ops:>9.0f} {added_ops:>6.0f} {calls:>9.0f} {added_calls:>6.0f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--steps", type=int, default=200, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=65)
    p.add_argument("--quick", action="store_true", help="a smoke run: a tiny model, 1 rep of 20 steps")
    p.add_argument("--only", default="", help="comma-separated variants (default: all)")
    p.add_argument("--profile", action="store_true", help="count ops and Python calls per step (CPU), no timing")
    args = p.parse_args(argv)
    if args.profile:  # counts do not need the timed window's length
        args.reps, args.steps, args.warmup = 1, min(args.steps, 40), min(args.warmup, 10)
    if args.quick:
        args.reps, args.steps, args.warmup, args.layers, args.d, args.block, args.batch = 1, 20, 10, 2, 32, 16, 4
    device = torch.device(args.device)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    g = torch.Generator().manual_seed(1)
    total = args.warmup + args.steps + 1
    batches = [
        (
            torch.randint(0, args.vocab, (args.batch, args.block), generator=g).to(device),
            torch.randint(0, args.vocab, (args.batch, args.block), generator=g).to(device),
        )
        for _ in range(total)
    ]
    variants = _variants(args.quick)
    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only.split(",") or k == "tap"}
    if args.profile:
        _print_profile(args, batches, {k: v for k, v in variants.items() if k != "mfu"})
        return 0
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(args.reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        got = {name: _run(variants[name], args, batches, device) for name in order}
        for name in names:
            times[name].append(got[name])
            ratios[name].append(got[name] / got["tap"])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    print(
        f"nanoGPT-style loop on {device}: {args.layers} layers, d={args.d}, block {args.block}, batch {args.batch}; "
        f"{args.reps} reps x {args.steps} steps, load average {load:.2f}, torch {torch.__version__}"
    )
    print(f"{'variant':<10} {'ms/step (median)':>17} {'vs tap (median of paired ratios)':>34} {'min..max ratio':>16}")
    for name in names:
        r = ratios[name]
        print(
            f"{name:<10} {1e3 * statistics.median(times[name]):>17.3f} {statistics.median(r):>33.4f}x "
            f"{min(r):>7.4f}..{max(r):.4f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
