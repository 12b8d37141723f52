"""``batchtap audit SCRIPT [ARGS...]``: find the host-device syncs hidden in a training script.

Runs the script in this process (``runpy``, ``sys.argv = [SCRIPT, *ARGS]``, ``__name__ ==
"__main__"``) with :class:`batchtap.hostreads.HostReadCounter` armed on the main thread, and
reports every line that read a tensor's value on the host: ``.item()``, ``float(t)``,
``if loss > x:``, ``.cpu()``, ``.tolist()``, ``.numpy()``, ``print(t)``. On a GPU each of these
makes the CPU wait until the device has finished all queued work; on the CPU the same reads are
counted, so the audit runs anywhere.

Steps are the script's calls to ``batchtap.Tap.step``; a script without a Tap gets totals.
"""

from __future__ import annotations

import argparse
import collections
import os
import runpy
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchtap.cli._common import CLIError, table

if TYPE_CHECKING:
    from batchtap.hostreads import HostRead, HostReadCounter

__all__ = ["register", "main", "Finding", "summarize", "report_lines"]

EXAMPLE = """examples:
  batchtap audit train.py --epochs 1          # ARGS after SCRIPT go to the script
  batchtap audit --check train.py             # exit 1 if any host read is found (for CI)

Each line: file:line, reads, reads per step, the op, the source. Typical fixes: keep running
sums on the device (total += loss.detach()) and read them once per epoch; replace
`if loss > x:` by a batchtap rule (bt.Threshold, bt.NonFinite); let the Tap record metrics."""


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``audit`` subcommand."""
    parser = commands.add_parser(
        "audit",
        help="run a training script and report its host-device syncs by source line",
        description="Run a Python training script with host-read counting armed and report each source line "
        "that reads a tensor value on the host (each one is a CPU-GPU sync on CUDA), with counts per step "
        "(steps = calls to batchtap's Tap.step). Works on CPU and CUDA.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when any host read is found")
    parser.add_argument("--top", type=int, default=50, metavar="N", help="list at most N source lines (default 50)")
    parser.add_argument("script", metavar="SCRIPT", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script")
    parser.set_defaults(func=main)


class Finding(collections.namedtuple("Finding", "filename lineno op count source")):
    """Host reads from one source line by one op.

    Attributes:
        filename: the file (``None``: inside torch or batchtap, no user frame found).
        lineno: line number.
        op: what read: ``item/float/bool``, ``to(cpu)``, ``copy_ to cpu``, ``Tensor.tolist``...
        count: how many times.
        source: the line's text.
    """

    __slots__ = ()


def summarize(reads: Sequence[HostRead]) -> list[Finding]:
    """Group reads by (file, line, op), most frequent first.

    Example:
        >>> from batchtap.hostreads import HostRead
        >>> r = HostRead("item/float/bool", "t.py", 3, "x.item()")
        >>> summarize([r, r, HostRead("Tensor.tolist", "t.py", 9, "y.tolist()")])[0]
        Finding(filename='t.py', lineno=3, op='item/float/bool', count=2, source='x.item()')
    """
    counts: collections.Counter[tuple[str | None, int | None, str]] = collections.Counter()
    source: dict[tuple[str | None, int | None, str], str] = {}
    for r in reads:
        key = (r.filename, r.lineno, r.op)
        counts[key] += 1
        source.setdefault(key, r.line or "")
    found = [Finding(f, n, op, c, source[(f, n, op)]) for (f, n, op), c in counts.items()]
    return sorted(found, key=lambda x: (-x.count, x.filename or "", x.lineno or 0, x.op))


def _where(f: Finding) -> str:
    if f.filename is None:
        return "<inside torch/batchtap>"
    path = f.filename
    try:
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    except ValueError:  # another drive on Windows
        pass
    return f"{path}:{f.lineno}"


def report_lines(script: str, findings: Sequence[Finding], steps: int, *, top: int = 50) -> list[str]:
    """The audit report as lines of text.

    Example:
        >>> report_lines("t.py", [], 10)[:2]
        ['batchtap audit: t.py ran 10 steps (Tap.step calls): 0 host reads', 'no host reads: nothing in this script makes the CPU wait for the device']
    """
    total = sum(f.count for f in findings)
    if steps:
        head = f"batchtap audit: {script} ran {steps} steps (Tap.step calls): {total} host reads"
        if total:
            head += f", {total / steps:.2f} per step"
    else:
        head = f"batchtap audit: {script}: {total} host reads (no Tap.step calls seen, so totals only)"
    lines = [head]
    if not findings:
        lines.append("no host reads: nothing in this script makes the CPU wait for the device")
        return lines
    rows = [
        [_where(f), str(f.count), f"{f.count / steps:.2f}" if steps else "-", f.op, f.source]
        for f in findings[: max(top, 0)]
    ]
    lines.extend(table(["file:line", "reads", "per step", "op", "source"], rows, right=[False, True, True, False, False]))
    if len(findings) > top:
        lines.append(f"... {len(findings) - top} more lines (--top N shows more)")
    lines.append(
        f"{len(findings)} source line{'s' if len(findings) != 1 else ''} read tensor values on the host; "
        "on CUDA each read waits for the GPU to finish all queued work"
    )
    return lines


@contextmanager
def _script_context(script: Path, args: Sequence[str]) -> Iterator[None]:
    """``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGS`` would set them; restored after."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        yield
    finally:
        sys.argv[:] = saved_argv
        sys.path[:] = saved_path


