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
    assert outside["ppl_mean"] is None and outside["needle_retained"] is None and "∞" in r.stdout


def test_show_labels_what_was_measured_and_what_is_predicted(synthetic):
    """Headline rows are the quality model's predictions: each says whether its perplexity was measured as it
    is; passkeys read as measured (share and count) or not measured, never 0% nor another row's figure."""
    r = invoke("quality", "--show", str(synthetic), "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    rows = {row["config"]: row for row in summary["headline"]}
    picked = {name: (rows[name]["ppl_basis"], rows[name]["needle_retained"], rows[name]["needle_found"],
                     rows[name]["needle_trials"])
              for name in ("int4 keys+values", "int4 keys+values, newest 128 at 16 bits", "h2o 25%", "h2o 10%",
                           "streaming 50%")}
    assert picked == {"int4 keys+values": ("predicted", 0.75, 3, 4),  # keys and values measured apart
                      "int4 keys+values, newest 128 at 16 bits": ("predicted", None, None, None),
                      "h2o 25%": ("measured", 0.25, 1, 4), "h2o 10%": ("outside grid", None, None, None),
                      "streaming 50%": ("measured", None, None, None)}
    wide = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["quality", "--show", str(synthetic)])
    table = [" ".join(line.replace("│", " ").split()) for line in wide.stdout.splitlines()]
    # mean, its one-sided 95% bound (two windows: wide), worst window
    # (NLL +0.02 and +0.04 on the two windows)
    assert "int4 keys+values +3.05% +9.76% +4.08% predicted 75% (3/4)" in table
    assert "h2o 25% +6.18% +20.48% +8.33% measured 25% (1/4)" in table
    assert "h2o 10% ∞ ∞ ∞ outside grid not measured" in table
    assert rows["h2o 25%"]["ppl_mean_bound"] > rows["h2o 25%"]["ppl_mean"] and rows["h2o 10%"]["ppl_mean_bound"] is None
    assert any(line.startswith("int4 keys+values, newest 128 at 16 bits") and line.endswith("predicted not measured")
               for line in table)


def test_show_states_the_baseline_and_the_goal(synthetic):
    r = invoke("quality", "--show", str(synthetic), "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    ppl = 2.718281828459045 ** 2.5  # the synthetic full cache's NLL: 2.0 and 3.0 on its two windows
    assert summary["baseline"] == pytest.approx({"ppl_all_positions": ppl, "ppl_continuation": ppl,
                                                 "needle_found": 4, "needle_trials": 4})
    text = " ".join(r.stdout.split())
    assert f"baseline (16-bit KV, no eviction): perplexity {ppl:.2f} over the windows' positions" in text
    goal = "|predicted - measured| <= max(20% of measured, 0.5 percentage points)"
    assert summary["goal"] == goal and f"within goal: {goal}" in text


def test_show_of_a_hardware_profile_names_the_command_that_shows_it():
    r = invoke("quality", "--show", PROFILE)
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1
    assert f"a hardware profile, not a quality profile: print it with `skistune profile --show {PROFILE}`" in \
        " ".join(r.stderr.split())


@pytest.mark.parametrize("args, match", [
    (["--show", "/no/such/file.json"], "cannot read quality profile"),
    (["--model", "llama-3-8b"], "no real weights"),
    (["--model", "nope"], "nope"),
])
def test_bad_input_is_one_line_and_exit_2(args, match, tmp_path):
    out = [] if "--show" in args else ["--out", str(tmp_path / "q.json")]  # (--show with --out is refused)
    r = invoke("quality", *args, *out)
    assert r.exit_code == 2 and match in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "q.json").exists()


@pytest.mark.parametrize("values, what", [
    ([float("nan"), 1.0], "expected finite numbers, got nan at window 0"),
    ([2.0, -1.0], "expected non-negative NLLs, got -1.0 at window 1"),
    ([2.0], "expected one value per window (2), got 1"),
])
@pytest.mark.parametrize("command", [["quality", "--show"], ["optimize", "--quality", "ppl+5%", "--quality-profile"]])
def test_a_bad_measurement_is_one_line_naming_file_entry_and_field(command, values, what, tmp_path, monkeypatch):
    """`--show` died in statistics.stdev on a NaN (exit 1, a traceback); optimize read it silently."""
    monkeypatch.chdir(tmp_path)  # (optimize writes its study and config here if it ever gets that far)
    data = profile_data()
    key = next(k for k, e in data["perplexity"].items() if e["kind"] == "key")
    data["perplexity"][key]["nll_all_positions"] = values
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    r = invoke(*command, str(path), *(["--trials", "2", "--validate", "0", "--profile", PROFILE]
                                      if command[0] == "optimize" else []))
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines() == [f"error: {path}: perplexity[{key!r}].nll_all_positions: {what}"]
    assert not (tmp_path / "skistune-tuned.yaml").exists()


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


