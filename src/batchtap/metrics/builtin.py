"""The built-in metrics: loss, accuracy, learning rate, gradient norm, AMP loss scale, timings,
throughput, memory."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from batchtap.errors import ConfigError, InputError
from batchtap.metrics import functional as F
from batchtap.metrics.base import (
    BlockTiming,
    Combine,
    Metric,
    Requirement,
    RowWriter,
    StepInputs,
    StepTiming,
    with_settle,
)
from batchtap.metrics.domain import ANY_FINITE, NONNEGATIVE, UNIT_INTERVAL, Domain, Output, Reduce

__all__ = [
    "Loss",
    "Accuracy",
    "LearningRate",
    "GradNorm",
    "LossScale",
    "StepTime",
    "DataTime",
    "Throughput",
    "Memory",
    "Custom",
    "Extra",
    "default_metrics",
]


def _float32(t: torch.Tensor) -> torch.Tensor:
    # No op of its own: the ring row is float32 and torch.stack(out=row) casts on the way in (exact
    # for fp16/bf16). Called under no_grad (Tap.step), so no detach is needed either.
    return t


class _Filled:
    """0-dim float32 tensors of fixed values, made once per value and device: a constant column
    (a placeholder, a host-known count) costs no device op per step. Holds a few at a time."""

    def __init__(self) -> None:
        self._made: dict[tuple[float, torch.device], torch.Tensor] = {}

    def __call__(self, value: float, device: torch.device) -> torch.Tensor:
        key = (value, device)  # math.nan is one object, so its key is found again
        made = self._made.get(key)
        if made is None:
            if len(self._made) >= 8:  # e.g. a count that changes with the sequence length
                self._made.clear()
            made = self._made[key] = torch.full((), value, dtype=torch.float32, device=device)
        return made


def _everywhere(rows: int, width: int) -> np.ndarray:
    """A block's presence mask with every value present."""
    return np.ones((rows, width), dtype=bool)


