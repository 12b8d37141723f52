"""The built-in metrics' decoders whose device code needs torch: their host hooks, numpy only.

Each metric derives from its decoding class here (``class Accuracy(AccuracyDecoding, Metric)``),
so the hooks are the metric's own on the training side, and the pipeline decodes a torch-free twin
of it (:meth:`~batchtap.metrics.Metric.decoder`) that holds only the attributes ``decode_state``
names: a pipeline process never loads torch for them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from batchtap.metrics.decoding import BlockTiming, MetricDecoder, StepTiming, everywhere

__all__ = [
    "AccuracyDecoding",
    "ExtraDecoding",
    "GradNormDecoding",
    "LossScaleDecoding",
    "LearningRateDecoding",
    "LossDecoding",
    "MemoryDecoding",
    "EXACT_FLOAT32",
    "NO_NOTICE",
    "AMBIGUOUS",
    "ONE_HOT",
]

#: float32 holds every integer up to 2**24 exactly, and not all of them above: past it a count
#: is kept as a low and a high part
EXACT_FLOAT32 = 2**24

#: where a gradient norm's row found its value (GradNorm's marker column)
_NORM_ON_DEVICE, _NORM_ON_HOST, _NORM_NOT_PASSED, _NORM_NO_GRADIENT = 1.0, 2.0, 0.0, -1.0
#: what a LossScale row holds (its host marker column)
_SCALE_NONE, _SCALE_PRESENT, _SKIP_UNKNOWN = 0.0, 1.0, 2.0

#: notice codes of accuracy's host column (see ``AccuracyDecoding.warning``)
NO_NOTICE, AMBIGUOUS, ONE_HOT = 0, 1, 2


class LossDecoding(MetricDecoder):
    """The loss's one device column, as it is."""

    def finalize_block(self, raw: np.ndarray, timing: BlockTiming) -> tuple[np.ndarray, np.ndarray]:
        return raw[:, :1], everywhere(raw.shape[0], 1)


class LearningRateDecoding(MetricDecoder):
    """One lr per param group; a group's value only where it differs from group 0's; a skipped
    step's lr that could not be told (NaN) left out, with one warning."""

    decode_state: ClassVar[tuple[str, ...]] = ("name",)
    name: str

    def finalize_block(self, raw: np.ndarray, timing: BlockTiming) -> tuple[np.ndarray, np.ndarray]:
        present = raw != raw[:, :1]  # a group's value where it differs from group 0's (NaN always does)
        known = ~np.isnan(raw[:, 0])
        present[:, 0] = known
        present &= known[:, None]
        return raw, present

    def warning(self, raw: Sequence[float]) -> str | None:
        if not math.isnan(raw[0]):
            return None
        return (
            f"{self.name}: a step the GradScaler skipped ran no optimizer step, and whether the lr moved before "
            "or after tap.step was not known yet, so the lr that step would have used is left out of its row"
        )


class MemoryDecoding(MetricDecoder):
    """Allocator counters as they are; NaN (not a CUDA step) left out."""

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        return tuple(None if math.isnan(v) else v for v in raw)


class ExtraDecoding(MetricDecoder):
    """An ``extra=`` value and its presence flag: left out where the step did not pass it."""

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        value, present = raw
        return (value if present else None,)


class GradNormDecoding(MetricDecoder):
    """The norm from the device column or the host column its marker names; a step without
    gradients left out, with one warning."""

    decode_state: ClassVar[tuple[str, ...]] = ("name",)
    name: str

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
            f"{self.name}: no optimizer step of the model's parameters ran since the previous row and no "
            "parameter had a gradient when tap.step() ran (zero_grad(set_to_none=True) before tap.step, or "
            "tap.step twice per optimizer step?); the value is left out at such steps. Call tap.step once "
            "per optimizer step, or pass tap.step(grad_norm=clip_grad_norm_(...))"
        )


class LossScaleDecoding(MetricDecoder):
    """The scale and whether the scaler skipped the step (a ``skip`` event); unknown placement of
    ``tap.step`` left out, with one warning."""

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        scale, skipped, present = raw
        if present == _SCALE_NONE:
            return [None, None]
        if present == _SKIP_UNKNOWN:
            return [scale, None]
        return [scale, skipped]

    def skipped(self, raw: Sequence[float]) -> bool:
        return raw[2] == _SCALE_PRESENT and raw[1] >= 0.5

    def warning(self, raw: Sequence[float]) -> str | None:
        if raw[2] != _SKIP_UNKNOWN:
            return None
        return (
            "amp_skipped: tap.step() runs before scaler.step(optimizer), when the GradScaler has not checked "
            "the gradients for inf/NaN yet, so whether it skips the step is not known: amp_skipped is left out "
            "(a skipped step's non-finite gradient norm then shows as an anomaly). Call tap.step after "
            "scaler.step(optimizer) (before or after scaler.update())"
        )


