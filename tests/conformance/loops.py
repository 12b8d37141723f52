"""The matrix's hand-written training loops: one loop, its options set per scenario.

A loop is written the way people write it (no batchtap line in it); the front-end's :class:`Hooks`
add what that front-end needs (``tap.watch`` / ``tap.accumulate`` / ``tap.step`` for the explicit
API, nothing for ``bt.autolog()`` and ``batchtap run``). Each loop takes the truth of every optimizer
step in the same run: the tensors the loop made, read with ``.item()`` only after the loop ended, so
the host reads counted inside the loop are the front-end's alone.

"The step's loss" (docs/autolog.md): the loss the step's gradients minimise: micro-batches divided
by their count give the per-sample mean over the optimizer step (per-token for token-normalised
losses), undivided micro-batches their sum, two losses backpropagated in one step their sum.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["OPTIONS", "Hooks", "Options", "Truth", "train"]

EPOCHS = 2
BATCH = 4
VOCAB = 11
SEQ = 6
MAX_NORM = 0.05  # small: every step clips, so a stored clipped norm cannot pass for the pre-clip one
AMP_SCALE = 2.0**8


@dataclass(frozen=True)
class Options:
    """How a scenario's loop differs from the plain one."""

    accum: int = 1  # micro-batches per optimizer step (all the same size)
    backward: Literal["divided", "undivided", "token"] = "divided"  # what is given to backward()
    clip: Literal["none", "torch", "get_total_norm"] = "none"
    amp_skip_first: bool = False  # fp16 autocast + GradScaler, an inf planted in step 0's gradients
    two_losses: bool = False  # two backward() calls per step
    pad: int | None = None  # a sequence model whose targets are padded with this value (the loss's ignore_index)
    dist: Literal["none", "ddp", "fsdp2"] = "none"
    norm_as: Literal["returned", "full_tensor"] = "returned"  # what the explicit API is given as grad_norm
    world: int = 2  # ranks of a process group (dist != "none")
    device: Literal["cpu", "cuda"] = "cpu"


#: scenario name -> its loop's options (the registry lists the scenarios and documents them)
OPTIONS: dict[str, Options] = {
    "plain": Options(),
    "divided-accum": Options(accum=2),
    "undivided-accum": Options(accum=2, backward="undivided"),
    "token-normalised-accum": Options(accum=2, backward="token", pad=-100),
    "clip-torch": Options(clip="torch"),
    "clip-get_total_norm": Options(clip="get_total_norm"),
    "amp-skipped-first-step": Options(amp_skip_first=True),
    "two-losses": Options(two_losses=True),
    "pad-100": Options(pad=-100),
    "pad-1": Options(pad=-1),
    "pad-100-accum": Options(pad=-100, accum=2),
    "ddp-2-ranks": Options(dist="ddp"),
    "ddp-2-ranks-undivided-accum": Options(dist="ddp", accum=2, backward="undivided"),
    "fsdp2-2-ranks": Options(dist="fsdp2", clip="torch"),
    "fsdp2-2-ranks-full_tensor": Options(dist="fsdp2", clip="torch", norm_as="full_tensor"),
    # the CUDA cells (bench/gpu_check.sh): a single-rank mesh on one GPU where two are not lent
    "fsdp2-cuda-1-rank": Options(dist="fsdp2", clip="torch", world=1, device="cuda"),
}


class Hooks:
    """What a front-end adds to the loop; the base class adds nothing (autolog, ``batchtap run``)."""

    def begin(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, opts: Options) -> None:
        """Called once, after the model, optimizer and scaler exist."""

    def loader(self, loader: Iterable[Any], epoch: int) -> Iterable[Any]:
        return loader

    def micro(
        self, loss: torch.Tensor, outputs: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor | None
    ) -> None:
        """One micro-batch of an accumulated step: its loss as a mean over ``weight`` tokens (None: its samples)."""

    def step(
        self,
        loss: torch.Tensor | None,
        outputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        grad_norm: Any,
    ) -> None:
        """The optimizer step just taken (after ``optimizer.step()``/``scaler.step()``, before ``update()``)."""

    @contextlib.contextmanager
    def iteration(self, index: int) -> Iterator[None]:
        """Around one optimizer step's work (host reads are counted here where a front-end does)."""
        yield

    def end(self) -> None:
        """After the last step."""

    def fail(self, exc: BaseException) -> None:
        """The loop raised ``exc``."""


