"""Metric definitions: pure device-side math plus each value's domain and reduction.

Example:
    >>> import batchtap as bt
    >>> [o.name for m in (bt.metrics.Loss(), bt.metrics.Accuracy(topk=(1, 5))) for o in m.outputs()]
    ['loss', 'accuracy', 'accuracy_top5']
"""

from batchtap.metrics import functional
from batchtap.metrics.accuracy import Accuracy
from batchtap.metrics.base import Combine, Metric, StepInputs, StepTiming
from batchtap.metrics.defaults import default_metrics
from batchtap.metrics.domain import ANY_FINITE, NONNEGATIVE, UNIT_INTERVAL, Domain, Output, Reduce
from batchtap.metrics.gradients import GradNorm, LossScale
from batchtap.metrics.layers import Layers
from batchtap.metrics.scalars import Custom, Extra, LearningRate, Loss, Memory
from batchtap.metrics.system import System
from batchtap.metrics.throughput import MFU
from batchtap.metrics.timing import DataTime, StepTime, Throughput

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
