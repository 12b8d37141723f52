"""Shared machinery of the benchmarks: workloads, the loops users would write, and a fair runner.

Every variant is the literal training loop a user writes with that tool, kept short so a reader can
check it does the same work as the others. What the runner makes fair:

* one process, the same model weights (re-seeded per run), the same batches already on the device;
* repetitions interleaved (rep r runs the variants in an order rotated by r), medians over reps, and
  the ratio to bare taken per rep (variant / bare of the same rep) before its median, so slow drift
  of a shared machine cancels;
* a warm-up inside every run before the timed window (first-step setup, allocator, caches);
* host reads counted in separate short runs under :class:`_hostreads.HostReadCounter` (the counter's
  dispatch mode slows every op, so timed runs never carry it);
* NaN detection in separate short runs: the loss of step ``nan_at`` is multiplied by NaN and the
  latency is the number of steps the loop ran past it before its own stop check fired.

This module is private to ``bench/`` (a plain module, not a package): scripts there import it as
``import _harness`` because ``python bench/x.py`` puts ``bench/`` first on ``sys.path``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import io
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from _hostreads import HostReadCounter
from torch import nn
from torch.nn import functional as F

__all__ = [
    "Workload",
    "Spec",
    "Outcome",
    "Variant",
    "Row",
    "digits_workload",
    "cnn32_workload",
    "mlp_workload",
    "Bare",
    "ItemRecipe",
    "Batchtap",
    "HFStyle",
    "LightningCSV",
    "peer_variants",
    "run_suite",
    "format_table",
    "machine_lines",
    "percentile",
]

Batch = tuple[torch.Tensor, torch.Tensor]
NULL = open(os.devnull, "w")  # noqa: SIM115  # the recipe's prints go here: formatting cost, no terminal cost


# ---------------------------------------------------------------------- workloads


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model and its batches, already on ``device``.

    Attributes:
        name: short label for tables.
        description: what it is, for the table's legend.
        make_model: a freshly initialised model on ``device`` (same weights every call).
        batches: the batches a run cycles through.
        epoch_len: batches per epoch in NaN runs (Lightning's NaN stop fires at epoch end).
        lr: SGD learning rate (momentum 0.9 everywhere).
        device: where everything runs.
    """

    name: str
    description: str
    make_model: Callable[[], nn.Module]
    batches: list[Batch]
    epoch_len: int
    lr: float
    device: torch.device

    def epochs(self, total: int, epoch_len: int | None = None) -> list[list[Batch]]:
        """``total`` steps of batches split into epochs of ``epoch_len`` (default: one epoch)."""
        size = epoch_len or total
        flat = [self.batches[i % len(self.batches)] for i in range(total)]
        return [flat[i : i + size] for i in range(0, total, size)]


def _seeded(build: Callable[[], nn.Module], device: torch.device) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return build().to(device)

    return make


def digits_workload(device: torch.device, batch_size: int = 32) -> Workload:
    """The demo's ``DigitsCNN`` on scikit-learn's 8x8 digits (the demo's own model and data)."""
    from batchtap.demo.digits import DigitsCNN, load_digits

    train, _ = load_digits(seed=0)
    x, y = train.tensors
    batches = [
        (x[i : i + batch_size].to(device), y[i : i + batch_size].to(device))
        for i in range(0, len(y) - batch_size + 1, batch_size)  # full batches only: equal work per step
    ]
    return Workload(
        name="digits-cnn",
        description=f"batchtap demo's DigitsCNN on sklearn digits 1x8x8, batch {batch_size}",
        make_model=_seeded(DigitsCNN, device),
        batches=batches,
        epoch_len=len(batches),
        lr=0.05,
        device=device,
    )


