"""A training loop written for Hugging Face Accelerate, as its nlp_example.py is: ``Accelerator``
with gradient accumulation, ``accelerator.prepare``, ``with accelerator.accumulate(model)``,
``accelerator.backward(loss)``, a linear warm-up scheduler stepped with the optimizer, and
``accelerator.print``. A small MLP on synthetic data (no download).

    batchtap run examples/autolog/accelerate_train.py
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=5e-3)
    args = parser.parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, cpu=True)
    torch.manual_seed(42)
    g = torch.Generator().manual_seed(42)
    x = torch.randn(512, 20, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + (x[:, 4:8].sum(1) > 1).long()
    train_dataloader = DataLoader(TensorDataset(x[:384], y[:384]), batch_size=16, shuffle=True)
    eval_dataloader = DataLoader(TensorDataset(x[384:], y[384:]), batch_size=64)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    total = args.epochs * len(train_dataloader) // args.gradient_accumulation_steps
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4) * (1 - s / total))
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    for epoch in range(args.epochs):
        model.train()
        losses = []
        for step, (inputs, targets) in enumerate(train_dataloader):
            with accelerator.accumulate(model):
                logits = model(inputs)
                loss = F.cross_entropy(logits, targets)
                accelerator.backward(loss)
                losses.append(loss.detach())
                if accelerator.sync_gradients:
                    lr = optimizer.param_groups[0]["lr"]
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                mean = torch.stack(losses).mean().item()
                accelerator.print(f"epoch {epoch} step {step}: loss {mean:.6f} lr {lr:.8f}")
                losses = []
        model.eval()
        correct = 0
        for inputs, targets in eval_dataloader:
            with torch.no_grad():
                correct += (model(inputs).argmax(-1) == targets).sum().item()
        accelerator.print(f"epoch {epoch}: eval accuracy {correct / 128:.3f}")


if __name__ == "__main__":
    main()
