"""The metrics a TensorFlow ring's rows are decoded with, and which of a Tap's metrics they stand for.

A TensorFlow step writes named float32 columns into its ring (``_tf_ring.py``); at a flush the host
hands them to the Tap's pipeline as one block (:meth:`batchtap.Tap.hand_over`), decoded by the
metrics below exactly as a PyTorch block is: every value checked against its domain (an anomaly
event for one outside it), reduced over ranks as its output says, seen by the rules. A value a step
did not have is marked absent by a presence column, never by NaN, so a NaN that a step did produce
(a NaN gradient norm) stays a NaN and is reported.

This module imports no TensorFlow; a pipeline process does not even import it: these metrics decode
there as twins of their torch-free decoding classes (``_tf_decoding.py``), so a TensorFlow run's
pipeline process loads neither torch nor TensorFlow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from batchtap.integrations._tf_decoding import TFAccuracyDecoding, TFValueDecoding
from batchtap.metrics import Accuracy, GradNorm, LearningRate, Loss, StepTime, Throughput
from batchtap.metrics.base import Metric
from batchtap.metrics.domain import ANY_FINITE, NONNEGATIVE, UNIT_INTERVAL, Domain, Output, Reduce

__all__ = ["TFAccuracy", "TFValue", "TFPlan", "plan_for"]


class TFAccuracy(TFAccuracyDecoding, Metric):
    """Top-1 accuracy from two ring columns: hits and counted targets of the step.

    Absent where nothing was counted; a mean weighted by the counted targets across ranks (as
    :class:`~batchtap.metrics.Accuracy`). Decoded by :class:`TFAccuracyDecoding` (torch-free).
    """

    device_width = 2

    def __init__(self, name: str) -> None:
        self.name = name

    def outputs(self) -> tuple[Output, ...]:
        return (Output(self.name, UNIT_INTERVAL, Reduce.MEAN, unit="%", weight="metric", higher_is_better=True),)


class TFValue(TFValueDecoding, Metric):
    """One value and its presence flag (two ring columns): absent where the flag is 0. Decoded by
    :class:`TFValueDecoding` (torch-free)."""

    device_width = 2

    def __init__(self, name: str, domain: Domain = ANY_FINITE, reduce: Reduce = Reduce.MEAN) -> None:
        self.name = name
        self.domain = domain
        self.reduce = reduce

    def outputs(self) -> tuple[Output, ...]:
        return (Output(self.name, self.domain, self.reduce),)


#: a Tap's metrics that the TensorFlow step measures itself (by a TensorFlow equivalent)
_MEASURED = (Loss, Accuracy, StepTime, Throughput, LearningRate, GradNorm)


@dataclasses.dataclass(frozen=True)
class TFPlan:
    """What a TensorFlow ring holds and how its rows become a block.

    Attributes:
        columns: the ring's column names, in order (each value column followed by its ``?``
            presence column where it has one).
        metrics: the metrics the block is decoded with, in layout order.
        sources: per metric, the ring columns that fill its device columns.
        unmeasured: names of the Tap's metrics that cannot be measured on TensorFlow.
    """

    columns: tuple[str, ...]
    metrics: tuple[Metric, ...]
    sources: tuple[tuple[str, ...], ...]
    unmeasured: tuple[str, ...]


def plan_for(
    tap_metrics: Sequence[Metric],
    *,
    heads: Sequence[str] = (),
    accuracy_heads: Sequence[str] = (),
    extras: Sequence[str] = (),
) -> TFPlan:
    """The ring columns and decoding metrics of a TensorFlow step for a Tap with ``tap_metrics``.

    Always: ``loss``, ``lr``, ``grad_norm``, ``step_time``, ``throughput``; ``accuracy`` (per
    head ``accuracy/<head>`` when the model has several outputs), ``loss/<head>`` per head, and the
    extras. Of the Tap's own metrics, those with no TensorFlow equivalent (memory, data wait,
    custom metrics...) are named in ``unmeasured``, to be said once; the run goes on without them.

    Example:
        >>> plan = plan_for([Loss(), Accuracy(), StepTime()], heads=("a", "b"), accuracy_heads=("a",))
        >>> [o.name for m in plan.metrics for o in m.outputs()]
        ['loss', 'lr', 'grad_norm', 'loss/a', 'loss/b', 'accuracy/a', 'step_time', 'throughput']
    """
    loss = next((m for m in tap_metrics if isinstance(m, Loss)), None) or Loss()
    metrics: list[Metric] = [loss]
    sources: list[tuple[str, ...]] = [("loss",)]
    columns: list[str] = ["loss", "samples", "skipped"]

    def value(name: str, domain: Domain = ANY_FINITE, reduce: Reduce = Reduce.MEAN) -> None:
        metrics.append(TFValue(name, domain, reduce))
        sources.append((name, f"{name}?"))
        columns.extend((name, f"{name}?"))

    value("lr", NONNEGATIVE, Reduce.MAX)
    value("grad_norm", NONNEGATIVE, Reduce.MAX)
    if len(heads) > 1:
        for head in heads:
            value(f"loss/{head}")
    named = list(accuracy_heads) if len(heads) > 1 else (["accuracy"] if accuracy_heads or not heads else [])
    for head in named:
        name = head if head == "accuracy" else f"accuracy/{head}"
        metrics.append(TFAccuracy(name))
        sources.append((f"hits/{name}", f"kept/{name}"))
        columns.extend((f"hits/{name}", f"kept/{name}"))
    for name in extras:
        value(name)
    step_time = next((m for m in tap_metrics if isinstance(m, StepTime)), None) or StepTime()
    throughput = next((m for m in tap_metrics if isinstance(m, Throughput)), None) or Throughput()
    metrics += [step_time, throughput]
    sources += [(), ()]
    unmeasured: list[str] = []
    for metric in tap_metrics:
        if not isinstance(metric, _MEASURED):
            unmeasured.extend(o.name for o in metric.outputs())
        elif isinstance(metric, Accuracy) and tuple(metric.topk) != (1,):
            unmeasured.extend(o.name for o in metric.outputs() if o.name != "accuracy")
    return TFPlan(tuple(columns), tuple(metrics), tuple(sources), tuple(unmeasured))
