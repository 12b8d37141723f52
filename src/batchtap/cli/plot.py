"""``batchtap plot RUN``: a run's metrics as a PNG, anomalies and actions marked, epochs shaded."""

from __future__ import annotations

import argparse
import math
import re

from batchtap.cli._common import add_db_arguments, open_store, pick_metrics, resolve_run, short_id
from batchtap.cli._plotting import (
    ACTION_COLOR,
    ANOMALY_COLOR,
    LOGGED_COLOR,
    add_size_arguments,
    draw_events,
    epoch_spans,
    new_figure,
    robust_limits,
    save,
    smooth,
    x_of,
)

__all__ = ["register", "main", "DEFAULT_METRICS"]

#: Panels when no -m is given: those the run has.
DEFAULT_METRICS = ("loss", "accuracy")

EXAMPLE = """examples:
  batchtap plot demo -m loss -m accuracy -o loss.png
  batchtap plot demo -m loss --smooth 0.9 --x time --size 1600x600 -o loss-time.png
  batchtap plot 3f2a9c -m grad_norm -m lr --smooth 0 -o grad.png

A value logged with tap.log() (val_loss, ...) is drawn as dots joined by a line, unsmoothed:
  batchtap plot demo -m loss -m val_loss -o eval.png

Red X: an anomaly on that metric's curve (a red triangle at the top: an anomaly of a metric not
plotted, or one off the scale). When a few values (a divergence) would squash a curve flat, its
y axis shows the bulk of the values and says so. Dashed purple line: an action (stop, rollback, ...).
Grey bands: every other epoch. Prints how many anomalies and actions it marked."""


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``plot`` subcommand."""
    parser = commands.add_parser(
        "plot",
        help="plot a run's metrics to a PNG",
        description="Plot a run's metrics to a PNG (matplotlib, no display needed): one panel per metric, "
        "anomalies and actions marked, epochs shaded.",
        epilog=EXAMPLE,
    )
    parser.add_argument("run", metavar="RUN", help="run id, unique id prefix, or name")
    add_size_arguments(parser, default_smooth=0.6)
    add_db_arguments(parser)
    parser.set_defaults(func=main)


def default_output(name: str) -> str:
    """A file name from a run name: ``my run/1`` -> ``my_run_1.png``.

    Example:
        >>> default_output("resnet 50/a")
        'resnet_50_a.png'
    """
    return (re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "run") + ".png"


def main(args: argparse.Namespace) -> int:
    """Plot one run; returns the exit status."""
    with open_store(args) as store:
        run = resolve_run(store, args.run)
        metrics = pick_metrics(store, run, args.metrics, DEFAULT_METRICS)
        logged = set(store.sparse_names(run.id)) & set(metrics)
        series = {m: store.series(run.id, m) for m in metrics}
        events = store.events(run.id)
    out = args.output or default_output(run.name)
    fig, axes = new_figure(args.size, len(metrics))
    t0 = run.started_at
    anomalies = actions = points = 0
    clipped: list[str] = []
    # Epochs come from the step values (a few logged values would shade coarse bands), the same on
    # every panel; from the logged values only when nothing else is plotted.
    ref = next((m for m in metrics if m not in logged), metrics[0])
    spans = epoch_spans(series[ref], x_of(series[ref], args.x, t0))
    for i, (ax, metric) in enumerate(zip(axes, metrics)):
        pts = series[metric]
        xs = x_of(pts, args.x, t0)
        raw = [p.value for p in pts]
        points += len(pts)
        for epoch, a, b in spans:
            if epoch % 2 == 1:
                ax.axvspan(a, b, color="0.93", lw=0, zorder=0)
        ylim = robust_limits(raw)
        if metric in logged:
            # A few points at the steps they were logged: each one shown, none smoothed away.
            ys = raw
            ax.plot(xs, ys, color=LOGGED_COLOR, lw=1.2, marker="o", ms=5, label=metric)
        else:
            # Off-scale values (a divergence) stay out of the smoothed curve, or its average would
            # sit off scale for hundreds of steps after them; the faint raw curve still shows them.
            kept = raw if ylim is None else [v if ylim[0] <= v <= ylim[1] else math.nan for v in raw]
            if args.smooth > 0:
                ax.plot(xs, raw, color="C0", alpha=0.3, lw=1)
                ys = smooth(kept, args.smooth)
            else:
                ys = raw
            ax.plot(xs, ys, color="C0", lw=1.6, label=metric)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        if ylim is not None:
            ax.set_ylim(*ylim)
            off = sum(1 for v in raw if not ylim[0] <= v <= ylim[1] and v == v)
            clipped.append(f"{metric} ({off} values off scale)")
        a, k = draw_events(ax, events, metric, pts, xs, ys, args.x, t0, actions=True, ylim=ylim)
        anomalies += a
        actions = max(actions, k)
        if i == 0:
            # Anomalies of metrics without a panel still show, at the top of the first one.
            others = [e for e in events if e.metric not in metrics]
            a, _ = draw_events(ax, others, None, pts, xs, ys, args.x, t0, actions=False)
            anomalies += a
    axes[-1].set_xlabel("step" if args.x == "step" else "seconds since start")
    title = f"{run.name} ({short_id(run.id)}) - {run.status.value}, {run.steps} steps"
    axes[0].set_title(title, fontsize=11)
    _legend(
        axes[0], anomalies, actions, smoothed=args.smooth > 0, steps=len(logged) < len(metrics), logged=bool(logged)
    )
    fig.tight_layout()
    save(fig, out)
    w, h = args.size
    print(
        f"wrote {out} ({w}x{h}): {len(metrics)} panel{'s' if len(metrics) != 1 else ''} ({', '.join(metrics)}), "
        f"{points} points, {anomalies} anomalies marked, {actions} actions marked"
    )
    if logged:
        print(
            "logged values (tap.log) drawn as dots, unsmoothed: "
            + ", ".join(f"{m} ({len(series[m])})" for m in metrics if m in logged)
        )
    if clipped:
        print(f"y axis zoomed to the bulk of the values for {', '.join(clipped)}")
    return 0


def _legend(
    ax: object, anomalies: int, actions: int, *, smoothed: bool, steps: bool = True, logged: bool = False
) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Line2D | Patch] = []
    if steps:
        handles.append(Line2D([], [], color="C0", lw=1.6, label="value (smoothed)" if smoothed else "value"))
    if logged:
        handles.append(Line2D([], [], color=LOGGED_COLOR, lw=1.2, marker="o", ms=5, label="logged value (tap.log)"))
    if anomalies:
        handles.append(Line2D([], [], color=ANOMALY_COLOR, marker="X", ls="", label="anomaly"))
    if actions:
        handles.append(Line2D([], [], color=ACTION_COLOR, ls="--", label="action"))
    handles.append(Patch(color="0.93", label="odd epochs"))
    ax.legend(handles=handles, loc="best", fontsize=8)  # type: ignore[attr-defined]