class AccuracyDecoding(MetricDecoder):
    """Accuracy's counts (low and high parts) to fractions of the kept targets, its notices to
    warnings, and out-of-range class indices to input errors."""

    decode_state: ClassVar[tuple[str, ...]] = ("topk", "ignore_index", "class_dim", "_counts")
    notice_kind: ClassVar[str] = "info"  # a layout it guessed, targets it read as one-hot: assumptions
    topk: tuple[int, ...]
    ignore_index: int | None
    class_dim: int | None
    _counts: int

    def warning_suspects(self, raw: np.ndarray) -> np.ndarray:
        """The rows of a block whose :meth:`warning` may not be None (the pipeline asks only a block
        with one: the notice column is 0 in nearly every run)."""
        return raw[:, 2 * self._counts + 3] != NO_NOTICE

    def warning(self, raw: Sequence[float]) -> str | None:
        """Once per run: the step's layout was a guess (``[a, b, b]`` scores with ``[a, b]``
        targets), or its one-hot targets were scored against their argmax."""
        notice = raw[2 * self._counts + 3]
        if notice == NO_NOTICE:  # the common case first
            return None
        if notice == AMBIGUOUS:
            return (
                "Accuracy: outputs [a, b, b] with targets [a, b] fit both [N, C, d] (classes at dim 1, as "
                "F.cross_entropy and TorchMetrics read them) and [B, T, V] (classes last); classes were taken "
                "to be last. Pass Accuracy(class_dim=1) or Accuracy(class_dim=-1) to settle it"
            )
        if notice == ONE_HOT:
            where = "the last dim" if self.class_dim in (None, -1) else "dim 1"
            return (
                f"Accuracy: targets have the outputs' shape (one-hot or soft labels), not class indices; "
                f"accuracy is scored against targets.argmax over {where}. Pass class indices to silence this"
            )
        return None

    def _totals_block(self, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_totals` of every row of a block, and the kept targets (``[n, 1]``)."""
        n = self._counts
        totals = raw[:, n : 2 * n] * EXACT_FLOAT32 + raw[:, :n]
        with np.errstate(invalid="ignore"):
            return totals, totals[:, -1:] - totals[:, -2:-1]

    def finalize_block(self, raw: np.ndarray, timing: BlockTiming) -> tuple[np.ndarray, np.ndarray]:
        totals, kept = self._totals_block(raw)
        with np.errstate(invalid="ignore", divide="ignore"):
            present = kept > 0  # NaN fails too
            values = totals[:, :-2] / kept
        return values, np.broadcast_to(present, values.shape)

    def weight_block(self, raw: np.ndarray) -> np.ndarray:
        """The kept targets (positions - ignored): ranks combine accuracies weighted by them
        (exact with padding)."""
        return self._totals_block(raw)[1][:, 0]

    def input_suspects(self, raw: np.ndarray) -> np.ndarray:
        at = 2 * self._counts
        low, high, classes = raw[:, at], raw[:, at + 1], raw[:, at + 2]
        with np.errstate(invalid="ignore"):
            return ~((low >= 0) & (high < classes))  # the common case of input_error, for every row

    def input_error(self, raw: Sequence[float]) -> str | None:
        at = 2 * self._counts
        low, high, classes = raw[at], raw[at + 1], raw[at + 2]
        if 0 <= low and high < classes:  # in range — the common case first
            return None
        if not self.weight(raw) > 0:  # type: ignore[operator]
            return None  # nothing was counted, so no index was used
        if low < 0 or high >= classes:
            ignore = self.ignore_index
            ignored = "" if ignore is None else f" (targets equal to {ignore} left out)"
            bad = int(low) if low < 0 else int(high)
            fix = (
                f"if {bad} marks padding, pass Accuracy(ignore_index={bad}) (the value your loss ignores); "
                "else check the labels"
                if low < 0
                else "check the labels, or the model's number of outputs"
            )
            return (
                f"targets hold class indices outside [0, {int(classes)}) (smallest {int(low)}, largest "
                f"{int(high)}) for outputs with {int(classes)} classes{ignored}; this step's accuracy is not "
                f"stored; {fix}"
            )
        return None
