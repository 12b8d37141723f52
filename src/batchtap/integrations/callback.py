"""``MetricsCallback``: the common per-batch callback recipe, on top of a ``Tap``.

The recipe calls ``torch.cuda.synchronize()`` and ``loss.item()`` in every batch. This class keeps its
call signature and its ``batch_metrics`` list but captures through a :class:`~batchtap.Tap`, so the
training step never waits for the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from batchtap.metrics.base import Metric
from batchtap.records import Event, Record
from batchtap.sinks.base import Sink
from batchtap.sinks.console import Console
from batchtap.tap import Tap

__all__ = ["MetricsCallback"]


class _ListSink(Sink):
    """Keeps every record as a plain dict (runs on the sink worker thread)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        self.rows.extend({"epoch": r.epoch, "batch": r.batch, "step": r.step, **r.values} for r in records)


class MetricsCallback:
    """Per-batch callback with the recipe's interface, without its per-batch syncs.

    Call it after ``optimizer.step()`` with ``(epoch, batch, loss, outputs, targets)``. It prints
    ``epoch E batch B: loss=... acc=...%`` every ``print_every`` batches and keeps
    :attr:`batch_metrics`. Use it as a context manager (or call :meth:`close`) so the last steps
    are stored.

    Args:
        batch_size: nominal batch size, kept for compatibility with the recipe (the real size is
            read from each batch's outputs).
        print_every: console line every N batches.
        sinks: extra sinks (JSONL, SQLite, ...), besides the console.
        metrics: metrics to capture (default: the Tap's defaults).
        name: run name.
        flush_every: steps between host transfers.

    Example:
        >>> import torch, io
        >>> out = io.StringIO()
        >>> with MetricsCallback(print_every=2, stream=out) as callback:
        ...     for b in range(3):
        ...         logits = torch.randn(4, 3)
        ...         callback(0, b, torch.tensor(0.5), logits, logits.argmax(1))
        >>> [(m["batch"], m["loss"], m["accuracy"]) for m in callback.batch_metrics]
        [(0, 0.5, 1.0), (1, 0.5, 1.0), (2, 0.5, 1.0)]
    """

    def __init__(
        self,
        batch_size: int = 32,
        print_every: int = 10,
        *,
        sinks: Sequence[Sink] = (),
        metrics: Sequence[Metric] | None = None,
        name: str | None = None,
        flush_every: int = 50,
        stream: Any = None,
    ) -> None:
        self.batch_size = batch_size
        self._rows: list[dict[str, Any]] = []
        self.tap = Tap(
            metrics=metrics,
            sinks=[Console(every=print_every, stream=stream, live=False), *sinks, _ListSink(self._rows)],
            flush_every=flush_every,
        )
        self._name = name
        self._run: contextlib.ExitStack | None = None

    def __call__(
        self,
        epoch: int,
        batch: int,
        loss: torch.Tensor,
        outputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
    ) -> None:
        if self._run is None:
            stack = contextlib.ExitStack()
            stack.enter_context(self.tap.run(name=self._name))
            self._run = stack
        self.tap.step(loss=loss, outputs=outputs, targets=targets, epoch=epoch, batch=batch)

    @property
    def should_stop(self) -> bool:
        """True once a non-finite loss was seen."""
        return self.tap.should_stop

    @property
    def batch_metrics(self) -> list[dict[str, Any]]:
        """One dict per recorded batch: epoch, batch, step, loss, accuracy and the other values.

        Reading it hands every captured step to the host first, which waits for the device: read it
        at the end of an epoch, not every batch.
        """
        if self._run is not None:
            self.tap.flush()  # sync: the caller asked for host values of every step so far
        return self._rows

    def close(self, exc: BaseException | None = None) -> None:
        """End the run (storing every captured step) and close the sinks."""
        if self._run is not None:
            run, self._run = self._run, None
            if exc is None:
                run.close()
            else:
                run.__exit__(type(exc), exc, exc.__traceback__)
        self.tap.close()

    def __enter__(self) -> MetricsCallback:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(exc)
