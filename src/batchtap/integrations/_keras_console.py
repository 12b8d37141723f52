"""batchtap's console beside Keras' progress bar: its lines are held while the bar is drawn.

Keras' progress bar (``fit(verbose=1)``, or ``"auto"``, on a terminal or a notebook) is one line
redrawn in place with ``\\r`` until the epoch ends; a batchtap console line printed meanwhile starts
a new line under the half-drawn bar, and Keras then redraws the bar below it: a broken bar per
line. So while ``fit()`` shows that bar, every :class:`~batchtap.sinks.Console` of the Tap that runs
in this process (the thread pipeline) keeps what it is handed, and prints it between bars: at the
next epoch's start (Keras has ended the bar's line by then) and when ``fit()`` ends. Nothing is
dropped, and the order stays: the console sees the same calls, later. A console printing plain
lines into the file Keras prints to (``2>&1 | tee log``) normally holds the script's text back until
its own lines of the steps before are out (``sinks/_terminal.py``); while its lines wait for the
bar's end instead, that would hold the bar itself back and splice it between the console's lines, so
the script's text goes straight out for as long as the hold lasts.

``evaluate(verbose=1, callbacks=[cb])`` outside ``fit()`` draws a bar of its own: the consoles are
held from its start, and since Keras ends that bar after every callback's ``on_test_end`` (its
progress logger is the last callback), the hold ends with the next line Keras writes to stdout (the
bar's last redraw ends its line), not in ``on_test_end``.

A console in a pipeline process (``bt.Tap(pipeline="process")``) prints from that process, out of
``fit()``'s reach: the run says so once, with the fix.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any

from batchtap.records import Event, Record, RunInfo
from batchtap.sinks.console import Console
from batchtap.tap import Tap

__all__ = ["ConsoleHold", "draws_a_bar"]

_OUT_OF_REACH = (
    "Keras draws its progress bar (fit(verbose=1)) while this Tap's Console prints from its pipeline "
    "process (pipeline='process'), which fit() cannot hold back: its lines may break the bar; fix: "
    "fit(verbose=2) (one line per epoch) or verbose=0, or pipeline='thread' (the console then prints "
    "between bars)"
)


def draws_a_bar(params: Any) -> bool:
    """Whether Keras' fit() (or evaluate()) draws its in-place progress bar on stdout
    (``verbose=1``, or ``"auto"``, which Keras' ProgbarLogger reads as 1); ``verbose=2`` prints
    whole lines, one per epoch; with Keras' interactive logging off its bar goes to absl logging."""
    verbose = (params or {}).get("verbose", 0)
    if not (verbose == "auto" or (isinstance(verbose, int) and not isinstance(verbose, bool) and verbose == 1)):
        return False
    import keras  # type: ignore[import-untyped]  # loaded: a Keras callback asks

    return bool(keras.config.is_interactive_logging_enabled())


def _in_this_process(tap: Tap) -> bool:
    """Whether the Tap's sinks run in this process: the thread pipeline, or a process pipeline
    that went on in a thread. The Tap has no public accessor for its pipeline host, and
    integrations do not import the pipeline package (tests/test_architecture.py): its class is
    recognised by name."""
    host = getattr(tap, "_pipeline", None)
    host = getattr(host, "current", None) or host  # a process pipeline's link, or its fallback thread
    return type(host).__name__ == "ThreadPipeline"


class ConsoleHold:
    """Hold the lines of a Tap's consoles from :meth:`start` on; :meth:`release` prints what was
    held, :meth:`stop` prints it and lets the consoles print as they go again.

    The consoles' ``write`` and ``end_run`` are replaced on the instances (the pipeline's sink
    threads call them); one lock keeps the held calls and the releases (training thread) in order.
    """

    def __init__(self, tap: Tap) -> None:
        self.tap = tap
        self.consoles = [s for s in tap.sinks if isinstance(s, Console)]
        self._lock = threading.RLock()
        self._held: list[tuple[Console, Sequence[Record], Sequence[Event]]] = []
        self._hooked: list[Console] = []
        self._unheld: tuple[Any, int] | None = None  # the guarded stdout whose holding was lifted

    def start(self) -> None:
        """Hold from now on (said once instead when the consoles print from another process)."""
        if not self.consoles:
            return
        if not _in_this_process(self.tap):
            self.tap.warn(_OUT_OF_REACH)
            return
        for console in self.consoles:
            if "write" in vars(console) or "end_run" in vars(console):
                continue  # already replaced on the instance (by another hold): leave it be
            console.write = self._holding_write(console)  # type: ignore[method-assign]
            console.end_run = self._releasing_end(console)  # type: ignore[method-assign]
            self._hooked.append(console)
        if self._hooked:
            self._let_script_text_through()

    def release(self) -> None:
        """Print what was held (call where Keras' bar line has ended: between epochs)."""
        with self._lock:
            held, self._held = self._held, []
            for console, records, events in held:
                type(console).write(console, records, events)

    def stop(self) -> None:
        """Print what was held and give the consoles back their own methods."""
        with self._lock:
            self.release()
            self._hold_script_text_again()
            for console in self._hooked:
                for name in ("write", "end_run"):
                    vars(console).pop(name, None)
            self._hooked.clear()

    def stop_after_line(self) -> None:
        """Stop holding right after the next write to stdout that ends a line (Keras' last redraw
        of its bar), made by whoever writes next; see the module docstring."""
        if not self._hooked:
            return
        sys.stdout = _LineWatch(sys.stdout, self._line_ended)

    def _line_ended(self, watch: _LineWatch) -> None:
        if sys.stdout is watch:
            sys.stdout = watch.inner
        self.stop()

    def _holding_write(self, console: Console) -> Any:
        def write(records: Sequence[Record], events: Sequence[Event] = ()) -> None:
            with self._lock:
                if console in self._hooked:
                    self._held.append((console, list(records), list(events)))
                    return
                # a sink thread that took this method just before the hold stopped: print, never
                # keep lines nobody releases any more
                type(console).write(console, records, events)

        return write

    def _releasing_end(self, console: Console) -> Any:
        def end_run(run: RunInfo) -> None:
            with self._lock:  # the run's last lines before its end line
                self.release()
                self._hold_script_text_again()  # as the console left it: its end_run lets go of it
                type(console).end_run(console, run)

        return end_run

    def _let_script_text_through(self) -> None:
        """The script's text (Keras' bar) goes straight out while the consoles' lines wait.

        The console's stdout guard (``sinks/_terminal.GuardedStdout``, private to the sinks
        package) is recognised by its class name and driven by its public attributes: ``holding``
        (consoles holding the script's text back) and ``release()`` (write what is held)."""
        out: Any = sys.stdout
        holding = getattr(out, "holding", 0) if type(out).__name__ == "GuardedStdout" else 0
        if holding:
            out.release()  # what was held so far, in order, first
            self._unheld = (out, holding)
            out.holding = 0

    def _hold_script_text_again(self) -> None:
        if self._unheld is not None:
            out, holding = self._unheld
            self._unheld = None
            out.holding += holding


class _LineWatch:
    """``sys.stdout`` for as long as a hold waits for a line's end: passes every write through,
    then calls ``ended`` once, after the first write holding a newline."""

    def __init__(self, inner: Any, ended: Any) -> None:
        self.inner = inner
        self._ended = ended

    def write(self, text: str) -> int:
        written = self.inner.write(text)
        if self._ended is not None and "\n" in text:
            ended, self._ended = self._ended, None
            self.inner.flush()  # the bar's line is out before the held lines
            ended(self)
        return int(written) if written is not None else len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
