"""``batchtap audit SCRIPT [ARGS...]``: find the host-device syncs hidden in a training script.

Runs the script in this process (``runpy``, ``sys.argv = [SCRIPT, *ARGS]``, ``__name__ ==
"__main__"``) with :class:`batchtap.devicereads.DeviceReadTracker` armed on the main thread, and
reports every line of the user's own files that read, on the host, a tensor that would live on the
accelerator: ``.item()``, ``float(t)``, ``if loss > x:``, ``.cpu()``, ``.tolist()``, ``.numpy()``,
``print(t)``, boolean-mask indexing. On a GPU each of these makes the CPU wait until the device has
finished all queued work. On a CPU machine the tracker follows which tensors derive from the
model's parameters or from data the script moved with ``.to(device)``, so reads of host-only
tensors (numpy indexing, optimizer step counters, DataLoader seeds) are counted apart, not listed.

A read made inside a library (Lightning logging, a Trainer) is attributed to the user's line that
called into it, with the library line under it. A script that crashes gets the crash first, and
exit status 1. Steps are the script's calls to ``batchtap.Tap.step``; a script without a Tap gets
totals.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import runpy
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchtap._userframes import FrameClassifier, Kind
from batchtap.cli._common import CLIError, table

if TYPE_CHECKING:
    from batchtap.devicereads import DeviceRead

__all__ = ["register", "main", "Finding", "Outcome", "summarize", "report_lines"]

EXAMPLE = """examples:
  batchtap audit train.py --epochs 1          # ARGS after SCRIPT go to the script
  batchtap audit --check train.py             # exit 1 if any device read is found (for CI)
  batchtap audit --source src/ train.py       # your package's files count as yours too

Each line: file:line, reads, reads per step, the op, the source (and the library lines that
read on its behalf). Listed: reads of tensors that would live on the accelerator (derived from
the model's parameters or from data moved with .to(device)). Typical fixes: keep running
sums on the device (total += loss.detach()) and read them once per epoch; replace
`if loss > x:` by a batchtap rule (bt.Threshold, bt.NonFinite); let the Tap record metrics."""


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``audit`` subcommand."""
    parser = commands.add_parser(
        "audit",
        help="run a training script and report its host-device syncs by source line",
        description="Run a Python training script and report each of its source lines that reads, on the host, "
        "a tensor that would live on the accelerator (each one is a CPU-GPU sync on a GPU), with counts per step "
        "(steps = calls to batchtap's Tap.step). On a CPU machine device tensors are tracked: the model's "
        "parameters, data moved with .to(device), and everything computed from them. Works on CPU and CUDA.",
        epilog=EXAMPLE,
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when any host read of a device tensor is found")
    parser.add_argument("--top", type=int, default=50, metavar="N", help="list at most N source lines (default 50)")
    parser.add_argument(
        "--all",
        action="store_true",
        help="also list the reads of tensors that stay on the host on a GPU too (they never wait for it)",
    )
    parser.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="DIR",
        help="another folder of your own code: reads are attributed to its lines, not to your call into it "
        "(default: the script's folder only; repeatable)",
    )
    parser.add_argument("script", metavar="SCRIPT", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script")
    parser.set_defaults(func=main)


class Finding(collections.namedtuple("Finding", "filename lineno op count source via", defaults=((),))):
    """Host reads of device tensors from one of the user's source lines by one op.

    Attributes:
        filename: the user's file (``None``: no frame of the user's files was on the stack).
        lineno: line number.
        op: what read: ``item/float/bool``, ``to(cpu)``, ``copy_ to host``, ``Tensor.tolist``, ``nonzero``...
        count: how many times.
        source: the line's text.
        via: ``(library line, count)`` pairs, most frequent first: where inside a library called
            from this line the reads happened (empty when the line read the value itself).
    """

    __slots__ = ()


def summarize(reads: Sequence[DeviceRead]) -> list[Finding]:
    """Group reads by the user's line and op, most frequent first; library sites summarised under each.

    Example:
        >>> from batchtap.devicereads import DeviceRead
        >>> from batchtap._userframes import Site
        >>> r = DeviceRead("item/float/bool", True, Site("t.py", 3, "<module>", "x.item()"))
        >>> summarize([r, r])[0]
        Finding(filename='t.py', lineno=3, op='item/float/bool', count=2, source='x.item()', via=())
    """
    counts: collections.Counter[tuple[str | None, int | None, str]] = collections.Counter()
    source: dict[tuple[str | None, int | None, str], str] = {}
    via: dict[tuple[str | None, int | None, str], collections.Counter[str]] = collections.defaultdict(
        collections.Counter
    )
    for r in reads:
        key = (r.user.filename, r.user.lineno, r.op) if r.user else (None, None, r.op)
        counts[key] += 1
        source.setdefault(key, r.user.text if r.user else "")
        if r.via is not None:
            via[key][f"{_library_file(r.via.filename)}:{r.via.lineno} ({r.via.function})"] += 1
    found = [
        Finding(f, n, op, c, source[(f, n, op)], tuple(via[(f, n, op)].most_common()))
        for (f, n, op), c in counts.items()
    ]
    return sorted(found, key=lambda x: (-x.count, x.filename or "", x.lineno or 0, x.op))


def _library_file(path: str) -> str:
    """``.../site-packages/torch/optim/adamw.py`` -> ``torch/optim/adamw.py``."""
    parts = path.replace(os.sep, "/").split("/")
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(marker) :])
    return path


