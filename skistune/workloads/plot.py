"""Histograms of a workload's lengths and arrivals, as one PNG (matplotlib's Agg renderer, off-screen)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from skistune.workloads.model import Workload


def _length_bins(tokens: np.ndarray) -> np.ndarray:
    """Log-spaced bins: token lengths span several orders of magnitude."""
    return np.geomspace(max(1, tokens.min()), max(2, tokens.max()) * 1.01, 50)


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
        ax.hist(tokens, bins=_length_bins(tokens), color="tab:blue" if what == "input" else "tab:orange")
        ax.set(xscale="log", xlabel=f"{what} tokens", ylabel="requests", title=f"{what} length")
    bin_s = max(1.0, workload.duration_s / 100)
    ax_rate.hist(workload.arrival_s, bins=max(1, int(np.ceil(workload.duration_s / bin_s))), color="tab:green")
    ax_rate.set(xlabel="time (s)", ylabel=f"requests per {bin_s:.3g} s", title="arrivals")
    gaps_s = np.diff(workload.arrival_s)
    positive_s = gaps_s[gaps_s > 0]
    if len(positive_s):
        ax_gap.hist(positive_s, bins=np.geomspace(positive_s.min(), positive_s.max() * 1.01, 50), color="tab:red")
        ax_gap.set(xscale="log")
    ax_gap.set(xlabel="inter-arrival time (s)", ylabel="gaps", title=f"inter-arrival ({int(np.sum(gaps_s == 0))} at 0)")
    fig.suptitle(f"{workload.name}: {len(workload)} requests over {workload.duration_s:.0f} s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
