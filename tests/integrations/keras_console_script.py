"""A keras.io-style ``fit(verbose=1)`` with BatchtapCallback and a Tap whose Console prints plain
lines into the same stdout as Keras' progress bar; batches slowed down so the console's lines are
due while the bar is drawn. Writes the run's events as JSON to OUT; the caller reads stdout.

    KERAS_BACKEND=torch python tests/integrations/keras_console_script.py OUT thread|process|evaluate

``evaluate``: ``evaluate(verbose=1, callbacks=[cb])`` in a run before any training step (its logged
values print at once then), whose test batches are slow and each log a value: console lines due
mid-bar, and the ``eval_*`` line logged just before Keras ends its bar.

The events come from a sink beside the console (thread pipeline) or, under ``pipeline="process"``
(whose sinks must pickle), from batchtap's log.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import batchtap as bt  # noqa: E402
from batchtap.integrations.keras import BatchtapCallback  # noqa: E402

BATCH, BATCHES, EPOCHS = 16, 8, 2


class Slow(keras.callbacks.Callback):  # type: ignore[misc]
    """A training batch that takes a while, as a real one does: the console's lines fall due mid-bar."""

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        time.sleep(0.15)


class SlowTest(keras.callbacks.Callback):  # type: ignore[misc]
    """A slow evaluation batch that logs a value of its own (a user's callback): a console line due
    while evaluate()'s bar is drawn."""

    def __init__(self, tap: bt.Tap) -> None:
        super().__init__()
        self.tap = tap

    def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
        self.tap.log({f"probe_{batch}": float(batch)})
        time.sleep(0.15)


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(BATCH * BATCHES, 6)).astype("float32"), rng.integers(0, 3, BATCH * BATCHES)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(keras.optimizers.SGD(0.05), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    events: list[Any] = []

    class Events(bt.sinks.Sink):
        def write(self, records: Any, evs: Any = ()) -> None:
            events.extend({"kind": e.kind.value, "message": e.message} for e in evs)

    console = bt.sinks.Console(every=1, stream=sys.stdout, live=False)
    sinks: list[Any] = [console] if mode == "process" else [console, Events()]
    tap = bt.Tap(sinks=sinks, flush_every=1, flush_seconds=0.01, pipeline="process" if mode == "process" else "thread")
    with tap.run(name="console"):
        if mode == "evaluate":
            model.evaluate(x, y, batch_size=BATCH, verbose=1, callbacks=[SlowTest(tap), BatchtapCallback(tap)])
            print("after evaluate")
        else:
            model.fit(
                x,
                y,
                batch_size=BATCH,
                epochs=EPOCHS,
                shuffle=False,
                verbose=1,
                callbacks=[Slow(), BatchtapCallback(tap)],
            )
        if mode == "process":
            events.extend({"kind": "warning", "message": m} for m in _warned)
    tap.close()
    with open(out, "w") as f:
        json.dump(events, f)


_warned: list[str] = []


if __name__ == "__main__":
    import logging

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            _warned.append(record.getMessage())

    logging.getLogger("batchtap").addHandler(_Keep())
    main()
