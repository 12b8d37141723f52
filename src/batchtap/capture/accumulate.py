"""Device-side sums over the micro-batches of one optimizer step (gradient accumulation).

``Tap.accumulate()`` computes the per-micro-batch metrics (loss, accuracy counts, custom values) of
each micro-batch and folds them into one preallocated device vector, column by column as each metric
declares (:class:`~batchtap.metrics.Combine`): counts add up, sample-weighted means are summed as
``value * samples`` and divided by the step's samples when the step closes, minima and maxima combine
as such. Nothing is read on the host; the step's row is written once, by ``Tap.step()``.

The short path: once two micro-batches in a row had the same input signature and every metric has
a :meth:`~batchtap.metrics.Metric.micro_writer`, later micro-batches of that signature are only
*kept* by the writers (the loss by reference, the accuracy's argmax beside its targets: two ops a
micro-batch instead of a dozen), and :meth:`MicroBatches.result` reduces them all at once when the
step closes, folding the result into the same sums. A micro-batch of another signature takes the
general path and its values join the same sums, so any mix of the two adds up alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from batchtap.metrics.base import Combine, Metric, MicroWriter, StepInputs

__all__ = ["MicroBatches", "SHORT_CAPACITY", "autocast_device"]

#: micro-batches the short path's writers keep before they fold them into the step's sums (a step
#: with more folds every this many; a writer may hold fewer, see ``Metric.micro_writer``)
SHORT_CAPACITY = 8


def autocast_device(device: torch.device) -> str:
    """The device type ``torch.autocast`` knows for ``device`` ('' when it has none)."""
    return device.type if device.type in ("cuda", "cpu", "xpu", "mps") else ""


class MicroBatches:
    """The open optimizer step's micro-batches, summed on the device.

    Args:
        metrics: the per-micro-batch metrics, in the order their device columns are laid out.
        device: the capture device.
    """

    def __init__(self, metrics: Sequence[Metric], device: torch.device) -> None:
        self.metrics = list(metrics)
        self.host_readers = [m for m in self.metrics if m.host_width]  #: metrics with host columns
        self.device = device
        kinds = [kind for m in self.metrics for kind in m.combine()]
        self.width = len(kinds)
        self._scratch = torch.zeros(self.width, dtype=torch.float32, device=device)
        self._acc = torch.zeros(self.width, dtype=torch.float32, device=device)
        # Column masks, made once per run (the only host->device copies, at the run's first step).
        self._mean = self._mask(kinds, Combine.MEAN)
        self._min = self._mask(kinds, Combine.MIN)
        self._max = self._mask(kinds, Combine.MAX)
        self._folds = self._fold_plan(kinds)
        self._weight = math.nan  # the weight self._scale was made for (micro-batches repeat their size)
        self._scale: torch.Tensor | None = None  # weight in the mean columns, 1 elsewhere
        self.autocast_device = autocast_device(device)  #: what ``torch.autocast`` calls the device ('' none)
        self.host: dict[int, Sequence[float]] = {}  #: id(metric) -> its host columns (last micro-batch)
        # The short path (see the module docstring): the writers, the signature they were made for,
        # and the signature of the last general-path micro-batch (a second one in a row builds them).
        self.short_key: object = None
        self._candidate: object = None
        self._writers: list[MicroWriter] = []
        self._capacity = 0
        self._kept = 0  # micro-batches the writers keep (not yet in the sums)
        # host columns are taken from the general path's last call: only where they depend on the
        # inputs' metadata alone may later micro-batches skip reading them
        self._host_fixed = all(m.host_fixed_by_metadata for m in self.host_readers)
        self.reset()

    def _mask(self, kinds: list[Combine], kind: Combine) -> torch.Tensor | None:
        if kind not in kinds:
            return None
        return torch.tensor([k is kind for k in kinds], dtype=torch.bool, device=self.device)

    def _fold_plan(self, kinds: list[Combine]) -> list[tuple[Callable[..., object], torch.Tensor, torch.Tensor]] | None:
        """How a micro-batch's row folds into the sums through views of the two buffers, made once:
        one in-place op per run of adjacent columns that combine alike (means and counts add up,
        minima, maxima). None where the masked fold of :meth:`_combine` takes fewer ops (many
        interleaved kinds)."""
        ops = {Combine.MIN: torch.minimum, Combine.MAX: torch.maximum}
        runs: list[tuple[Combine, int, int]] = []  # (kind, start, length); MEAN and SUM both add
        for i, kind in enumerate(kinds):
            kind = Combine.SUM if kind is Combine.MEAN else kind
            if runs and runs[-1][0] is kind:
                runs[-1] = (kind, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((kind, i, 1))
        masked_ops = 1 + 2 * (self._min is not None) + 2 * (self._max is not None)  # see _combine
        if len(runs) > masked_ops:
            return None
        return [
            (ops.get(kind, torch.add), self._acc.narrow(0, start, n), self._scratch.narrow(0, start, n))
            for kind, start, n in runs
        ]

    def reset(self) -> None:
        """Forget the sums (the step was written); the device buffers are reused."""
        self.count = 0
        self.samples = 0.0  # NaN once a micro-batch of unknown size was added
        self.weight = 0.0  # what means are divided by: samples, or micro-batches when sizes are unknown
        self.tokens = math.nan
        self.data_time = math.nan
        self._folded = 0  # rows folded into self._acc (micro-batches, or the writers' settled sums)
        self._kept = 0

    def add(self, values: Sequence[torch.Tensor], *, samples: float, tokens: float | None) -> None:
        """Fold one micro-batch's device values (``width`` 0-dim tensors) into the sums."""
        weight = samples if math.isfinite(samples) else 1.0
        if self.width:
            self._fold(values, weight)
        self._count(samples, weight, tokens)

    def _fold(self, values: Sequence[torch.Tensor], weight: float | None) -> None:
        """Fold one row of values into the sums: a micro-batch's, whose mean columns are multiplied
        by its ``weight`` here, or the writers' settled sums (``weight`` None: multiplied already)."""
        # Written with out= and in-place ops only, never a device-to-device copy_: the same
        # kernels, and the whole path also runs under FakeTensorMode (the CUDA-path tests).
        acc = self._acc
        first = self._folded == 0
        self._folded += 1
        row = acc if first else self._scratch
        torch.stack(values if type(values) is list else list(values), out=row)  # cast to float32 on the way
        if weight is not None and self._mean is not None:
            scale = self._scale
            if scale is None or weight != self._weight:  # made once while the micro-batches keep their size
                scale = self._scale = torch.where(self._mean, weight, 1.0)
                self._weight = weight
            row.mul_(scale)  # means are summed as value * samples
        if not first:
            folds = self._folds
            if folds is None:
                self._combine(acc, row)
            else:
                for op, into, part in folds:
                    op(into, part, out=into)  # in place, on views made once

    def _count(self, samples: float, weight: float, tokens: float | None) -> None:
        self.count += 1
        self.samples += samples
        self.weight += weight
        if tokens is not None:
            self.tokens = float(tokens) + (0.0 if math.isnan(self.tokens) else self.tokens)

    def _combine(self, acc: torch.Tensor, row: torch.Tensor) -> None:
        """Fold ``row`` into ``acc`` in place: sums, minima and maxima by column."""
        low, high = self._min, self._max
        if low is None and high is None:
            acc.add_(row)
            return
        combined = acc + row
        if low is not None and high is not None:
            combined = torch.where(low, torch.minimum(acc, row), combined)
            low = None
        if low is not None:
            torch.where(low, torch.minimum(acc, row), combined, out=acc)  # inputs are new tensors
        else:
            assert high is not None
            torch.where(high, torch.maximum(acc, row), combined, out=acc)

    # ------------------------------------------------------------------ the short path

    def offer_short(self, key: object, inputs: StepInputs) -> None:
        """After a general-path micro-batch whose inputs (signature ``key``) passed the checks: the
        second such micro-batch in a row builds the writers for ``key`` (a loop whose shapes change
        at every micro-batch never builds any)."""
        if key == self._candidate and key != self.short_key and self.width and self._host_fixed:
            writers = [m.micro_writer(inputs, SHORT_CAPACITY) for m in self.metrics if m.device_width]
            if all(w is not None for w in writers):
                self._settle()  # what the writers of another signature keep, before they go
                self._writers = [w for w in writers if w is not None]
                self._capacity = min(w.capacity for w in self._writers)
                self.short_key = key
        self._candidate = key

    def add_short(self, inputs: StepInputs, *, tokens: float | None) -> None:
        """Keep one micro-batch whose signature is :attr:`short_key` (checked) for the writers to
        reduce when the step closes: their device ops only, no host read."""
        if self._kept == self._capacity:
            self._settle()
        index = self._kept
        for writer in self._writers:
            writer.write(inputs, index)
        self._kept = index + 1
        samples = inputs.batch_size
        self._count(samples, samples if math.isfinite(samples) else 1.0, tokens)

    def _settle(self) -> None:
        """Fold what the writers keep into the sums: one reduction each over all their micro-batches
        (autocast off: the sums stay float32 whatever region the step closes in)."""
        count = self._kept
        if not count:
            return
        self._kept = 0
        device_type = self.autocast_device
        if device_type and torch.is_autocast_enabled(device_type):
            with torch.autocast(device_type, enabled=False):
                self._fold([v for writer in self._writers for v in writer.settle(count)], None)
        else:
            self._fold([v for writer in self._writers for v in writer.settle(count)], None)

    # ------------------------------------------------------------------ the step's close

    def add_data_time(self, seconds: float) -> None:
        """Add one micro-batch's loader wait (NaN when none was measured)."""
        if not math.isnan(seconds):
            self.data_time = seconds + (0.0 if math.isnan(self.data_time) else self.data_time)

    def result(self) -> torch.Tensor:
        """The step's values: ``[width]`` float32, sample-weighted means divided through."""
        self._settle()
        if self._mean is None:
            return self._acc
        return torch.where(self._mean, self._acc / self.weight, self._acc)
