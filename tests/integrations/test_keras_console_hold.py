"""batchtap's console hold beside Keras' progress bar (``integrations/_keras_console.py``), on a
real Tap and Console: no line is lost when a sink thread races the hold's end."""

from __future__ import annotations

import pytest

import batchtap as bt


def test_a_console_line_that_arrives_as_the_hold_stops_is_printed_not_kept() -> None:
    """A sink thread that took the holding ``write`` just before the hold stopped (the ``eval_*``
    line of ``evaluate()``, racing Keras' last redraw of its bar): its line is printed, never left
    in a hold nobody releases any more."""
    import io

    pytest.importorskip("keras")
    from batchtap.integrations._keras_console import ConsoleHold
    from batchtap.records import Record

    stream = io.StringIO()
    console = bt.sinks.Console(every=1, stream=stream, live=False)
    tap = bt.Tap([bt.metrics.Loss()], [console])
    with tap, tap.run(name="hold"):
        hold = ConsoleHold(tap)
        hold.start()
        late = console.write  # taken by the sink thread while the hold is on
        hold.stop()
        late([Record("r", step=0, epoch=0, batch=-1, rank=0, wall_time=0.0, values={"eval_loss": 0.5}, sparse=True)])
        assert "eval_loss 0.5000" in stream.getvalue()
