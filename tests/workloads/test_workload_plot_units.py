"""`skistune workload show --plot`: arrivals counted in half-open bins, times in units that read plainly, and
the --json line naming the file written (problems a visual QA test found)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from skistune.cli import app
from skistune.plotting import plain_number
from skistune.workloads import load_workload
from workload_paths import BURSTGPT_1

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.fixture
def figures(monkeypatch):
    """The figures plot_workload draws, instead of their PNG files."""
    import matplotlib.figure

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    return saved


def _plot(workload, figures, tmp_path):
    from skistune.workloads.plot import plot_workload

    plot_workload(workload, tmp_path / "w.png")
    figures[-1].draw_without_rendering()
    return figures[-1]


def _tick_texts(axis) -> list[str]:
    low, high = sorted(axis.get_view_interval())
    return [t.label1.get_text() for t in axis.get_major_ticks() if low <= t.get_loc() <= high]


def test_arrivals_at_whole_seconds_are_one_per_bin_not_a_burst_at_the_end(figures, tmp_path, write):
    """Arrivals at 0, 1, 2 and 3 s were drawn as 1, 1 and 2 per 1 s: numpy's last bin holds its end too."""
    rows = "".join(f"2023-11-16 18:15:{46 + i}.68,500,100\n" for i in range(4))
    ax_rate = _plot(load_workload(str(write("same.csv", HEADER + rows))), figures, tmp_path).axes[2]
    assert [p.get_height() for p in ax_rate.patches] == [1, 1, 1, 1]
    assert ax_rate.get_xlim() == (0.0, 4.0) and ax_rate.get_ylabel() == "requests per 1 s"
    from skistune.workloads.plot import arrival_bins

    bin_s, per, counts = arrival_bins(np.array([0.0, 1.0, 2.0, 3.0]), 3.0)
    assert (bin_s, per, list(counts)) == (1.0, "1 s", [1, 1, 1, 1])


def test_a_trace_of_years_is_plotted_in_days_without_scientific_notation(figures, tmp_path):
    """BurstGPT at --rate-scale 0.0001 spans 372,690,000 s: "requests per 3.7e+06 s", a "1e8" offset and "1e+06"
    gap labels."""
    workload = load_workload(str(BURSTGPT_1), rate_scale=0.0001)
    fig = _plot(workload, figures, tmp_path)
    _, _, ax_rate, ax_gap = fig.axes
    assert fig._suptitle.get_text() == "BurstGPT_1: 383 requests over 4,314 days"
    assert ax_rate.get_xlabel() == "time (days)" and ax_rate.get_ylabel() == "requests per 43 days"
    assert ax_rate.get_xlim()[1] == pytest.approx(len(ax_rate.patches) * 43)
    assert sum(p.get_height() for p in ax_rate.patches) == len(workload)
    assert ax_rate.xaxis.get_offset_text().get_text() == ""
    assert ax_gap.get_xlabel() == "inter-arrival time (days)"
    for axis in (ax_rate.xaxis, ax_gap.xaxis):
        assert not any("e" in text for text in _tick_texts(axis)), _tick_texts(axis)


def test_hours_and_minutes_for_a_trace_of_hours(figures, tmp_path):
    fig = _plot(load_workload(str(BURSTGPT_1)), figures, tmp_path)  # 37,269 s
    ax_rate = fig.axes[2]
    assert fig._suptitle.get_text() == "BurstGPT_1: 383 requests over 10 h"
    assert ax_rate.get_xlabel() == "time (h)" and ax_rate.get_ylabel() == "requests per 6.2 min"
    widths_s = np.array([p.get_width() for p in ax_rate.patches]) * 3600
    assert np.allclose(widths_s, 6.2 * 60)  # bins as wide as labelled


def test_plain_numbers_never_use_an_exponent():
    assert [plain_number(v) for v in (1e6, 1e8, 0.0002, 0.5, 20, 1000, 2.5)] == \
        ["1,000,000", "100,000,000", "0.0002", "0.5", "20", "1,000", "2.5"]


def test_json_names_the_plot_written_inside_a_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    for target, written in (("out/", "out/chat.png"), ("out", "out/chat.png"), ("x", "x.png")):
        result = CliRunner().invoke(app, ["workload", "show", "chat", "--requests", "20", "--plot", target, "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout.strip().splitlines()[-1])["plot"] == written
        assert (tmp_path / written).is_file()
    result = CliRunner().invoke(app, ["workload", "show", "chat", "--requests", "20", "--json"])
    assert json.loads(result.stdout.strip().splitlines()[-1])["plot"] is None
