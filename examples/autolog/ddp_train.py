"""Distributed data-parallel training as the PyTorch DDP tutorial writes it, for ``torchrun``:
``init_process_group`` (gloo), a ``DistributedSampler``, ``DistributedDataParallel``, each rank
its own shard of every batch; rank 0 prints the loss and accuracy over all ranks (all-reduced).

    torchrun --nproc_per_node=2 -m batchtap run examples/autolog/ddp_train.py
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 10, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    sampler = DistributedSampler(TensorDataset(x, y), num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad()
            out = model(inputs)
            loss = F.cross_entropy(out, targets)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()
            stats = torch.stack([loss.detach() * len(targets), (out.argmax(1) == targets).sum().float()])
            stats = torch.cat([stats, torch.tensor([float(len(targets))])])
            dist.all_reduce(stats)
            if rank == 0:
                print(
                    f"epoch {epoch} step {step}: loss {(stats[0] / stats[2]).item():.6f} "
                    f"acc {(stats[1] / stats[2]).item():.6f} lr {optimizer.param_groups[0]['lr']:.6f} "
                    f"norm {norm.item():.6f}"
                )
            step += 1
        scheduler.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
