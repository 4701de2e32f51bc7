"""Histograms of a workload's lengths and arrivals, as one PNG (matplotlib's Agg renderer, off-screen)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from skistune.paths import check_out_file
from skistune.plotting import log_axis, wants_log
from skistune.workloads.model import Workload

FEW_GAP_VALUES = 5  # nonzero gaps taking at most this many distinct values are a clock's steps, not timing
CLUSTER_SPAN = 0.05  # values within this fraction of their largest are plotted on an axis from 0


def _integer_ticks(axis) -> None:
    """Ticks at whole numbers only, for counts ("17.5 requests" on a small trace means nothing)."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _histogram(ax, values: np.ndarray, color: str, integer: bool = False) -> None:
    """50 bins, log-spaced on a log axis where the positive values span over `LOG_AXIS_SPAN` (token lengths
    often span decades), else even on a linear one (a log axis over a short span only crowds its labels:
    Mooncake's nonzero gaps, 2.99-3.03 s, were labelled "3x10^0 3.005x10^0 ..." on top of each other).
    Values bunched within `CLUSTER_SPAN` of their largest get an axis from 0, so that float noise of a few
    milliseconds around 3 s is not spread over the panel as if it were fine-grained timing. ``integer``:
    the values are counts (tokens), ticked at whole numbers."""
    from matplotlib.ticker import MaxNLocator

    low, high = float(values.min()), float(values.max())
    if wants_log(low, high):
        ax.hist(values, bins=np.geomspace(low, high * 1.01, 50), color=color)
        log_axis(ax.xaxis, ax.set_xscale, low, high)
        return
    if not integer and high > 0 and high - low < CLUSTER_SPAN * high:
        ax.hist(values, bins=50, range=(0.0, high * 1.1), color=color)
        ax.set_xlim(0.0, high * 1.1)
    else:
        ax.hist(values, bins=50, color=color)
    ax.xaxis.set_major_locator(MaxNLocator(6, integer=integer, min_n_ticks=1))  # (one length: one tick)
    # ("+3" under ticks of -0.001..0.001 said little; "1e7" under token counts, no more)
    ax.ticklabel_format(axis="x", useOffset=False, style="plain")


def arrival_bins(arrival_s: np.ndarray, duration_s: float) -> tuple[float, str, np.ndarray]:
    """The arrivals panel's bins: their width in seconds, as labelled (2 significant digits in `bin_unit`: "per
    36 s", not "per 36.2" of 36.17 s bins; at least 1 s), its label, and the count of arrivals in each bin, each
    bin holding its start and not its end (numpy's closed last bin had drawn arrivals at 0, 1, 2 and 3 s as 1, 1
    and 2 per second: a burst that is not there). The last bin may reach past the last arrival rather than every
    bin be narrower than labelled."""
    unit, seconds = bin_unit(max(1.0, duration_s / 100))
    width = float(f"{max(1.0, duration_s / 100) / seconds:.2g}")  # (>= 1 of its unit)
    bin_s = width * seconds
    index = np.floor((arrival_s - arrival_s[0]) / bin_s).astype(np.int64)
    return bin_s, f"{width:g} {unit}", np.bincount(index)


def _arrivals_panel(ax, arrival_s: np.ndarray, duration_s: float) -> None:
    """Arrivals per bin (`arrival_bins`) over time, in the unit the trace's length reads best in (`time_unit`),
    ticked in plain numbers (no "1e8" offset)."""
    bin_s, per, counts = arrival_bins(arrival_s, duration_s)
    unit, seconds = time_unit(duration_s)
    start = float(arrival_s[0])
    edges = (start + bin_s * np.arange(counts.size + 1)) / seconds
    ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="tab:green")
    ax.set_xlim(edges[0], edges[-1])
    ax.ticklabel_format(axis="x", useOffset=False, style="plain")
    _integer_ticks(ax.yaxis)
    ax.set(xlabel=f"time ({unit})", ylabel=f"requests per {per}", title="arrivals")


def _step_note(positive_s: np.ndarray) -> str | None:
    """What few distinct nonzero gaps mean: "nonzero gaps take 3 values (2.999-3.001 s): arrivals recorded in
    3 s steps; try --jitter 3". None when the gaps take many values (or too few gaps to tell)."""
    values = np.unique(np.round(positive_s, 6))  # float noise of seconds computed from milliseconds
    if len(values) > FEW_GAP_VALUES or len(positive_s) < 2 * len(values):
        return None
    span = f"{values[0]:g} s" if len(values) == 1 else f"{values[0]:g}-{values[-1]:g} s"
    note = f"nonzero gaps take {len(values)} value{'s' * (len(values) != 1)} ({span})"
    step_s = float(f"{np.median(positive_s):.2g}")  # Mooncake: 2.999, 3.000 and 3.001 s are steps of 3 s
    multiples = values / step_s
    if np.all(np.abs(multiples - np.round(multiples)) < 0.01) and np.all(np.round(multiples) >= 1):
        note += f":\narrivals recorded in {step_s:g} s steps; try --jitter {step_s:g}"
    return note


