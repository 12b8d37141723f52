"""Per-output accuracy on Keras' torch backend: a real accuracy, declared as the TensorFlow one is.

A model with several outputs gets ``accuracy/<head>`` per output of class scores. Passed to
``tap.step`` as a plain ``extra=`` value it would only be checked finite: not held to [0, 1], not
weighted by each head's counted targets across ranks, not higher-is-better. So each head gets a
metric of its own, :class:`HeadAccuracy`: the step's hits and counted targets computed on the
device (two columns, as the TensorFlow ring holds them), decoded by the TensorFlow accuracy's
torch-free decoding (``_tf_decoding.TFAccuracyDecoding``: hits / counted, absent where nothing was
counted, weighted by the counted targets) with :class:`~batchtap.metrics.Accuracy`'s output
declaration (domain [0, 1], mean over ranks weighted by the metric, higher is better).

The head's output and targets are not among a step's inputs (``tap.step`` takes one ``outputs``):
the recorder hands each metric its pair just before ``tap.step``, and the metric's ``compute`` (on
the training thread, inside that call) takes it. No host read: argmax, compare, sum on the device.

The metrics go into the open run only, before its first step (``Tap.run_metrics``: the Tap's
own metric list is left as it was, so its next run does not inherit them). A run that already
recorded steps without them keeps plain extras.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchtap.integrations._tf_metrics import TFAccuracy
from batchtap.metrics.base import StepInputs
from batchtap.tap import Tap

__all__ = ["HeadAccuracy", "head_accuracies"]


class HeadAccuracy(TFAccuracy):
    """``accuracy/<head>`` of one output: top-1 hits and counted targets of the step, on the device.

    Example:
        >>> acc = HeadAccuracy("accuracy/a")
        >>> acc.give(torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]), torch.tensor([1, 1, 1]))
        >>> [float(v) for v in acc.compute(StepInputs(None, None, None, 3.0))]
        [2.0, 3.0]
        >>> acc.finalize([2.0, 3.0], None)  # type: ignore[arg-type]
        (0.6666666666666666,)
    """

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._pair: tuple[torch.Tensor, torch.Tensor] | None = None
        self._none: tuple[torch.Tensor, torch.Tensor] | None = None  # (0, 0): nothing counted

    def give(self, scores: torch.Tensor, targets: torch.Tensor) -> None:
        """This step's class scores ``[..., C]`` and class-index targets ``[...]`` (taken by the
        next :meth:`compute`)."""
        self._pair = (scores, targets)

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        pair, self._pair = self._pair, None
        if pair is None:  # the head had no class targets this step: absent, not 0
            device = inputs.device or torch.device("cpu")
            if self._none is None or self._none[0].device != device:
                zero = torch.zeros((), dtype=torch.float32, device=device)
                self._none = (zero, zero)
            return self._none
        scores, targets = pair
        with torch.no_grad():
            hits = (scores.argmax(-1) == targets).sum().to(torch.float32)
            # the count is a shape fact: filled on the device, no copy from the host
            counted = torch.full_like(hits, float(targets.numel()))
        return (hits, counted)


def head_accuracies(tap: Tap, heads: Sequence[str]) -> dict[str, HeadAccuracy] | None:
    """A :class:`HeadAccuracy` per head (``accuracy/<head>``) in the Tap's open run, added before
    its first step or found there from an earlier ``fit()``; None where the run already recorded
    steps without them (the caller passes plain extras then)."""
    metrics = tap.run_metrics()
    if metrics is None or not heads:
        return None
    names = [f"accuracy/{h}" for h in heads]
    found = {m.name: m for m in metrics if isinstance(m, HeadAccuracy)}
    if all(n in found for n in names):
        return {h: found[n] for h, n in zip(heads, names)}
    taken = {o.name for m in metrics for o in m.outputs()}
    added = {h: HeadAccuracy(n) for h, n in zip(heads, names) if n not in taken}
    if len(added) != len(heads):
        return None  # a name the Tap's own metrics already have: leave them be
    ran = tap.run_metrics(tuple(added.values()))
    # not added where the run already recorded steps: its columns are fixed
    return added if ran is not None and all(any(m is r for r in ran) for m in added.values()) else None