@dataclass
class Truth:
    """One optimizer step as the loop's own tensors say (read with ``.item()`` by :meth:`values`)."""

    epoch: int
    batch: int
    lr: float
    loss: torch.Tensor
    correct: torch.Tensor
    kept: torch.Tensor
    grad_norm: torch.Tensor  # left out of values() on a step the GradScaler skipped
    loss_scale: torch.Tensor | None = None
    skipped: torch.Tensor | None = None
    samples: int = 0  # sequences (rows of the batches the loader handed out) over the step's micro-batches

    def counts(self) -> dict[str, float]:
        """What the step's throughput counts (``compare.COUNTS``): its samples, its kept tokens."""
        return {"samples": float(self.samples), "tokens": float(self.kept.item())}

    def values(self) -> dict[str, float]:
        out = {"loss": self.loss.item(), "accuracy": self.correct.item() / self.kept.item(), "lr": self.lr}
        if self.grad_norm is not None:
            out["grad_norm"] = self.grad_norm.item()
        if self.loss_scale is not None and self.skipped is not None:
            out["loss_scale"] = self.loss_scale.item()
            out["amp_skipped"] = float(self.skipped.item())
            if self.skipped.item():
                out.pop("grad_norm", None)  # a skipped step's norm is not finite: left out, not stored
        return out


def _model(opts: Options) -> nn.Module:
    if opts.pad is not None:
        return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, VOCAB))
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _data(opts: Options, rank: int) -> TensorDataset:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    n = 4 * opts.accum * BATCH
    if opts.pad is None:
        return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    cut = torch.randint(1, SEQ + 1, (n,), generator=g)  # uneven lengths: kept tokens differ per micro-batch
    y[torch.arange(SEQ)[None, :] >= cut[:, None]] = opts.pad
    return TensorDataset(x, y)


def _wrap(model: nn.Module, opts: Options) -> nn.Module:
    if opts.dist == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if opts.dist == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(opts.device, (torch.distributed.get_world_size(),))
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value (its ``full_tensor()``), any other tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _total_norm(model: nn.Module) -> torch.Tensor:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return _full(torch.nn.utils.get_total_norm(grads)).detach().clone()


def train(opts: Options, hooks: Hooks) -> list[Truth]:
    """Run the loop; the truth of every optimizer step (this rank's, in a process group)."""
    rank = torch.distributed.get_rank() if opts.dist != "none" else 0
    torch.manual_seed(0)  # the same initial model on every rank
    model = _wrap(_model(opts).to(opts.device), opts)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)  # the lr moves mid-epoch
    scaler = torch.amp.GradScaler("cpu", init_scale=AMP_SCALE) if opts.amp_skip_first else None
    hooks.begin(model, optimizer, scaler, opts)
    ignore = opts.pad if opts.pad is not None else -100
    loader = DataLoader(_data(opts, rank), batch_size=BATCH)  # sequential sampling: no host read per batch
    truths: list[Truth] = []
    for epoch in range(EPOCHS):
        step_batches: list[tuple[int, Any]] = []
        for index, batch in enumerate(hooks.loader(loader, epoch)):
            step_batches.append((index, batch))
            if len(step_batches) < opts.accum:
                continue
            with hooks.iteration(len(truths)):
                truths.append(
                    _one_step(model, optimizer, scaler, hooks, opts, step_batches, epoch, ignore, len(truths))
                )
                scheduler.step()
            step_batches = []
    hooks.end()
    return truths


