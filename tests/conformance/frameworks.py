"""The framework front-ends of the matrix: Lightning (``BatchtapCallback``), the HF Trainer
(``BatchtapTrainer``) and Accelerate (``BatchtapTracker`` with the tap calls in the loop).

Each builds the scenario in its framework's own terms (the same models and data as ``loops.py``;
tiny BERT / GPT-2 built from configs for the Trainer) and takes the truth of every optimizer step
in the same run with ``.item()``: the frameworks read values on the host themselves, so these cells
have no host-read count.

A distributed scenario's runner runs inside each rank that ``_fw_worker.py`` starts under torchrun
(the framework makes its process group itself) and asserts that the framework really ran the engine
the scenario names (``_assert_engine``). The GPU scenario (``fsdp2-cuda-1-rank``: one rank under torchrun,
FSDP2 on a single-rank mesh on CUDA) runs the same runners on the GPU (``accelerator="cuda"``,
``use_cpu=False``, ``Accelerator(cpu=False)``); those cells were written on a machine without a GPU and
have not run yet: ``bench/gpu_check.sh`` runs them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import batchtap as bt
from tests.conformance.compare import Outcome
from tests.conformance.loops import BATCH, EPOCHS, MAX_NORM, OPTIONS, VOCAB, Options, _data, _full, _model

__all__ = ["RUNNERS"]


def _tap(db: Path, opts: Options, **kwargs: Any) -> bt.Tap:
    metrics = bt.metrics.default_metrics(**kwargs)
    if opts.pad is not None and opts.pad != -100:
        metrics = [bt.metrics.Accuracy(ignore_index=opts.pad) if type(m) is bt.metrics.Accuracy else m for m in metrics]
    return bt.Tap(metrics, [bt.sinks.SQLite(str(db))], flush_every=3)


def _counts(out: torch.Tensor, y: torch.Tensor, ignore: int) -> tuple[int, int]:
    mask = y != ignore
    return int(((out.detach().float().argmax(-1) == y) & mask).sum()), int(mask.sum())


def _loss(out: torch.Tensor, y: torch.Tensor, opts: Options) -> torch.Tensor:
    ignore = opts.pad if opts.pad is not None else -100
    if opts.pad is not None:
        return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1), ignore_index=ignore)
    return F.cross_entropy(out, y)


def _step_truth(epoch: int, micro: list[tuple[int, float, int, int, int]], lr: float, norm: float) -> dict[str, float]:
    """One optimizer step from its micro-batches' (batch index, loss, correct, kept, samples): equal-sized
    micro-batches, so the step's loss is the mean of theirs; the counts throughput is held to
    (``compare.COUNTS``): samples (the batches' rows) and kept tokens."""
    return {
        "samples": float(sum(m[4] for m in micro)),
        "tokens": float(sum(m[3] for m in micro)),
        "epoch": epoch,
        "batch": micro[-1][0],
        "loss": sum(m[1] for m in micro) / len(micro),
        "accuracy": sum(m[2] for m in micro) / sum(m[3] for m in micro),
        "lr": lr,
        "grad_norm": norm,
    }


# ---------------------------------------------------------------------------------------- Lightning


def run_lightning(scenario: str, workdir: Path, *, autolog: bool = False) -> Outcome:
    """The LightningModule of the scenario under ``BatchtapCallback``, or (``autolog``) under
    ``bt.autolog()`` with no callback, as ``batchtap run`` would record a Lightning script."""
    import lightning.pytorch as pl

    from batchtap.integrations.lightning import BatchtapCallback

    opts = OPTIONS[scenario]
    ignore = opts.pad if opts.pad is not None else -100

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = _model(opts)
            self.micro: list[tuple[int, float, int, int, int]] = []
            self.truth: list[dict[str, float]] = []
            self.engine: list[torch.nn.Module] = []  # a list: a module attribute would become a submodule

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            out = self.net(x)
            loss = _loss(out, y, opts)
            if opts.two_losses:
                loss = loss + out.float().pow(2).mean() * 0.01  # two losses, one backward(): their sum
            self.micro.append((batch_idx, loss.item(), *_counts(out, y, ignore), len(x)))
            return {"loss": loss, "logits": out}

        def configure_model(self) -> None:  # ModelParallelStrategy (FSDP2): the user shards here
            if opts.dist == "fsdp2":
                _shard(self.net, self.device_mesh["data_parallel"])

        def on_before_optimizer_step(self, optimizer: Any) -> None:  # before Lightning clips
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            norm = _full(torch.nn.utils.get_total_norm(grads)).item()  # DDP: all-reduced grads; FSDP2: a DTensor
            self.engine[:] = [self.trainer.strategy.model]  # what trained (fit's teardown unwraps DDP)
            lr = float(optimizer.param_groups[0]["lr"])
            self.truth.append(_step_truth(self.current_epoch, self.micro, lr, norm))
            self.micro = []

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    module = Module()
    if autolog:
        bt.autolog(sinks=[bt.sinks.SQLite(str(workdir / "store.db"))], name=scenario, flush_every=3)
        callbacks = []
    else:
        tap = _tap(workdir / "store.db", opts)
        callbacks = [BatchtapCallback(tap, name=scenario)]
    trainer = pl.Trainer(
        max_epochs=EPOCHS,
        accelerator="cuda" if opts.device == "cuda" else "cpu",
        devices=opts.world if opts.dist != "none" else 1,  # under torchrun: its ranks, no process started here
        strategy=_lightning_strategy(opts),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=opts.accum,
        gradient_clip_val=MAX_NORM if opts.clip == "torch" else None,
        callbacks=callbacks,
    )
    try:
        trainer.fit(module, DataLoader(_data(opts, 0), batch_size=BATCH))
    finally:
        if autolog:
            bt.autolog(enabled=False)
        else:
            tap.close()
    _assert_engine(opts, module.engine[0] if opts.dist == "ddp" else module.net)
    # the callback and autolog both time the fit loop's fetcher (the batch each step trained on): both store data_time
    return Outcome(module.truth, None, workdir / "store.db", data_time=True, step_time=True)


def _lightning_strategy(opts: Options) -> Any:
    if opts.dist == "ddp":
        return "ddp"
    if opts.dist == "fsdp2":  # Lightning's FSDP2 strategy: fully_shard in configure_model
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=opts.world, tensor_parallel_size=1)
    return "auto"