class CNN32(nn.Module):
    """Three conv blocks on 3x32x32 inputs, 10 classes: a CIFAR-sized CNN for a 10-30 ms CPU step."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]

        self.net = nn.Sequential(
            *block(3, width),
            *block(width, 2 * width),
            *block(2 * width, 4 * width),
            nn.Flatten(),
            nn.Linear(4 * width * 4 * 4, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _random_batches(shape: Sequence[int], n: int, batch_size: int, device: torch.device) -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(batch_size, *shape, generator=g).to(device),
            torch.randint(0, 10, (batch_size,), generator=g).to(device),
        )
        for _ in range(n)
    ]


def cnn32_workload(device: torch.device, width: int = 16, batch_size: int = 32) -> Workload:
    """:class:`CNN32` on random 3x32x32 data (random data: the bench measures steps, not learning)."""
    return Workload(
        name=f"cnn32-w{width}",
        description=f"3-block CNN (width {width}) on random 3x32x32, batch {batch_size}",
        make_model=_seeded(lambda: CNN32(width), device),
        batches=_random_batches((3, 32, 32), 16, batch_size, device),
        epoch_len=32,
        lr=0.01,
        device=device,
    )


def mlp_workload(device: torch.device, width: int = 256, depth: int = 12, batch_size: int = 64) -> Workload:
    """A deep narrow MLP: tiny kernels, so on a GPU the step is bound by kernel launches (~1 ms),
    which is where a per-step host read hurts most."""

    def build() -> nn.Module:
        layers: list[nn.Module] = [nn.Flatten(), nn.Linear(3 * 32 * 32, width), nn.ReLU()]
        for _ in range(depth - 2):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, 10))
        return nn.Sequential(*layers)

    return Workload(
        name=f"mlp-d{depth}",
        description=f"launch-bound MLP ({depth} linear layers of {width}) on random 3x32x32, batch {batch_size}",
        make_model=_seeded(build, device),
        batches=_random_batches((3, 32, 32), 16, batch_size, device),
        epoch_len=32,
        lr=0.01,
        device=device,
    )


# ---------------------------------------------------------------------- runs


@dataclasses.dataclass
class Spec:
    """One run's shape.

    Attributes:
        warmup: untimed steps before the window.
        steps: steps inside the window.
        nan_at: global step whose loss is made NaN, or None.
        epoch_len: batches per epoch (None: one epoch of ``warmup + steps``).
        counter: a host-read counter active for the whole run; reset when the window opens.
        sync_debug: arm ``torch.cuda.set_sync_debug_mode("error")`` around the loop (CUDA only).
        tmp: a fresh folder for the run's files.
    """

    warmup: int
    steps: int
    tmp: Path
    nan_at: int | None = None
    epoch_len: int | None = None
    counter: HostReadCounter | None = None
    sync_debug: bool = False


@dataclasses.dataclass
class Outcome:
    """What one run measured."""

    seconds: float = math.nan  # wall time of the window
    steps: int = 0  # steps inside the window
    reads: int | None = None  # host reads inside the window (counting runs only)
    reads_by_op: dict[str, int] = dataclasses.field(default_factory=dict)  # the same, by kind
    stopped_at: int | None = None  # global step at which the loop's NaN stop fired
    step_host_s: list[float] = dataclasses.field(default_factory=list)  # per-call host time of tap.step()
    exit_s: float = math.nan  # leaving the run: final flush + drain (batchtap only)
    flusher_waits: int = 0  # times the training thread waited for a ring slot (batchtap only)
    error: str | None = None  # e.g. the sync debug mode raised

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.seconds / self.steps if self.steps else math.nan


class Window:
    """The timed part of a run: opened after the warm-up, closed after the last step.

    On CUDA both edges synchronize the device, so the window holds the GPU time of its steps and
    no queued work leaks in or out. These are the only syncs the harness adds, outside the steps.
    """

    def __init__(self, device: torch.device, counter: HostReadCounter | None, outcome: Outcome) -> None:
        self.device, self.counter, self.outcome = device, counter, outcome
        self._t0 = math.nan

    def _sync(self) -> None:
        if self.device.type != "cuda":
            return
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)  # our own edge sync is not the loop's
        try:
            torch.cuda.synchronize(self.device)  # sync: window edge, outside the measured steps
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    def start(self) -> None:
        self._sync()
        if self.counter is not None:
            self.counter.reset()
        self._t0 = time.perf_counter()

    def stop(self, steps: int) -> None:
        self._sync()
        self.outcome.seconds = time.perf_counter() - self._t0
        self.outcome.steps = steps
        if self.counter is not None:
            self.outcome.reads = self.counter.count
            self.outcome.reads_by_op = dict(self.counter.by_op)


@contextlib.contextmanager
def sync_debug(enabled: bool, device: torch.device) -> Iterator[None]:
    """``set_sync_debug_mode("error")`` for the loop: any implicit sync raises."""
    if not (enabled and device.type == "cuda"):
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


class Variant:
    """A way of training with per-batch metrics. Subclasses implement :meth:`run`."""

    name = "?"
    has_nan_stop = False

    def unavailable(self) -> str | None:
        """Why this variant cannot run here (a missing package), or None."""
        return None

    def run(self, wl: Workload, spec: Spec) -> Outcome:
        raise NotImplementedError


def _optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


class Bare(Variant):
    """The plain PyTorch loop: no metrics at all."""

    name = "bare"

    def run(self, wl: Workload, spec: Spec) -> Outcome:
        model, out = wl.make_model(), Outcome()
        opt, window, i = _optimizer(model, wl.lr), Window(wl.device, spec.counter, out), 0
        for batches in wl.epochs(spec.warmup + spec.steps, spec.epoch_len):
            for x, y in batches:
                if i == spec.warmup:
                    window.start()
                outputs = model(x)
                loss = F.cross_entropy(outputs, y)
                if i == spec.nan_at:
                    loss = loss * math.nan
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                i += 1
        window.stop(i - spec.warmup)
        return out


class ItemRecipe(Variant):
    """The common per-batch callback recipe: ``loss.item()`` and an accuracy ``.item()`` every step,
    kept in a list of dicts, a line printed every 10 batches (to /dev/null here), and a NaN check on
    the host float it already has."""

    name = "per-step .item()"
    has_nan_stop = True

    def run(self, wl: Workload, spec: Spec) -> Outcome:
        model, out = wl.make_model(), Outcome()
        opt, window, i = _optimizer(model, wl.lr), Window(wl.device, spec.counter, out), 0
        history: list[dict[str, float]] = []
        for epoch, batches in enumerate(wl.epochs(spec.warmup + spec.steps, spec.epoch_len)):
            for batch, (x, y) in enumerate(batches):
                if i == spec.warmup:
                    window.start()
                outputs = model(x)
                loss = F.cross_entropy(outputs, y)
                if i == spec.nan_at:
                    loss = loss * math.nan
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                # the recipe: two host reads per step (each one a device sync on a GPU)
                loss_value = loss.item()
                accuracy = (outputs.argmax(1) == y).float().mean().item()
                history.append({"epoch": epoch, "batch": batch, "loss": loss_value, "accuracy": accuracy})
                if batch % 10 == 0:
                    print(f"epoch {epoch} batch {batch}: loss={loss_value:.4f} acc={accuracy:.2%}", file=NULL)
                i += 1
                if not math.isfinite(loss_value) and out.stopped_at is None:
                    out.stopped_at = i - 1
                    break
            if out.stopped_at is not None:
                break
        window.stop(i - spec.warmup)
        return out


class HFStyle(Variant):
    """What ``transformers.Trainer`` does for its loss: accumulate ``loss.detach()`` on the device and
    read it once every ``logging_steps`` (an average, no per-batch values, no accuracy). The stop
    check on the logged value is ours: Trainer itself never stops on NaN (its default
    ``logging_nan_inf_filter`` drops non-finite losses, with a per-step ``isnan`` check)."""

    has_nan_stop = True

    def __init__(self, logging_steps: int = 10) -> None:
        self.logging_steps = logging_steps
        self.name = f"HF-style (log every {logging_steps})"

    def run(self, wl: Workload, spec: Spec) -> Outcome:
        model, out = wl.make_model(), Outcome()
        opt, window, i = _optimizer(model, wl.lr), Window(wl.device, spec.counter, out), 0
        tr_loss = torch.zeros((), device=wl.device)
        logged: list[dict[str, float]] = []
        for epoch, batches in enumerate(wl.epochs(spec.warmup + spec.steps, spec.epoch_len)):
            for x, y in batches:
                if i == spec.warmup:
                    window.start()
                outputs = model(x)
                loss = F.cross_entropy(outputs, y)
                if i == spec.nan_at:
                    loss = loss * math.nan
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                tr_loss += loss.detach()
                i += 1
                if i % self.logging_steps == 0:
                    average = tr_loss.item() / self.logging_steps  # sync: once per logging_steps
                    tr_loss.zero_()
                    logged.append({"epoch": epoch, "step": i, "loss": average})
                    print(f"step {i}: loss={average:.4f}", file=NULL)
                    if not math.isfinite(average) and out.stopped_at is None:
                        out.stopped_at = i - 1
                        break
            if out.stopped_at is not None:
                break
        window.stop(i - spec.warmup)
        return out


SinkFactory = Callable[[Path], list[Any]]


class Batchtap(Variant):
    """batchtap with its default metrics (loss, accuracy, step/data time, throughput, memory).

    Args:
        name: label for tables.
        sinks: makes the sinks from the run's folder; None means ``sinks=[]``.
        needs: modules that must import for this variant (sinks written by others, lazily).
        time_steps: time every ``tap.step()`` call on the host.
        pipeline: ``"thread"`` or ``"process"`` (where decoding, rules and sinks run).
    """

    has_nan_stop = True

    def __init__(
        self,
        name: str = "batchtap",
        sinks: SinkFactory | None = None,
        *,
        needs: Sequence[str] = (),
        time_steps: bool = True,
        pipeline: str = "thread",
    ) -> None:
        self.name, self.sinks, self.needs, self.time_steps = name, sinks, tuple(needs), time_steps
        self.pipeline = pipeline

    def unavailable(self) -> str | None:
        for module in self.needs:
            try:
                importlib.import_module(module)
            except Exception as exc:  # ImportError, or a half-written module failing at import
                return f"skipped: {module} not available ({type(exc).__name__})"
        return None

    def run(self, wl: Workload, spec: Spec) -> Outcome:
        import batchtap as bt

        model, out = wl.make_model(), Outcome()
        opt, window, i = _optimizer(model, wl.lr), Window(wl.device, spec.counter, out), 0
        tap = bt.Tap(sinks=self.sinks(spec.tmp) if self.sinks else [], pipeline=self.pipeline)  # type: ignore[arg-type]
        perf, host, timed = time.perf_counter, out.step_host_s, self.time_steps
        try:
            with tap:
                with tap.run(name=f"bench-{wl.name}"), sync_debug(spec.sync_debug, wl.device):
                    for epoch, batches in enumerate(wl.epochs(spec.warmup + spec.steps, spec.epoch_len)):
                        for x, y in tap.watch(batches, epoch=epoch):
                            if i == spec.warmup:
                                window.start()
                            outputs = model(x)
                            loss = F.cross_entropy(outputs, y)
                            if i == spec.nan_at:
                                loss = loss * math.nan
                            opt.zero_grad(set_to_none=True)
                            loss.backward()
                            opt.step()
                            if timed and i >= spec.warmup:
                                t0 = perf()
                                tap.step(loss=loss, outputs=outputs, targets=y)
                                host.append(perf() - t0)
                            else:
                                tap.step(loss=loss, outputs=outputs, targets=y)
                            i += 1
                            if tap.should_stop:
                                out.stopped_at = i - 1
                                break
                        if out.stopped_at is not None:
                            break
                    window.stop(i - spec.warmup)
                    out.flusher_waits = _flusher_waits(tap)
                    t_exit = perf()
                out.exit_s = perf() - t_exit  # leaving the run: final flush, pipeline drain, sinks flushed
        except RuntimeError as exc:
            if not (spec.sync_debug and wl.device.type == "cuda"):
                raise
            out.error = f"sync debug mode raised: {str(exc).splitlines()[0][:120]}"
        return out


class LightningCSV(Variant):
    """A Lightning ``Trainer``: ``self.log(on_step=True)`` of the loss and of a TorchMetrics
    ``Accuracy``, a ``CSVLogger`` written every step (``log_every_n_steps=1``, what per-batch logging
    asks for), and the stop a Lightning user has for NaN: ``EarlyStopping(check_finite=True)``,
    which Lightning checks at the end of an epoch."""

    name = "Lightning + TorchMetrics + CSV"
    has_nan_stop = True

    def unavailable(self) -> str | None:
        for module in ("lightning", "torchmetrics"):
            try:
                importlib.import_module(module)
            except ImportError:
                return f"skipped: {module} not installed (pip install lightning torchmetrics)"
        return None

    def run(self, wl: Workload, spec: Spec) -> Outcome:
        import lightning as L
        import torchmetrics
        from lightning.pytorch.callbacks import EarlyStopping
        from lightning.pytorch.loggers import CSVLogger

        out = Outcome()
        window = Window(wl.device, spec.counter, out)
        epochs = wl.epochs(spec.warmup + spec.steps, spec.epoch_len)
        total = sum(len(e) for e in epochs)
        nan_at, warmup, lr = spec.nan_at, spec.warmup, wl.lr

        class Module(L.LightningModule):
            def __init__(self, model: nn.Module) -> None:
                super().__init__()
                self.model = model
                self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")

            def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
                x, y = batch
                outputs = self.model(x)
                loss = F.cross_entropy(outputs, y)
                if self.global_step == nan_at:
                    loss = loss * math.nan
                self.train_acc(outputs, y)
                self.log("loss", loss, on_step=True, on_epoch=False)
                self.log("acc", self.train_acc, on_step=True, on_epoch=False)
                return loss

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return _optimizer(self.model, lr)

        class Timing(L.Callback):
            def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
                done = trainer.global_step  # optimizer steps completed
                if done == warmup:
                    window.start()
                elif done == total:
                    window.stop(total - warmup)

        stop = EarlyStopping(monitor="loss", check_finite=True, check_on_train_epoch_end=True, patience=10**9)
        with _quiet_lightning():
            trainer = L.Trainer(
                accelerator="gpu" if wl.device.type == "cuda" else "cpu",
                devices=1,
                max_epochs=len(epochs),
                logger=CSVLogger(spec.tmp, name="lightning"),
                log_every_n_steps=1,
                callbacks=[Timing(), stop],
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                limit_val_batches=0,
            )
            # wrapped: Lightning reads a bare list as a list of dataloaders
            trainer.fit(Module(wl.make_model()), train_dataloaders=_Batches(epochs[0]))
        if nan_at is not None and trainer.should_stop:
            out.stopped_at = trainer.global_step - 1  # the last step it ran before stopping
        if out.steps == 0:  # stopped before the window closed (NaN runs)
            window.stop(trainer.global_step - warmup)
        return out


class _Batches:
    """The same prepared batches the other loops get, as one iterable with a length."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Lightning's banner lines and its 'few batches / num_workers' warnings are noise here."""
    loggers = [logging.getLogger(n) for n in ("lightning", "lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _flusher_waits(tap: Any) -> int:
    """How often the training thread waited for a ring slot (private state; 0 if it moved)."""
    capture = getattr(getattr(tap, "_state", None), "capture", None)
    return int(getattr(getattr(capture, "flusher", None), "waits", 0))


def _sqlite_tensorboard(tmp: Path) -> list[Any]:
    from batchtap.sinks.sqlite import SQLite
    from batchtap.sinks.tensorboard import TensorBoard

    return [SQLite(tmp / "batchtap.db"), TensorBoard(tmp / "tb")]


def _jsonl(tmp: Path) -> list[Any]:
    from batchtap.sinks.jsonl import JSONL

    return [JSONL(tmp / "metrics.jsonl")]


def peer_variants() -> list[Variant]:
    """The variants of issue 7 (plus the process pipeline of issue 14), in table order."""
    return [
        Bare(),
        ItemRecipe(),
        Batchtap("batchtap (default metrics, no sink)"),
        Batchtap(
            "batchtap + SQLite + TensorBoard sinks",
            _sqlite_tensorboard,
            needs=("batchtap.sinks.sqlite", "batchtap.sinks.tensorboard", "tensorboard"),
        ),
        Batchtap(
            "batchtap + SQLite + TensorBoard, pipeline process",
            _sqlite_tensorboard,
            needs=("batchtap.sinks.sqlite", "batchtap.sinks.tensorboard", "tensorboard"),
            pipeline="process",
        ),
        LightningCSV(),
        HFStyle(logging_steps=10),
    ]


def jsonl_variant() -> Variant:
    """batchtap with default metrics and a JSONL sink (overhead.py)."""
    return Batchtap("batchtap + JSONL sink", _jsonl)


# ---------------------------------------------------------------------- the suite


@dataclasses.dataclass
class Row:
    """Aggregated figures of one (workload, variant)."""

    workload: str
    variant: str
    ms: list[float] = dataclasses.field(default_factory=list)  # per rep
    ratios: list[float] = dataclasses.field(default_factory=list)  # per rep, to bare of the same rep
    reads_per_step: float | None = None
    nonblocking_per_step: float | None = None
    reads_by_op: dict[str, int] = dataclasses.field(default_factory=dict)
    nan_latency: int | None = None
    nan_note: str = ""
    step_host_us: list[float] = dataclasses.field(default_factory=list)  # all timed step() calls
    exit_ms: list[float] = dataclasses.field(default_factory=list)
    flusher_waits: int = 0
    note: str = ""
    sync_debug: str = ""  # under set_sync_debug_mode("error"): what happened

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ms) if self.ms else math.nan

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios) if self.ratios else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) by linear interpolation; NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _one(variant: Variant, wl: Workload, spec_kwargs: dict[str, Any]) -> Outcome:
    gc.collect()
    with tempfile.TemporaryDirectory(prefix="batchtap-bench-") as tmp:
        return variant.run(wl, Spec(tmp=Path(tmp), **spec_kwargs))


