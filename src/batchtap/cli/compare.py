"""``batchtap compare RUN1 RUN2 ...``: several runs' metrics overlaid in one PNG."""

from __future__ import annotations

import argparse
import math
import sys
from typing import TYPE_CHECKING

from batchtap.cli._common import CLIError, add_db_arguments, open_store, resolve_run, short_id, wrap
from batchtap.cli._plotting import (
    ANOMALY_COLOR,
    add_size_arguments,
    draw_events,
    new_figure,
    robust_limits,
    save,
    smooth,
    x_of,
)

if TYPE_CHECKING:
    from batchtap.store import RunRow

__all__ = ["register", "main"]

#: what compare draws and writes when -m / -o are not given (its --help says so from these)
DEFAULT_METRICS = ("loss",)
DEFAULT_OUTPUT = "compare.png"

EXAMPLE = """examples:
  batchtap compare baseline tuned -m loss -o cmp.png
  batchtap compare 3f2a9c 7be1d0 demo -m loss -m accuracy --x time --smooth 0.9 -o cmp.png

Each run is one colour on every panel (legend: name and id); red X marks an anomaly on that
run's curve. A value logged with tap.log() (-m val_loss) is drawn as dots, unsmoothed. Names may repeat across runs: give ids or id prefixes to pick older ones."""


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``compare`` subcommand."""
    parser = commands.add_parser(
        "compare",
        help="overlay several runs' metrics in one PNG",
        description="Overlay several runs' metrics in one PNG: one panel per metric, one colour per run.",
        epilog=EXAMPLE,
    )
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run ids, unique id prefixes, or names")
    add_size_arguments(parser, default_smooth=0.6, default_metrics=DEFAULT_METRICS, default_output=DEFAULT_OUTPUT)
    add_db_arguments(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Overlay runs; returns the exit status."""
    wanted = list(dict.fromkeys(args.metrics or DEFAULT_METRICS))
    with open_store(args) as store:
        runs: list[RunRow] = []
        for ref in args.runs:
            run = resolve_run(store, ref)
            if any(r.id == run.id for r in runs):
                note = f"batchtap: note: {ref!r} is run {short_id(run.id)} again; drawn once"
                print("\n".join(wrap(note, indent="  ")), file=sys.stderr)
                continue
            runs.append(run)
        present = {run.id: set(store.metric_names(run.id)) for run in runs}
        logged = {run.id: set(store.sparse_names(run.id)) for run in runs}
        for m in wanted:
            if not any(m in p for p in present.values()):
                every = sorted(set().union(*present.values()))
                raise CLIError(
                    f"no run given has values for {m!r}; they have {', '.join(every) or 'none'}; "
                    "fix: pick one of those with -m"
                )
        data = {(run.id, m): store.series(run.id, m) for run in runs for m in wanted if m in present[run.id]}
        events = {run.id: store.events(run.id) for run in runs}
    for run in runs:
        lacking = [m for m in wanted if m not in present[run.id]]
        if lacking:
            note = f"batchtap: note: run {run.name!r} ({short_id(run.id)}) has no {', '.join(lacking)}"
            print("\n".join(wrap(note, indent="  ")), file=sys.stderr)
    out = args.output or DEFAULT_OUTPUT
    fig, axes = new_figure(args.size, len(wanted))
    anomalies = 0
    for ax, metric in zip(axes, wanted):
        ylim = robust_limits([p.value for run in runs for p in data.get((run.id, metric), ())])
        for i, run in enumerate(runs):
            pts = data.get((run.id, metric))
            if not pts:
                continue
            xs = x_of(pts, args.x, run.started_at)
            raw = [p.value for p in pts]
            color = f"C{i % 10}"
            if metric in logged[run.id]:
                # a few logged points: each shown, none smoothed away
                ax.plot(xs, raw, color=color, lw=1.2, marker="o", ms=5, label=f"{run.name} ({short_id(run.id)})")
                a, _ = draw_events(
                    ax, events[run.id], metric, pts, xs, raw, args.x, run.started_at, actions=False, ylim=ylim
                )
                anomalies += a
                continue
            if args.smooth > 0:
                ax.plot(xs, raw, color=color, alpha=0.25, lw=1)
            # as in plot: off-scale values stay out of the smoothed curve
            kept = raw if ylim is None else [v if ylim[0] <= v <= ylim[1] else math.nan for v in raw]
            ys = smooth(kept, args.smooth) if args.smooth > 0 else raw
            ax.plot(xs, ys, color=color, lw=1.6, label=f"{run.name} ({short_id(run.id)})")
            a, _ = draw_events(
                ax, events[run.id], metric, pts, xs, ys, args.x, run.started_at, actions=False, ylim=ylim
            )
            anomalies += a
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        if ylim is not None:
            ax.set_ylim(*ylim)
    from matplotlib.lines import Line2D

    handles, labels = axes[0].get_legend_handles_labels()
    if anomalies:
        handles.append(Line2D([], [], color=ANOMALY_COLOR, marker="X", ls=""))
        labels.append("anomaly")
    axes[0].legend(handles, labels, loc="best", fontsize=8)
    axes[0].set_title(f"{len(runs)} runs", fontsize=11)
    axes[-1].set_xlabel("step" if args.x == "step" else "seconds since start")
    fig.tight_layout()
    save(fig, out)
    w, h = args.size
    said = f"wrote {out} ({w}x{h}): {len(runs)} runs, {len(wanted)} panels ({', '.join(wanted)}), {anomalies} anomalies marked"
    print("\n".join(wrap(said, indent="  ")))
    return 0
