"""A short real training run that stores its metrics: the store every CLI test reads.

Run as a script (``python tests/cli/_train.py --db PATH``) so that the CLI tests can start it as
the "other process" writing while ``batchtap tail`` reads. Prints the run id on its first line.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import batchtap as bt


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True, help="SQLite path or postgresql:// URL")
    p.add_argument("--schema", default=None, help="PostgreSQL schema")
    p.add_argument("--name", default="cli-test")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batches", type=int, default=12)
    p.add_argument(
        "--nan-at", type=int, default=None, help="record a NaN loss at this step (an anomaly; training goes on)"
    )
    p.add_argument("--nan-action", default="alert", choices=("alert", "stop"), help="what the NonFinite rule does")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each step")
    p.add_argument("--go-file", default=None, help="after the first epoch, wait until this file exists")
    p.add_argument("--flush-every", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--log-eval", action="store_true", help="tap.log() val_loss/val_acc after each epoch, test_acc at the end"
    )
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    centers = torch.randn(4, 8, generator=gen) * 2
    labels = torch.randint(0, 4, (args.batches, 16), generator=gen)
    batches = [(centers[y] + torch.randn(16, 8, generator=gen), y) for y in labels]
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if args.db.startswith("postgres"):
        sink: bt.sinks.Sink = bt.sinks.Postgres(args.db, schema=args.schema)
    else:
        sink = bt.sinks.SQLite(args.db)
    tap = bt.Tap(
        sinks=[sink],
        flush_every=args.flush_every,
        flush_seconds=0.2,
        optimizer=opt,
        model=model,
        rules=[bt.NonFinite("loss", action=args.nan_action)],
        handle_sigterm=False,
    )
    step = 0
    with tap, tap.run(name=args.name, config={"lr": 0.1, "epochs": args.epochs, "seed": args.seed}) as info:
        print(info.id, flush=True)
        for epoch in range(args.epochs):
            if epoch == 1 and args.go_file:
                tap.flush()  # epoch 0 is stored whole before the pause
                print("paused", flush=True)
                while not Path(args.go_file).exists():
                    time.sleep(0.05)
            if tap.should_stop:
                break
            for x, y in tap.watch(batches, epoch=epoch):
                if tap.should_stop:
                    break
                out = model(x)
                loss = torch.nn.functional.cross_entropy(out, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                recorded = loss.detach() * float("nan") if step == args.nan_at else loss.detach()
                tap.step(recorded, outputs=out.detach(), targets=y)
                step += 1
                if args.sleep:
                    time.sleep(args.sleep)
            if args.log_eval:
                x, y = batches[0]
                with torch.no_grad():
                    out = model(x)
                    tap.log(
                        {
                            "val_loss": torch.nn.functional.cross_entropy(out, y),
                            "val_acc": (out.argmax(1) == y).float().mean(),
                        }
                    )
        if args.log_eval:
            tap.log({"test_acc": 0.5})
    return info.id


if __name__ == "__main__":
    main()
