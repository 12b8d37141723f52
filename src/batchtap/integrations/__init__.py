"""Callbacks that drive a :class:`~batchtap.Tap` from other training frameworks.

* :mod:`batchtap.integrations.lightning` — ``BatchtapCallback`` for a Lightning ``Trainer``
  (``pip install 'batchtap[lightning]'``).

Each module imports its framework when imported itself, never from here.
"""