class _StepCount:
    """Calls to ``Tap.step`` seen, and the host reads made inside batchtap's own step code."""

    def __init__(self) -> None:
        self.steps = 0
        self.internal = 0


@contextmanager
def _counting_steps(counter: HostReadCounter) -> Iterator[_StepCount]:
    """Count calls to ``Tap.step`` while active, and take batchtap's own reads out of ``counter``.

    Tap has no step hook, and the audit must not ask users to change their script; so the method
    is wrapped for the audit's duration only and restored after, like the counter's own wrappers.

    A read made inside batchtap during a step is attributed to the user's ``tap.step(...)`` line
    (the counter skips batchtap frames). Those are the ring's one-time host-buffer views
    (``pinned.numpy()``), not device reads (tests/test_no_sync.py proves steps free of them), so
    they are moved out of the report into a count of their own. Reads in a user's own metric code
    called by the step keep their own file:line and stay in the report.
    """
    from batchtap.tap import Tap

    seen = _StepCount()
    original: Callable[..., Any] = Tap.step

    def step(self: Tap, *args: Any, **kwargs: Any) -> Any:
        seen.steps += 1
        caller = sys._getframe(1)
        where = (caller.f_code.co_filename, caller.f_lineno)
        before = len(counter.reads)
        try:
            return original(self, *args, **kwargs)
        finally:
            new = counter.reads[before:]
            keep = [r for r in new if (r.filename, r.lineno) != where]
            seen.internal += len(new) - len(keep)
            counter.reads[before:] = keep

    Tap.step = step  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        Tap.step = original  # type: ignore[method-assign]


def _run_script(script: Path) -> int:
    """Run the script as ``__main__``; returns its exit status (a traceback goes to stderr)."""
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except Exception:
        traceback.print_exc()
        return 1
    return 0


def main(args: argparse.Namespace) -> int:
    """Audit one script; returns the exit status (1 when the script failed, or with ``--check`` found reads)."""
    script = Path(args.script)
    if not script.is_file():
        raise CLIError(f"no script {args.script!r}: expected a Python file to run; fix: check the path")
    from batchtap.hostreads import HostReadCounter

    counter = HostReadCounter(locate=True)
    with _script_context(script, args.args), _counting_steps(counter) as seen:
        with counter:
            status = _run_script(script)
    sys.stdout.flush()
    findings = summarize(counter.reads)
    print()
    print("\n".join(report_lines(str(script), findings, seen.steps, top=args.top)))
    if seen.internal:
        print(f"({seen.internal} reads inside batchtap's Tap.step not listed: its one-time host-buffer setup, not device reads)")
    if status != 0:
        print(f"batchtap: note: {script} exited with status {status}; counts cover what ran", file=sys.stderr)
        return 1
    if args.check and findings:
        return 1
    return 0