def _assert_engine(opts: Options, model: torch.nn.Module, context: str = "") -> None:
    """The framework ran the scenario's engine: a DDP wrapper, or FSDP2's sharded (DTensor) parameters."""
    if opts.dist == "ddp":
        assert isinstance(model, torch.nn.parallel.DistributedDataParallel), (
            f"not DDP: {type(model).__name__} {context}"
        )
    elif opts.dist == "fsdp2":
        kinds = {type(p).__name__ for p in model.parameters()}
        wrapper = type(model).__name__
        assert kinds == {"DTensor"}, f"FSDP2 expected every parameter a DTensor, got {kinds} in a {wrapper} {context}"


def _shard(net: torch.nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in net:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)


# ---------------------------------------------------------------------------------------- HF Trainer


def run_hf(scenario: str, workdir: Path, *, autolog: bool = False) -> Outcome:
    """The scenario under ``BatchtapTrainer``, or (``autolog``) under ``bt.autolog()`` over the plain
    ``transformers.Trainer`` (what ``batchtap run`` records of a Trainer script)."""
    import transformers as tf

    from batchtap.integrations.transformers import BatchtapTrainer
    from tests.integrations.test_transformers import _args, _bert, _Data, _gpt2

    base: Any = tf.Trainer if autolog else BatchtapTrainer

    opts = OPTIONS[scenario]
    lm = opts.pad is not None  # a causal LM on -100-padded labels (the Trainer's token-normalised path)
    accum = opts.accum
    world = opts.world if opts.dist != "none" else 1  # under torchrun each rank trains on n / world samples
    # an odd number of micro-batches per epoch under accumulation: each epoch ends with a one-micro-batch step
    n = BATCH * (2 * accum + 1 if accum > 1 else 4)
    model = _gpt2() if lm else _bert()
    micro: list[tuple[int, float, int, int, int]] = []  # (batch index, loss sum or mean, correct, kept, samples)
    input_tokens: list[int] = []  # the micro-batches' input_ids elements (what BatchtapTrainer counts for an LM)
    truth: list[dict[str, float]] = []
    batch_index = [-1]

    class Trainer(base):  # type: ignore[misc, valid-type]
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):  # type: ignore[no-untyped-def]
            labels = inputs["labels"].clone()
            loss, outputs = super().compute_loss(
                model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
            )
            if model.training:
                batch_index[0] += 1
                input_tokens.append(inputs["input_ids"].numel())
                logits = outputs["logits"].detach().float()
                if lm:  # logits at t predict label t + 1
                    logits, labels = logits[:, :-1], labels[:, 1:]
                    summed = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
                    value = summed.item()
                else:
                    value = F.cross_entropy(logits, labels).item()
                micro.append((batch_index[0], value, *_counts(logits, labels, -100), len(labels)))
            return (loss, outputs) if return_outputs else loss

    args = _args(
        workdir,
        gradient_accumulation_steps=accum,
        max_grad_norm=MAX_NORM if opts.clip == "get_total_norm" else 1.0,
        learning_rate=0.01,
        num_train_epochs=EPOCHS,
        use_cpu=opts.device != "cuda",
        **({"fsdp": "full_shard", "fsdp_config": {"version": 2}} if opts.dist == "fsdp2" else {}),
    )
    if autolog:
        bt.autolog(sinks=[bt.sinks.SQLite(str(workdir / "store.db"))], name=scenario, flush_every=3)
        trainer = Trainer(model=model, args=args, train_dataset=_Data(n, lm=lm))
    else:
        tap = _tap(workdir / "store.db", opts)
        trainer = Trainer(model=model, args=args, train_dataset=_Data(n, lm=lm), tap=tap)
    if scenario == "divided-accum":
        trainer.model_accepts_loss_kwargs = False  # the Trainer divides each micro-batch's loss by the count
    micro_per_epoch = math.ceil(n / world / BATCH)
    steps_per_epoch = math.ceil(micro_per_epoch / accum)
    clip = trainer.accelerator.clip_grad_norm_

    def clip_with_truth(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        parameters = list(parameters)
        norm = _full(torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])).item()
        lr = float(trainer.optimizer.param_groups[0]["lr"])
        epoch = len(truth) // steps_per_epoch
        step = micro[:]
        micro.clear()
        step_input_tokens = float(sum(input_tokens))
        input_tokens.clear()
        if lm:
            kept = sum(m[3] for m in step)
            loss = sum(m[1] for m in step) / kept  # sum CE / N over the whole step
            row = _step_truth(epoch, step, lr, norm) | {"loss": loss}
        else:
            row = _step_truth(epoch, step, lr, norm)
            if opts.backward == "undivided":  # the Trainer adds the model's per-micro-batch means undivided
                row["loss"] = sum(m[1] for m in step)
        row["batch"] = step[-1][0] - epoch * micro_per_epoch
        row["input_tokens"] = step_input_tokens
        truth.append(row)
        return clip(parameters, max_norm, norm_type)

    trainer.accelerator.clip_grad_norm_ = clip_with_truth
    del tf
    try:
        trainer.train()
    finally:
        if autolog:
            bt.autolog(enabled=False)
        else:
            tap.close()
    _assert_engine(
        opts, trainer.model_wrapped, f"the Trainer's Accelerate made a {trainer.accelerator.distributed_type}"
    )
    return Outcome(truth, None, workdir / "store.db", data_time=True, step_time=True)  # its loader's fetches timed


