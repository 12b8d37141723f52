"""Top-k classification accuracy: the metric with the most code paths (general ``compute``, the
short path's row writer, the fused top-1 count settled at the flush), all held to one answer by
``tests/metrics/test_accuracy.py`` and ``tests/metrics/test_row_writers.py``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from batchtap.errors import ConfigError, InputError
from batchtap.metrics import functional as F
from batchtap.metrics._shared import Filled
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
from batchtap.metrics.domain import UNIT_INTERVAL, Output, Reduce

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
        >>> import math
        >>> from batchtap.metrics import StepInputs, StepTiming
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
        self._fill = Filled()

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