def run_suite(
    workloads: Sequence[Workload],
    variants: Sequence[Variant],
    *,
    reps: int,
    steps: dict[str, int],
    warmup: int,
    count_steps: int,
    nan_at: int,
    nan_epoch_len: int | None = None,
    sync_debug_for: Callable[[Variant], bool] = lambda v: False,
) -> list[Row]:
    """Run every variant on every workload: interleaved timed reps, then one counting run and one
    NaN run each (two epochs of ``nan_epoch_len`` batches, default the workload's epoch).
    ``steps`` maps workload name to timed steps per rep; ``sync_debug_for`` says which variants run
    under ``torch.cuda.set_sync_debug_mode("error")`` (CUDA only)."""
    rows: list[Row] = []
    for wl in workloads:
        active = [v for v in variants if v.unavailable() is None]
        table = {v.name: Row(wl.name, v.name) for v in variants}
        for v in variants:
            reason = v.unavailable()
            if reason:
                table[v.name].note = reason
            elif sync_debug_for(v) and wl.device.type == "cuda":
                table[v.name].sync_debug = "armed, nothing raised"
        n_steps = steps[wl.name]
        for rep in range(reps):
            order = active[rep % len(active) :] + active[: rep % len(active)]
            bare_ms: float | None = None
            per_rep: dict[str, float] = {}
            for v in order:
                o = _one(v, wl, dict(warmup=warmup, steps=n_steps, sync_debug=sync_debug_for(v)))
                row = table[v.name]
                if o.error:
                    row.sync_debug = o.error
                    continue
                row.ms.append(o.ms_per_step)
                row.step_host_us += [1e6 * s for s in o.step_host_s]
                if not math.isnan(o.exit_s):
                    row.exit_ms.append(1e3 * o.exit_s)
                row.flusher_waits += o.flusher_waits
                per_rep[v.name] = o.ms_per_step
                if isinstance(v, Bare):
                    bare_ms = o.ms_per_step
            if bare_ms:
                for name, ms in per_rep.items():
                    table[name].ratios.append(ms / bare_ms)
            _log(f"  {wl.name} rep {rep + 1}/{reps}: " + ", ".join(f"{k} {v:.2f}" for k, v in per_rep.items()))
        for v in active:
            row = table[v.name]
            armed = sync_debug_for(v)
            with HostReadCounter() as counter:
                o = _one(v, wl, dict(warmup=warmup, steps=count_steps, counter=counter, sync_debug=armed))
            if o.reads is not None and o.steps:
                row.reads_per_step = o.reads / o.steps
                row.nonblocking_per_step = counter.nonblocking_copies / o.steps
                row.reads_by_op = o.reads_by_op  # inside the window, like reads_per_step
            if v.has_nan_stop:
                epoch = nan_epoch_len or wl.epoch_len
                o = _one(v, wl, dict(warmup=0, steps=2 * epoch, epoch_len=epoch, nan_at=nan_at, sync_debug=armed))
                if o.error:
                    row.sync_debug = o.error
                if o.stopped_at is None:
                    row.nan_note = "never stopped"
                else:
                    row.nan_latency = o.stopped_at - nan_at
            _log(f"  {wl.name}: counted and NaN runs of {v.name} done")
        rows += [table[v.name] for v in variants]
    return rows


