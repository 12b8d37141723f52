"""The metric interface: what a metric computes on the device, reads on the host, and reports.

A metric is a device writer plus a host decoder, so the training step never reads a device value:

1. :meth:`Metric.compute` (or its :meth:`Metric.row_writer`) — on the training thread, inside
   ``Tap.step()``: float32 device tensors, no host reads. They land in the device ring.
2. :meth:`Metric.read_host` — on the training thread: host-only facts (tensor shapes, the optimizer's
   learning rate, allocator statistics). They land in host arrays.
3. its decoder (:meth:`Metric.decoder`, a :class:`~batchtap.metrics.decoding.MetricDecoder`) — on the
   pipeline, once the rows reached the host: raw floats (device columns first, then host columns)
   plus the steps' timing become the reported values. Numpy only: the pipeline process never
   loads torch.

This module loads torch only where a tensor is made (the pipeline process imports it for the
decoder's base).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from batchtap.metrics.decoding import HOST_HOOKS, BlockTiming, MetricDecoder, StepTiming
from batchtap.metrics.domain import Output

if TYPE_CHECKING:
    import torch

__all__ = [
    "Metric",
    "StepInputs",
    "StepTiming",
    "BlockTiming",
    "Requirement",
    "Combine",
    "MicroWriter",
    "RowWriter",
    "Settle",
    "write_values",
    "with_settle",
    "settle_of",
]

Requirement = Literal["loss", "outputs", "targets"]

#: ``write(inputs, slot, fresh)``: a metric's device columns of ring row ``slot``, written in place
#: (see :meth:`Metric.row_writer`); ``fresh`` is True when another writer wrote the slot last
RowWriter = Callable[["StepInputs", int, bool], None]

#: ``settle(start, length)``: completes the columns a row writer left for the flush, in ring slots
#: ``[start, start + length)`` (see :func:`with_settle`)
Settle = Callable[[int, int], None]


class MicroWriter(abc.ABC):
    """A metric's writer for the micro-batches of gradient accumulation (see
    :meth:`Metric.micro_writer`): :meth:`write` keeps what one micro-batch needs in buffers of its
    own, :meth:`settle` reduces up to :attr:`capacity` of them at once, when the step closes.

    Attributes:
        capacity: micro-batches the buffers hold (the caller settles before writing more).
    """

    capacity: int

    @abc.abstractmethod
    def write(self, inputs: StepInputs, index: int) -> None:
        """Keep micro-batch ``index`` (``0 <= index < capacity``, in order from 0 after each
        settle): device ops only, no host read, no host-to-device copy."""

    @abc.abstractmethod
    def settle(self, count: int) -> Sequence[torch.Tensor]:
        """The metric's device columns over micro-batches ``[0, count)`` as
        :class:`~batchtap.capture.accumulate.MicroBatches` sums them: a ``MEAN`` column as the sum of
        ``value * weight`` (weight: the micro-batch's samples, ``inputs.batch_size``, or 1 when
        that is NaN), a ``SUM`` column summed, ``MIN``/``MAX`` as such; 0-dim tensors, no host
        read. Drops what the buffers referenced."""


def with_settle(write: RowWriter, settle: Settle) -> RowWriter:
    """Mark ``write`` as a row writer that leaves some of its columns to be completed at the flush.

    The ring calls ``settle(start, length)`` right before it queues the copy of a block, once per
    run of consecutive slots whose rows ``write`` wrote last: one op for a whole block where a
    per-step op would cost host time at every step (the built-in accuracy counts its hits there).
    ``settle`` must write exactly what the step's writes would have, from state the writes left
    per slot, and must not read device values.
    """
    write.settle = settle  # type: ignore[attr-defined]  # a plain function keeps the per-step call cheap
    return write


def settle_of(write: RowWriter) -> Settle | None:
    """The ``settle`` that :func:`with_settle` attached to ``write``, if any."""
    settle: Settle | None = getattr(write, "settle", None)
    return settle


class Combine(str, enum.Enum):
    """How one device column of a metric combines over the micro-batches of an optimizer step
    (``Tap.accumulate``): on the device, before the step's row is written.

    ``MEAN`` is sample-weighted: each micro-batch's value is multiplied by its sample count, summed,
    and divided by the step's total samples.
    """

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"


@dataclasses.dataclass(slots=True)
class StepInputs:
    """What one ``Tap.step()`` call received (device tensors; never read on the host).

    Read-only by contract, not frozen: a frozen dataclass costs ~0.6 us more to build, and one is
    built at every step.
    """

    loss: torch.Tensor | None
    outputs: torch.Tensor | None
    targets: torch.Tensor | None
    batch_size: float  #: samples in the batch (NaN when no tensor tells)
    extra: Mapping[str, torch.Tensor | float] = dataclasses.field(default_factory=dict)
    #: the gradient norm the loop computed itself (``clip_grad_norm_``'s return value), if passed
    grad_norm: torch.Tensor | float | None = None
    #: the run's capture device (set by the Tap; metrics without tensor inputs, e.g. a gradient
    #: norm at the end of an accumulated step, put their values there)
    device: torch.device | None = None


def write_values(row: torch.Tensor, values: Sequence[torch.Tensor]) -> None:
    """0-dim tensors into ``row`` (a 1-dim float32 view of the ring), cast on the way: one device
    op, no allocation, no host read."""
    if len(values) == 1:
        # fill_ from a 0-dim tensor of the same device is a device-side copy, a third of a
        # stack's host time
        row.fill_(values[0])
    elif values:
        import torch  # loaded already: the values are tensors

        torch.stack(values, out=row)  # type: ignore[arg-type]  # a tuple or list


class Metric(MetricDecoder, abc.ABC):
    """Base class of all metrics: a device writer (declared here) and its host decoder (the hooks
    of :class:`~batchtap.metrics.decoding.MetricDecoder`, which every metric is).

    **The contract** (what every metric defines; together it says what the metric is):
    :attr:`requires`, :attr:`device_width`, :attr:`host_width`, :meth:`outputs` (each value's
    domain, reduction across ranks, weight and direction), :meth:`compute` (training thread, device
    ops only), :meth:`read_host` (training thread, host facts only) and the decoder's
    :meth:`~batchtap.metrics.decoding.MetricDecoder.finalize` (pipeline: raw columns, device then
    host, to the reported values; default: as they are).

    **Optional behaviour** (defaults fit most metrics): :meth:`check`, :meth:`applies`,
    :meth:`left_out_reason`, :attr:`per_micro_batch`, :meth:`combine`, :meth:`on_flush`, :attr:`gradient_based`,
    :attr:`watched_by_nan_guard`, and the decoder's ``warning``, ``weight``, ``skipped``,
    ``input_error``.

    **Optional speed-ups** (each must give exactly what the contract gives; leave them out and
    nothing changes but the cost): :meth:`row_writer` and :attr:`host_fixed_by_metadata` (the short
    step path; held to :meth:`compute` by ``tests/metrics/test_row_writers.py`` and
    ``tests/capture/test_short_path.py``), :meth:`micro_writer` (the short accumulation path; held to
    :meth:`compute` by ``tests/capture/test_micro_writers.py``), the decoder's ``*_block`` and
    ``*_suspects`` hooks
    (held to its row hooks by ``tests/pipeline/test_decode_blocks.py``).
    """

    # ------------------------------------------------------------------ the contract

    #: the ``Tap.step()`` arguments this metric needs
    requires: ClassVar[frozenset[Requirement]] = frozenset()
    #: number of float32 device tensors returned by :meth:`compute`
    device_width: int = 0
    #: number of floats returned by :meth:`read_host`
    host_width: int = 0

    @abc.abstractmethod
    def outputs(self) -> tuple[Output, ...]:
        """The values this metric reports, in the order :meth:`finalize` returns them."""

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        """``device_width`` float32 0-dim device tensors. No host reads."""
        return ()

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        """``host_width`` floats from host-only state (shapes, Python floats). No tensor reads."""
        return ()

    def decoder(self) -> MetricDecoder:
        """What decodes this metric's columns on the pipeline, where torch may not be loaded.

        A metric that overrides none of the decoder's hooks decodes as a plain
        :class:`~batchtap.metrics.decoding.MetricDecoder`; one whose hooks live in a torch-free
        decoding class it derives from (see ``MetricDecoder``) gets a twin of that class holding
        the attributes named in its ``decode_state``; any other (a user's metric with its own
        ``finalize``) decodes itself, and its module is loaded wherever it is decoded. Called once
        per run, when the run's chain opens.
        """
        twin_class: type[MetricDecoder] | None = None
        for klass in type(self).__mro__:
            if klass is Metric or klass is MetricDecoder:
                break
            if any(hook in vars(klass) for hook in HOST_HOOKS):
                if issubclass(klass, Metric) or not issubclass(klass, MetricDecoder):
                    return self  # host hooks defined beside the device code
                twin_class = klass
                break
        if twin_class is None:
            return MetricDecoder()
        twin: Any = object.__new__(twin_class)
        for name in twin_class.decode_state:
            setattr(twin, name, getattr(self, name))
        return twin  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ optional behaviour

    #: the value is computed from gradients: on a step the AMP GradScaler skipped (inf/NaN
    #: gradients), a non-finite value is expected and left out of the record instead of flagged
    gradient_based: ClassVar[bool] = False
    #: the metric's first device column is the step's loss: the NaN guard copies it to the host
    #: every step (the first such metric of a run is the one watched)
    watched_by_nan_guard: ClassVar[bool] = False

    def check(self, inputs: StepInputs) -> None:
        """Reject unusable inputs from their metadata (shape, dtype, device) with an InputError.

        Runs before anything of the step is written. Must not read tensor values.
        """

    def applies(self, inputs: StepInputs) -> bool:
        """Whether this metric makes sense for inputs like these (used to pick the *default*
        metrics at a run's first step, e.g. no accuracy for regression targets). Metadata only."""
        return self.requires <= {k for k in ("loss", "outputs", "targets") if getattr(inputs, k) is not None}

    def left_out_reason(self, inputs: StepInputs) -> str | None:
        """Why a *default* metric that does not apply to inputs like these was left out, when that
        looks like a mistake the user would want to hear about (one warning at the run's first
        step); None (the default) when leaving it out needs no word. Metadata only."""
        return None

    @property
    def per_micro_batch(self) -> bool:
        """Whether :meth:`compute` runs once per micro-batch (``Tap.accumulate``) rather than once
        per optimizer step: true for metrics of the micro-batch's loss, outputs or targets."""
        return bool(self.requires)

    def combine(self) -> tuple[Combine, ...]:
        """How each device column combines over micro-batches (one entry per device column).

        Default: sample-weighted mean of every column.
        """
        return (Combine.MEAN,) * self.device_width

    def on_flush(self) -> None:
        """Called on the training thread each time the Tap flushes captured rows (e.g. to reset a
        per-interval counter). Must not read device values."""

    # ------------------------------------------------------------------ optional speed-ups: must agree with the contract

    #: :meth:`read_host` depends on nothing but the inputs' metadata (e.g. a number of classes):
    #: the short step path reads it once per input signature instead of at every step
    host_fixed_by_metadata: ClassVar[bool] = False

    def row_writer(self, example: StepInputs, columns: torch.Tensor) -> RowWriter:
        """A writer of this metric's device columns straight into the ring, for steps whose inputs
        have the metadata of ``example`` (the short step path, ``capture/short.py``, uses it).

        The default writes :meth:`compute`'s values (one ``fill_`` for a single column, else one
        ``stack``). Metrics override it to write their columns with ``out=`` and in-place ops, with
        no 0-dim intermediates: the built-in loss and accuracy do. A writer must write exactly what
        :meth:`compute` gives for the same inputs (the short path's differential test checks the
        built-in ones), with no host read; it runs with grad mode off and autocast off.

        Args:
            example: inputs of a step that passed :meth:`check` (fixes shapes, dtypes, device).
            columns: ``[capacity, device_width]`` view of the ring: this metric's columns of every
                slot. The writer gets the slot index, and ``fresh``: True when the slot's row was
                last written by someone else (the general path, or a writer for other inputs), so
                columns a writer normally leaves alone (its constants) must be written too.

        A writer may leave columns to the flush: see :func:`with_settle`.
        """
        rows = [columns.select(0, slot) for slot in range(columns.shape[0])]

        def write(inputs: StepInputs, slot: int, fresh: bool) -> None:
            write_values(rows[slot], self.compute(inputs))

        return write

    def micro_writer(self, example: StepInputs, capacity: int) -> MicroWriter | None:
        """A :class:`MicroWriter` for ``Tap.accumulate()`` micro-batches with the metadata of
        ``example``, holding at most ``capacity`` of them (it may hold fewer); None (the default):
        every micro-batch is computed by :meth:`compute` and folded into the step's sums.

        The short accumulation path (``capture/accumulate.py``) uses it: a writer defers what it can
        to the step's close (one reduction over all the step's micro-batches instead of one per
        micro-batch). Its settled columns must equal the sums of :meth:`compute`'s values over the
        same micro-batches (float32 rounding aside), with no host read; it runs with grad mode off
        and autocast off. Held to :meth:`compute` by ``tests/capture/test_micro_writers.py``.
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(o.name for o in self.outputs())})"
