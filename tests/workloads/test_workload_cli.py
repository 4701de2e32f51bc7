"""`skistune workload show`: the table, --json, --plot and the transformation options."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from skistune.cli import app
from workload_paths import AZURE_CONV, BURSTGPT_1, MOONCAKE_CONV


def _show(*args: str) -> dict:
    result = CliRunner().invoke(app, ["workload", "show", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_table_lists_the_figures():
    result = CliRunner().invoke(app, ["workload", "show", "chat", "--requests", "300"])
    assert result.exit_code == 0, result.output
    for label in ("requests", "duration (s)", "rate (req/s)", "burstiness", "input tokens mean / p50 / p99",
                  "output tokens mean / p50 / p99", "prefix reuse ratio", "300"):
        assert label in result.stdout


def test_json_is_one_object_with_the_same_figures():
    figures = _show(str(AZURE_CONV))
    assert figures["requests"] == 19366
    assert figures["rate_rps"] == pytest.approx(5.5304, abs=1e-4)
    assert figures["input_p50"] == 1020 and figures["output_p99"] == pytest.approx(601, abs=0.5)
    for key in ("duration_s", "burstiness", "input_mean", "input_p99", "output_mean", "output_p50",
                "prefix_reuse_ratio", "digest", "source", "transforms", "notes"):
        assert key in figures


def test_notes_go_to_stderr_and_json_stays_clean():
    result = CliRunner().invoke(app, ["workload", "show", str(BURSTGPT_1), "--json"])
    assert result.exit_code == 0
    assert "dropped 17 of 400 rows" in result.stderr
    assert json.loads(result.stdout)["requests"] == 383


def test_transformation_options():
    figures = _show(str(MOONCAKE_CONV), "--jitter", "3", "--first", "1000", "--length-scale", "0.03125",
                    "--max-input", "1024", "--max-output", "64", "--rate-scale", "2", "--seed", "5")
    assert figures["requests"] == 1000
    assert figures["input_p99"] <= 1024 and figures["output_p99"] <= 64
    assert figures["block_tokens"] == 16
    assert figures["transforms"][0] == "jitter 3 s seed 5" and figures["transforms"][-1] == "rate x2"
    sampled = _show(str(AZURE_CONV), "--sample", "100", "--seed", "1")
    assert sampled["requests"] == 100
    window = _show(str(AZURE_CONV), "--window", "0:60")
    assert window["duration_s"] < 60


def test_preset_options():
    figures = _show("agent", "--requests", "500", "--rate", "8", "--burstiness", "2", "--seed", "3")
    assert figures["requests"] == 500 and figures["rate_rps"] == pytest.approx(8.0)
    again = _show("agent", "--requests", "500", "--rate", "8", "--burstiness", "2", "--seed", "3")
    assert again["digest"] == figures["digest"]


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "chat.png"  # (the folder must exist: test_workload_show_plot.py)
    result = CliRunner().invoke(app, ["workload", "show", "chat", "--requests", "200", "--plot", str(path)])
    assert result.exit_code == 0, result.output
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_axes_go_log_only_where_the_values_span_decades(tmp_path, monkeypatch):
    """Mooncake's nonzero gaps (2.999-3.001 s) on a log axis were labelled "3x10^0 3.005x10^0 ..." on top of
    each other: a short span gets a linear axis with plain ticks, lengths over decades a log one."""
    import matplotlib.figure

    from skistune.workloads import load_workload
    from skistune.workloads.plot import plot_workload

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    plot_workload(load_workload(MOONCAKE_CONV), tmp_path / "m.png")
    ax_in, ax_out, _, ax_gap = saved[-1].axes
    assert (ax_in.get_xscale(), ax_out.get_xscale(), ax_gap.get_xscale()) == ("log", "log", "linear")
    assert ax_gap.xaxis.get_major_formatter().get_useOffset() is False
    plot_workload(load_workload(AZURE_CONV), tmp_path / "a.png")
    assert saved[-1].axes[3].get_xscale() == "log"  # gaps from microseconds to seconds


def test_tables_piped_to_a_file_are_not_cut_to_80_columns(tmp_path):
    """rich draws 80 columns when stdout is no terminal: cells such as 'capacity set by' were cut short in logs.
    The command line draws 200 unless COLUMNS says otherwise."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    command = [sys.executable, "-m", "skistune", "workload", "show", "chat", "--requests", "5"]
    wide = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    narrow = subprocess.run(command, capture_output=True, text=True, env={**env, "COLUMNS": "80"}, cwd=tmp_path,
                            timeout=120)
    assert wide.returncode == narrow.returncode == 0, wide.stderr + narrow.stderr
    width = {name: max(len(line) for line in r.stdout.splitlines() if line.startswith("│"))
             for name, r in (("wide", wide), ("narrow", narrow))}
    assert width["narrow"] <= 80 < width["wide"] <= 200
