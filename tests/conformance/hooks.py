"""The front-ends' hooks into the matrix's loops (``loops.Hooks``), with host-read counting."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

import batchtap as bt
from batchtap.hostreads import HostReadCounter
from tests.conformance.loops import Hooks, Options

__all__ = ["ExplicitHooks", "ReadCounting"]


class ReadCounting(Hooks):
    """No batchtap call in the loop (autolog, ``batchtap run``); host reads counted per optimizer
    step after the first (which builds the ring), where ``count_reads`` asks for it."""

    def __init__(self, *, count_reads: bool) -> None:
        self.count_reads = count_reads
        self.reads: list[int] | None = [] if count_reads else None
        self.own_reads = 0  # reads the hooks make on the loop's behalf (a value the API takes as an int)

    @contextlib.contextmanager
    def iteration(self, index: int) -> Iterator[None]:
        if self.reads is None or index == 0:
            yield
            return
        self.own_reads = 0
        with HostReadCounter() as counter:
            yield
        self.reads.append(counter.count - self.own_reads)


class ExplicitHooks(ReadCounting):
    """The explicit API as its docs say to use it: ``bt.Tap(optimizer=, model=, scaler=)``,
    ``tap.watch(loader)``, ``tap.accumulate`` per micro-batch, ``tap.step(grad_norm=)`` with what the
    loop's clipping returned."""

    def __init__(self, db: Path, *, count_reads: bool) -> None:
        super().__init__(count_reads=count_reads)
        self.db = db
        self.tap: bt.Tap | None = None
        self._run: Any = None

    def begin(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, opts: Options) -> None:
        clips = opts.clip != "none"  # the loop's own norm is given to step(); else the Tap's GradNorm takes it
        metrics = bt.metrics.default_metrics(optimizer, None if clips else model, scaler=scaler)
        if opts.pad is not None and opts.pad != -100:
            metrics = [
                bt.metrics.Accuracy(ignore_index=opts.pad) if type(m) is bt.metrics.Accuracy else m for m in metrics
            ]
        self.tap = bt.Tap(metrics, [bt.sinks.SQLite(str(self.db))], flush_every=3)
        self._run = self.tap.run(name="explicit")
        self._run.__enter__()

    def loader(self, loader: Iterable[Any], epoch: int) -> Iterable[Any]:
        assert self.tap is not None
        return self.tap.watch(loader, epoch=epoch)

    def micro(self, loss: torch.Tensor, outputs: torch.Tensor, targets: torch.Tensor, weight: Any) -> None:
        assert self.tap is not None
        size = None
        if weight is not None:
            size = int(weight)  # sync: the API takes a token count as an int (counted as the loop's own read)
            self.own_reads += 1
        self.tap.accumulate(loss=loss, outputs=outputs, targets=targets, batch_size=size)

    def step(self, loss: Any, outputs: Any, targets: Any, grad_norm: Any) -> None:
        assert self.tap is not None
        self.tap.step(loss=loss, outputs=outputs, targets=targets, grad_norm=grad_norm)

    def end(self) -> None:
        assert self.tap is not None
        self._run.__exit__(None, None, None)
        self.tap.close()

    def fail(self, exc: BaseException) -> None:
        if self.tap is not None:
            self._run.__exit__(type(exc), exc, exc.__traceback__)
            self.tap.close()
