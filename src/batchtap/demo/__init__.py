"""The demo's model, data and training loop (``batchtap demo``, and the model the benchmarks train).

:mod:`batchtap.demo.digits` imports torch; this package itself imports nothing, so the command line
can name it without loading torch. The demo uses batchtap's public API only (``import batchtap as bt``),
the way a user's script does.
"""

from __future__ import annotations

__all__: list[str] = []
