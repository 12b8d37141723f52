"""Top-k classification accuracy: the metric with the most code paths (general ``compute``, the
short path's row writer, the fused top-1 count settled at the flush), all held to one answer by
``tests/metrics/test_accuracy.py`` and ``tests/metrics/test_row_writers.py``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from batchtap.errors import ConfigError, InputError
from batchtap.metrics import functional as F
from batchtap.metrics._shared import Filled
from batchtap.metrics.base import (
    Combine,
    Metric,
    MicroWriter,
    Requirement,
    RowWriter,
    StepInputs,
    with_settle,
)
from batchtap.metrics.decoders import AMBIGUOUS, NO_NOTICE, ONE_HOT, AccuracyDecoding
from batchtap.metrics.domain import UNIT_INTERVAL, Output, Reduce

#: device memory one accuracy row writer may take for its per-slot buffers (``capacity * 2 *
#: targets * 8`` bytes: int64, the dtype the argmax and the targets have, so the per-step op casts
#: nothing); past it the counts are reduced at every step instead of at the flush
HITS_BUFFER_BYTES = 64 * 2**20


class Accuracy(AccuracyDecoding, Metric):
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

    Integer one-hot targets of the outputs' own shape (what ``F.one_hot`` gives) are taken as
    ``targets.argmax`` over the class dim, with one warning event per run saying so.

    When targets fit both readings of 3+-dim scores (``[a, b, b]`` with targets ``[a, b]``),
    classes are taken to be last (language models are the more common case) and one warning event
    per run says so: pass ``class_dim=1`` (``[N, C, d]``, as ``F.cross_entropy`` reads it) or
    ``class_dim=-1`` (``[B, T, V]``) to settle it.

    Every step's kept targets are checked to be class indices in ``[0, C)``: a step holding
    another value (one that is not ``ignore_index``) stores no accuracy but NaN with an anomaly
    event naming the offending targets, and the next ``Tap.step()`` after that row reached the
    host raises :class:`~batchtap.InputError`. On the short step path the check costs no launch of
    its own per step (the targets travel with the hit flags and are checked at the flush).

    Args:
        topk: the k values, e.g. ``(1, 5)``. Must contain 1.
        ignore_index: target value that is not counted (``-100``, like ``F.cross_entropy``);
            ``None`` counts every target.
        class_dim: where the classes are in the outputs: ``1`` (``[N, C, d1, ...]``) or ``-1``
            (classes last); ``None`` (the default) works it out from the targets' shape.
        check_targets_every: kept so existing code runs; ignored. Every step's targets are
            checked now: a sampled check let the steps between checks store accuracies of
            out-of-range targets (e.g. ``-1`` padding with ``ignore_index=-100``).

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
    # the number of classes, and a notice code (NOTICES) for a warning: shape facts, known on the host
    host_width = 2
    host_fixed_by_metadata = True

    def __init__(
        self,
        topk: Sequence[int] = (1,),
        *,
        ignore_index: int | None = -100,
        class_dim: int | None = None,
        check_targets_every: int = 16,
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
        if class_dim is not None and (isinstance(class_dim, bool) or class_dim not in (1, -1)):
            raise ConfigError(
                f"Accuracy class_dim must be 1 (scores [N, C, d1, ...]), -1 (classes last, [B, T, V]) or None "
                f"(worked out from the targets' shape), got {class_dim!r}"
            )
        self.topk = ks
        self.ignore_index = ignore_index
        self.class_dim = class_dim
        self.check_targets_every = check_targets_every  # ignored: every step is checked (see Args)
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
            Output(
                "accuracy" if k == 1 else f"accuracy_top{k}",
                UNIT_INTERVAL,
                Reduce.MEAN,
                unit="%",
                weight="metric",  # the kept targets, not the samples: exact with padding
                higher_is_better=True,
            )
            for k in self.topk
        )

    def combine(self) -> tuple[Combine, ...]:
        # accuracy over every kept target of every micro-batch: counts add, the range widens
        return (Combine.SUM,) * (2 * self._counts) + (Combine.MIN, Combine.MAX)

    def applies(self, inputs: StepInputs) -> bool:
        outputs, targets = inputs.outputs, inputs.targets
        if not (isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor)):
            return False
        if not outputs.is_floating_point() or outputs.dim() < 2:
            return False
        if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
            # floating point: regression, or soft labels; from metadata alone a [B, k] regression
            # target looks like soft labels, so the default accuracy leaves both out (and says so)
            return False
        return True  # class indices, or integer one-hot targets of the outputs' shape (their argmax)

    def left_out_reason(self, inputs: StepInputs) -> str | None:
        """Why the *default* accuracy cannot be computed from inputs like these, when that looks like
        a mistake the user would want to hear about (no ``targets=`` next to class scores, outputs
        of shape ``[B]``); None when it applies or is left out on purpose (no outputs at all: a
        loss-only loop; floating-point targets of another shape: regression). Metadata only."""
        if self.applies(inputs):
            return None
        outputs, targets = inputs.outputs, inputs.targets
        if not isinstance(outputs, torch.Tensor) or not outputs.is_floating_point():
            return None
        if targets is None:
            if outputs.dim() < 2:
                return None  # a regression loop that passed predictions only
            return (
                f"no accuracy is recorded: tap.step() got outputs of shape {list(outputs.shape)} but no "
                "targets; pass targets=<class indices> to record accuracy"
            )
        if not isinstance(targets, torch.Tensor):
            return None
        if targets.is_floating_point():
            if outputs.dim() >= 2 and targets.shape == outputs.shape and outputs.shape[-1] >= 2:
                return (
                    f"no accuracy is recorded: targets are floating point with the outputs' shape "
                    f"{list(outputs.shape)}, which regression targets and one-hot labels both have; for one-hot "
                    "or soft labels pass targets.argmax(-1) (integer one-hot targets are scored against their argmax)"
                )
            return None  # regression
        if outputs.dim() < 2:
            return (
                f"no accuracy is recorded: outputs of shape {list(outputs.shape)} hold one score per sample, "
                f"not class scores [N, C] (targets {_dtype_name(targets.dtype)} of shape {list(targets.shape)}); "
                "pass the model's [N, C] logits (for a single binary logit x: torch.stack([-x, x], 1))"
            )
        return None

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
                "floating-point targets); for one-hot or soft labels pass targets.argmax(-1) (integer one-hot "
                "targets of the outputs' shape are taken as their argmax)"
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
        if targets.shape == outputs.shape:  # one-hot: the outputs' own shape, any class dim fits
            class_dim: int | None = self.class_dim if self.class_dim is not None else -1
        else:
            class_dim, _ = _class_dim(outputs, targets, self.class_dim)
        if class_dim is None:
            raise InputError(_layout_error(outputs, targets, self.class_dim))
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
        one_hot = targets.shape == outputs.shape  # integer one-hot: no layout of class indices has this shape
        if one_hot:
            class_dim, notice = (self.class_dim if self.class_dim is not None else -1), ONE_HOT
            index_shape = outputs.shape[:class_dim] + (outputs.shape[class_dim + 1 :] if class_dim == 1 else ())
            index_dtype = torch.int64  # what argmax gives
        else:
            found, ambiguous = _class_dim(outputs, targets, self.class_dim)
            assert found is not None  # check() ran
            class_dim, notice = found, (AMBIGUOUS if ambiguous else NO_NOTICE)
            index_shape, index_dtype = targets.shape, targets.dtype
        classes = outputs.shape[class_dim]
        ignore = self.ignore_index
        info = torch.iinfo(index_dtype)
        masked = ignore is not None and info.min <= ignore <= info.max  # see F.kept_mask
        # A prediction is a class index, so it never equals an ignore_index outside [0, C) (-100):
        # the mask is needed on hits only when the ignored value is a class (pad id 0).
        mask_hits = masked and ignore is not None and 0 <= ignore < classes
        n = int(torch.Size(index_shape).numel())
        exact = n <= F.EXACT_FLOAT32  # float32 sums are exact: no high parts needed
        fuse = self._fuse_counts if self._fuse_counts is not None else outputs.device.type != "cpu"
        fused = fuse and exact and self.topk == (1,) and masked and not mask_hits
        high_n, low_n = divmod(n, F.EXACT_FLOAT32)
        facts = self._facts = _AccuracyShape(
            key=key,
            class_dim=class_dim,
            classes=float(classes),
            notice=float(notice),
            one_hot=one_hot,
            index_shape=tuple(index_shape),
            masked=masked,
            mask_hits=mask_hits,
            exact=exact,
            numel=n,
            zero=self._fill(0.0, outputs.device),
            positions=(self._fill(float(low_n), outputs.device), self._fill(float(high_n), outputs.device)),
            counts=torch.empty((2, *index_shape), dtype=torch.bool, device=outputs.device) if fused else None,
        )
        return facts

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        outputs, targets = inputs.outputs, inputs.targets
        assert outputs is not None and targets is not None
        facts = self._shape_facts(outputs, targets)
        class_dim = facts.class_dim
        if facts.one_hot:
            targets = targets.argmax(class_dim)
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
        low, high = self._kept_range(targets, dropped)  # every step: no stored accuracy of unchecked targets
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
        intermediates, counted and range-checked at the flush.

        Row 0 of a ``[2, *targets]`` int64 buffer takes the argmax; row 1 holds zeros. One ``sub``
        of the buffer from the targets writes, into the slot's own ``[2, *targets]`` int64 buffer,
        ``targets - argmax`` (0 exactly on a hit) and the targets themselves: the cost of the
        ``eq`` it replaces (an int64 out casts nothing; a float32 one took twice the host time).
        At the flush (see ``with_settle``) one ``eq`` with ``(0, ignore_index)`` marks the hits
        and the ignored targets of the whole block, one sum counts both into the rows' (correct,
        ignored) columns, and a ``where`` (ignored targets as 0, in float32), ``amin`` and ``amax``
        write every row's target range: every step's targets are checked, with no launch of its
        own per step. A prediction never equals an ignored value outside ``[0, C)``, so the hits
        are hits among the kept targets. The other columns are constants for these inputs
        (the positions, zero high parts): written only when the slot's row is not this writer's.

        The per-slot buffers take ``capacity * 2 * targets.numel() * 8`` bytes of device memory;
        past :data:`HITS_BUFFER_BYTES` the eq writes one shared float buffer instead, a matrix
        product with a column of ones counts it into the row, and an ``add`` and an ``aminmax``
        write the range, at every step (five ops a step).

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
        shape = facts.index_shape
        # columns 2..5: positions, the three high parts (made constants: written with one stack, as
        # the general path's row; a device-to-device copy_ is not traceable under FakeTensorMode,
        # which the CUDA-path tests use)
        constants = (facts.positions[0], *(facts.zero,) * 3)
        capacity = columns.shape[0]
        slots = range(capacity)
        rest = [columns.select(0, s).narrow(0, 2, 4) for s in slots]
        class_dim, one_hot = facts.class_dim, facts.one_hot
        lows, highs = columns.select(1, 6), columns.select(1, 7)

        if capacity * 2 * facts.numel * 8 <= HITS_BUFFER_BYTES:
            pair = torch.zeros((2, *shape), dtype=torch.int64, device=device)  # row 0: the argmax; row 1: 0
            predicted = pair.select(0, 0)
            diffs = torch.empty((capacity, 2, facts.numel), dtype=torch.int64, device=device)
            slot_diffs = [diffs.select(0, s).view(pair.shape) for s in slots]
            # a hit: targets - argmax == 0; an ignored target: targets == ignore_index
            wanted = torch.tensor([[0], [ignore]], dtype=torch.int64, device=device)
            counted = columns.narrow(1, 0, 2)  # correct, ignored
            zero = facts.zero  # float32 0-dim: torch.where with it gives the range in the columns' dtype

            def write(inputs: StepInputs, slot: int, fresh: bool) -> None:
                targets = inputs.targets
                if one_hot:
                    targets = targets.argmax(class_dim)  # type: ignore[union-attr]
                torch.argmax(inputs.outputs, class_dim, out=predicted)  # type: ignore[arg-type]
                torch.sub(targets, pair, out=slot_diffs[slot])  # type: ignore[arg-type]  # checked at the flush
                if fresh:
                    torch.stack(constants, out=rest[slot])

            def settle(start: int, length: int) -> None:
                block = diffs.narrow(0, start, length)
                flags = torch.eq(block, wanted)  # [slots, 2, targets]: hits, ignored
                torch.sum(flags, 2, dtype=torch.float32, out=counted.narrow(0, start, length))
                # the kept targets' range, ignored ones as 0 (a class of every output)
                kept = torch.where(flags.select(1, 1), zero, block.select(1, 1))  # float32 (the 0-dim zero's)
                # amin and amax (aminmax's out= into these strided columns is not traceable under
                # FakeTensorMode, which the CUDA-path tests use)
                torch.amin(kept, 1, out=lows.narrow(0, start, length))
                torch.amax(kept, 1, out=highs.narrow(0, start, length))

            return with_settle(write, settle)

        pair = torch.full((2, *shape), ignore, dtype=torch.int64, device=device)  # the argmax; ignore_index
        predicted = pair.select(0, 0)
        matches = torch.empty(pair.shape, dtype=torch.float32, device=device)
        per_row = matches.view(2, -1)
        ignored_flags = matches.select(0, 1)
        kept = torch.empty(shape, dtype=torch.float32, device=device)
        ones = torch.ones((facts.numel, 1), dtype=torch.float32, device=device)
        # correct, ignored as a [2, 1] column for the product (mm: mv's out= is not traceable under
        # FakeTensorMode, which the CUDA-path tests use)
        counts = [columns.select(0, s).narrow(0, 0, 2).unsqueeze(1) for s in slots]
        ranges = [(lows.select(0, s), highs.select(0, s)) for s in slots]

        def write_counted(inputs: StepInputs, slot: int, fresh: bool) -> None:
            targets = inputs.targets
            if one_hot:
                targets = targets.argmax(class_dim)  # type: ignore[union-attr]
            torch.argmax(inputs.outputs, class_dim, out=predicted)  # type: ignore[arg-type]
            torch.eq(pair, targets, out=matches)  # type: ignore[arg-type]
            torch.mm(per_row, ones, out=counts[slot])  # correct, ignored
            # the kept targets' range: an ignored target (flag 1) moved to 0 by t - ignore * flag
            torch.add(targets, ignored_flags, alpha=-ignore, out=kept)  # type: ignore[arg-type]
            torch.aminmax(kept, out=ranges[slot])
            if fresh:
                torch.stack(constants, out=rest[slot])

        return write_counted

    def micro_writer(self, example: StepInputs, capacity: int) -> MicroWriter | None:
        """Top-1 with padding (the default) over accumulated micro-batches: two ops a micro-batch
        (the argmax, and ``targets - argmax`` beside the targets into the micro-batch's own
        buffer, as the row writer does), counted and range-checked once for the whole step.

        The buffers take ``capacity * 2 * targets * 8`` bytes, at most :data:`HITS_BUFFER_BYTES`,
        and the step's counts stay exact in float32 (at most ``2**24`` targets per settle):
        ``capacity`` shrinks to fit both. Other settings (top-k, an ignored value that is a class,
        no ``ignore_index``, one-hot targets, fewer than 2 micro-batches fitting) take ``compute``.
        """
        outputs, targets = example.outputs, example.targets
        assert outputs is not None and targets is not None
        facts = self._shape_facts(outputs, targets)
        ignore = self.ignore_index
        if (
            self.topk != (1,)
            or not facts.masked
            or facts.mask_hits
            or ignore is None
            or facts.one_hot
            or not facts.numel
        ):
            return None
        capacity = min(capacity, F.EXACT_FLOAT32 // facts.numel, HITS_BUFFER_BYTES // (16 * facts.numel))
        if capacity < 2:
            return None
        return _TopOneSums(facts, ignore, capacity, self._fill)

    def _fused_top1(
        self, outputs: torch.Tensor, targets: torch.Tensor, ignore: int, facts: _AccuracyShape, counts: torch.Tensor
    ) -> Sequence[torch.Tensor]:
        """Top-1 with padding in six kernels instead of seven: hits and ignored flags are written
        into the two rows of one buffer and counted by a single reduction. Used off the CPU on the
        general path, where each kernel launch costs host time; on the CPU two plain sums are
        cheaper than a reduction over a dimension, so it is not used there (tests force it with
        ``_fuse_counts``). The buffer is reused every step: stream order puts each step's reduction
        before the next step's writes. The counts are summed in float32: exact below 2**24 targets
        (``facts.exact``), where float16 would already round past 2,048 hits."""
        hits, dropped = counts.unbind(0)  # views (select(): indexing a CUDA tensor with an int is not one)
        torch.eq(outputs.argmax(facts.class_dim), targets, out=hits)
        torch.eq(targets, ignore, out=dropped)
        correct, ignored = counts.flatten(1).sum(1, dtype=torch.float32).unbind(0)
        low, high = self._kept_range(targets, dropped)
        zero = facts.zero
        return (correct, ignored, facts.positions[0], zero, zero, zero, low, high)

    @staticmethod
    def _kept_range(targets: torch.Tensor, dropped: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Smallest and largest target, ignored ones (``dropped``) counted as 0, a valid index."""
        return F.target_range(targets.masked_fill(dropped, 0) if dropped is not None else targets)

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        outputs, targets = inputs.outputs, inputs.targets
        assert outputs is not None and targets is not None
        facts = self._shape_facts(outputs, targets)
        return (facts.classes, facts.notice)


