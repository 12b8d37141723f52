"""What a terminal shows for a stream of output: a small emulator of the controls batchtap writes.

``\\r`` returns to column 0, ``\\n`` goes down a line at column 0 (a terminal's ``onlcr``), text
overwrites, a line longer than the width wraps (when a width is given), ``ESC[nA`` moves up,
``ESC[nF`` up to column 0, ``ESC[K`` clears to the end of the line and ``ESC[J`` to the end of the
screen. Any other control sequence fails the test: it would be noise on some terminal.
"""

from __future__ import annotations

import re

_CSI = re.compile(r"\x1b\[(\d*)([AFKJ])")


class Screen:
    """A terminal of ``columns`` (None: unbounded, nothing wraps) and unbounded height."""

    def __init__(self, columns: int | None = None) -> None:
        self.columns = columns
        self.rows: list[list[str]] = [[]]
        self.row = 0
        self.col = 0

    def _put(self, ch: str) -> None:
        if self.columns is not None and self.col >= self.columns:
            self._down()
        line = self.rows[self.row]
        while len(line) < self.col:
            line.append(" ")
        if self.col < len(line):
            line[self.col] = ch
        else:
            line.append(ch)
        self.col += 1

    def _down(self) -> None:
        self.row += 1
        self.col = 0
        if self.row == len(self.rows):
            self.rows.append([])

    def feed(self, text: str) -> Screen:
        i = 0
        while i < len(text):
            ch = text[i]
            if ch == "\x1b":
                m = _CSI.match(text, i)
                assert m, f"unexpected escape sequence at {text[i : i + 12]!r}"
                n = int(m.group(1) or 1)
                op = m.group(2)
                if op in "AF":
                    self.row = max(0, self.row - n)
                    if op == "F":
                        self.col = 0
                elif op == "K":
                    del self.rows[self.row][self.col :]
                elif op == "J":
                    del self.rows[self.row][self.col :]
                    del self.rows[self.row + 1 :]
                i = m.end()
                continue
            if ch == "\r":
                self.col = 0
            elif ch == "\n":
                self._down()
            else:
                assert ch >= " " or ch == "\t", f"unexpected control character {ch!r}"
                self._put(ch)
            i += 1
        return self

    def lines(self) -> list[str]:
        """The screen's lines, trailing blanks dropped, without an empty last line."""
        out = ["".join(r).rstrip() for r in self.rows]
        if out and out[-1] == "" and self.col == 0:
            out.pop()
        return out


def render(raw: str, columns: int | None = None) -> list[str]:
    """The lines a terminal of ``columns`` shows for ``raw``."""
    return Screen(columns).feed(raw).lines()
