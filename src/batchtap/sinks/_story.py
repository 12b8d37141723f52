"""What the console prints of a run's events: one line per step and kind, one rollback as one
line, skipped steps summed up per ``every`` steps, a warning said once; and the counts of what it
did not print (see :class:`batchtap.sinks.Console`)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from batchtap.records import Event, EventKind

__all__ = ["Story", "event_lines", "MESSAGES_PER_LINE", "HOLD_WRITES"]

#: One line: (step, order within the step, wall time, text); the console sorts by the first two.
Line = tuple[int, int, float, str]


def _without_step(message: str, step: int) -> str:
    """The message without its own mention of the step, which the line names once."""
    return re.sub(rf"\s+at step {step}\b", "", re.sub(rf"^step {step}: ", "", message))


#: Messages of one step and kind printed on its line at most; the rest are counted ("and 4 more").
MESSAGES_PER_LINE = 4

# How a rollback's events read (recovery/actions.py and recovery/rollback.py write them): the
# action that restored a snapshot, the batches it skipped afterwards, and each decision about the
# abandoned trajectory that it ignored.
_ROLLBACK = re.compile(r"^rollback \d+: (?!skipped batches)")
_ROLLBACK_SKIPPED = re.compile(r"^rollback \d+: skipped batches")
_IGNORED = re.compile(r"^ignored .* a rollback abandoned that trajectory")
_UNDONE = re.compile(r"undone steps (\d+)\.\.(\d+)")
_ASKS_ROLLBACK = re.compile(r" -> (?:\w+, )*rollback(?:, \w+)*$")  # the rule's actions end its message
#: Writes an anomaly that asked for a rollback waits for the rollback's action before it is
#: printed alone (the action comes one or two flushes later; a decision the rollback ignored never
#: brings one).
HOLD_WRITES = 2


def _told_by(event: Event, undone: tuple[int, int] | None) -> bool:
    """Whether a rollback's line tells this anomaly: the one that asked for it, or one of the
    steps it undid (``undone``: first and last)."""
    if event.kind is not EventKind.ANOMALY:
        return False
    if _ASKS_ROLLBACK.search(event.message):
        return True
    return undone is not None and undone[0] <= event.step <= undone[1]


def event_lines(events: Sequence[Event]) -> list[tuple[Event, int, str]]:
    """One line per step and kind, in step order: ``(first event, events in it, line)``.

    A NaN at one step raises an anomaly per value it poisons, each message naming the step: they
    become one line that names the step once (at most :data:`MESSAGES_PER_LINE` messages, then a
    count: a line stays readable however many values one step poisons).
    """
    groups: dict[tuple[int, EventKind], list[Event]] = {}
    for event in sorted(events, key=lambda e: e.step):  # stable: same-step events keep their order
        groups.setdefault((event.step, event.kind), []).append(event)
    out = []
    for (step, kind), group in groups.items():
        messages = list(dict.fromkeys(_without_step(e.message, step) for e in group))
        more = len(messages) - MESSAGES_PER_LINE
        text = "; ".join(messages[:MESSAGES_PER_LINE]) + (f"; and {more} more" if more > 0 else "")
        label = "rollback" if kind is EventKind.ACTION and _ROLLBACK.match(group[0].message) else kind.value
        if label == "rollback":
            text = re.sub(r"^rollback \d+: ", "", text)
        out.append((group[0], len(group), f"batchtap {label} at step {step}: {text}"))
    return out


class Story:
    """The events of a run as the console tells them, and the counts for its last line.

    Args:
        every: the console's ``every``: skipped steps are summed up per this many steps.
        max_lines: anomaly lines (and skip lines) printed per run before they are only counted.
    """

    def __init__(self, every: int, max_lines: int) -> None:
        self.every = every
        self.max_lines = max_lines
        self.anomalies = 0
        self._anomaly_lines = 0
        self.skips = 0
        self._skip_lines = 0
        self._skip_windows: dict[int, list[Event]] = {}  # first step of an `every`-step window -> its skips
        self._held: list[tuple[int, Event]] = []  # (writes waited, anomaly) awaiting its rollback's line
        self._acted_through = -1  # an anomaly at or before this step came after its action: counted only
        self.rollbacks = 0
        self._after_action = 0  # anomalies (and ignored decisions) counted into an action's story
        self._said: set[str] = set()  # warnings and notes printed this run

    def lines(self, events: Sequence[Event], last_step: int | None) -> list[Line]:
        """The lines of one write's events, given the last step its records reach (``None`` at the
        run's end: whatever still waits comes out)."""
        if last_step is None:
            events = [*(e for _, e in self._held), *events]
            self._held = []
        out = [
            (event.step, 0, event.wall_time, line)
            for event, count, line in event_lines(self._shown(events, last_step) if last_step is not None else events)
            if self._counted(event.kind, count)
        ]
        return out + self._skip_lines_due(last_step)

    def counts(self, run_id: str) -> str:
        """The counts for the run's last line, and where the events not printed can be read."""
        skips = f"; skipped steps: {self.skips}" if self.skips else ""
        rollbacks = f"; rollbacks: {self.rollbacks}" if self.rollbacks else ""
        unprinted = self._after_action + max(0, self._anomaly_lines - self.max_lines)
        details = f" (`batchtap show {run_id[:8]}` lists every event)" if unprinted else ""
        return f"anomalies: {self.anomalies}{skips}{rollbacks}{details}"

    def _counted(self, kind: EventKind, count: int) -> bool:
        """Count ``count`` events of ``kind``; whether their line is still printed."""
        if kind is EventKind.ANOMALY:
            self.anomalies += count
            self._anomaly_lines += 1
            return self._anomaly_lines <= self.max_lines
        return True

    def _shown(self, events: Sequence[Event], last_step: int | None) -> list[Event]:
        """The events of one write that get a line, in step order; the rest counted.

        A rollback's anomaly waits (at most :data:`HOLD_WRITES` writes) for the rollback's line and
        is told inside it; anomalies at or before a printed action's step, and the decisions a
        rollback ignored, are counted into its story; the batches it skipped are in its line
        already ("skipping the next 3 batches"); skipped steps wait for their window's summary; a
        warning or note already printed this run is not printed again.
        """
        held, self._held = self._held, []
        shown: list[Event] = []
        for event in sorted([e for _, e in held] + list(events), key=lambda e: e.step):
            kind = event.kind
            if kind is EventKind.SKIP:
                self.skips += 1
                start = event.step - event.step % self.every
                self._skip_windows.setdefault(start, []).append(event)
            elif kind is EventKind.ACTION and _IGNORED.match(event.message):
                self._after_action += 1
            elif kind is EventKind.ACTION and _ROLLBACK_SKIPPED.match(event.message):
                continue
            elif kind is EventKind.ACTION:
                undone = _UNDONE.search(event.message)
                self._acted_through = max(self._acted_through, event.step, int(undone[2]) if undone else -1)
                if _ROLLBACK.match(event.message):
                    self.rollbacks += 1

                    # Its anomaly is told in its line (the divergence it names), and so are the
                    # anomalies of the steps it undid: counted, not shown.
                    span = (int(undone[1]), int(undone[2])) if undone else None
                    self.anomalies += sum(1 for e in shown if _told_by(e, span))
                    shown = [e for e in shown if not _told_by(e, span)]
                shown.append(event)
            elif kind is EventKind.ANOMALY and event.step <= self._acted_through:
                self.anomalies += 1  # it came after the action that followed it
                self._after_action += 1
            elif kind is EventKind.ANOMALY and _ASKS_ROLLBACK.search(event.message):
                shown.append(event)
            elif kind in (EventKind.WARNING,) or kind.value == "info":
                said = _without_step(event.message, event.step)
                if said not in self._said:
                    self._said.add(said)
                    shown.append(event)
            else:
                shown.append(event)
        # A rollback's anomaly still without its action waits for the next write (bounded), and
        # so do the anomalies after it (the trajectory the rollback will abandon).
        waits = {id(e): n for n, e in held}
        asks = [e.step for e in shown if e.kind is EventKind.ANOMALY and _ASKS_ROLLBACK.search(e.message)]
        pivot = min(asks) if asks else None
        out = []
        for event in shown:
            if event.kind is EventKind.ANOMALY and pivot is not None and event.step >= pivot:
                n = waits.get(id(event), 0)
                if n < HOLD_WRITES:
                    self._held.append((n + 1, event))
                    continue
            out.append(event)
        return out

    def _skip_lines_due(self, last_step: int | None) -> list[tuple[int, int, float, str]]:
        """One summary line per ``every``-step window of skipped steps that has ended (all of them
        at the run's end, ``last_step=None``)."""
        lines = []
        for start in sorted(self._skip_windows):
            end = start + self.every - 1
            if last_step is not None and end > last_step:
                continue
            skipped = self._skip_windows.pop(start)
            self._skip_lines += 1
            if self._skip_lines > self.max_lines:
                continue
            first = skipped[0]
            what = _without_step(first.message, first.step)
            span = f"step {start}" if self.every == 1 else f"{start}..{end}"
            lines.append(
                (
                    min(end, max(e.step for e in skipped)),
                    0,
                    first.wall_time,
                    f"batchtap skip: {len(skipped)} step{'s' if len(skipped) > 1 else ''} skipped in {span} ({what})",
                )
            )
        return lines