def _gap_panel(ax, arrival_s: np.ndarray) -> None:
    """Inter-arrival histogram of the nonzero gaps; the title counts the zero ones (simultaneous arrivals)."""
    gaps_s = np.diff(arrival_s)
    positive_s = gaps_s[gaps_s > 0]
    zeros = len(gaps_s) - len(positive_s)
    unit = "s"
    if len(gaps_s) == 0:
        title = "inter-arrival"
        message = "no gap to show: one request"
    elif len(positive_s) == 0:
        title = f"inter-arrival\nall {len(gaps_s):,} gaps are 0 (simultaneous arrivals)"
        message = "no nonzero gap to show: every request arrives at once"
    else:
        title = (f"inter-arrival\n{zeros:,} of {len(gaps_s):,} gaps are 0 (simultaneous arrivals)"
                 if zeros else f"inter-arrival\n{len(gaps_s):,} gaps, none 0")
        message = _step_note(positive_s)  # (in seconds, as --jitter takes them)
        unit, seconds = time_unit(float(np.median(positive_s)))  # (the typical gap's: gaps of days read in days)
        _histogram(ax, positive_s / seconds, "tab:red")
        _integer_ticks(ax.yaxis)
    ax.set(xlabel=f"inter-arrival time ({unit})", ylabel="nonzero gaps" if zeros else "gaps", title=title)
    if len(positive_s) == 0:
        ax.set_xticks([])
        ax.set_yticks([])
        ax.text(0.5, 0.5, message, transform=ax.transAxes, ha="center", va="center")
    elif message:
        ax.text(0.03, 0.95, message, transform=ax.transAxes, ha="left", va="top", fontsize=9,
                bbox=dict(facecolor="white", edgecolor="0.7", alpha=0.9))


# time units a plot's axes and labels may use, smallest first: seconds over days of trace had been labelled
# "requests per 3.7e+06 s" under ticks with a "1e8" offset
TIME_UNITS = (("s", 1.0), ("min", 60.0), ("h", 3600.0), ("days", 86400.0))
UNIT_FROM_S = 2 * 3600.0  # spans up to 2 h stay in seconds (their ticks read plainly: 0-7,200 s)


def time_unit(span_s: float) -> tuple[str, float]:
    """The unit to show a span of ``span_s`` seconds in: seconds up to `UNIT_FROM_S`, else hours, or days past two
    days (so that the span is at least 2 of the unit)."""
    if span_s <= UNIT_FROM_S:
        return TIME_UNITS[0]
    return TIME_UNITS[3] if span_s > 2 * TIME_UNITS[3][1] else TIME_UNITS[2]


def bin_unit(width_s: float) -> tuple[str, float]:
    """The largest unit in which a bin of ``width_s`` seconds is at least 1 (a 468 s bin: "per 7.8 min")."""
    return next(u for u in reversed(TIME_UNITS) if width_s >= u[1] or u[1] == 1.0)


def _amount(value: float) -> str:
    """A duration's number, plain: thousands separated past 10 (4,314), else 2 significant digits (0.8, 1.5)."""
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}"


def _title(workload: Workload) -> str:
    n = len(workload)
    if n == 1:
        return f"{workload.name}: 1 request"
    if workload.duration_s == 0:
        return f"{workload.name}: {n:,} requests, all at the same time"
    unit, seconds = time_unit(workload.duration_s)  # (0.8 s, not "1 s"; 4,314 days, not 372,690,000 s)
    return f"{workload.name}: {n:,} requests over {_amount(workload.duration_s / seconds)} {unit}"


def png_path(path: str | Path) -> Path:
    """The file a plot is written to: ``path`` when it ends in .png, ``path`` + .png when it has no suffix
    (matplotlib would add it unseen, and "wrote x" named a file that did not exist). Another suffix is refused:
    matplotlib would write that format (a JPEG for x.jpg) under a help text that promises PNG."""
    path = Path(path)
    if path.suffix.lower() == ".png":
        return path
    if path.suffix == "":
        return path.with_name(f"{path.name}.png")
    raise ValueError(f"--plot {path}: the plot is a PNG file; name it .png (e.g. {path.with_suffix('.png')})")


def plot_path(path: str | Path, name: str) -> Path:
    """The file a plot of workload ``name`` is written to: NAME.png inside ``path`` when that is an existing
    folder (as `cp FILE DIR` puts FILE in it; ``DIR.png`` beside it surprised), else `png_path` (``path``).
    A ``path`` typed with a trailing separator names a folder: one that is missing is refused (ValueError),
    as `cp FILE DIR/` refuses it, rather than written to as ``DIR.png``."""
    typed = str(path)  # (before Path(): it drops the trailing separator)
    path = Path(path)
    if path.is_dir():
        return path / f"{name}.png"
    if typed.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep)):
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            raise ValueError(f"--plot {typed}: {existing} is a file, not a folder")
        raise ValueError(f"--plot {typed}: folder {path} does not exist")
    return png_path(path)


def plot_workload(workload: Workload, path: str | Path) -> Path:
    """Input and output length histograms, arrivals per time bin and the inter-arrival histogram, as a PNG at
    `plot_path` (``path``, the workload's name); returns that path. The folder must exist (ValueError otherwise)."""
    path = plot_path(path, workload.name)
    check_out_file(path, "--plot")
    try:
        from matplotlib.figure import Figure  # no pyplot: draws off-screen without touching global state
    except ImportError:
        raise ValueError("plotting needs matplotlib: pip install matplotlib") from None
    fig = Figure(figsize=(11, 7))
    (ax_in, ax_out), (ax_rate, ax_gap) = fig.subplots(2, 2)
    for ax, tokens, what in ((ax_in, workload.input_tokens, "input"), (ax_out, workload.output_tokens, "output")):
        _histogram(ax, np.asarray(tokens), "tab:blue" if what == "input" else "tab:orange", integer=True)
        _integer_ticks(ax.yaxis)
        ax.set(xlabel=f"{what} tokens", ylabel="requests", title=f"{what} length")
    _arrivals_panel(ax_rate, np.asarray(workload.arrival_s, dtype=np.float64), workload.duration_s)
    _gap_panel(ax_gap, workload.arrival_s)
    fig.suptitle(_title(workload))
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    return path