# ---------------------------------------------------------------------------------------- Accelerate


def run_accelerate(scenario: str, workdir: Path) -> Outcome:
    import accelerate

    from batchtap.integrations.accelerate import BatchtapTracker

    opts = OPTIONS[scenario]
    ignore = opts.pad if opts.pad is not None else -100
    torch.manual_seed(0)
    model = _model(opts)
    # the Tap's own GradNorm where the loop clips nothing (its parameters are the prepared model's)
    tap = _tap(workdir / "store.db", opts, model=model if opts.clip == "none" else None)
    tracker = BatchtapTracker(tap, run_name=scenario)
    fsdp = accelerate.utils.FullyShardedDataParallelPlugin(fsdp_version=2) if opts.dist == "fsdp2" else None
    accelerator = accelerate.Accelerator(
        cpu=opts.device != "cuda", gradient_accumulation_steps=opts.accum, log_with=tracker, fsdp_plugin=fsdp
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    loader = DataLoader(_data(opts, 0), batch_size=BATCH)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    _assert_engine(opts, model, f"Accelerate made a {accelerator.distributed_type}")
    truth: list[dict[str, float]] = []
    micro: list[tuple[int, float, int, int, int]] = []
    run_tap = tracker.tap  # starts the run
    for epoch in range(EPOCHS):
        if opts.backward == "token":
            truth += _accelerate_token_epoch(accelerator, model, optimizer, scheduler, run_tap, loader, epoch)
            continue
        for index, (x, y) in enumerate(run_tap.watch(loader, epoch=epoch)):
            with accelerator.accumulate(model):
                out = model(x)
                loss = _loss(out, y, opts)
                if opts.two_losses:
                    aux = out.float().pow(2).mean() * 0.01
                    accelerator.backward(loss, retain_graph=True)
                    accelerator.backward(aux)
                    loss = loss + aux
                else:
                    accelerator.backward(loss)  # Accelerate divides it for accumulation
                run_tap.accumulate(loss=loss.detach(), outputs=out, targets=y)  # the undivided loss
                micro.append((index, loss.item(), *_counts(out, y, ignore), len(x)))
                norm = None
                if accelerator.sync_gradients:
                    grads = [p.grad for p in model.parameters() if p.grad is not None]
                    norm_truth = _full(torch.nn.utils.get_total_norm(grads)).item()
                    lr = float(optimizer.param_groups[0]["lr"])  # the rate this step uses
                    if opts.clip != "none":  # an Accelerate loop clips through the accelerator (FSDP2: a DTensor)
                        norm = accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:  # one record per optimizer step
                run_tap.step(grad_norm=norm, extra={"lr": lr})
                truth.append(_step_truth(epoch, micro, lr, norm_truth))
                micro = []
    tracker.finish()
    accelerator.end_training()
    tap.close()
    return Outcome(truth, None, workdir / "store.db", data_time=True, step_time=True)


def _accelerate_token_epoch(
    accelerator: Any, model: Any, optimizer: Any, scheduler: Any, run_tap: bt.Tap, loader: Any, epoch: int
) -> list[dict]:
    """One epoch of a token-normalised Accelerate loop, written as Accelerate's guide to gradient
    accumulation over samples of variable size writes it: the step's
    micro-batches loaded first, ``num_items_in_batch`` = their kept tokens summed over the processes (a
    host number), each micro-batch's ``CE(reduction="sum")`` multiplied by ``gradient_accumulation_steps
    x num_processes`` (``accelerator.backward`` divides by the first, DDP averages over the second) and
    divided by it. The step's loss: sum CE / N. batchtap is given each micro-batch's token mean,
    weighted by its kept tokens."""
    import contextlib

    accum = accelerator.gradient_accumulation_steps
    truth: list[dict] = []
    step: list[tuple[int, Any]] = []
    for index, batch in enumerate(run_tap.watch(loader, epoch=epoch)):
        step.append((index, batch))
        if len(step) < accum:
            continue
        n_items = sum((y != -100).sum() for _, (_, y) in step)
        n_items = accelerator.gather(n_items).sum().item()
        micro: list[tuple[int, float, int, int, int]] = []
        for i, (index, (x, y)) in enumerate(step):
            syncs = i == len(step) - 1 or accelerator.num_processes == 1
            with contextlib.nullcontext() if syncs else accelerator.no_sync(model):
                out = model(x)
                summed = F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1), reduction="sum")
                accelerator.backward(summed * accum * accelerator.num_processes / n_items)
            correct, kept = _counts(out, y, -100)
            run_tap.accumulate(loss=summed.detach() / kept, outputs=out, targets=y, batch_size=kept)
            micro.append((index, summed.item(), correct, kept, len(x)))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm_truth = torch.nn.utils.get_total_norm(grads).item()
        lr = float(optimizer.param_groups[0]["lr"])  # the rate this step uses
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        run_tap.step(extra={"lr": lr})
        loss = sum(m[1] for m in micro) / sum(m[3] for m in micro)  # this rank's sum CE / N
        truth.append(_step_truth(epoch, micro, lr, norm_truth) | {"loss": loss})
        step = []
    return truth


def run_lightning_autolog(scenario: str, workdir: Path) -> Outcome:
    return run_lightning(scenario, workdir, autolog=True)


def run_hf_autolog(scenario: str, workdir: Path) -> Outcome:
    return run_hf(scenario, workdir, autolog=True)


RUNNERS: dict[str, Callable[[str, Path], Outcome]] = {
    "lightning": run_lightning,
    "lightning-autolog": run_lightning_autolog,
    "hf": run_hf,
    "hf-autolog": run_hf_autolog,
    "accelerate": run_accelerate,
}
