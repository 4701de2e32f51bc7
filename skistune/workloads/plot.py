"""Histograms of a workload's lengths and arrivals, as one PNG (matplotlib's Agg renderer, off-screen)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from skistune.plotting import log_axis, wants_log
from skistune.workloads.model import Workload


def _histogram(ax, values: np.ndarray, color: str) -> None:
    """50 bins, log-spaced on a log axis where the positive values span over `LOG_AXIS_SPAN` (token lengths
    often span decades), else even on a linear one (a log axis over a short span only crowds its labels:
    Mooncake's nonzero gaps, 2.99-3.03 s, were labelled "3x10^0 3.005x10^0 ..." on top of each other)."""
    low, high = float(values.min()), float(values.max())
    if wants_log(low, high):
        ax.hist(values, bins=np.geomspace(low, high * 1.01, 50), color=color)
        log_axis(ax.xaxis, ax.set_xscale, low, high)
    else:
        from matplotlib.ticker import MaxNLocator

        ax.hist(values, bins=50, color=color)
        ax.xaxis.set_major_locator(MaxNLocator(6))
        ax.ticklabel_format(axis="x", useOffset=False)  # ("+3" under ticks of -0.001..0.001 said little)


def plot_workload(workload: Workload, path: str | Path) -> Path:
    """Input and output length histograms, arrivals per time bin and the inter-arrival histogram."""
    try:
        from matplotlib.figure import Figure  # no pyplot: draws off-screen without touching global state
    except ImportError:
        raise ValueError("plotting needs matplotlib: pip install matplotlib") from None
    path = Path(path)
    fig = Figure(figsize=(11, 7))
    (ax_in, ax_out), (ax_rate, ax_gap) = fig.subplots(2, 2)
    for ax, tokens, what in ((ax_in, workload.input_tokens, "input"), (ax_out, workload.output_tokens, "output")):
        _histogram(ax, np.asarray(tokens), "tab:blue" if what == "input" else "tab:orange")
        ax.set(xlabel=f"{what} tokens", ylabel="requests", title=f"{what} length")
    bin_s = max(1.0, workload.duration_s / 100)
    ax_rate.hist(workload.arrival_s, bins=max(1, int(np.ceil(workload.duration_s / bin_s))), color="tab:green")
    ax_rate.set(xlabel="time (s)", ylabel=f"requests per {bin_s:.3g} s", title="arrivals")
    gaps_s = np.diff(workload.arrival_s)
    positive_s = gaps_s[gaps_s > 0]
    if len(positive_s):
        _histogram(ax_gap, positive_s, "tab:red")
    ax_gap.set(xlabel="inter-arrival time (s)", ylabel="gaps", title=f"inter-arrival ({int(np.sum(gaps_s == 0))} at 0)")
    fig.suptitle(f"{workload.name}: {len(workload)} requests over {workload.duration_s:.0f} s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
