"""Per-iteration cost of batchtap on a nanoGPT-style char LM on the CPU: bare vs the explicit API vs
``batchtap run`` (autolog on the unmodified loop).

The model: 2 transformer blocks, 64 wide, 4 heads, block size 64, a 65-character vocabulary;
4 micro-batches of 8 sequences per optimizer step, ``(loss / 4).backward()``, ``clip_grad_norm_``,
AdamW with a hand-set cosine lr (nanoGPT's ``train.py`` loop). Each measurement is a fresh process
running the same loop, timed by the loop itself (``time.perf_counter`` around each training
iteration: the micro-batches, clipping, the optimizer step and, for the explicit API, the
``tap.accumulate``/``tap.step`` calls); the first ``--warmup`` iterations are left out (the ring
and the short path are built there) and the process's median iteration time is its figure.
Start-up and the run's end are not in it. Beside the wall time each process also reports the
training thread's CPU time per iteration (``time.thread_time``): the loop runs on one thread
(``OMP_NUM_THREADS=1``), so that is the host work the step costs, and it does not count the time the
thread was descheduled by other processes on a shared machine; the pipeline's own thread is not in it.

The three processes run in turn, in alternating order (``bare, explicit, run`` then ``run,
explicit, bare``...), ``--rounds`` times; the table gives each variant's median over rounds and
the ratios ``run / explicit`` (goal <= 1.01) and ``explicit / bare`` (goal <= 1.03); then the
same ratios paired within each round (the variants' processes run back to back), median and range:
on this VM a process can run ~10 % slower than the one before it whatever it runs, so the paired
figure is the steadier one. A fourth process per round, ``bare-again`` (the bare loop once more), is
the control: ``bare-again / bare`` is what the machine alone spreads, against which the goals' 1-3 %
are read.

    .venv/bin/python bench/engines.py                     # 5 rounds x 3 processes x 200 iterations
    .venv/bin/python bench/engines.py --rounds 1 --iters 20 --warmup 5   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, BLOCK, WIDTH, HEADS, LAYERS = 65, 64, 64, 4, 2
MICRO, ACCUM = 8, 4
LR, MIN_LR, WARMUP_ITERS, DECAY_ITERS = 1e-3, 1e-4, 20, 400


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln1(x)).split(WIDTH, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(BLOCK, WIDTH)
        self.blocks = nn.Sequential(*(Block() for _ in range(LAYERS)))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def get_lr(it: int) -> float:
    """nanoGPT's warmup + cosine decay, set by hand on the param groups."""
    if it < WARMUP_ITERS:
        return LR * (it + 1) / (WARMUP_ITERS + 1)
    ratio = min(1.0, (it - WARMUP_ITERS) / (DECAY_ITERS - WARMUP_ITERS))
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)


def loop(mode: str, iters: int, warmup: int, db: str) -> list[tuple[float, float]]:
    """The training loop; ``mode`` 'bare' (also what ``batchtap run`` runs) or 'explicit'.

    Returns (wall seconds, training-thread CPU seconds) per iteration after ``warmup``."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = torch.randint(0, VOCAB, (200_000,), generator=torch.Generator().manual_seed(1))
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    tap = None
    if mode == "explicit":
        import batchtap as bt

        tap = bt.Tap(optimizer=optimizer)  # the default sinks, as batchtap run's: SQLite at $BATCHTAP_DB + console
        tap.start(name="engines-explicit")
    g = torch.Generator().manual_seed(2)
    times = []
    for it in range(iters):
        starts = torch.randint(0, len(data) - BLOCK - 1, (ACCUM, MICRO), generator=g)
        batches = [
            (torch.stack([data[s : s + BLOCK] for s in row]), torch.stack([data[s + 1 : s + 1 + BLOCK] for s in row]))
            for row in starts
        ]
        began, began_cpu = time.perf_counter(), time.thread_time()
        lr = get_lr(it)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for x, y in batches:
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1), ignore_index=-1)
            (loss / ACCUM).backward()
            if tap is not None:
                tap.accumulate(loss=loss, outputs=logits, targets=y)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if tap is not None:
            tap.step(grad_norm=norm)
        optimizer.zero_grad(set_to_none=True)
        times.append((time.perf_counter() - began, time.thread_time() - began_cpu))
    if tap is not None:
        tap.finish()
        tap.close()
    return times[warmup:]


def _child(args: argparse.Namespace) -> None:
    times = loop(args.child, args.iters, args.warmup, args.db)
    Path(args.out).write_text(json.dumps(times))


def _measure(variant: str, args: argparse.Namespace, workdir: Path) -> tuple[float, float]:
    """One fresh process of ``variant``; its median iteration wall time and training-thread CPU
    time, in seconds."""
    out = workdir / f"{variant}.json"
    db = str(workdir / f"{variant}.db")
    child = [str(Path(__file__).resolve()), "--iters", str(args.iters), "--warmup", str(args.warmup)]
    child += ["--out", str(out), "--db", db]
    if variant == "run":
        command = [sys.executable, "-m", "batchtap", "run", "--db", db, *child, "--child", "bare"]
    else:
        command = [sys.executable, *child, "--child", "bare" if variant == "bare-again" else variant]
    env = dict(os.environ, OMP_NUM_THREADS="1", BATCHTAP_DB=db)
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    times = json.loads(out.read_text())
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--child", choices=("bare", "explicit"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--db", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    # bare-again: the bare loop in a process of its own again, the A/A control of the machine's spread
    variants = ["bare", "explicit", "run", "bare-again"]
    wall: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for variant in order:
                w, c = _measure(variant, args, Path(tmp))
                wall[variant].append(w)
                cpu[variant].append(c)
            print(
                f"round {r + 1}: "
                + ", ".join(f"{v} {wall[v][-1] * 1e3:.2f} ms (cpu {cpu[v][-1] * 1e3:.2f})" for v in variants),
                flush=True,
            )
    print(
        f"\nper training iteration (median of {args.rounds} process medians, {args.iters - args.warmup} iterations each)"
    )
    for label, series in (("wall", wall), ("training-thread CPU", cpu)):
        m = {v: statistics.median(series[v]) for v in variants}
        print(f"{label}:")
        for v in variants:
            print(f"  {v:9s} {m[v] * 1e3:8.3f} ms")
        print(f"  run / explicit  = {m['run'] / m['explicit']:.4f}  (goal <= 1.01)")
        print(f"  explicit / bare = {m['explicit'] / m['bare']:.4f}  (goal <= 1.03)")
        print(f"  run / bare      = {m['run'] / m['bare']:.4f}")
    # Processes on this VM drift by up to ~10 % from one to the next whatever they run: the ratios of the
    # variants' runs within each round (run back to back) are the steadier figure
    print(f"paired per round (median, quartiles, range of {args.rounds} rounds), wall:")
    pairs = (("run", "explicit"), ("explicit", "bare"), ("bare-again", "bare"))
    for label, num, den in ((f"{a} / {b}", a, b) for a, b in pairs):
        ratios = sorted(a / b for a, b in zip(wall[num], wall[den]))
        quarter = len(ratios) // 4
        print(
            f"  {label:17s} = {statistics.median(ratios):.4f}  quartiles [{ratios[quarter]:.4f}-{ratios[-1 - quarter]:.4f}]"
            f"  range [{ratios[0]:.4f}-{ratios[-1]:.4f}]"
        )
    print(f"load average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
