"""The run/metric/event store shared by the SQL sinks and the CLI's readers.

* :func:`open` — read a store (SQLite path, ``sqlite:///path`` or ``postgresql://...``).
* :mod:`batchtap.store.schema` — the schema, rendered per SQL dialect, and its migrations.

Example:
    >>> import batchtap.store
    >>> batchtap.store.SCHEMA_VERSION
    3
"""

from __future__ import annotations

from batchtap.store.errors import MetricNotFound, RunNotFound, StoreError
from batchtap.store.reader import MetricSummary, Point, RunRow, Store, open
from batchtap.store.schema import SCHEMA_VERSION
from batchtap.store.url import StoreURL, parse_url, redact_dsn

__all__ = [
    "open",
    "Store",
    "RunRow",
    "Point",
    "MetricSummary",
    "StoreError",
    "RunNotFound",
    "MetricNotFound",
    "StoreURL",
    "parse_url",
    "redact_dsn",
    "SCHEMA_VERSION",
]
