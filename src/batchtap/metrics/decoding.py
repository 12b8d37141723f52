"""The host half of a metric: its decoder, and the column layout a block of raw rows comes with.

A metric is a device writer (:class:`~batchtap.metrics.Metric`: the training thread, torch) plus a
decoder (:class:`MetricDecoder`: the pipeline, numpy only). This module imports no torch, so the
pipeline process decodes blocks without loading it: what crosses from capture to the pipeline is
a block of arrays (:class:`~batchtap.capture.flush.BlockData`) and, once per run, a
:class:`ColumnLayout` naming each metric's columns, its decoder and its outputs' declarations.
Another capture (Keras' TensorFlow ring) hands over blocks of the same kind.

Every hook the pipeline calls is declared here, with the default that fits most metrics; a metric
overrides only what it needs. The ``*_block`` hooks take a whole block (``[n, columns]`` float64,
device columns first, then host columns) at once; the row hooks are asked only where a block
hook says a row needs it (or where a metric has no block hook).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from batchtap.metrics.domain import Output

__all__ = [
    "BlockData",
    "FACTS",
    "INTEGER_FACTS",
    "SLOT_FACTS",
    "BlockTiming",
    "ColumnLayout",
    "ColumnSpan",
    "HOST_HOOKS",
    "MetricDecoder",
    "StepTiming",
    "everywhere",
    "measured",
    "overrides",
]


@dataclasses.dataclass(slots=True)  # not frozen: one is built per row, and frozen costs ~0.6 us more
class StepTiming:
    """Host-side facts about one captured step, known once its row reached the host.

    Attributes:
        samples: samples in the batch.
        step_time: seconds of compute for the step (device events on CUDA, host clock on CPU).
        data_time: seconds the loop waited for the batch (NaN when no loader is watched).
        tokens: tokens of the step when the loop passed ``tokens=`` (NaN otherwise); throughput
            counts them instead of samples.
    """

    samples: float
    step_time: float
    data_time: float
    tokens: float = math.nan


@dataclasses.dataclass(slots=True)
class BlockTiming:
    """:class:`StepTiming` of a block of rows, one float64 array per field (see
    :meth:`MetricDecoder.finalize_block`)."""

    samples: np.ndarray
    step_time: np.ndarray
    data_time: np.ndarray
    tokens: np.ndarray


@dataclasses.dataclass(frozen=True, slots=True)
class BlockData:
    """A block of captured rows on the host: what crosses from a capture to the pipeline.

    Plain arrays (copies, safe to keep after a ring's slots are reused), one row per step:
    ``device_values`` ``[n, device_width]`` and ``host_values`` ``[n, host_width]`` float64 hold the
    metrics' raw columns where the run's :class:`ColumnLayout` says; the fields after them are the
    row facts (:data:`FACTS`, in this order): step, epoch and batch (integers), wall time (seconds
    since the epoch), samples, data wait, tokens and step time (seconds; NaN where not known).
    A Tap's ring makes them (:mod:`batchtap.capture.flush`); another capture (Keras' TensorFlow
    ring) makes the same. An absent raw value is NaN: the metric's decoder decides what it means.
    """

    device_values: np.ndarray  # [n, device_width] float64
    host_values: np.ndarray  # [n, host_width] float64
    step: np.ndarray
    epoch: np.ndarray
    batch: np.ndarray
    wall_time: np.ndarray
    samples: np.ndarray
    data_time: np.ndarray
    tokens: np.ndarray
    step_time: np.ndarray  # from the step clock, not the ring: last

    def __len__(self) -> int:
        return len(self.step)


#: a row's facts besides its values, in :class:`BlockData`'s order (defined by its fields, once)
FACTS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(BlockData))[2:]
#: the facts the ring keeps per slot, as one tuple in this order (``MetricRing.facts``)
SLOT_FACTS = FACTS[:-1]
#: facts that are integers (exact in float64 up to 2**53)
INTEGER_FACTS = ("step", "epoch", "batch")


def everywhere(rows: int, width: int) -> np.ndarray:
    """A block's presence mask with every value present."""
    return np.ones((rows, width), dtype=bool)