def _relative(path: str) -> str:
    """``path`` relative to the working folder when it lies below it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return path
    return rel if not rel.startswith("..") else path


def _where(f: Finding) -> str:
    if f.filename is None:
        return "<no line of yours>"
    return f"{_relative(f.filename)}:{f.lineno}"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How the audited script ended.

    Attributes:
        status: its exit status (0: it finished).
        crash: ``"RuntimeError: boom at train.py:3"`` when it raised, else ``None``.
    """

    status: int = 0
    crash: str | None = None


def _table(findings: Sequence[Finding], steps: int, top: int) -> list[str]:
    rows: list[list[str]] = []
    for f in findings[: max(top, 0)]:
        rows.append([_where(f), str(f.count), f"{f.count / steps:.2f}" if steps else "-", f.op, f.source])
        for site, n in f.via[:3]:
            rows.append(["", "", "", "", f"  via {site}: {n}"])
        if len(f.via) > 3:
            rows.append(["", "", "", "", f"  via {len(f.via) - 3} more library lines: {sum(n for _, n in f.via[3:])}"])
    lines = list(
        table(["file:line", "reads", "per step", "op", "source"], rows, right=[False, True, True, False, False])
    )
    if len(findings) > top:
        lines.append(f"... {len(findings) - top} more lines (--top N shows more)")
    return lines