class _TopOneSums(MicroWriter):
    """:meth:`Accuracy.micro_writer`'s writer: per micro-batch, ``targets - argmax`` (0 exactly on
    a hit) and the targets into row ``index`` of a ``[capacity, 2, targets]`` int64 buffer; at the
    step's close one ``eq`` with ``(0, ignore_index)`` marks hits and ignored targets of all its
    micro-batches, one sum counts both, and a ``where`` and an ``aminmax`` give the kept targets'
    range (ignored ones as 0), the columns :meth:`Accuracy.compute` sums to."""

    def __init__(self, facts: _AccuracyShape, ignore: int, capacity: int, fill: Filled) -> None:
        self.capacity = capacity
        self._facts, self._fill = facts, fill
        device = facts.zero.device
        pair = torch.zeros((2, *facts.index_shape), dtype=torch.int64, device=device)  # the argmax; 0
        self._pair, self._predicted = pair, pair.select(0, 0)
        self._diffs = torch.empty((capacity, 2, facts.numel), dtype=torch.int64, device=device)
        self._rows = [self._diffs.select(0, i).view(pair.shape) for i in range(capacity)]
        self._blocks = [self._diffs.narrow(0, 0, n) for n in range(capacity + 1)]  # views made once, by count
        self._wanted = torch.zeros((2, 1), dtype=torch.int64, device=device)  # a hit: 0; ignored: ignore_index
        self._wanted.select(0, 1).fill_(ignore)  # made on the device: no upload

    def write(self, inputs: StepInputs, index: int) -> None:
        torch.argmax(inputs.outputs, self._facts.class_dim, out=self._predicted)  # type: ignore[arg-type]
        torch.sub(inputs.targets, self._pair, out=self._rows[index])  # type: ignore[arg-type]

    def settle(self, count: int) -> Sequence[torch.Tensor]:
        facts = self._facts
        block = self._blocks[count]  # [count, 2, targets]
        flags = torch.eq(block, self._wanted)
        correct, ignored = flags.sum((0, 2), dtype=torch.float32).unbind(0)
        zero = facts.zero  # float32 0-dim: the where gives the range in float32
        low, high = torch.aminmax(torch.where(flags.select(1, 1), zero, block.select(1, 1)))
        positions = self._fill(float(count * facts.numel), zero.device)  # exact: capacity keeps it <= 2**24
        return (correct, ignored, positions, zero, zero, zero, low, high)


