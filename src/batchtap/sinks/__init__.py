"""Sinks: where decoded records go. Each runs on its own worker thread, never on the training thread.

Example:
    >>> import batchtap as bt
    >>> sink = bt.sinks.Console(every=10)
"""

# Loaded on first use: the pipeline process imports the sinks it was handed, not every sink (and
# what each imports: the PostgreSQL sink loads the store's readers), before it answers a run's start.
from __future__ import annotations

from typing import TYPE_CHECKING

from batchtap._lazy import lazy_exports

if TYPE_CHECKING:
    from batchtap.sinks.base import Sink
    from batchtap.sinks.console import Console
    from batchtap.sinks.csv import CSV
    from batchtap.sinks.jsonl import JSONL
    from batchtap.sinks.mlflow import MLflow
    from batchtap.sinks.postgres import Postgres
    from batchtap.sinks.prometheus import Prometheus
    from batchtap.sinks.sqlite import SQLite
    from batchtap.sinks.tensorboard import TensorBoard
    from batchtap.sinks.wandb import WandB
    from batchtap.sinks.webhook import Webhook

#: public name -> the module of this package that defines it
_WHERE = {
    "Sink": "base",
    "Console": "console",
    "CSV": "csv",
    "JSONL": "jsonl",
    "MLflow": "mlflow",
    "Postgres": "postgres",
    "Prometheus": "prometheus",
    "SQLite": "sqlite",
    "TensorBoard": "tensorboard",
    "WandB": "wandb",
    "Webhook": "webhook",
}

__all__ = [
    "Sink",
    "Console",
    "JSONL",
    "CSV",
    "SQLite",
    "Postgres",
    "TensorBoard",
    "MLflow",
    "Prometheus",
    "WandB",
    "Webhook",
]


__getattr__, __dir__ = lazy_exports("batchtap.sinks", _WHERE, globals())