def report_lines(
    script: str,
    findings: Sequence[Finding],
    steps: int,
    *,
    top: int = 50,
    outcome: Outcome = Outcome(),
    host_only: Sequence[Finding] = (),
    show_host_only: bool = False,
    internal: int = 0,
    internal_device: int = 0,
) -> list[str]:
    """The audit report as lines of text: a crash first, then the device reads by line.

    Args:
        script: the script's name as given.
        findings: host reads of device tensors (the ones that sync on a GPU), from :func:`summarize`.
        steps: calls to ``Tap.step`` seen (0: totals only).
        top: list at most this many lines.
        outcome: how the script ended.
        host_only: reads of tensors that stay on the host on a GPU too (counted; listed with ``show_host_only``).
        show_host_only: list ``host_only`` in a table of its own (``--all``).
        internal: reads made inside batchtap's own code (not listed).
        internal_device: how many of those read device tensors.

    Example:
        >>> report_lines("t.py", [], 10)[:2]
        ['batchtap audit: t.py ran 10 steps (Tap.step calls): 0 host reads of device tensors', 'no host reads of device tensors: nothing in this script makes the CPU wait for the device']
    """
    lines: list[str] = []
    if outcome.crash is not None:
        lines.append(f"batchtap audit: {script} CRASHED: {outcome.crash} (traceback above)")
        lines.append("the counts below cover only what ran before the crash")
    elif outcome.status != 0:
        lines.append(f"batchtap audit: {script} exited with status {outcome.status}; the counts below cover what ran")
    total = sum(f.count for f in findings)
    if steps:
        head = f"batchtap audit: {script} ran {steps} steps (Tap.step calls): {total} host reads of device tensors"
        if total:
            head += f", {total / steps:.2f} per step"
    else:
        head = (
            f"batchtap audit: {script}: {total} host reads of device tensors (no Tap.step calls seen, so totals only)"
        )
    lines.append(head)
    if not findings:
        if outcome.crash is None and outcome.status == 0:
            lines.append("no host reads of device tensors: nothing in this script makes the CPU wait for the device")
        else:
            lines.append("no host reads of device tensors before it stopped")
    else:
        lines.extend(_table(findings, steps, top))
        lines.append(
            f"{len(findings)} source line{'s' if len(findings) != 1 else ''} read device tensors on the host; "
            "on a GPU each read waits for it to finish all queued work"
        )
    other = sum(f.count for f in host_only)
    if show_host_only and host_only:
        lines.append(
            f"host-only tensors ({other} reads; these stay on the host on a GPU too, so they never wait for it):"
        )
        lines.extend(_table(host_only, steps, top))
    elif other:
        lines.append(
            f"({other} more reads of tensors that stay on the host on a GPU too - data indexing, optimizer step "
            "counters, seeds - not listed: they never wait for the device; --all lists them)"
        )
    if internal and not internal_device:
        lines.append(f"({internal} reads inside batchtap itself not listed: none of a device tensor)")
    elif internal:
        lines.append(
            f"({internal} reads inside batchtap itself not listed, {internal_device} of device tensors: "
            "batchtap's own labelled sync points and copies into its host buffers)"
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


@contextmanager
def _counting_steps() -> Iterator[list[int]]:
    """Count calls to ``Tap.step`` while active (``[count]``).

    Tap has no step hook, and the audit must not ask users to change their script; so the method
    is wrapped for the audit's duration only and restored after, like the tracker's own wrappers.
    """
    from batchtap.tap import Tap

    seen = [0]
    original: Callable[..., Any] = Tap.step

    def step(self: Tap, *args: Any, **kwargs: Any) -> Any:
        seen[0] += 1
        return original(self, *args, **kwargs)

    Tap.step = step  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        Tap.step = original  # type: ignore[method-assign]


def _crash_site(exc: BaseException, classifier: FrameClassifier) -> str:
    """The innermost line of the traceback in the user's files (else the innermost line at all)."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if classifier.kind(f.filename) is Kind.USER]
    chosen = mine or list(frames)
    if not chosen:
        return ""
    return f" at {_relative(chosen[-1].filename)}:{chosen[-1].lineno}"


def _run_script(script: Path, classifier: FrameClassifier) -> Outcome:
    """Run the script as ``__main__``; how it ended (a traceback goes to stderr)."""
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            return Outcome()
        if isinstance(code, int):
            return Outcome(code)
        print(code, file=sys.stderr)
        return Outcome(1)
    except BaseException as exc:  # KeyboardInterrupt included: the report still says what ran
        traceback.print_exc()
        first = (str(exc).splitlines() or [""])[0]
        return Outcome(1, f"{type(exc).__name__}{': ' + first if first else ''}{_crash_site(exc, classifier)}")
    return Outcome()


def main(args: argparse.Namespace) -> int:
    """Audit one script; returns the exit status (1 when the script failed, or with ``--check`` found reads)."""
    script = Path(args.script)
    if not script.is_file():
        raise CLIError(f"no script {args.script!r}: expected a Python file to run; fix: check the path")
    roots = [str(script.resolve().parent), *args.source]
    for root in args.source:
        if not Path(root).is_dir():
            raise CLIError(
                f"--source {root!r} is not a folder: expected a folder of your own code; fix: check the path"
            )
    from batchtap.devicereads import DeviceReadTracker
    from batchtap.devicereads import __file__ as tracker_file

    classifier = FrameClassifier(roots, plumbing=[tracker_file])
    tracker = DeviceReadTracker(classifier)
    with _script_context(script, args.args), _counting_steps() as steps:
        with tracker:
            outcome = _run_script(script, classifier)
    sys.stdout.flush()
    mine = [r for r in tracker.reads if not r.in_batchtap]
    internal = [r for r in tracker.reads if r.in_batchtap]
    findings = summarize([r for r in mine if r.device])
    host_only = summarize([r for r in mine if not r.device])
    print()
    print(
        "\n".join(
            report_lines(
                str(script),
                findings,
                steps[0],
                top=args.top,
                outcome=outcome,
                host_only=host_only,
                show_host_only=args.all,
                internal=len(internal),
                internal_device=sum(r.device for r in internal),
            )
        )
    )
    if outcome.status != 0:
        return 1
    if args.check and findings:
        return 1
    return 0
