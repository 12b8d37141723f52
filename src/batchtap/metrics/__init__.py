"""Metric definitions: pure device-side math plus each value's domain and reduction.

Example:
    >>> import batchtap as bt
    >>> [o.name for m in (bt.metrics.Loss(), bt.metrics.Accuracy(topk=(1, 5))) for o in m.outputs()]
    ['loss', 'accuracy', 'accuracy_top5']
"""

# Loaded on first use: the pipeline process imports the torch-free parts of this package
# (decoding, domain, the timing metrics) without loading torch through the others.
from __future__ import annotations

from typing import TYPE_CHECKING

from batchtap._lazy import lazy_exports

if TYPE_CHECKING:
    from batchtap.metrics import functional
    from batchtap.metrics.accuracy import Accuracy
    from batchtap.metrics.base import Combine, Metric, StepInputs, StepTiming
    from batchtap.metrics.defaults import default_metrics
    from batchtap.metrics.domain import ANY_FINITE, NONNEGATIVE, UNIT_INTERVAL, Domain, Output, Reduce
    from batchtap.metrics.gradients import GradNorm, LossScale
    from batchtap.metrics.histograms import Histograms
    from batchtap.metrics.layers import Layers
    from batchtap.metrics.scalars import Custom, Extra, LearningRate, Loss, Memory
    from batchtap.metrics.system import System
    from batchtap.metrics.throughput import MFU
    from batchtap.metrics.timing import DataTime, StepTime, Throughput

#: public name -> the module of this package that defines it
_WHERE = {
    "Accuracy": "accuracy",
    "Combine": "base",
    "Metric": "base",
    "StepInputs": "base",
    "StepTiming": "base",
    "default_metrics": "defaults",
    "ANY_FINITE": "domain",
    "NONNEGATIVE": "domain",
    "UNIT_INTERVAL": "domain",
    "Domain": "domain",
    "Output": "domain",
    "Reduce": "domain",
    "GradNorm": "gradients",
    "LossScale": "gradients",
    "Histograms": "histograms",
    "Layers": "layers",
    "Custom": "scalars",
    "Extra": "scalars",
    "LearningRate": "scalars",
    "Loss": "scalars",
    "Memory": "scalars",
    "System": "system",
    "MFU": "throughput",
    "DataTime": "timing",
    "StepTime": "timing",
    "Throughput": "timing",
}

__all__ = [
    "Metric",
    "StepInputs",
    "StepTiming",
    "Combine",
    "Loss",
    "Accuracy",
    "LearningRate",
    "GradNorm",
    "LossScale",
    "Layers",
    "Histograms",
    "StepTime",
    "DataTime",
    "Throughput",
    "MFU",
    "Memory",
    "System",
    "Custom",
    "Extra",
    "default_metrics",
    "Domain",
    "Output",
    "Reduce",
    "ANY_FINITE",
    "NONNEGATIVE",
    "UNIT_INTERVAL",
    "functional",
]


__getattr__, __dir__ = lazy_exports("batchtap.metrics", _WHERE, globals(), modules=("functional",))