def _measured(seconds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A block of one timing column: present where it was measured (not NaN)."""
    return seconds.reshape(-1, 1), ~np.isnan(seconds).reshape(-1, 1)


class Loss(Metric):
    """The training loss as given to ``Tap.step(loss=...)``, recorded in float32.

    Args:
        nonnegative: the loss can never be negative (cross-entropy, MSE, ...); a negative value
            then becomes an anomaly. Pass False for losses that can go below zero (e.g. a negative
            log-likelihood of continuous data, GAN objectives).

    Example:
        >>> [o.name for o in Loss().outputs()]
        ['loss']
    """

    watched_by_nan_guard: ClassVar[bool] = True
    requires: ClassVar[frozenset[Requirement]] = frozenset({"loss"})
    device_width = 1

    def __init__(self, *, nonnegative: bool = True) -> None:
        self._domain = NONNEGATIVE if nonnegative else ANY_FINITE

    def outputs(self) -> tuple[Output, ...]:
        return (Output("loss", self._domain, Reduce.MEAN),)

    def combine(self) -> tuple[Combine, ...]:
        return (Combine.MEAN,)  # sample-weighted over the micro-batches of an optimizer step

    def check(self, inputs: StepInputs) -> None:
        loss = inputs.loss
        if not isinstance(loss, torch.Tensor):
            raise InputError(
                f"loss must be a 0-dim floating-point tensor, got {type(loss).__name__}; pass the loss "
                "tensor itself (loss.item() or float(loss) already forced a device sync)"
            )
        if loss.dim() != 0:
            raise InputError(
                f"loss must be a 0-dim tensor, got shape {tuple(loss.shape)}; reduce it first, "
                "e.g. loss.mean(), or build the criterion with reduction='mean'"
            )
        if not loss.is_floating_point():
            raise InputError(
                f"loss must be a floating-point tensor, got dtype {loss.dtype}; "
                "pass the criterion's floating-point output"
            )

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        assert inputs.loss is not None
        return (_float32(inputs.loss),)

    def finalize_block(self, raw: np.ndarray, timing: BlockTiming) -> tuple[np.ndarray, np.ndarray]:
        return raw[:, :1], _everywhere(raw.shape[0], 1)

    def row_writer(self, example: StepInputs, columns: torch.Tensor) -> RowWriter:
        cells = [columns.select(0, slot).select(0, 0) for slot in range(columns.shape[0])]

        def write(inputs: StepInputs, slot: int, fresh: bool) -> None:
            # fill_ from a 0-dim tensor of the same device: a device-side copy, cast to float32
            cells[slot].fill_(inputs.loss)  # type: ignore[arg-type]  # the short path checked it

        return write


#: device memory one accuracy row writer may take for its per-slot hit flags (``capacity * 2 *
#: targets`` bytes); past it the counts are reduced at every step instead of at the flush
HITS_BUFFER_BYTES = 16 * 2**20


class Accuracy(Metric):
    """Top-k classification accuracy from class scores and integer targets.

    Reports ``accuracy`` for top-1 and ``accuracy_top{k}`` for every other k, as fractions in
    [0, 1] of the *kept* targets: targets equal to ``ignore_index`` (padding, prompt tokens) are
    left out, as ``F.cross_entropy`` leaves them out of the loss. On the device it keeps counts
    (correct per k, kept), never means, so values add up exactly over the micro-batches of an
    optimizer step; a step whose targets are all ignored has no accuracy (left out of the record).

    Accepted layouts, taken as they are (no reshaping needed):

    * scores ``[N, C]`` with targets ``[N]``;
    * scores ``[N, C, d1, ...]`` with targets ``[N, d1, ...]`` (classes at dim 1, the
      ``F.cross_entropy`` layout: segmentation, ...);
    * sequence logits ``[B, T, V]`` with targets ``[B, T]`` (classes last, as a causal LM gives them).

    When targets fit both readings of 3+-dim scores (e.g. ``[B, T, V]`` with ``T == V``), classes
    are taken to be last: language models are by far the more common case.

    Args:
        topk: the k values, e.g. ``(1, 5)``. Must contain 1.
        ignore_index: target value that is not counted (``-100``, like ``F.cross_entropy``);
            ``None`` counts every target.
        check_targets_every: check that the kept targets are class indices in ``[0, C)`` on the
            first step and then every this many steps (micro-batches with accumulation). The check
            costs two more device ops (and a mixed-dtype row write) per checked step, a third of
            the metric's cost, for an error the loss itself raises in most loops
            (``F.cross_entropy`` rejects such targets); ``1`` checks every step.

    Example:
        >>> [o.name for o in Accuracy(topk=(1, 5)).outputs()]
        ['accuracy', 'accuracy_top5']
        >>> acc = Accuracy()
        >>> logits = torch.tensor([[[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]]])  # [B=1, T=3, V=2]
        >>> inputs = StepInputs(None, logits, torch.tensor([[0, 0, -100]]), 1.0)
        >>> raw = [float(v) for v in acc.compute(inputs)] + list(acc.read_host(inputs))
        >>> acc.finalize(raw, StepTiming(1.0, 0.1, math.nan))  # 1 of the 2 kept tokens
        [0.5]
    """

    requires: ClassVar[frozenset[Requirement]] = frozenset({"outputs", "targets"})
    host_width = 1  # number of classes: a shape fact, known on the host
    host_fixed_by_metadata = True

    def __init__(
        self, topk: Sequence[int] = (1,), *, ignore_index: int | None = -100, check_targets_every: int = 16
    ) -> None:
        ks = tuple(sorted(set(int(k) for k in topk)))
        if not ks or ks[0] < 1 or 1 not in ks:
            raise ConfigError(f"Accuracy topk must be positive and contain 1, got {tuple(topk)}; e.g. topk=(1, 5)")
        if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
            raise ConfigError(f"Accuracy ignore_index must be an integer or None, got {ignore_index!r}")
        if isinstance(check_targets_every, bool) or not isinstance(check_targets_every, int) or check_targets_every < 1:
            raise ConfigError(
                f"Accuracy check_targets_every must be a positive integer, got {check_targets_every!r}; "
                "1 checks the targets at every step"
            )
        self.topk = ks
        self.ignore_index = ignore_index
        self.check_targets_every = check_targets_every
        self._calls = 0  # compute() calls so far: the target range is checked on some of them
        self._facts: _AccuracyShape | None = None
        self._fuse_counts: bool | None = None  # count hits and ignored in one reduction; None: off the CPU
        # counts (correct per k, the ignored targets, all target positions; kept = positions -
        # ignored) as float32 low parts, the same counts' high parts (nonzero only past 2**24
        # positions per step), then the smallest and largest kept target. The positions are a
        # host-known constant per shape: storing them (rather than the kept count) lets the device
        # count hits and ignored targets in one reduction, and costs no op per step.
        self._counts = len(ks) + 2
        self.device_width = 2 * self._counts + 2
        self._fill = _Filled()

    def outputs(self) -> tuple[Output, ...]:
        return tuple(
            Output("accuracy" if k == 1 else f"accuracy_top{k}", UNIT_INTERVAL, Reduce.MEAN, unit="%")
            for k in self.topk
        )

    def combine(self) -> tuple[Combine, ...]:
        # accuracy over every kept target of every micro-batch: counts add, the range widens
        return (Combine.SUM,) * (2 * self._counts) + (Combine.MIN, Combine.MAX)

    def applies(self, inputs: StepInputs) -> bool:
        outputs, targets = inputs.outputs, inputs.targets
        return (
            isinstance(outputs, torch.Tensor)
            and isinstance(targets, torch.Tensor)
            and outputs.is_floating_point()
            and outputs.dim() >= 2
            and not targets.is_floating_point()
            and not targets.is_complex()
            and targets.dtype != torch.bool
        )

    def check(self, inputs: StepInputs) -> None:
        outputs, targets = inputs.outputs, inputs.targets
        assert outputs is not None and targets is not None
        if not isinstance(outputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
            raise InputError(
                f"Accuracy needs tensors for outputs and targets, got {type(outputs).__name__} and "
                f"{type(targets).__name__}"
            )
        if outputs.dim() < 2 or not outputs.is_floating_point():
            raise InputError(
                f"Accuracy expects floating-point class scores of shape [N, C] (or [N, C, ...], or "
                f"[B, T, V] sequence logits), got shape {tuple(outputs.shape)} dtype {outputs.dtype}; "
                "pass the model's logits"
            )
        if outputs.shape[0] == 0:
            raise InputError(
                f"Accuracy got an empty batch (outputs of shape {tuple(outputs.shape)}); skip empty batches"
            )
        if targets.is_floating_point() or targets.is_complex():
            raise InputError(
                f"Accuracy needs integer class indices as targets, got {_dtype_name(targets.dtype)} targets: "
                "for regression leave Accuracy out (the default metrics leave it out by themselves for "
                "floating-point targets); for one-hot or soft labels pass targets.argmax(-1)"
            )
        if targets.dtype == torch.bool:
            raise InputError(
                "Accuracy needs integer class indices as targets, got bool targets; for two classes "
                "pass targets.long() with scores of shape [N, 2]"
            )
        if targets.shape[:1] != outputs.shape[:1]:
            raise InputError(
                f"outputs and targets disagree on batch size: {outputs.shape[0]} vs "
                f"{targets.shape[0] if targets.dim() else 'a 0-dim tensor'}; pass the targets of the same batch"
            )
        class_dim = _class_dim(outputs, targets)
        if class_dim is None:
            raise InputError(_layout_error(outputs, targets))
        classes = outputs.shape[class_dim]
        if self.topk[-1] > classes:
            raise InputError(
                f"Accuracy(topk={self.topk}) needs at least {self.topk[-1]} classes, outputs have {classes}; lower topk"
            )

    def _shape_facts(self, outputs: torch.Tensor, targets: torch.Tensor) -> _AccuracyShape:
        """What the inputs' metadata decides, worked out once per shape (steps repeat shapes)."""
        key = (outputs.shape, targets.shape, targets.dtype, outputs.device)
        facts = self._facts
        if facts is not None and facts.key == key:
            return facts
        class_dim = _class_dim(outputs, targets)
        assert class_dim is not None  # check() ran
        classes = outputs.shape[class_dim]
        ignore = self.ignore_index
        info = torch.iinfo(targets.dtype)
        masked = ignore is not None and info.min <= ignore <= info.max  # see F.kept_mask
        # A prediction is a class index, so it never equals an ignore_index outside [0, C) (-100):
        # the mask is needed on hits only when the ignored value is a class (pad id 0).
        mask_hits = masked and ignore is not None and 0 <= ignore < classes
        n = targets.numel()
        exact = n <= F.EXACT_FLOAT32  # float32 sums are exact: no high parts needed
        fuse = self._fuse_counts if self._fuse_counts is not None else outputs.device.type != "cpu"
        fused = fuse and exact and self.topk == (1,) and masked and not mask_hits
        high_n, low_n = divmod(n, F.EXACT_FLOAT32)
        facts = self._facts = _AccuracyShape(
            key=key,
            class_dim=class_dim,
            classes=float(classes),
            masked=masked,
            mask_hits=mask_hits,
            exact=exact,
            numel=n,
            zero=self._fill(0.0, outputs.device),
            positions=(self._fill(float(low_n), outputs.device), self._fill(float(high_n), outputs.device)),
            counts=targets.new_empty((2, *targets.shape), dtype=torch.bool) if fused else None,
        )
        return facts

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        outputs, targets = inputs.outputs, inputs.targets
        assert outputs is not None and targets is not None
        facts = self._shape_facts(outputs, targets)
        class_dim = facts.class_dim
        ignore = self.ignore_index
        if facts.counts is not None and ignore is not None:
            return self._fused_top1(outputs, targets, ignore, facts, facts.counts)
        dropped = targets.eq(ignore) if facts.masked and ignore is not None else None
        dtype = torch.float32 if facts.exact else torch.int64
        # an ignored value that is a class (pad id 0) can be predicted: such hits are no hits
        hit_mask = dropped.logical_not() if facts.mask_hits and dropped is not None else None
        if self.topk == (1,):  # the common case, fewest ops: argmax, eq, sum
            correct: Sequence[torch.Tensor] = (
                F.top1_correct(outputs, targets, class_dim=class_dim, dtype=dtype, keep=hit_mask),
            )
        else:
            counts = F.topk_correct(outputs, targets, self.topk, class_dim=class_dim, dtype=dtype, keep=hit_mask)
            correct = counts.unbind(0)
        low, high = self._sampled_range(targets, dropped, facts.zero)
        zero = facts.zero
        if facts.exact:
            ignored = dropped.sum(dtype=torch.float32) if dropped is not None else zero
            return (*correct, ignored, facts.positions[0], *(zero,) * self._counts, low, high)
        # Past 2**24 targets float32 sums lose counts: int64 counts, each split in two exact parts.
        parts = [F.split_count(c) for c in correct]
        parts.append(F.split_count(dropped.sum()) if dropped is not None else (zero, zero))
        parts.append(facts.positions)
        return (*(p[0] for p in parts), *(p[1] for p in parts), low, high)

    def row_writer(self, example: StepInputs, columns: torch.Tensor) -> RowWriter:
        """Top-1 with padding (the default) written into the ring row in two ops a step, no
        intermediates, and counted at the flush.

        Row 0 of a ``[2, *targets]`` buffer takes the argmax; row 1 holds ``ignore_index``. One
        ``eq`` of the buffer with the targets marks the hits and the ignored positions into the
        slot's own ``[2, *targets]`` bool buffer, and at the flush one sum over the block's slots
        counts both rows straight into the rows' (correct, ignored) columns (see ``with_settle``):
        the per-step reduction and the per-step cast to float are gone (together they cost more
        host time than the argmax and the eq). A prediction never equals the ignored value (it is
        no class index), so the hits are hits among the kept targets. Counts of 0/1 values in
        float32 are exact below 2**24. The other columns are constants for these inputs (the
        positions, zero high parts, an unchecked target range of (0, 0)): written only when the
        slot's row is not this writer's, or held a checked range.

        The per-slot buffers take ``capacity * 2 * targets.numel()`` bytes of device memory; past
        :data:`HITS_BUFFER_BYTES` the eq writes one shared float buffer instead and a matrix
        product with a column of ones counts it into the row at every step (three ops a step).

        Other settings (top-k, an ignored value that is a class, no ``ignore_index``, more than
        ``2**20`` targets, where the buffers would grow large) take the default writer: compute,
        then stack.
        """
        outputs, targets = example.outputs, example.targets
        assert outputs is not None and targets is not None
        facts = self._shape_facts(outputs, targets)
        ignore = self.ignore_index
        if self.topk != (1,) or not facts.masked or facts.mask_hits or ignore is None or facts.numel > 2**20:
            return super().row_writer(example, columns)
        device = outputs.device
        pair = torch.full((2, *targets.shape), ignore, dtype=torch.int64, device=device)
        predicted = pair.select(0, 0)
        dropped = torch.empty(targets.shape, dtype=torch.bool, device=device)  # for the range check
        # columns 2..7: positions, the three high parts, the target range (made constants: written
        # with one stack, as the general path's row; a device-to-device copy_ is not traceable
        # under FakeTensorMode, which the CUDA-path tests use)
        constants = (facts.positions[0], *(facts.zero,) * 5)
        capacity = columns.shape[0]
        slots = range(capacity)
        rest = [columns.select(0, s).narrow(0, 2, 6) for s in slots]
        ranges = [columns.select(0, s).narrow(0, 6, 2) for s in slots]
        ranged = [False] * capacity  # the slot's row holds a checked target range
        class_dim = facts.class_dim
        range_due, kept_range = self._range_due, self._kept_range

        def write_constants(targets: torch.Tensor, slot: int, fresh: bool) -> None:
            if fresh or ranged[slot]:
                torch.stack(constants, out=rest[slot])
                ranged[slot] = False
            if range_due():
                torch.eq(targets, ignore, out=dropped)  # type: ignore[arg-type]
                torch.stack(kept_range(targets, dropped), out=ranges[slot])  # type: ignore[arg-type]
                ranged[slot] = True

        if capacity * 2 * facts.numel <= HITS_BUFFER_BYTES:
            hits = torch.empty((capacity, 2, facts.numel), dtype=torch.bool, device=device)
            slot_hits = [hits.select(0, s).view(pair.shape) for s in slots]
            counted = columns.narrow(1, 0, 2)  # correct, ignored

            def write(inputs: StepInputs, slot: int, fresh: bool) -> None:
                targets = inputs.targets
                torch.argmax(inputs.outputs, class_dim, out=predicted)  # type: ignore[arg-type]
                torch.eq(pair, targets, out=slot_hits[slot])  # type: ignore[arg-type]  # counted at the flush
                write_constants(targets, slot, fresh)  # type: ignore[arg-type]

            def settle(start: int, length: int) -> None:
                # one reduction for the block: bool -> float32 counts of the hits and the ignored
                torch.sum(hits.narrow(0, start, length), 2, dtype=torch.float32, out=counted.narrow(0, start, length))

            return with_settle(write, settle)

        matches = torch.empty(pair.shape, dtype=torch.float32, device=device)
        per_row = matches.view(2, -1)
        ones = torch.ones((facts.numel, 1), dtype=torch.float32, device=device)
        # correct, ignored as a [2, 1] column for the product (mm: mv's out= is not traceable under
        # FakeTensorMode, which the CUDA-path tests use)
        counts = [columns.select(0, s).narrow(0, 0, 2).unsqueeze(1) for s in slots]

        def write_counted(inputs: StepInputs, slot: int, fresh: bool) -> None:
            targets = inputs.targets
            torch.argmax(inputs.outputs, class_dim, out=predicted)  # type: ignore[arg-type]
            torch.eq(pair, targets, out=matches)  # type: ignore[arg-type]
            torch.mm(per_row, ones, out=counts[slot])  # correct, ignored
            write_constants(targets, slot, fresh)  # type: ignore[arg-type]

        return write_counted

    def _fused_top1(
        self, outputs: torch.Tensor, targets: torch.Tensor, ignore: int, facts: _AccuracyShape, counts: torch.Tensor
    ) -> Sequence[torch.Tensor]:
        """Top-1 with padding in four kernels instead of five: hits and ignored flags are written
        into the two rows of one buffer and counted by a single reduction. Used off the CPU on the
        general path, where each kernel launch costs host time; on the CPU two plain sums are
        cheaper than a reduction over a dimension, so it is not used there (tests force it with
        ``_fuse_counts``). The buffer is reused every step: stream order puts each step's reduction
        before the next step's writes."""
        hits, dropped = counts.unbind(0)  # views (select(): indexing a CUDA tensor with an int is not one)
        torch.eq(outputs.argmax(facts.class_dim), targets, out=hits)
        torch.eq(targets, ignore, out=dropped)
        correct, ignored = counts.flatten(1).sum(1, dtype=torch.float32).unbind(0)
        low, high = self._sampled_range(targets, dropped, facts.zero)
        zero = facts.zero
        return (correct, ignored, facts.positions[0], zero, zero, zero, low, high)

    def _sampled_range(
        self, targets: torch.Tensor, dropped: torch.Tensor | None, zero: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept targets' smallest and largest index on the first call and every
        ``check_targets_every`` calls; else (0, 0), which never flags (0 is a class of every output)."""
        return self._kept_range(targets, dropped) if self._range_due() else (zero, zero)

    def _range_due(self) -> bool:
        """Count a call; whether it is one whose targets are checked (the first, then every
        ``check_targets_every``-th)."""
        calls = self._calls
        self._calls = calls + 1
        return calls % self.check_targets_every == 0

    @staticmethod
    def _kept_range(targets: torch.Tensor, dropped: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Smallest and largest target, ignored ones (``dropped``) counted as 0, a valid index."""
        return F.target_range(targets.masked_fill(dropped, 0) if dropped is not None else targets)

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        outputs, targets = inputs.outputs, inputs.targets
        assert outputs is not None and targets is not None
        return (self._shape_facts(outputs, targets).classes,)

    def _totals(self, raw: Sequence[float]) -> list[float]:
        """Correct per k, ignored, positions: each count's low and high part joined."""
        n = self._counts
        return [hi * F.EXACT_FLOAT32 + lo for lo, hi in zip(raw[:n], raw[n : 2 * n])]

    def weight(self, raw: Sequence[float]) -> float | None:
        """The kept targets (positions - ignored): ranks combine accuracies weighted by them
        (exact with padding)."""
        totals = self._totals(raw)
        return totals[-1] - totals[-2]

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        totals = self._totals(raw)
        kept = totals[-1] - totals[-2]
        if not kept > 0:  # every target ignored: no accuracy at this step
            return [None] * len(self.topk)
        return [c / kept for c in totals[:-2]]

    def _totals_block(self, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_totals` of every row of a block, and the kept targets (``[n, 1]``)."""
        n = self._counts
        totals = raw[:, n : 2 * n] * F.EXACT_FLOAT32 + raw[:, :n]
        with np.errstate(invalid="ignore"):
            return totals, totals[:, -1:] - totals[:, -2:-1]

    def finalize_block(self, raw: np.ndarray, timing: BlockTiming) -> tuple[np.ndarray, np.ndarray]:
        totals, kept = self._totals_block(raw)
        with np.errstate(invalid="ignore", divide="ignore"):
            present = kept > 0  # NaN fails too
            values = totals[:, :-2] / kept
        return values, np.broadcast_to(present, values.shape)

    def weight_block(self, raw: np.ndarray) -> np.ndarray:
        return self._totals_block(raw)[1][:, 0]

    def input_suspects(self, raw: np.ndarray) -> np.ndarray:
        low, high, classes = raw[:, 2 * self._counts], raw[:, 2 * self._counts + 1], raw[:, -1]
        with np.errstate(invalid="ignore"):
            return ~((low >= 0) & (high < classes))  # the common case of input_error, for every row

    def input_error(self, raw: Sequence[float]) -> str | None:
        low, high, classes = raw[2 * self._counts], raw[2 * self._counts + 1], raw[-1]
        if 0 <= low and high < classes:  # in range (or not checked at this step: 0, 0) — the common case first
            return None
        if not self.weight(raw) > 0:  # type: ignore[operator]
            return None  # nothing was counted, so no index was used
        if low < 0 or high >= classes:
            ignored = "" if self.ignore_index is None else f" (targets equal to {self.ignore_index} left out)"
            return (
                f"targets hold class indices outside [0, {int(classes)}) (smallest {int(low)}, largest "
                f"{int(high)}) for outputs with {int(classes)} classes{ignored}; check the labels (or the "
                "model's number of outputs, or Accuracy(ignore_index=...) for the padding value)"
            )
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class _AccuracyShape:
    """Facts :class:`Accuracy` derives from its inputs' metadata (see ``Accuracy._shape_facts``)."""

    key: tuple[Any, ...]  # outputs shape, targets shape, targets dtype, device
    class_dim: int
    classes: float
    masked: bool  # ignored targets must be counted (an ignore_index the targets' dtype can hold)
    mask_hits: bool  # ... and left out of the hits (the ignore_index is a class index)
    exact: bool  # few enough targets for exact float32 counts
    numel: int
    zero: torch.Tensor
    positions: tuple[torch.Tensor, torch.Tensor]  # numel's low and high part (constants)
    counts: torch.Tensor | None  # [2, *targets.shape] bool: hits and ignored, for Accuracy._fused_top1


def _class_dim(outputs: torch.Tensor, targets: torch.Tensor) -> int | None:
    """Where the classes are in ``outputs`` for targets of this shape, or None when they do not fit.

    Classes last wins when both layouts fit (``[B, T, V]`` with ``T == V``): LMs are the common case.
    """
    shape = tuple(targets.shape)
    if outputs.dim() >= 2 and shape == tuple(outputs.shape[:-1]):
        return -1
    if outputs.dim() >= 3 and shape == (outputs.shape[0], *outputs.shape[2:]):
        return 1
    return None


def _layout_error(outputs: torch.Tensor, targets: torch.Tensor) -> str:
    got, out = list(targets.shape), list(outputs.shape)
    if outputs.dim() == 2:
        fix = f"targets must have shape {out[:1]} for outputs of shape {out}, got {got}"
    else:
        fix = (
            f"targets of shape {got} fit neither layout Accuracy takes for outputs of shape {out}: "
            f"{out[:-1]} (classes last, sequence logits [B, T, V] with targets [B, T]) or "
            f"{[out[0], *out[2:]]} (classes at dim 1, [N, C, d1, ...] with targets [N, d1, ...] as "
            "for F.cross_entropy)"
        )
    if got == out:
        fix += "; for one-hot targets pass targets.argmax(-1)"
    return fix


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class LearningRate(Metric):
    """The optimizer's learning rate, read on the host (it is a Python float there).

    Reports ``name`` for the first parameter group and ``{name}_group{i}`` for the others, one
    value per param group where groups differ: a group's value is recorded only at steps where it
    differs from group 0's (the common case of equal groups stores one value).

    Args:
        optimizer: the optimizer whose ``param_groups`` are read.
        name: the value's name, e.g. ``"lr_g"`` for a GAN's generator.

    Example:
        >>> w, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
        >>> opt = torch.optim.SGD([{"params": [w]}, {"params": [b], "lr": 0.01}], lr=0.1)
        >>> lr = LearningRate(opt)
        >>> [o.name for o in lr.outputs()], lr.read_host(None)
        (['lr', 'lr_group1'], (0.1, 0.01))
        >>> lr.finalize([0.1, 0.1], StepTiming(1.0, 0.1, math.nan))  # equal groups: one value
        [0.1, None]
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, name: str = "lr") -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"LearningRate needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not name or not isinstance(name, str):
            raise ConfigError(f"LearningRate name must be a non-empty string, got {name!r}")
        for i, group in enumerate(optimizer.param_groups):
            lr = group["lr"]
            if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
                raise ConfigError(
                    f"param group {i} has a {lr.device} tensor learning rate; reading it would sync the "
                    "device every step. Use a float lr, or record it with bt.metrics.Custom"
                )
        self.optimizer = optimizer
        self.name = name
        self.host_width = len(optimizer.param_groups)

    def outputs(self) -> tuple[Output, ...]:
        return tuple(
            Output(self.name if i == 0 else f"{self.name}_group{i}", NONNEGATIVE, Reduce.MAX)
            for i in range(self.host_width)
        )

    def read_host(self, inputs: StepInputs | None) -> Sequence[float]:
        # A CPU tensor lr (allowed above) is read without any device involvement.
        return tuple(float(group["lr"]) for group in self.optimizer.param_groups[: self.host_width])

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        first = raw[0]
        return [first, *(None if v == first else v for v in raw[1:])]

    def finalize_block(self, raw: np.ndarray, timing: BlockTiming) -> tuple[np.ndarray, np.ndarray]:
        present = raw != raw[:, :1]  # NaN differs from everything, as in finalize
        present[:, 0] = True
        return raw, present


# GradNorm's host state column: where this step's value is, or why there is none
_NORM_ON_DEVICE, _NORM_ON_HOST, _NORM_NOT_PASSED, _NORM_NO_GRADIENT = 1.0, 2.0, 0.0, -1.0


class GradNorm(Metric):
    """Global L2 norm of the gradients, as ``torch.nn.utils.clip_grad_norm_`` computes it.

    The norm comes from the loop when it passes one — ``tap.step(grad_norm=total_norm)`` with what
    ``clip_grad_norm_`` returned, the norm *before* clipping, as a tensor (no sync) or a Python
    float — and is computed from ``model``'s gradients otherwise: float32 accumulation whatever the
    gradients' dtype, a constant number of device ops however many parameters there are. A passed
    value is taken as it is (clip after ``scaler.unscale_``, as AMP clipping must) and goes to the
    value named ``grad_norm``: a ``GradNorm`` with another ``name`` always computes its own.

    Call ``tap.step()`` after ``backward()`` and before ``zero_grad()``. When no parameter has a
    gradient at that point (``zero_grad(set_to_none=True)`` ran first) the value is left out and
    the run gets one warning saying so — never a norm of 0.

    With a ``scaler`` (``torch.amp.GradScaler``) the recorded norm is of the *unscaled* gradients:
    if ``scaler.unscale_(opt)`` or ``scaler.step(opt)`` ran since the last ``scaler.update()``, the
    gradients are already unscaled and taken as they are; otherwise they still carry the loss scale
    and the norm is divided by it on the device. So place ``tap.step`` after ``backward()`` and
    before ``scaler.update()`` — best after ``scaler.unscale_``/``scaler.step``, where the skip of
    :class:`LossScale` is exact too. After ``scaler.update()`` the scaler's per-step state is
    reset and nothing on the host tells unscaled gradients from scaled ones: the norm is then
    divided by the (new) scale although the gradients were unscaled; pass
    ``grad_norm=clip_grad_norm_(...)`` there instead.

    Args:
        model: a module, an iterable of parameters, or None to record only the passed
            ``grad_norm=`` (the value is left out at steps that pass none).
        name: the value's name (``grad_norm_g``... for several models).
        scaler: the AMP ``GradScaler`` whose loss scale the gradients carry.
        sharded: each rank holds a disjoint shard of the parameters (FSDP, ZeRO): each rank's value
            is its local norm and ranks combine as the root of the summed squares
            (:attr:`~batchtap.metrics.Reduce.L2`), instead of the maximum over ranks that holds
            replicated (DDP) gradients. ``None``: sharded when a parameter is a ``DTensor`` (the
            norm then uses each gradient's local shard).

    Example:
        >>> model = torch.nn.Linear(3, 1)
        >>> model(torch.ones(2, 3)).sum().backward()
        >>> norm = GradNorm(model)
        >>> inputs = StepInputs(None, None, None, 2.0)
        >>> raw = [float(v) for v in norm.compute(inputs)] + list(norm.read_host(inputs))
        >>> reference = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9).item()
        >>> abs(norm.finalize(raw, StepTiming(2.0, 0.1, math.nan))[0] - reference) < 1e-6
        True
    """

    device_width = 1
    host_width = 2  # where the value is (device, host, none: why), the host value
    gradient_based: ClassVar[bool] = True

    def __init__(
        self,
        model: torch.nn.Module | Iterable[torch.nn.Parameter] | None = None,
        *,
        name: str = "grad_norm",
        scaler: torch.amp.GradScaler | None = None,
        sharded: bool | None = None,
    ) -> None:
        if not name or not isinstance(name, str):
            raise ConfigError(f"GradNorm name must be a non-empty string, got {name!r}")
        params: list[torch.Tensor] | None = None
        if model is not None:
            params = list(model.parameters()) if isinstance(model, torch.nn.Module) else list(model)
            if not params:
                raise ConfigError("GradNorm got no parameters; pass the model (or its parameters)")
        if scaler is not None:
            _check_scaler(scaler, "GradNorm")
        self.parameters = params
        self.name = name
        self.scaler = scaler
        self._dtensor = _dtensor_type()
        dtensor = self._dtensor
        dtensors = dtensor is not None and params is not None and any(isinstance(p, dtensor) for p in params)
        self.sharded = bool(dtensors) if sharded is None else bool(sharded)
        self._local_shards = bool(dtensors)
        #: whether ``tap.step(grad_norm=...)`` is this metric's value
        self.takes_step_grad_norm = name == "grad_norm"
        self._fill = _Filled()

    def outputs(self) -> tuple[Output, ...]:
        return (Output(self.name, NONNEGATIVE, Reduce.L2 if self.sharded else Reduce.MAX),)

    def _passed(self, inputs: StepInputs) -> torch.Tensor | float | None:
        return inputs.grad_norm if self.takes_step_grad_norm else None

    def check(self, inputs: StepInputs) -> None:
        value = self._passed(inputs)
        if self._dtensor is not None and isinstance(value, self._dtensor):
            raise InputError(
                "grad_norm is a DTensor (clip_grad_norm_ of sharded parameters); pass "
                "grad_norm.full_tensor(), the global norm"
            )

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        device = inputs.device or _step_device(inputs)
        value = self._passed(inputs)
        if isinstance(value, torch.Tensor):
            return (value if value.device == device else value.to(device, non_blocking=True),)
        if value is not None or self.parameters is None:  # a Python float (host column), or nothing
            return (self._fill(math.nan, device),)
        grads = [p.grad for p in self.parameters if p.grad is not None]
        if not grads:
            return (self._fill(math.nan, device),)
        if self._local_shards and self._dtensor is not None:
            dtensor = self._dtensor
            grads = [_local_shard(g) if isinstance(g, dtensor) else g for g in grads]
        norm = F.grads_norm(grads, device)
        scale = _scale_carried(self.scaler) if self.scaler is not None else None
        if scale is not None:  # still scaled: divide on the device, never read the scale
            norm = norm / (scale if scale.device == device else scale.to(device, non_blocking=True))
        return (norm,)

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        value = self._passed(inputs)
        if isinstance(value, torch.Tensor):
            return (_NORM_ON_DEVICE, math.nan)
        if value is not None:
            return (_NORM_ON_HOST, float(value))
        if self.parameters is None:
            return (_NORM_NOT_PASSED, math.nan)
        # p.grad being None is metadata; stops at the first gradient in the usual case
        has_grad = any(p.grad is not None for p in self.parameters)
        return (_NORM_ON_DEVICE if has_grad else _NORM_NO_GRADIENT, math.nan)

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        where = raw[1]
        if where == _NORM_ON_DEVICE:
            return (raw[0],)
        if where == _NORM_ON_HOST:
            return (raw[2],)
        return (None,)

    def warning(self, raw: Sequence[float]) -> str | None:
        if raw[1] != _NORM_NO_GRADIENT:
            return None
        return (
            f"{self.name}: no parameter had a gradient when tap.step() ran (zero_grad(set_to_none=True) "
            "before tap.step?); call tap.step after backward() and before zero_grad(), or pass "
            "tap.step(grad_norm=clip_grad_norm_(...))"
        )


class LossScale(Metric):
    """The AMP ``GradScaler``'s loss scale, and whether it skipped the optimizer step.

    Reports ``loss_scale`` and ``amp_skipped`` (1 when the scaler found inf/NaN gradients and
    skipped ``optimizer.step``, else 0). A skipped step is reported as a ``skip`` event, and its
    non-finite gradient values (:attr:`~batchtap.metrics.Metric.gradient_based`) are left out
    instead of flagged as anomalies. Both values are read on the device, never on the host.

    Where ``tap.step`` sits decides how the skip is known:

    * after ``scaler.step(opt)`` (or ``scaler.unscale_(opt)``), before ``scaler.update()`` — the
      recommended place: the skip is the scaler's own inf/NaN check of this step, and
      ``loss_scale`` is the scale this step's loss was multiplied by;
    * after ``scaler.update()``: the scaler has forgotten its check; a skip shows as the scale
      dropping below the previous step's (nothing is known at the run's first step, and a scale
      lowered by hand with ``update(new_scale=)`` reads as a skip); ``loss_scale`` is the scale
      for the next step;
    * before ``scaler.step`` (right after ``backward()``): the drop is seen one step late, so a
      skip is marked on the step after the skipped one.

    A scaler that is disabled (``enabled=False``) or has not scaled a loss yet gives no values.

    Args:
        scaler: a ``torch.amp.GradScaler`` (``torch.cuda.amp.GradScaler`` too).

    Example:
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        >>> w = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([w], lr=0.1)
        >>> scaler.scale((w * float("inf")).sum()).backward()  # inf gradients
        >>> scaler.step(opt)
        >>> metric = LossScale(scaler)
        >>> inputs = StepInputs(None, None, None, 1.0)
        >>> raw = [float(v) for v in metric.compute(inputs)] + list(metric.read_host(inputs))
        >>> metric.finalize(raw, StepTiming(1.0, 0.1, math.nan)), metric.skipped(raw)
        ([1024.0, 1.0], True)
    """

    device_width = 2  # the scale, the skip flag
    host_width = 1  # whether the scaler has a scale

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        _check_scaler(scaler, "LossScale")
        self.scaler = scaler
        self._previous: torch.Tensor | None = None  # the scale at the last step (device copy)
        self._fill = _Filled()

    def outputs(self) -> tuple[Output, ...]:
        return (
            Output("loss_scale", NONNEGATIVE, Reduce.MAX),
            Output("amp_skipped", Domain(low=0.0, high=1.0), Reduce.MAX),
        )

    def _scale(self) -> torch.Tensor | None:
        return self.scaler._scale if self.scaler.is_enabled() else None

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        device = inputs.device or _step_device(inputs)
        scale = self._scale()
        if scale is None:
            self._previous = None
            nan = self._fill(math.nan, device)
            return (nan, nan)
        if scale.device != device:
            scale = scale.to(device, non_blocking=True)
        found = [
            f for state in self.scaler._per_optimizer_states.values() for f in state["found_inf_per_device"].values()
        ]
        if found:  # scaler.step/unscale_ ran and update() did not yet: the scaler's own check
            self._previous = None  # (the scale-drop comparison is not used at this placement)
            if len(found) == 1 and found[0].device == device:
                flag = found[0]  # 0.0 or 1.0, a fresh tensor of this step: read as it is now
            else:
                flag = torch.stack([f.to(device, non_blocking=True) for f in found]).amax()
            return (scale, flag)
        # update() ran (or nothing did yet): a skip lowered the scale below the previous step's
        previous = self._previous
        if previous is None or previous.device != scale.device:
            self._previous = scale.clone()
            return (scale, self._fill(0.0, device))
        flag = scale.lt(previous)
        previous.copy_(scale)  # after the comparison, in stream order
        return (scale, flag)

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        return (0.0 if self._scale() is None else 1.0,)

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        scale, skipped, present = raw
        if not present:
            return [None, None]
        return [scale, skipped]

    def skipped(self, raw: Sequence[float]) -> bool:
        return bool(raw[2]) and raw[1] >= 0.5


def _check_scaler(scaler: object, who: str) -> None:
    if not callable(getattr(scaler, "is_enabled", None)) or not callable(getattr(scaler, "update", None)):
        raise ConfigError(
            f"{who} needs a torch.amp.GradScaler, got {type(scaler).__name__}; pass the scaler whose "
            "scale(loss).backward() the loop calls"
        )


def _scale_carried(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The scale the gradients still carry (a device tensor, not read), or None when they carry
    none: scaler disabled, nothing scaled yet, or ``unscale_``/``step`` already ran since the last
    ``update()`` (its per-optimizer stages are host-side Python state)."""
    if not scaler.is_enabled() or scaler._scale is None:
        return None
    for state in scaler._per_optimizer_states.values():
        if getattr(state.get("stage"), "name", None) in ("UNSCALED", "STEPPED"):
            return None
    return scaler._scale


def _local_shard(grad: Any) -> torch.Tensor:
    local: torch.Tensor = grad.to_local()  # a DTensor's own shard: no communication
    return local


def _dtensor_type() -> type | None:
    """``DTensor`` when its module is loaded (a model with DTensor parameters loaded it), else None:
    nothing is imported here, so plain runs never pay for ``torch.distributed.tensor``."""
    for module in ("torch.distributed.tensor", "torch.distributed._tensor"):
        found = getattr(sys.modules.get(module), "DTensor", None)
        if isinstance(found, type):
            return found
    return None


class StepTime(Metric):
    """Seconds of compute per step: device events on CUDA, a host clock on CPU.

    Measured from the moment the watched loader handed over the batch (or from the previous step
    when no loader is watched) to the ``Tap.step()`` call.
    """

    def outputs(self) -> tuple[Output, ...]:
        return (Output("step_time", NONNEGATIVE, Reduce.MAX, unit="s"),)

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        return (None if math.isnan(timing.step_time) else timing.step_time,)

    def finalize_block(self, raw: np.ndarray, timing: BlockTiming) -> tuple[np.ndarray, np.ndarray]:
        return _measured(timing.step_time)


class DataTime(Metric):
    """Seconds the loop waited for the batch (host clock around the loader); needs ``tap.watch()``."""

    def outputs(self) -> tuple[Output, ...]:
        return (Output("data_time", NONNEGATIVE, Reduce.MAX, unit="s"),)

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        return (None if math.isnan(timing.data_time) else timing.data_time,)

    def finalize_block(self, raw: np.ndarray, timing: BlockTiming) -> tuple[np.ndarray, np.ndarray]:
        return _measured(timing.data_time)


class Throughput(Metric):
    """Samples per second of step time (summed over ranks in a process group), or tokens per
    second when the loop passes ``tap.step(tokens=...)``.

    Left out of a step's record when the count is unknown (no batch size, no tokens) or the step
    time is: a loss-only loop gets no throughput rather than NaN values.

    Example:
        >>> Throughput().finalize([], StepTiming(samples=8.0, step_time=0.5, data_time=math.nan, tokens=8192.0))
        (16384.0,)
        >>> Throughput().finalize([], StepTiming(samples=math.nan, step_time=0.5, data_time=math.nan))
        (None,)
    """

    def outputs(self) -> tuple[Output, ...]:
        return (Output("throughput", NONNEGATIVE, Reduce.SUM),)

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        count = timing.tokens if math.isfinite(timing.tokens) else timing.samples
        if not math.isfinite(count) or not timing.step_time > 0 or not math.isfinite(timing.step_time):
            return (None,)
        return (count / timing.step_time,)

    def finalize_block(self, raw: np.ndarray, timing: BlockTiming) -> tuple[np.ndarray, np.ndarray]:
        count = np.where(np.isfinite(timing.tokens), timing.tokens, timing.samples)
        seconds = timing.step_time
        with np.errstate(invalid="ignore", divide="ignore"):
            present = np.isfinite(count) & (seconds > 0) & np.isfinite(seconds)
            values = count / seconds
        return values.reshape(-1, 1), present.reshape(-1, 1)


class Memory(Metric):
    """CUDA memory held by tensors and its peak, in bytes, from the caching allocator's host-side
    counters (no device read). Reports nothing on other devices.

    One allocator-stats lookup per step (``torch.cuda.memory_stats_as_nested_dict``; the
    ``memory_allocated`` / ``max_memory_allocated`` pair would build and flatten the whole stats
    dict twice). ``memory_peak`` is the peak since the previous flush: the Tap resets the
    allocator's peak counter at each flush, so a spike shows in the rows around it rather than in
    every later row. Pass ``peak="process"`` to keep the allocator's peak since process start (and
    leave ``torch.cuda.max_memory_allocated`` to a loop that reads it itself).
    """

    host_width = 2

    def __init__(self, *, peak: str = "interval") -> None:
        if peak not in ("interval", "process"):
            raise ConfigError(f"Memory peak must be 'interval' or 'process', got {peak!r}")
        self.peak = peak
        self._device: torch.device | None = None  # the CUDA device of the steps, once seen

    def outputs(self) -> tuple[Output, ...]:
        return (
            Output("memory_allocated", NONNEGATIVE, Reduce.MAX, unit="B"),
            Output("memory_peak", NONNEGATIVE, Reduce.MAX, unit="B"),
        )

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        device = _step_device(inputs)
        if device.type != "cuda":
            return (math.nan, math.nan)
        self._device = device
        stats = torch.cuda.memory_stats_as_nested_dict(device)  # empty before CUDA is initialised
        allocated = stats.get("allocated_bytes", {}).get("all", {})
        return (float(allocated.get("current", math.nan)), float(allocated.get("peak", math.nan)))

    def on_flush(self) -> None:
        if self.peak == "interval" and self._device is not None and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats(self._device)  # host-side counters: no device sync

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        return tuple(None if math.isnan(v) else v for v in raw)


class Custom(Metric):
    """A user-defined metric: a pure tensor function of the step's tensors.

    Args:
        name: value name in records.
        fn: called with the required tensors as keyword arguments (``loss=``, ``outputs=``,
            ``targets=``); returns a 0-dim tensor. It must not read values on the host.
        requires: which of ``"loss"``, ``"outputs"``, ``"targets"`` ``fn`` takes.
        domain: legal values; others become NaN plus an anomaly event.
        reduce: how values combine across ranks.

    Example:
        >>> mae = Custom("mae", lambda outputs, targets: (outputs - targets).abs().mean(),
        ...              requires=("outputs", "targets"), domain=Domain(low=0.0))
        >>> [o.name for o in mae.outputs()]
        ['mae']
    """

    device_width = 1

    def __init__(
        self,
        name: str,
        fn: Callable[..., torch.Tensor],
        *,
        requires: Sequence[Requirement] = ("outputs", "targets"),
        domain: Domain = ANY_FINITE,
        reduce: Reduce = Reduce.MEAN,
    ) -> None:
        unknown = set(requires) - {"loss", "outputs", "targets"}
        if unknown:
            raise ConfigError(f"Custom requires must name loss/outputs/targets, got {sorted(unknown)}")
        if not name or not isinstance(name, str):
            raise ConfigError(f"Custom metric name must be a non-empty string, got {name!r}")
        self.name, self.fn, self.domain, self.reduce = name, fn, domain, Reduce(reduce)
        self.requires = frozenset(requires)  # type: ignore[misc]  # per-instance override

    def outputs(self) -> tuple[Output, ...]:
        return (Output(self.name, self.domain, self.reduce),)

    def combine(self) -> tuple[Combine, ...]:
        # over micro-batches as over ranks; a norm (L2) has no micro-batch form: a weighted mean
        return (_COMBINE_OF_REDUCE.get(self.reduce, Combine.MEAN),)

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        kwargs = {key: getattr(inputs, key) for key in sorted(self.requires)}
        value = self.fn(**kwargs)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise InputError(f"custom metric {self.name!r} must return a 0-dim tensor, got {got}")
        return (_float32(value),)


_COMBINE_OF_REDUCE = {
    Reduce.MEAN: Combine.MEAN,
    Reduce.SUM: Combine.SUM,
    Reduce.MAX: Combine.MAX,
    Reduce.MIN: Combine.MIN,
}


class Extra(Metric):
    """A value passed as ``tap.step(extra={name: value})``: a device tensor or a Python number.

    The kind (tensor or number) is fixed at the value's first appearance. A step that does not pass
    the value leaves it out of its record (a host-side presence column says which steps did).
    """

    def __init__(self, name: str, *, on_device: bool) -> None:
        self.name = name
        self.on_device = on_device
        # device value + presence flag, or host value + presence flag
        self.device_width, self.host_width = (1, 1) if on_device else (0, 2)
        self._missing: torch.Tensor | None = None  # NaN placeholder, made once per device

    def outputs(self) -> tuple[Output, ...]:
        return (Output(self.name, ANY_FINITE, Reduce.MEAN),)

    def check(self, inputs: StepInputs) -> None:
        value = inputs.extra.get(self.name)
        if value is None:
            return
        if isinstance(value, torch.Tensor):
            if not self.on_device:
                raise InputError(
                    f"extra {self.name!r} arrived as a tensor but was a Python number at its first step; "
                    "pass the same kind every step"
                )
            if value.dim() != 0 or value.is_complex():
                raise InputError(
                    f"extra {self.name!r} must be a real 0-dim tensor, got shape {tuple(value.shape)} "
                    f"dtype {value.dtype}; reduce it first, e.g. value.mean()"
                )
        elif self.on_device:
            raise InputError(
                f"extra {self.name!r} arrived as {type(value).__name__} but was a tensor at its first step; "
                "pass the same kind every step"
            )
        elif not isinstance(value, (int, float)) or isinstance(value, bool):
            raise InputError(f"extra {self.name!r} must be a 0-dim tensor or a number, got {type(value).__name__}")

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        if not self.on_device:
            return ()
        value = inputs.extra.get(self.name)
        if isinstance(value, torch.Tensor):
            return (_float32(value),)
        device = _step_device(inputs)
        if self._missing is None or self._missing.device != device:
            self._missing = torch.full((), math.nan, dtype=torch.float32, device=device)
        return (self._missing,)

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        value = inputs.extra.get(self.name)
        present = 0.0 if value is None else 1.0
        if self.on_device:
            return (present,)
        return (math.nan if value is None else float(value), present)  # type: ignore[arg-type]

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        value, present = raw
        return (value if present else None,)


def _step_device(inputs: StepInputs) -> torch.device:
    if inputs.device is not None:
        return inputs.device
    for t in (inputs.loss, inputs.outputs, inputs.targets):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def default_metrics(
    optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer] | None = None,
    model: torch.nn.Module | Mapping[str, torch.nn.Module] | None = None,
    *,
    scaler: torch.amp.GradScaler | None = None,
) -> list[Metric]:
    """The metric set a ``Tap`` uses when none is given.

    Loss, top-1 accuracy, step time, data wait, throughput and (on CUDA) memory; plus the learning
    rate and gradient norm when an optimizer or model is given, and the AMP loss scale with a
    ``scaler`` (which also makes the gradient norm unscaled). Metrics that do not fit a step's
    inputs (accuracy without targets, or of floating-point targets) are dropped at the first step
    instead of failing.

    Args:
        optimizer: an optimizer (value ``lr``), or a mapping name -> optimizer, e.g.
            ``{"g": opt_g, "d": opt_d}`` (values ``lr_g``, ``lr_d``).
        model: a module (value ``grad_norm``), or a mapping name -> module (``grad_norm_g``...).
        scaler: an AMP ``GradScaler``: adds :class:`LossScale`.

    Example:
        >>> [type(m).__name__ for m in default_metrics()]
        ['Loss', 'Accuracy', 'StepTime', 'DataTime', 'Throughput', 'Memory']
        >>> g, d = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
        >>> opts = {"g": torch.optim.SGD(g.parameters(), lr=0.1), "d": torch.optim.SGD(d.parameters(), lr=0.2)}
        >>> [o.name for m in default_metrics(opts, {"g": g, "d": d}) for o in m.outputs()][:6]
        ['loss', 'accuracy', 'grad_norm_g', 'grad_norm_d', 'lr_g', 'lr_d']
    """
    metrics: list[Metric] = [Loss(), Accuracy()]
    if model is not None:
        if isinstance(model, Mapping):
            metrics += [GradNorm(m, name=f"grad_norm_{key}", scaler=scaler) for key, m in model.items()]
        else:
            metrics.append(GradNorm(model, scaler=scaler))
    if scaler is not None:
        metrics.append(LossScale(scaler))
    if optimizer is not None:
        if isinstance(optimizer, Mapping):
            metrics += [LearningRate(opt, name=f"lr_{key}") for key, opt in optimizer.items()]
        else:
            metrics.append(LearningRate(optimizer))
    metrics += [StepTime(), DataTime(), Throughput(), Memory()]
    return metrics
