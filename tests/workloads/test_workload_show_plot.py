"""`skistune workload show`: --plot's folder check, the plot's panels on small and coarse traces, and the
multi-turn session row (problems a user test found)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from skistune.cli import app
from skistune.workloads import load_workload, workload_stats
from skistune.workloads.model import Workload
from workload_paths import AZURE_CONV, BURSTGPT_1, BURSTGPT_3, MOONCAKE_CONV


@pytest.fixture
def figures(monkeypatch):
    """The figures plot_workload draws, instead of their PNG files."""
    import matplotlib.figure

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    return saved


def _plot(workload: Workload, figures: list, tmp_path):
    from skistune.workloads.plot import plot_workload

    plot_workload(workload, tmp_path / "w.png")
    return figures[-1]


def _json_error(line: str, json_flag: list[str]) -> str:
    """stdout of a refused run: nothing, or with --json the error as its one JSON line."""
    return json.dumps({"error": line, "exit_code": 2}, separators=(",", ":")) + "\n" if json_flag else ""


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_plot_into_a_missing_folder_is_refused_not_created(tmp_path, json_flag):
    target = tmp_path / "nonexist" / "x.png"
    result = CliRunner().invoke(app, ["workload", "show", "chat", "--requests", "50", "--plot", str(target),
                                      *json_flag])
    assert result.exit_code == 2
    line = f"--plot {target}: folder {target.parent} does not exist"
    assert result.stderr.strip().splitlines() == [f"error: {line}"]
    assert "Traceback" not in result.output and result.stdout == _json_error(line, json_flag)
    assert not target.parent.exists()


def test_plot_workload_refuses_a_missing_folder(tmp_path):
    from skistune.workloads.plot import plot_workload

    with pytest.raises(ValueError, match="does not exist"):
        plot_workload(load_workload("chat", requests=20), tmp_path / "no" / "x.png")
    assert not (tmp_path / "no").exists()


def test_gap_panel_says_how_many_gaps_are_zero_and_reads_coarse_steps_honestly(figures, tmp_path):
    """Raw Mooncake: 7168 of 7979 gaps are 0 and the rest are 2.999-3.001 s (3 s steps in milliseconds); they
    were three bars on an axis of 2.9992-3.0008 s under the title "(7168 at 0)"."""
    ax_gap = _plot(load_workload(MOONCAKE_CONV), figures, tmp_path).axes[3]
    assert "7,168 of 7,979 gaps are 0 (simultaneous arrivals)" in ax_gap.get_title()
    texts = " ".join(text.get_text() for text in ax_gap.texts)
    assert "take 3 values" in texts and "3 s steps" in texts and "--jitter 3" in texts
    low, high = ax_gap.get_xlim()
    assert low == 0 and 3.1 < high < 4  # the steps on an axis from 0, not float noise spread over the panel
    jittered = _plot(load_workload(MOONCAKE_CONV, jitter_s=3.0), figures, tmp_path).axes[3]
    assert not any("steps" in text.get_text() for text in jittered.texts)  # spread gaps take many values


@pytest.mark.parametrize("source, label", [("chat", "requests per 1 s"), (AZURE_CONV, "requests per 35 s")])
def test_arrival_bins_are_as_wide_as_labelled(figures, tmp_path, source, label):
    """chat's first 10 requests span 1.8 s: "requests per 1 s" sat over two bins of 0.904 s."""
    workload = load_workload(source, first=10) if source == "chat" else load_workload(source)
    ax_rate = _plot(workload, figures, tmp_path).axes[2]
    assert ax_rate.get_ylabel() == label
    bin_s = float(label.split()[2])
    widths = np.array([patch.get_width() for patch in ax_rate.patches])
    assert np.allclose(widths, bin_s, rtol=1e-9)
    assert sum(patch.get_height() for patch in ax_rate.patches) == len(workload)  # the last bin holds the last
    assert ax_rate.get_xlim() == pytest.approx((workload.arrival_s[0], workload.arrival_s[0] + len(widths) * bin_s))


def test_gap_panel_without_zero_gaps(figures, tmp_path):
    ax_gap = _plot(load_workload("chat", requests=200), figures, tmp_path).axes[3]
    assert "199 gaps, none 0" in ax_gap.get_title() and not ax_gap.texts


@pytest.mark.parametrize("trace", [BURSTGPT_1, BURSTGPT_3])
def test_count_axes_have_integer_ticks(figures, tmp_path, trace):
    """BurstGPT's samples were labelled "17.5 requests"."""
    fig = _plot(load_workload(trace), figures, tmp_path)
    for ax in fig.axes:
        ticks = ax.yaxis.get_majorticklocs()
        assert len(ticks) and np.all(ticks == np.round(ticks)), (ax.get_title(), ticks)


