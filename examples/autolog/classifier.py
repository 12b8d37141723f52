"""An image classifier trained the way torchvision's references/classification/train.py does it:
``train_one_epoch`` with ``nn.CrossEntropyLoss(label_smoothing=...)``, SGD with momentum, a
``OneCycleLR`` stepped after every optimizer step, a metric line every ``--print-freq`` batches,
``evaluate`` under ``inference_mode``. Synthetic 3x16x16 images (no torchvision, no download).

    batchtap run examples/autolog/classifier.py --epochs 2
"""

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def make_data(n, classes, generator):
    centers = torch.randn(classes, 3, 16, 16, generator=generator)
    y = torch.randint(0, classes, (n,), generator=generator)
    x = centers[y] + 1.5 * torch.randn(n, 3, 16, 16, generator=generator)
    return TensorDataset(x, y)


def small_resnet(classes):
    def block(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

    return nn.Sequential(
        block(3, 16),
        block(16, 32),
        nn.MaxPool2d(2),
        block(32, 32),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, classes),
    )


def accuracy(output, target, topk=(1,)):
    with torch.inference_mode():
        maxk = max(topk)
        _, pred = output.topk(maxk, 1, True, True)
        correct = pred.t().eq(target[None])
        return [correct[:k].flatten().sum(dtype=torch.float32) * (100.0 / target.size(0)) for k in topk]


def train_one_epoch(model, criterion, optimizer, lr_scheduler, data_loader, device, epoch, args):
    model.train()
    for i, (image, target) in enumerate(data_loader):
        image, target = image.to(device), target.to(device)
        output = model(image)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        if args.clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        lr_scheduler.step()
        if i % args.print_freq == 0:
            (acc1,) = accuracy(output, target)
            print(
                f"Epoch: [{epoch}] [{i}/{len(data_loader)}] lr: {lr:.8f} loss: {loss.item():.6f} acc1: {acc1.item():.4f}"
            )


def evaluate(model, criterion, data_loader, device):
    model.eval()
    total, correct = 0, 0
    with torch.inference_mode():
        for image, target in data_loader:
            output = model(image.to(device))
            correct += (output.argmax(1) == target.to(device)).sum().item()
            total += target.numel()
    print(f"Test: Acc@1 {100.0 * correct / total:.3f}")


def main():
    parser = argparse.ArgumentParser(description="Classification training (torchvision reference style)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--wd", type=float, default=1e-4)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--clip-grad-norm", type=float, default=None)
    parser.add_argument("--print-freq", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    train_loader = DataLoader(make_data(640, 10, g), batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(make_data(200, 10, g), batch_size=100)
    model = small_resnet(10).to(device)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.wd)
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, epochs=args.epochs, steps_per_epoch=len(train_loader)
    )
    for epoch in range(args.epochs):
        train_one_epoch(model, criterion, optimizer, lr_scheduler, train_loader, device, epoch, args)
        evaluate(model, criterion, val_loader, device)


if __name__ == "__main__":
    main()
