"""`skistune workload show` (and the loader that optimize/evaluate share): what a tester found next. The
realised burstiness beside the source's requested one, unlabelled; --rate and --length-scale magnitudes no
workload means; --plot DIR writing DIR.png beside the folder."""
from __future__ import annotations


import pytest

from skistune.workloads import load_workload
from show_cli import one_line_error, run_show, show_json
from workload_paths import AZURE_CONV, SHAREGPT


def _run(*args: str):
    return run_show(*args, terminal_width=200)


def _row(stdout: str, label: str) -> str:
    """The value of the table row ``label`` (rows are "│ label │ value │")."""
    line = next(line for line in stdout.splitlines() if f" {label} " in line)
    return line.split("│")[2].strip()


# ---- 1. realised and requested burstiness are told apart ----

def test_table_labels_the_realised_and_the_requested_burstiness():
    """chat printed "burstiness (CV of inter-arrival) 0.97" beside the source's "burstiness=1.09"."""
    result = _run("chat", "--requests", "200")
    assert result.exit_code == 0, result.output
    assert _row(result.stdout, "burstiness (CV of gaps, requested)") == "1.09"
    realised = _row(result.stdout, "burstiness (CV of gaps, realised)")
    assert realised == f"{show_json('chat', '--requests', '200')['burstiness']:.2f}"


def test_json_adds_the_requested_burstiness_and_keeps_the_realised_key():
    chat = show_json("chat", "--requests", "200")
    assert chat["burstiness_requested"] == 1.09 and isinstance(chat["burstiness"], float)
    assert show_json("chat", "--requests", "200", "--burstiness", "3")["burstiness_requested"] == 3.0
    # a length-only trace's generated arrivals were requested too; a recorded trace's were not
    assert show_json(str(SHAREGPT), "--burstiness", "2")["burstiness_requested"] == 2.0
    assert show_json(str(AZURE_CONV), "--first", "100")["burstiness_requested"] is None


def test_recorded_arrivals_have_no_requested_row():
    result = _run(str(AZURE_CONV), "--first", "100")
    assert result.exit_code == 0, result.output
    assert "burstiness (CV of gaps, realised)" in result.stdout and "requested" not in result.stdout


def test_requested_burstiness_survives_transforms_that_change_the_realised_one():
    workload = load_workload("code", requests=300, sample=50, seed=2)
    assert workload.requested_burstiness == 13.2


# ---- 2. magnitudes no serving workload means ----

@pytest.mark.parametrize("workload", ["chat", str(AZURE_CONV)])
def test_a_rate_with_a_mean_gap_under_a_microsecond_is_refused(workload):
    """--rate 1e300 gave a trace 1e-299 s long."""
    one_line_error(_run(workload, "--rate", "1e300"), "--rate", "above 1e+06 req/s")
    with pytest.raises(ValueError, match=r"^--rate 2e\+06 req/s: above 1e\+06 req/s.* \(in Python: rate_rps=\)$"):
        load_workload(workload, rate_rps=2e6)


def test_a_rate_scale_past_the_limit_is_refused_by_its_name():
    one_line_error(_run("chat", "--rate", "1000", "--rate-scale", "1e4"), "--rate-scale", "1e+07 req/s",
                    "above 1e+06 req/s")
    one_line_error(_run(str(AZURE_CONV), "--rate-scale", "1e300"), "--rate-scale")


def test_a_rate_with_a_mean_gap_over_eleven_days_is_refused():
    """--rate 1e-300 had spanned 1e300 s (an overflow warning, then a trace no service sees)."""
    one_line_error(_run("chat", "--rate", "1e-300"), "--rate", "below 1e-06 req/s")
    one_line_error(_run(str(AZURE_CONV), "--rate-scale", "1e-300"), "--rate-scale", "below 1e-06 req/s")
    assert show_json("chat", "--rate", "0.001")["rate_rps"] == 0.001  # (one request every 17 minutes: kept)


def test_a_length_scale_past_ten_million_tokens_is_refused_even_under_caps():
    """--length-scale 1e9 gave 1e12-token prompts in 16e9-token blocks; a cap hid the prompts, not the blocks."""
    for extra in ([], ["--max-input", "100", "--max-output", "10"]):
        one_line_error(_run("chat", "--requests", "50", "--length-scale", "1e9", *extra),
                        "--length-scale", "above 10,000,000")
    with pytest.raises(ValueError, match=r"^--length-scale 1000: makes the longest request .* \(in Python: "
                                         r"length_scale=\)$"):
        load_workload("long-context", requests=50, length_scale=1000)


def test_legitimate_magnitudes_still_work():
    assert show_json("chat", "--requests", "50", "--length-scale", "0.01")["input_mean"] >= 1
    assert show_json("chat", "--requests", "50", "--length-scale", "100")["input_mean"] > 10_000
    assert show_json("chat", "--requests", "50", "--rate", "1000")["rate_rps"] == pytest.approx(1000)
    assert show_json(str(AZURE_CONV), "--first", "100", "--rate-scale", "100")["rate_rps"] > 100


# ---- 3. --plot DIR writes inside the folder ----

def test_plot_into_an_existing_folder_writes_the_workload_named_file_inside(tmp_path):
    """--plot /tmp/x, an existing folder, wrote /tmp/x.png beside it."""
    folder = tmp_path / "plots"
    folder.mkdir()
    result = _run("chat", "--requests", "30", "--plot", str(folder), "--json")
    assert result.exit_code == 0, result.output
    written = folder / "chat.png"
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "plots.png").exists()
    assert f"wrote {written}" in result.stderr.splitlines()


def test_plot_of_a_trace_into_a_folder_is_named_as_the_trace(tmp_path):
    from skistune.workloads.plot import plot_workload

    written = plot_workload(load_workload(AZURE_CONV, first=50), tmp_path)
    assert written == tmp_path / "AzureLLMInferenceTrace_conv.png" and written.is_file()


def test_plot_help_says_what_a_folder_gets():
    result = _run("--help")
    assert "DIR/WORKLOAD.png" in result.stdout