def test_show_refuses_options_that_only_measuring_uses(synthetic):
    r = invoke("quality", "--show", str(synthetic), "--model", "llama-3-8b", "--quick")
    assert r.exit_code == 2 and r.stderr.strip() == ("error: --show prints a profile as it is; --quick, --model "
                                                     "applies only when measuring")


def test_show_says_when_a_profile_is_incomplete_or_has_another_layer_count(tmp_path):
    """An interrupted run's file (1 of 22 measurements) and one with n_layers edited were shown as if whole."""
    shipped = json.loads((Path(PROFILE).parent / "quality-smollm2-135m.json").read_text())
    whole = invoke("quality", "--show", str(Path(PROFILE).parent / "quality-smollm2-135m.json"))
    assert whole.exit_code == 0 and "note:" not in whole.stderr
    part = dict(shipped, perplexity=dict(list(shipped["perplexity"].items())[:3]), n_layers=5)
    (tmp_path / "part.json").write_text(json.dumps(part))
    r = invoke("quality", "--show", str(tmp_path / "part.json"))
    assert r.exit_code == 0, r.output
    notes = " ".join(r.stderr.split())
    assert "the profile says 5 layers, but smollm2-135m has 30" in notes
    assert f"incomplete: {3 + len(shipped['needle'])} of the full grid's" in notes and "--out FILE` resumes it" in notes


def test_an_out_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    import skistune.quality_cli as cli

    monkeypatch.setattr(cli, "_measure", lambda *a, **k: pytest.fail("measured"))
    r = invoke("quality", "--quick", "--out", str(tmp_path))
    assert r.exit_code == 2 and r.stderr.startswith(f"error: --out {tmp_path}: is a directory")
    r = invoke("quality", "--quick", "--out", str(tmp_path / "no" / "q.json"))
    assert r.exit_code == 2 and "folder" in r.stderr and "does not exist" in r.stderr


def test_the_shipped_quality_profile_is_named_as_a_hardware_one_is(tmp_path, monkeypatch):
    """`--profile cpu-smollm2-135m` worked by name, `--quality-profile quality-smollm2-135m` and `quality --show` did
    not (installed from a wheel, the shipped file lives inside the package)."""
    from skistune.quality import load_quality_profile, quality_profile_path

    monkeypatch.chdir(tmp_path)
    shown = CliRunner().invoke(app, ["quality", "--show", "quality-smollm2-135m", "--json"])
    assert shown.exit_code == 0, shown.output
    path = quality_profile_path("quality-smollm2-135m")
    assert path.name == "quality-smollm2-135m.json" and load_quality_profile("quality-smollm2-135m").path == str(path)
    unknown = CliRunner().invoke(app, ["quality", "--show", "quality-nope"])
    assert unknown.exit_code == 2
    assert "quality-nope: no such quality profile file, nor a shipped quality profile (shipped: quality-smollm2-135m" \
        in unknown.stderr


def test_optimize_says_its_quality_profile_is_incomplete_as_show_does(tmp_path):
    """An interrupted `quality --quick` (9 of 22 measurements) was used by optimize with no word; --show said it."""
    import json
    import warnings

    from skistune.optimize import build_problem
    from skistune.profile import load_profile
    from skistune.quality import incomplete_notes, load_quality_profile, quality_profile_path
    from skistune.workloads import load_workload

    data = json.loads(quality_profile_path("quality-smollm2-135m").read_text())
    kept = dict(list(data["perplexity"].items())[:len(data["perplexity"]) // 2])
    data["perplexity"] = kept
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps(data))
    [line] = incomplete_notes(load_quality_profile(str(cut)))
    assert line.startswith(f"incomplete: {len(kept) + len(data['needle'])} of the full grid's ")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        problem = build_problem(load_workload("chat", requests=8), slo="p99=200ms", quality="ppl+1%",
                                quality_profile=str(cut), profile=load_profile("cpu-smollm2-135m"))
    assert f"quality profile {cut}: {line}" in problem.notes
    assert not incomplete_notes(load_quality_profile("quality-smollm2-135m"))  # (the shipped one is whole)


def test_a_profile_missing_an_entry_is_one_line_naming_it(tmp_path):
    """A profile with "protocol": {} had ended in `error: 'grid'`, a bare key."""
    import json

    from skistune.quality import quality_profile_path

    data = json.loads(quality_profile_path("quality-smollm2-135m").read_text())
    data["protocol"] = {}
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(data))
    r = CliRunner().invoke(app, ["quality", "--show", str(broken)])
    assert r.exit_code == 2
    [line] = r.stderr.strip().splitlines()
    assert line.startswith("error: an entry '") and line.endswith("' is missing (a file the command read lacks it)")