def _one_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    hooks: Hooks,
    opts: Options,
    batches: list[tuple[int, Any]],
    epoch: int,
    ignore: int,
    step: int,
) -> Truth:
    seq = opts.pad is not None
    # the HF Trainer's N: kept tokens of the whole optimizer step, known before its first backward()
    n_items = sum((y.to(opts.device) != ignore).sum() for _, (_, y) in batches) if opts.backward == "token" else None
    loss_sum = torch.zeros((), dtype=torch.float64, device=opts.device)
    correct = torch.zeros((), dtype=torch.int64, device=opts.device)
    kept = torch.zeros((), dtype=torch.int64, device=opts.device)
    last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    for x, y in (b for _, b in batches):
        x, y = x.to(opts.device), y.to(opts.device)  # host-to-device copies: no read
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
            out = model(x)
            flat, flat_y = (out.reshape(-1, VOCAB), y.reshape(-1)) if seq else (out, y)
            if opts.backward == "token":
                summed = F.cross_entropy(flat, flat_y, ignore_index=ignore, reduction="sum")
                loss = summed / n_items
            else:
                loss = F.cross_entropy(flat, flat_y, ignore_index=ignore)
        mask = y != ignore
        correct += ((out.detach().float().argmax(-1) == y) & mask).sum()
        kept += mask.sum()
        if opts.two_losses:
            aux = out.float().pow(2).mean() * 0.01
            loss.backward(retain_graph=True)
            aux.backward()  # a second backward() in the same optimizer step: the step's loss is the sum
            total = loss + aux
            loss_sum += total.detach().double()
            last = (total.detach(), out, y)
        elif scaler is not None:
            scaler.scale(loss).backward()
            loss_sum += loss.detach().double()
            last = (loss.detach(), out, y)
        elif opts.backward == "token":
            loss.backward()
            loss_sum += summed.detach().double()
            micro_kept = mask.sum()
            hooks.micro(summed.detach() / micro_kept, out, y, micro_kept)  # explicit API: the micro-batch's mean
        elif opts.accum > 1:
            (loss / opts.accum if opts.backward == "divided" else loss).backward()
            loss_sum += loss.detach().double()
            # the explicit API takes each micro-batch's loss and stores their mean: for undivided
            # micro-batches (whose sum the gradients minimise) that is accum x the tensor given to backward()
            hooks.micro(loss if opts.backward == "divided" else loss * opts.accum, out, y, None)
        else:
            loss.backward()
            loss_sum += loss.detach().double()
            last = (loss.detach(), out, y)
    if opts.amp_skip_first and step == 0:
        next(model.parameters()).grad.view(-1)[0] = math.inf  # what an fp16 overflow leaves in a gradient
    lr = float(optimizer.param_groups[0]["lr"])  # a host float: the rate this step uses
    # the scale this step's loss was multiplied by, kept on the device (get_scale() would read it)
    scale = scaler._scale.detach().clone() if scaler is not None else None
    if scaler is not None:
        scaler.unscale_(optimizer)
    returned: torch.Tensor | None = None
    if opts.clip == "torch":
        returned = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        norm = _full(returned).detach().clone()
    elif opts.clip == "get_total_norm":
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        returned = torch.nn.utils.get_total_norm(grads)
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), MAX_NORM, returned)
        norm = returned.detach().clone()
    else:
        norm = _total_norm(model)
    if scaler is not None:
        scaler.step(optimizer)
    else:
        optimizer.step()
    given = returned
    if returned is not None and opts.norm_as == "full_tensor":
        given = _full(returned)
    if last is not None:
        loss_given, out, y = last
        hooks.step(loss_given, out, y, given)
    else:
        hooks.step(None, None, None, given)
    skipped = None
    if scaler is not None:
        scaler.update()
        skipped = scaler._scale < scale  # the scaler halves its scale on a skip
    optimizer.zero_grad(set_to_none=True)
    if opts.backward == "token":
        step_loss = loss_sum / n_items
    elif opts.backward == "undivided":
        step_loss = loss_sum  # what the gradients of undivided micro-batches minimise: their sum
    else:
        step_loss = loss_sum / len(batches)  # equal micro-batches: the per-sample mean
    return Truth(
        epoch=epoch,
        batch=batches[-1][0],
        lr=lr,
        loss=step_loss,
        correct=correct,
        kept=kept,
        grad_norm=norm,
        loss_scale=scale,
        skipped=skipped,
        samples=sum(len(x) for _, (x, _) in batches),
    )
