"""Sinks: where decoded records go. Each runs on its own worker thread, never on the training thread.

Example:
    >>> import batchtap as bt
    >>> sink = bt.sinks.Console(every=10)
"""

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