@dataclasses.dataclass(frozen=True, slots=True)
class _AccuracyShape:
    """Facts :class:`Accuracy` derives from its inputs' metadata (see ``Accuracy._shape_facts``)."""

    key: tuple[Any, ...]  # outputs shape, targets shape, targets dtype, device
    class_dim: int
    classes: float
    notice: float  # NO_NOTICE, AMBIGUOUS or ONE_HOT: a warning the run gets once
    one_hot: bool  # floating-point targets of the outputs' shape, scored against their argmax
    index_shape: tuple[int, ...]  # the class indices' shape (the targets', or one-hot's argmax)
    masked: bool  # ignored targets must be counted (an ignore_index the targets' dtype can hold)
    mask_hits: bool  # ... and left out of the hits (the ignore_index is a class index)
    exact: bool  # few enough targets for exact float32 counts
    numel: int
    zero: torch.Tensor
    positions: tuple[torch.Tensor, torch.Tensor]  # numel's low and high part (constants)
    counts: torch.Tensor | None  # [2, *targets.shape] bool: hits and ignored, for Accuracy._fused_top1


def _class_dim(outputs: torch.Tensor, targets: torch.Tensor, wanted: int | None = None) -> tuple[int | None, bool]:
    """Where the classes are in ``outputs`` for targets of this shape (None when they do not fit),
    and whether both layouts fit (``[a, b, b]`` with ``[a, b]``) and the choice was a guess.

    ``wanted`` (``Accuracy(class_dim=...)``) settles it; else classes last wins when both fit:
    LMs are the common case.
    """
    shape = tuple(targets.shape)
    last = outputs.dim() >= 2 and shape == tuple(outputs.shape[:-1])
    second = outputs.dim() >= 3 and shape == (outputs.shape[0], *outputs.shape[2:])
    if wanted is not None:
        fits = last if wanted == -1 else (second or (outputs.dim() == 2 and last))
        return (wanted if fits else None), False
    if last:
        return -1, second
    if second:
        return 1, False
    return None, False


def _layout_error(outputs: torch.Tensor, targets: torch.Tensor, wanted: int | None = None) -> str:
    got, out = list(targets.shape), list(outputs.shape)
    if wanted == -1 and outputs.dim() > 2:
        fix = f"Accuracy(class_dim=-1) needs targets of shape {out[:-1]} for outputs of shape {out}, got {got}"
    elif wanted == 1 and outputs.dim() > 2:
        fix = f"Accuracy(class_dim=1) needs targets of shape {[out[0], *out[2:]]} for outputs of shape {out}, got {got}"
    elif outputs.dim() == 2:
        fix = f"targets must have shape {out[:1]} for outputs of shape {out}, got {got}"
    else:
        fix = (
            f"targets of shape {got} fit neither layout Accuracy takes for outputs of shape {out}: "
            f"{out[:-1]} (classes last, sequence logits [B, T, V] with targets [B, T]) or "
            f"{[out[0], *out[2:]]} (classes at dim 1, [N, C, d1, ...] with targets [N, d1, ...] as "
            "for F.cross_entropy)"
        )
    return fix


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
