"""One terminal, two writers: the training script's own prints and batchtap's console output.

A progress bar is a line without its newline at the bottom of the terminal. A ``print()`` from the
script (``sys.stdout``) while the bar is drawn would land on the bar's line, and a bar or a
batchtap line drawn while the script's line is unfinished (``print("a", end="")``, or between the
two writes of one ``print``) would land on the script's line. :data:`SCREEN` arbitrates:

* while a :class:`~batchtap.sinks.Console` shows a bar, ``sys.stdout`` is wrapped by
  :class:`GuardedStdout`, which hides the bars before the script's text, flushes it, and draws
  them again once the script's line is complete;
* the console draws and prints only under :data:`SCREEN` ``.lock``, never while the script's line
  is unfinished (a batchtap line then starts on a new line).

Where the console prints plain lines into the file the script prints to, the guard also holds the
script's text back (at most 2 s) until the console's lines of the steps before it are out, so the
two come out in the order they happened (:func:`hold_script_stdout`).

A closed stdout (``python train.py | head``: the reader went away) must not fail training: the
guard drops the script's text from then on instead of raising ``BrokenPipeError`` into the
training loop (:func:`drop_broken`), as the console does with its own stream.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

__all__ = [
    "SCREEN",
    "GuardedStdout",
    "guard_stdout",
    "unguard_stdout",
    "flush_script_stdout",
    "real_stream",
    "terminal_width",
    "reported_width",
    "drop_broken",
    "is_closed_error",
    "hold_script_stdout",
    "unhold_script_stdout",
    "release_script_stdout",
    "same_file",
]


class _Screen:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        #: (hide, show) of every bar on screen
        self.bars: dict[int, tuple[Callable[[], None], Callable[[], None]]] = {}
        self.guards = 0

    @property
    def mid_line(self) -> bool:
        """The script's stdout holds text after its last newline. Kept by the guard of the
        ``sys.stdout`` in place now, so a stream swapped in since (a test's capture) starts clean."""
        out = sys.stdout
        return isinstance(out, GuardedStdout) and out.mid_line

    @mid_line.setter
    def mid_line(self, value: bool) -> None:
        out = sys.stdout
        if isinstance(out, GuardedStdout):
            out.mid_line = value

    def hide_bars(self) -> None:
        for hide, _ in self.bars.values():
            hide()

    def show_bars(self) -> None:
        if not self.mid_line:
            for _, show in self.bars.values():
                show()


SCREEN = _Screen()


class GuardedStdout:
    """``sys.stdout`` as the script sees it while a bar is shown: every write goes to the real
    stream between hiding the bars and showing them again (once the line is complete).

    Example:
        >>> import io
        >>> real = io.StringIO()
        >>> out = GuardedStdout(real)
        >>> out.write("epoch done\\n"), real.getvalue()
        (11, 'epoch done\\n')
    """

    #: seconds the script's text is held back at most (see :func:`hold_script_stdout`)
    max_hold = 2.0

    def __init__(self, wrapped: IO[str]) -> None:
        self.wrapped = wrapped
        self.mid_line = False
        #: the reader of the stream went away: what the script prints is dropped from then on
        self.broken = False
        #: consoles printing plain lines to the same file that asked to hold the script's text
        self.holding = 0
        #: the script's text not written yet, each with the ``time.time()`` it was printed at
        self.held: list[tuple[float, str]] = []
        self._timer: threading.Timer | None = None

    def write(self, text: str) -> int:
        with SCREEN.lock:
            if self.holding and text:
                self.held.append((time.time(), text))
                self._arm()
                return len(text)
            return self._write_now(text)

    def release(self, before: float | None = None) -> None:
        """Write the held text printed before ``before`` (a ``time.time()``; None: all), in order."""
        with SCREEN.lock:
            if not self.held:
                return
            while self.held and (before is None or self.held[0][0] < before):
                self._write_now(self.held.pop(0)[1])
            self.flush()

    def _arm(self) -> None:
        """Release what is held at the latest ``max_hold`` seconds after it was printed, even when
        no console line comes (a long evaluation after a print)."""
        if self._timer is None and self.held:
            delay = max(0.0, self.held[0][0] + self.max_hold - time.time())
            self._timer = threading.Timer(delay, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _expire(self) -> None:
        with SCREEN.lock:
            self._timer = None
            self.release(before=time.time() - self.max_hold + 1e-3)
            self._arm()

    def _write_now(self, text: str) -> int:
        with SCREEN.lock:
            if SCREEN.bars and not self.mid_line:
                SCREEN.hide_bars()
            try:
                n = self.wrapped.write(text)
                if SCREEN.bars:
                    self.wrapped.flush()  # on the terminal before a bar is drawn below it
            except (OSError, ValueError) as e:
                if not is_closed_error(e):
                    raise
                self._break()
                n = len(text)
            if text:
                self.mid_line = not text.endswith("\n")
            if SCREEN.bars:
                SCREEN.show_bars()
            return n

    def flush(self) -> None:  # what is held stays held: its order against batchtap's lines matters more
        try:
            self.wrapped.flush()
        except (OSError, ValueError) as e:
            if not is_closed_error(e):
                raise
            self._break()

    def _break(self) -> None:
        self.broken = True
        drop_broken(self.wrapped)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, buffer...: the real stream's
        return getattr(self.wrapped, name)


def guard_stdout() -> None:
    """Wrap ``sys.stdout`` (once, however many consoles ask)."""
    with SCREEN.lock:
        SCREEN.guards += 1
        if not isinstance(sys.stdout, GuardedStdout):
            sys.stdout = GuardedStdout(sys.stdout)  # type: ignore[assignment]


def unguard_stdout() -> None:
    """Undo :func:`guard_stdout` when the last console is done (unless someone wrapped it since)."""
    with SCREEN.lock:
        SCREEN.guards = max(0, SCREEN.guards - 1)
        if SCREEN.guards == 0 and isinstance(sys.stdout, GuardedStdout):
            sys.stdout.release()  # nothing the script printed stays behind
            sys.stdout = sys.stdout.wrapped  # type: ignore[assignment]


def hold_script_stdout() -> None:
    """Hold the script's prints back until batchtap's lines of the steps before them are written
    (:meth:`GuardedStdout.release`; at most :attr:`GuardedStdout.max_hold` seconds).

    A console printing plain lines into the file the script prints to (``2>&1 | tee log``, a log
    file, a terminal too narrow to draw on) shows each step a flush after it ran: without this, an
    epoch's ``print`` would come out above that epoch's last batch lines.
    """
    with SCREEN.lock:
        out = sys.stdout
        if isinstance(out, GuardedStdout):
            out.holding += 1


def unhold_script_stdout() -> None:
    """Write everything held and stop holding (when the last console that held is done)."""
    with SCREEN.lock:
        out = sys.stdout
        if isinstance(out, GuardedStdout) and out.holding:
            out.release()
            out.holding -= 1


def release_script_stdout(before: float) -> None:
    """Write the script's text held since before ``before`` (the wall time of the step a console
    is about to print)."""
    out = sys.stdout
    if isinstance(out, GuardedStdout):
        out.release(before)


def same_file(a: IO[str], b: IO[str]) -> bool:
    """Whether two streams write into the same file, pipe or terminal."""
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def flush_script_stdout() -> None:
    """Push the script's buffered stdout out before batchtap writes a line (call under the lock).

    Redirected to a file (``python train.py > log 2>&1``) stdout is block-buffered: without this, a
    buffer boundary in the middle of the script's line would put batchtap's line inside it.
    """
    out = sys.stdout
    if isinstance(out, GuardedStdout):
        try:
            out.wrapped.flush()
        except (OSError, ValueError):  # closed or broken: nothing of it can reach the screen anyway
            pass


def is_closed_error(error: BaseException) -> bool:
    """The stream's reader is gone (EPIPE) or the file object was closed: nothing written to it
    can be read by anyone."""
    if isinstance(error, ValueError):
        return "closed file" in str(error)
    return isinstance(error, OSError) and error.errno in (errno.EPIPE, errno.ECONNRESET)


def drop_broken(stream: IO[str]) -> None:
    """Point a stream whose reader went away at ``/dev/null``, so that what is still buffered,
    later prints and the interpreter's flush at exit are dropped instead of raising
    ``BrokenPipeError`` (what the Python documentation recommends for ``| head``)."""
    try:
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError, AttributeError):  # no file descriptor (a StringIO), or closed
        return
    try:
        os.dup2(devnull, fd)
    except OSError:
        pass
    finally:
        os.close(devnull)


def reported_width(stream: IO[str]) -> int | None:
    """Columns the terminal behind ``stream`` reports (``$COLUMNS`` first, when set), 0 included;
    None when nothing tells (not a terminal, no file descriptor)."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return None


def terminal_width(stream: IO[str], fallback: int = 80) -> int:
    """Columns of the terminal behind ``stream``; ``fallback`` when it does not tell or reports 0."""
    columns = reported_width(stream)
    return columns if columns else fallback


def real_stream(stream: IO[str]) -> IO[str]:
    """The stream under a :class:`GuardedStdout` (the console writes there, under the lock)."""
    return stream.wrapped if isinstance(stream, GuardedStdout) else stream
