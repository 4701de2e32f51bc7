"""`skistune evaluate`: the simulated metrics as one JSON object; bad input is one line and exit code 2."""
import io
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


TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
MOONCAKE = TRACES / "mooncake_conversation" / "conversation_trace.head.jsonl"


def test_what_was_evaluated_is_said_context_caps_and_transforms_included(tmp_path):
    """Mooncake's prompts outgrow SmolLM2's 8,192-token context: the caps that fit them are a note (stderr)
    and part of the workload's label and JSON, as are the options applied (here `workload show`'s --jitter);
    a profile measured elsewhere is one warning line, not Python's warning with its source line."""
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("{}\n")
    r = CliRunner().invoke(app, ["evaluate", str(cfg), "--workload", str(MOONCAKE), "--first", "40", "--jitter", "3",
                                 "--profile", PROFILE, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    assert out["transforms"][:2] == ["jitter 3 s seed 0", "first 40"]
    assert out["transforms"][2].startswith("fit 8192-token context (")  # (only the requests that do not fit)
    cap = [n for n in out["workload_notes"] if "do not fit smollm2-135m's 8,192-token context" in n]
    assert len(cap) == 1 and "prompt tokens cut" in cap[0]
    assert not any("--jitter 3" in n for n in out["workload_notes"])  # (the reader's advice, taken)
    assert f"note: conversation_trace: {cap[0]}" in " ".join(r.output.split())
    assert "jitter 3 s seed 0, first 40, fit 8192-token context" in " ".join(r.output.split())  # the table's title
    assert "FingerprintWarning" not in r.output and "load_profile(" not in r.output


def test_long_latencies_print_in_seconds():
    """An overloaded run queues for hours: in ms its figures would not fit an 80-column table."""
    from rich.console import Console

    from skistune.display import metrics_table
    from skistune.runtime.metrics import Metrics, Percentiles

    def table_text(latency_s: float) -> str:
        p = Percentiles.of([latency_s])
        m = Metrics(ttft_s=p, tbt_s=Percentiles.of([0.02]), e2e_s=p, tpot_s=Percentiles.of([0.02]), duration_s=1.0,
                    num_requests=1, num_finished=1, num_rejected=0, output_tokens=2, throughput_tok_per_s=2.0,
                    throughput_req_per_s=1.0, kv_peak_bytes=0, kv_capacity_bytes=1, preemptions=0,
                    prefix_hit_tokens=0, prompt_tokens=1, busy_s=1.0)
        console = Console(width=80, record=True, file=io.StringIO())
        console.print(metrics_table(m))
        return console.export_text()

    assert "…" not in table_text(3600.0) and "3,600.00" in table_text(3600.0) and "latency (s)" in table_text(3600.0)
    assert "latency (ms)" in table_text(0.5)


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
    # ... and the prediction made again at the speed just checked: the simulator's own error
    from skistune.evaluate import FIDELITY_FIGURES

    assert set(out["errors_at_checked_speed"]) == {name for name, _, _ in FIDELITY_FIGURES}
    assert "the prediction's errors with the profile's steps at the speed just checked" in r.output
