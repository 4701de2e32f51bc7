"""`skistune evaluate`: the simulated metrics as one JSON object; bad input is one line and exit code 2."""
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skistune.cli import app

PROFILE = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json")


def test_simulated_metrics_end_with_one_json_object(tmp_path):
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("batching:\n  max_num_batched_tokens: 256\n  chunk_size: 64\n")
    r = CliRunner().invoke(app, ["evaluate", str(cfg), "--requests", "20", "--profile", PROFILE, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    assert out["mode"] == "simulate" and out["metrics"]["num_requests"] == 20
    assert out["metrics"]["num_finished"] == 20 and out["metrics"]["ttft_s"]["p99"] > 0


def test_bad_config_is_one_line_and_exit_2(tmp_path):
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("batching:\n  max_num_seqs: 0\n")
    r = CliRunner().invoke(app, ["evaluate", str(cfg), "--profile", PROFILE])
    assert r.exit_code == 2 and "batching.max_num_seqs: 0 is outside" in r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


def test_bad_mode_is_one_line_and_exit_2(tmp_path):
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("batching:\n  max_num_seqs: 8\n")
    r = CliRunner().invoke(app, ["evaluate", str(cfg), "--mode", "both", "--profile", PROFILE])
    assert r.exit_code == 2 and "--mode 'both': use simulate, run or compare" in r.output
    assert len(r.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_compare_prints_the_prediction_the_measurement_and_its_error(tmp_path):
    """One command checks a prediction: the simulator and the real runtime on the same requests, each
    figure's relative error, and both Metrics in the JSON."""
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("batching:\n  max_num_seqs: 8\n")
    r = CliRunner().invoke(app, ["evaluate", str(cfg), "--mode", "compare", "--requests", "2", "--max-input", "32",
                                 "--max-output", "4", "--profile", PROFILE, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    assert out["mode"] == "compare" and out["measured"]["num_finished"] == out["predicted"]["num_finished"] == 2
    p, m = out["predicted"]["ttft_s"]["p99"], out["measured"]["ttft_s"]["p99"]
    assert out["errors"]["ttft p99"] == pytest.approx((p - m) / m)
    kv = out["predicted"]["kv_peak_bytes"] / out["measured"]["kv_peak_bytes"] - 1
    assert out["errors"]["kv peak"] == pytest.approx(kv)
    assert "ttft p99 (ms)" in r.output and "preemptions" in r.output
    # the machine's drift since the profile, from its own steps timed again: told apart from the model's error
    check = out["speed_check"]
    assert check["ratio"] > 0 and set(check["by_kind"]) <= {"decode", "prefill", "mixed"} and check["points"]
    assert f"this machine runs the profile's steps x{check['ratio']:.3f}" in r.output
