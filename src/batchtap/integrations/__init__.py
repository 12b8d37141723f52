"""Drive a :class:`~batchtap.Tap` from other training frameworks (see docs/integrations.md).

* :mod:`batchtap.integrations.lightning` — ``BatchtapCallback`` for a Lightning ``Trainer``
  (``pip install 'batchtap[lightning]'``).
* :mod:`batchtap.integrations.transformers` — ``BatchtapTrainer`` / ``BatchtapMixin`` for a Hugging
  Face ``Trainer`` (``pip install 'batchtap[transformers]'``).
* :mod:`batchtap.integrations.accelerate` — ``BatchtapTracker``, an Accelerate tracker
  (``pip install 'batchtap[accelerate]'``).
* :mod:`batchtap.integrations.callback` — ``MetricsCallback`` (``bt.MetricsCallback``), the common
  per-batch callback recipe ``cb(epoch, batch, loss, outputs, targets)`` for a hand-written loop.

Each module imports its framework when imported itself, never from here.
"""