def test_one_request_plots_gracefully(figures, tmp_path):
    workload = load_workload("chat", requests=50, first=1)
    fig = _plot(workload, figures, tmp_path)
    ax_in, ax_out, ax_rate, ax_gap = fig.axes
    assert fig._suptitle.get_text() == "chat: 1 request"  # was "1 requests over 0 s"
    assert ax_rate.get_xlim()[0] >= 0  # was -0.5..0.5
    assert [text.get_text() for text in ax_gap.texts] == ["no gap to show: one request"]
    for ax, tokens in ((ax_in, workload.input_tokens), (ax_out, workload.output_tokens)):
        low, high = ax.get_xlim()  # one tick, at the one length (was 1495.6 1495.8 ... 1496.4)
        ticks = ax.xaxis.get_majorticklocs()
        assert list(ticks[(ticks >= low) & (ticks <= high)]) == [tokens[0]]


def test_one_arrival_time_plots_gracefully(figures, tmp_path):
    """Mooncake's first ten requests all arrive at 0."""
    fig = _plot(load_workload(MOONCAKE_CONV, first=10), figures, tmp_path)
    _, _, ax_rate, ax_gap = fig.axes
    assert fig._suptitle.get_text() == "conversation_trace: 10 requests, all at the same time"
    assert ax_rate.get_xlim()[0] >= 0
    assert "all 9 gaps are 0" in ax_gap.get_title()
    assert "no nonzero gap to show" in ax_gap.texts[0].get_text()


def test_one_request_through_the_cli(tmp_path):
    path = tmp_path / "one.png"
    result = CliRunner().invoke(app, ["workload", "show", "chat", "--first", "1", "--plot", str(path)])
    assert result.exit_code == 0, result.output
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _table(*args: str) -> str:
    result = CliRunner().invoke(app, ["workload", "show", *args], terminal_width=200)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_session_row_counts_multi_turn_sessions_and_their_requests():
    """BurstGPT_3: 135 sessions, 76 of two or more turns; 5 API-log rows have no session id. The row said
    "140 (76)", counting each of those rows as a session; Azure (no sessions) said "19,366 (0)"."""
    row = next(line for line in _table(str(BURSTGPT_3)).splitlines() if "multi-turn sessions" in line)
    assert "multi-turn sessions / their requests" in row and "76 / 335" in row
    assert "140" not in row
    azure = next(line for line in _table(str(AZURE_CONV)).splitlines() if "multi-turn sessions" in line)
    assert "none" in azure and "19,366" not in azure
    figures = json.loads(CliRunner().invoke(app, ["workload", "show", str(BURSTGPT_3), "--json"]).stdout
                         .strip().splitlines()[-1])
    assert (figures["sessions"], figures["multi_turn_sessions"], figures["multi_turn_requests"]) == (140, 76, 335)


def test_requests_without_a_session_id_are_not_in_multi_turn_sessions(write):
    header = "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    rows = ["1,a,1,ChatGPT,10,5,15,Conversation log", "2,,1,ChatGPT,10,5,15,API log",
            "3,a,1,ChatGPT,30,5,35,Conversation log", "4,,1,ChatGPT,10,5,15,API log",
            "5,b,1,ChatGPT,10,5,15,Conversation log"]
    stats = workload_stats(load_workload(str(write("sessions.csv", header + "\n".join(rows) + "\n"))))
    assert (stats.multi_turn_sessions, stats.multi_turn_requests) == (1, 2)
    assert stats.sessions == 4  # unchanged meaning: distinct ids, a lone request (with or without an id) its own


# ---- --plot DIR/: a trailing separator names a folder (a user test found nodir2/ written as ./nodir2.png) ----

@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_plot_into_a_missing_folder_named_with_a_trailing_slash_is_refused(tmp_path, monkeypatch, json_flag):
    monkeypatch.chdir(tmp_path)
    for typed, folder in (("nodir2/", "nodir2"), ("no/sub/", "no/sub"), (f"{tmp_path}/abs/", f"{tmp_path}/abs")):
        result = CliRunner().invoke(app, ["workload", "show", "chat", "--requests", "20", "--plot", typed, *json_flag])
        assert result.exit_code == 2, result.output
        line = f"--plot {typed}: folder {folder} does not exist"
        assert result.stderr.strip().splitlines() == [f"error: {line}"]
        assert "Traceback" not in result.output and result.stdout == _json_error(line, json_flag)
    assert list(tmp_path.iterdir()) == []  # no nodir2.png, no folder made


def test_plot_into_an_existing_folder_named_with_a_trailing_slash_writes_inside_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    result = CliRunner().invoke(app, ["workload", "show", "chat", "--requests", "20", "--plot", "out/", "--json"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "chat.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_plot_into_a_file_named_with_a_trailing_slash_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    result = CliRunner().invoke(app, ["workload", "show", "chat", "--requests", "20", "--plot", "notes.txt/"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == ["error: --plot notes.txt/: notes.txt is a file, not a folder"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_plot_path_reads_the_trailing_separator_of_the_text_typed(tmp_path):
    from skistune.workloads.plot import plot_path

    assert plot_path(f"{tmp_path}/", "chat") == tmp_path / "chat.png"
    assert plot_path(str(tmp_path / "x"), "chat") == tmp_path / "x.png"  # no separator: a file, as before
    with pytest.raises(ValueError, match="does not exist"):
        plot_path(f"{tmp_path / 'x'}/", "chat")
