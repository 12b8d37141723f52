"""Drawing shared by ``batchtap plot`` and ``batchtap compare``: sizes, smoothing, markers.

matplotlib is imported inside the functions that draw (Agg backend, no display needed), so
importing this module costs nothing.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from batchtap.cli._common import CLIError, add_metrics_option
from batchtap.records import Event

if TYPE_CHECKING:
    from batchtap.store import Point

__all__ = [
    "parse_size",
    "smooth",
    "epoch_spans",
    "new_figure",
    "save",
    "draw_events",
    "add_size_arguments",
    "x_of",
    "anomaly_y",
    "robust_limits",
    "ANOMALY_COLOR",
    "ACTION_COLOR",
    "LOGGED_COLOR",
]

#: Anomaly markers: a pure red that the curves' default colours never use.
ANOMALY_COLOR = "#ff0000"
#: Action lines.
ACTION_COLOR = "#8e24aa"
#: Values logged with ``Tap.log()`` in ``plot`` (dots): not the step curves' blue.
LOGGED_COLOR = "C1"


def parse_size(text: str) -> tuple[int, int]:
    """``"1200x700"`` -> ``(1200, 700)`` pixels (argparse type; a bad value is a usage error).

    Example:
        >>> parse_size("800x450")
        (800, 450)
    """
    parts = text.lower().split("x")
    try:
        w, h = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT in pixels like 1200x700, got {text!r}") from None
    if not (100 <= w <= 10000 and 100 <= h <= 10000):
        raise argparse.ArgumentTypeError(f"width and height must be within 100..10000 pixels, got {w}x{h}")
    return w, h


def _smoothing(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"smoothing must be in [0, 1) (0 = none, 0.9 = strong), got {value}")
    return value


def add_size_arguments(
    parser: argparse.ArgumentParser,
    *,
    default_smooth: float,
    default_metrics: Sequence[str] = ("loss", "accuracy"),
    default_output: str = "<run name>.png",
) -> None:
    """``-m``, ``--smooth``, ``--x``, ``-o`` and ``--size``, common to plot and compare; the help
    texts name the defaults the subcommand's ``main`` uses (passed here, not written twice)."""
    add_metrics_option(
        parser,
        f"metric to plot, one panel each (repeatable; default {', '.join(default_metrics)}); a name logged with "
        "tap.log() is drawn as dots",
    )
    parser.add_argument(
        "--smooth",
        type=_smoothing,
        default=default_smooth,
        metavar="W",
        help=f"exponential smoothing weight in [0, 1), TensorBoard-style; the raw curve stays faint behind (default {default_smooth})",
    )
    parser.add_argument(
        "--x",
        choices=("step", "time"),
        default="step",
        help="x axis: global step or seconds since the run started (default step)",
    )
    parser.add_argument("-o", "--output", metavar="FILE", help=f"PNG to write (default: {default_output})")
    parser.add_argument(
        "--size", type=parse_size, default=(1200, 700), metavar="WxH", help="image size in pixels (default 1200x700)"
    )


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing); NaN stays NaN and is skipped.

    Example:
        >>> [round(v, 3) for v in smooth([1.0, float("nan"), 3.0], 0.5)]
        [1.0, nan, 2.333]
    """
    if weight <= 0:
        return list(values)
    out: list[float] = []
    last, n = 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        n += 1
        last = last * weight + (1 - weight) * v
        # Divide out the weight the zero start still holds, so the first points are not pulled to 0.
        out.append(last / (1 - weight**n))
    return out


def epoch_spans(points: Sequence[Point], xs: Sequence[float]) -> list[tuple[int, float, float]]:
    """``(epoch, x_start, x_end)`` for each run of equal epochs, ends at the next epoch's start.

    Example:
        >>> from batchtap.store import Point
        >>> pts = [Point(s, 0.0, 0.0, s // 2, s % 2) for s in range(5)]
        >>> epoch_spans(pts, [float(p.step) for p in pts])
        [(0, 0.0, 2.0), (1, 2.0, 4.0), (2, 4.0, 4.0)]
    """
    spans: list[tuple[int, float, float]] = []
    for p, x in zip(points, xs):
        if spans and spans[-1][0] == p.epoch:
            continue
        if spans:
            e, start, _ = spans[-1]
            spans[-1] = (e, start, x)
        spans.append((p.epoch, x, x))
    if spans and xs:
        e, start, _ = spans[-1]
        spans[-1] = (e, start, xs[-1])
    return spans


def x_of(points: Sequence[Point], axis: str, t0: float) -> list[float]:
    """The x coordinates of ``points``: their step, or seconds since ``t0``."""
    if axis == "time":
        return [p.wall_time - t0 for p in points]
    return [float(p.step) for p in points]


def robust_limits(values: Sequence[float], *, factor: float = 5.0) -> tuple[float, float] | None:
    """Y limits for the bulk of a curve when a few values would squash it flat, else ``None``.

    A diverged step (loss 1e31) makes the rest of a linear axis a flat line at zero. When the full
    range is more than ``factor`` times the range of the 5th..95th percentiles, the axis shows that
    middle range widened by its own width on each side, and the values beyond are off scale.

    Example:
        >>> robust_limits([1.0, 0.9, 0.8] * 20 + [1e31]) is not None
        True
        >>> robust_limits([1.0, 0.5, 0.25]) is None
        True
    """
    finite = sorted(v for v in values if math.isfinite(v))
    if len(finite) < 10:
        return None
    lo, hi = finite[int(0.05 * (len(finite) - 1))], finite[int(round(0.95 * (len(finite) - 1)))]
    bulk = hi - lo
    if bulk <= 0:
        return None
    shown = (max(lo - bulk, finite[0]), min(hi + bulk, finite[-1]))
    if finite[-1] - finite[0] <= factor * (shown[1] - shown[0]):
        return None
    pad = 0.05 * (shown[1] - shown[0])
    return shown[0] - pad, shown[1] + pad


def anomaly_y(
    event: Event, points: Sequence[Point], ys: Sequence[float], ylim: tuple[float, float] | None = None
) -> float | None:
    """Where on a curve to mark an anomaly: its raw value when finite and within the axis range
    (``ylim``, else twice the curve's range), else the curve's nearest finite value at or before
    the event's step. ``None``: nowhere on the axis; mark it at the top of the panel."""
    finite = [y for y in ys if math.isfinite(y)]
    if ylim is None and finite:
        lo, hi = min(finite), max(finite)
        pad = max(hi - lo, 1e-12)
        ylim = (lo - pad, hi + pad)
    raw = event.raw_value
    if raw is not None and math.isfinite(raw) and ylim is not None and ylim[0] <= raw <= ylim[1]:
        return raw
    best: float | None = None
    for p, y in zip(points, ys):
        if p.step > event.step:
            break
        if math.isfinite(y):
            best = y
    if best is not None and ylim is not None and not ylim[0] <= best <= ylim[1]:
        return None
    return best


def new_figure(size: tuple[int, int], panels: int) -> tuple[Any, list[Any]]:
    """A figure of exactly ``size`` pixels (at 100 dpi) with ``panels`` stacked axes sharing x."""
    try:
        import matplotlib
    except ImportError:
        raise CLIError(
            "batchtap plot needs the optional package 'matplotlib', which is not installed; "
            "install it with: pip install 'batchtap[plot]'"
        ) from None
    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    w, h = size
    fig, axes = plt.subplots(panels, 1, figsize=(w / 100, h / 100), dpi=100, sharex=True, squeeze=False)
    return fig, [row[0] for row in axes]


def save(fig: Any, path: str) -> None:
    """Write the figure as PNG at exactly its pixel size, and free it."""
    import matplotlib.pyplot as plt

    try:
        # No bbox_inches="tight": that would change the pixel size the user asked for.
        fig.savefig(path, dpi=100, format="png")
    except OSError as exc:
        raise CLIError(
            f"cannot write {path}: {exc.strerror or exc}; fix: choose another -o or fix its folder"
        ) from None
    finally:
        plt.close(fig)


def draw_events(
    ax: Any,
    events: Sequence[Event],
    metric: str | None,
    points: Sequence[Point],
    xs: Sequence[float],
    ys: Sequence[float],
    axis: str,
    t0: float,
    *,
    actions: bool,
    ylim: tuple[float, float] | None = None,
) -> tuple[int, int]:
    """Mark anomalies (one red X per step and metric on the curve, or a red triangle at the top of the panel) and, with
    ``actions``, actions (dashed purple lines) on one panel.

    Args:
        ax: the matplotlib axes.
        events: the run's events.
        metric: the panel's metric: its anomalies go on the curve. ``None``: the panel marks the
            anomalies of every metric not on a panel of its own, at its top edge.
        points, xs, ys: the panel's curve (``ys`` as drawn, smoothed or not).
        axis: ``"step"`` or ``"time"``.
        t0: the run's start time, for ``axis="time"``.
        actions: also draw the actions.
        ylim: the panel's y limits when clipped (see :func:`robust_limits`).

    Returns:
        (anomalies marked, actions marked).
    """
    from batchtap.records import EventKind

    x_by_step = {p.step: x for p, x in zip(points, xs)}

    def x_at(e: Event) -> float:
        if axis == "step":
            return float(e.step)
        return x_by_step.get(e.step, e.wall_time - t0)

    anomalies = n_actions = 0
    top = ax.get_xaxis_transform()  # x in data, y in axes fraction
    # Validation and a rule often both report the same bad value, and a stop is both requested and
    # taken: one mark per anomalous (step, metric), one line per step with actions.
    marked: set[tuple[int, str | None, str]] = set()
    for e in events:
        key = (e.step, e.metric if e.kind is EventKind.ANOMALY else None, e.kind.value)
        if key in marked:
            continue
        marked.add(key)
        if e.kind is EventKind.ANOMALY and (e.metric == metric or metric is None):
            y = anomaly_y(e, points, ys, ylim) if metric is not None else None
            if y is None:
                ax.plot(
                    [x_at(e)], [0.96], marker="v", ms=9, color=ANOMALY_COLOR, transform=top, zorder=5, clip_on=False
                )
            else:
                ax.plot([x_at(e)], [y], marker="X", ms=10, color=ANOMALY_COLOR, mec=ANOMALY_COLOR, zorder=5)
            anomalies += 1
        elif e.kind is EventKind.ACTION and actions:
            ax.axvline(x_at(e), color=ACTION_COLOR, ls="--", lw=1.2, zorder=4)
            n_actions += 1
    return anomalies, n_actions