def measured(seconds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A block of one timing column: present where it was measured (not NaN)."""
    return seconds.reshape(-1, 1), ~np.isnan(seconds).reshape(-1, 1)


#: the hooks the pipeline calls on a decoder (a metric overriding none of them decodes as a plain
#: :class:`MetricDecoder`, wherever its own class lives)
HOST_HOOKS = (
    "finalize",
    "finalize_block",
    "warning",
    "warning_suspects",
    "weight",
    "weight_block",
    "skipped",
    "input_error",
    "input_suspects",
)


class MetricDecoder:
    """Turns a metric's raw columns into its reported values, on the pipeline (numpy, no torch).

    A metric's decoder is :meth:`Metric.decoder() <batchtap.metrics.Metric.decoder>`: the metric
    itself, or a torch-free twin of it. A metric whose device code needs torch at import puts its
    host hooks in a class of its own, defined in a torch-free module and listing the attributes the
    hooks read in :attr:`decode_state`, and derives from it: the pipeline process then decodes its
    columns without loading torch.

    All hooks are optional. ``finalize`` may give ``None`` for a value that does not exist at this
    step (data wait without a watched loader): it is left out of the record, not stored as an
    anomaly.
    """

    #: attributes a torch-free twin copies from the metric (see the class docstring)
    decode_state: ClassVar[tuple[str, ...]] = ()
    #: the event kind of :meth:`warning`'s message: "warning" (a value not measured), "info" (an assumption)
    notice_kind: ClassVar[str] = "warning"

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        """One row's raw columns (device then host) to its reported values.

        Default: the decoder's :meth:`finalize_block` on this one row where it has one (so a block
        decoder is never written twice), else the raw columns as they are. A metric with no array
        math overrides this instead of :meth:`finalize_block`.
        """
        block = self.finalize_block(np.array([list(raw)], dtype=np.float64), _one_row(timing))
        if block is None:
            return list(raw)
        values, present = (np.asarray(a).reshape(1, -1) for a in block)
        # sync: none — numpy arrays on the pipeline, no device value
        return [v if p else None for v, p in zip(values[0].astype(np.float64).tolist(), present[0].tolist())]

    def finalize_block(self, raw: np.ndarray, timing: BlockTiming) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`finalize` of a whole block at once, with array math.

        Args:
            raw: ``[n, device_width + host_width]`` float64, one row per step.
            timing: the rows' timing.

        Returns:
            ``(values, present)``: ``[n, len(outputs)]`` float64 values and a bool mask of the same
            shape, False where :meth:`finalize` would give None. None: the pipeline calls
            :meth:`finalize` row by row. Must agree with :meth:`finalize` row for row
            (``tests/pipeline/test_decode_blocks.py``).
        """
        return None

    def warning(self, raw: Sequence[float]) -> str | None:
        """A message when the raw columns show the value could not be measured at this step for a
        reason the user should fix (no gradient existed when ``Tap.step`` ran), else None.

        Reported as one warning event per run and metric; :meth:`finalize` leaves the value out.
        """
        return None

    def warning_suspects(self, raw: np.ndarray) -> np.ndarray | None:
        """The rows of a block whose :meth:`warning` may not be None (``[n]`` bool), so a block with
        none is not asked row by row; None (the default): every row is asked. Only used when
        :meth:`warning` is overridden."""
        return None

    def weight(self, raw: Sequence[float]) -> float | None:
        """What this row's values average over, for outputs declared ``weight="metric"`` (accuracy's
        kept targets); None: the step's samples. The cross-rank reduction weights each rank's value by
        it, so uneven counts combine exactly. Default: :meth:`weight_block` on this one row."""
        block = self.weight_block(np.array([list(raw)], dtype=np.float64))
        return None if block is None else float(np.asarray(block, dtype=np.float64)[0])

    def weight_block(self, raw: np.ndarray) -> np.ndarray | None:
        """:meth:`weight` of every row of a block (``[n]`` float64), or None: asked row by row."""
        return None

    def skipped(self, raw: Sequence[float]) -> bool:
        """Whether the raw columns show the optimizer skipped this step (AMP GradScaler found
        inf/NaN gradients). Such a step is reported as a ``skip`` event, not as anomalies."""
        return False

    def input_error(self, raw: Sequence[float]) -> str | None:
        """A message when the raw columns show the step's inputs were invalid in a way only their
        values reveal (class indices out of range), else None.

        Checked on the host after the row arrived: the step's values from this metric become NaN
        with an anomaly event, and the next ``Tap.step()`` raises :class:`~batchtap.InputError`.
        """
        return None

    def input_suspects(self, raw: np.ndarray) -> np.ndarray | None:
        """The rows of a block whose :meth:`input_error` may not be None (``[n]`` bool), so that
        only those are asked; None (the default): every row is asked."""
        return None


def _one_row(timing: StepTiming | None) -> BlockTiming:
    """One row's timing as a block's (none given: not known, as for a metric that reads none)."""
    if timing is None:
        timing = StepTiming(math.nan, math.nan, math.nan)
    return BlockTiming(
        np.array([timing.samples], dtype=np.float64),
        np.array([timing.step_time], dtype=np.float64),
        np.array([timing.data_time], dtype=np.float64),
        np.array([timing.tokens], dtype=np.float64),
    )


def overrides(decoder: MetricDecoder, hook: str) -> bool:
    """Whether ``decoder``'s class replaces the default ``hook``."""
    return getattr(type(decoder), hook) is not getattr(MetricDecoder, hook)


@dataclasses.dataclass(frozen=True, slots=True)
class ColumnSpan:
    """One metric's columns in a block: ``device_width`` from ``device_offset`` among the device
    columns, ``host_width`` from ``host_offset`` among the host columns; its decoder and outputs.

    ``gradient_based``: a non-finite value on a step the optimizer skipped is expected (left out,
    the skip event reports it), not an anomaly. ``name``: the metric's class name, for messages.
    """

    decoder: MetricDecoder
    device_offset: int
    device_width: int
    host_offset: int
    host_width: int
    outputs: tuple[Output, ...]
    gradient_based: bool = False
    name: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class ColumnLayout:
    """What a block's columns hold: one :class:`ColumnSpan` per metric, in value order.

    Sent once per run to wherever blocks are decoded; made by
    :attr:`Layout.columns <batchtap.metrics.layout.Layout.columns>` for a Tap's ring, and by any
    other capture for its own blocks (``device_width`` and ``host_width`` are the widths of a
    block's two value tables).
    """

    spans: tuple[ColumnSpan, ...]
    device_width: int
    host_width: int

    @property
    def names(self) -> tuple[str, ...]:
        """Every reported value's name, in column order."""
        return tuple(o.name for span in self.spans for o in span.outputs)

    @property
    def outputs(self) -> tuple[Output, ...]:
        """Every output, in column order."""
        return tuple(o for span in self.spans for o in span.outputs)
