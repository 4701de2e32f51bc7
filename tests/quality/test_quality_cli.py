"""`skistune quality`: --show prints the headline losses and the combination check (and --json), bad input
is one line and exit code 2; `skistune optimize --quality` with a quality profile file."""
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skistune.cli import app

from quality_synthetic import profile_data

PROFILE = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json")


@pytest.fixture
def synthetic(tmp_path):
    joint = (({"bitwidth.key_bits": 4, "bitwidth.value_bits": 4, "eviction.policy": "h2o",
               "eviction.budget_fraction": 0.5}, 0.05),)
    path = tmp_path / "q.json"
    data = profile_data(n_layers=30, joint=joint)
    from skistune.quality import QualityProfile

    data["combination"] = QualityProfile(data).combination_checks()
    path.write_text(json.dumps(data))
    return path


def invoke(*args):
    return CliRunner().invoke(app, list(args))


def test_show_prints_the_losses_and_the_combination_check(synthetic):
    r = invoke("quality", "--show", str(synthetic), "--json")
    assert r.exit_code == 0, r.output
    assert "int4 keys+values" in r.stdout and "Combination model" in r.stdout
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    int4 = next(row for row in summary["headline"] if row["config"] == "int4 keys+values")
    assert int4["ppl_mean"] == pytest.approx(2.718281828 ** 0.03 - 1) and int4["needle_retained"] == 0.75
    assert summary["combination"][0]["within_goal"]
    streaming = next(row for row in summary["headline"] if row["config"] == "streaming 50%")
    assert streaming["ppl_mean"] == pytest.approx(2.718281828 ** 0.01 - 1)
    outside = next(row for row in summary["headline"] if row["config"] == "h2o 10%")  # below the synthetic grid
    assert outside["ppl_mean"] is None and outside["needle_retained"] == 0.0 and "∞" in r.stdout


@pytest.mark.parametrize("args, match", [
    (["--show", "/no/such/file.json"], "cannot read quality profile"),
    (["--model", "llama-3-8b"], "no real weights"),
    (["--model", "nope"], "nope"),
])
def test_bad_input_is_one_line_and_exit_2(args, match, tmp_path):
    r = invoke("quality", *args, "--out", str(tmp_path / "q.json"))
    assert r.exit_code == 2 and match in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "q.json").exists()


def test_optimize_takes_a_quality_profile_file(synthetic, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = invoke("optimize", "--slo", "p99=200ms", "--quality", "ppl+5%", "--quality-profile", str(synthetic),
               "--requests", "16", "--trials", "6", "--validate", "0", "--profile", PROFILE, "--json")
    assert r.exit_code in (0, 3), r.output
    assert "lossless search" not in r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    if summary["feasible"]:
        assert summary["best"]["figures"]["quality_bound"] <= 0.05
        assert "quality" in r.stdout and summary["best"]["figures"]["quality_basis"] in ("exact", "measured")
