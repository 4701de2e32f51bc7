"""`benchmarks/fidelity.py --measured`: a recorded run (the H200's, in benchmarks/results/) predicted again on
this CPU with another profile, serving nothing."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "benchmarks" / "results" / "h200-2026-12-04-fidelity.json"


def fidelity(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fidelity.py"), *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)


def test_a_recorded_run_is_predicted_again_against_its_own_measurements():
    r = fidelity("--measured", str(RUN), "--profile", str(ROOT / "profiles" / "cuda-llama-3-8b-quick.json"), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    recorded = {(row["workload"], row["config"]): row for row in json.loads(RUN.read_text())["rows"]}
    assert (out["model"], out["device"], out["requests"], out["rate_scale"]) == ("llama-3-8b", "cuda", 12, 12.0)
    assert len(out["rows"]) == len(recorded) == 33 and out["machine_speed"] == []  # nothing timed here
    for row in out["rows"]:
        assert row["measured"] == recorded[row["workload"], row["config"]]["measured"]
        for name, error in row["errors"].items():
            assert error == pytest.approx(row["predicted"][name] / row["measured"][name] - 1)
    # another profile, other predictions: the recorded run's own (the profile shipped then) differ
    assert any(row["predicted"] != recorded[row["workload"], row["config"]]["predicted"] for row in out["rows"])


def test_a_file_that_is_not_a_recorded_run_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "run.json"
    bad.write_text('{"benchmark": "kernels"}\n')
    r = fidelity("--measured", str(bad))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().count("\n") == 0 and "not a fidelity run's --json output" in r.stderr