# ---------------------------------------------------------------------- output


def _fmt(value: float | None, spec: str, missing: str = "—") -> str:
    return missing if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_table(rows: Sequence[Row], *, nan_at: int, extra: Sequence[str] = ()) -> str:
    """One Markdown table: ms/step, spread, ratio to bare, reads/step, NaN latency.

    ``extra`` adds columns: ``"step_us"`` (host time of tap.step(): median / p90 / mean).
    """
    head = [
        "workload",
        "variant",
        "ms/step (median)",
        "min–max",
        "× bare",
        "host reads/step",
        f"NaN stop latency (NaN at step {nan_at})",
    ]
    if "step_us" in extra:
        head += ["tap.step() host µs median / p90 / mean"]
    if "sync_debug" in extra:
        head += ['set_sync_debug_mode("error")']
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if not r.ms:
            cells = [r.workload, r.variant, r.note or r.sync_debug or "no data", "", "", "", ""]
        else:
            if r.nan_latency is not None:
                nan = f"{r.nan_latency} steps"
            else:
                nan = r.nan_note or "no NaN stop"
            cells = [
                r.workload,
                r.variant,
                f"{r.median_ms:.3f}",
                f"{min(r.ms):.2f}–{max(r.ms):.2f}",
                f"{r.ratio:.3f}",
                _fmt(r.reads_per_step, ".2f"),
                nan,
            ]
            if r.note:
                cells[1] += f" ({r.note})"
        if "step_us" in extra:
            us = r.step_host_us
            cells.append(
                f"{statistics.median(us):.1f} / {percentile(us, 0.9):.1f} / {statistics.fmean(us):.1f}" if us else "—"
            )
        if "sync_debug" in extra:
            cells.append(r.sync_debug or "not armed")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine_lines(device: torch.device) -> list[str]:
    """Where the figures came from: CPU, cores, torch, threads, and the GPU when there is one."""
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    lines = [
        f"CPU: {model}, {os.cpu_count()} logical cores; torch {torch.__version__}, "
        f"intra-op threads {torch.get_num_threads()}; Python {sys.version.split()[0]}",
    ]
    if device.type == "cuda":
        lines.append(f"GPU: {torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}")
    return lines
