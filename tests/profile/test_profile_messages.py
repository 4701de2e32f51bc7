"""What `skistune profile` and `skistune evaluate` say about profiles: a CUDA profile checked without CUDA,
a quick profile about to be measured, and a profile with a bad thread count or an unknown model."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

from profile_tiny import SHIPPED
from typer.testing import CliRunner

from skistune.cli import app
from skistune.profile import FingerprintWarning, cached_profile_path, load_profile, machine_fingerprint

CUDA_PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "cuda-llama-3-8b.json"


def _edited_shipped(tmp_path: Path, edit) -> Path:
    data = json.loads(SHIPPED.read_text())
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


def _one_error_line(r) -> str:
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_check_of_a_cuda_profile_without_cuda_names_the_profile_device_not_an_option(monkeypatch):
    """It read `--device cuda: torch sees no CUDA device`, an option the user never passed, after a
    fingerprint warning."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = _one_error_line(CliRunner().invoke(app, ["profile", "--check", str(CUDA_PROFILE)]))
    assert "was measured on cuda and this machine has no CUDA device" in line and "--device" not in line


def test_evaluate_says_it_measures_the_quick_profile_before_measuring(tmp_path, monkeypatch):
    """With no --profile and an empty cache, the first evaluate measured for about a minute, silent when
    stderr is not a terminal."""
    import skistune.profile as profile_module

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FingerprintWarning)
        shipped = load_profile(SHIPPED)
    measured = []
    monkeypatch.setattr(profile_module, "default_profile", lambda model, device: measured.append(model) or shipped)
    config = tmp_path / "kv.yaml"
    config.write_text("offload: {host_kv_bytes: 1GB}\n")
    r = CliRunner().invoke(app, ["evaluate", str(config), "--workload", "chat", "--requests", "2"])
    assert r.exit_code == 0, r.output
    path = cached_profile_path("smollm2-135m", "cpu", machine_fingerprint("cpu"))
    assert measured == ["smollm2-135m"] and str(path).startswith(str(tmp_path / "cache"))
    said = [line for line in r.stderr.splitlines() if "quick profile" in line]  # (optimize's line: one function)
    assert said == [f"measuring this machine's quick profile for smollm2-135m: up to a minute, more on a busy "
                    f"machine, once (cached in {path})"]
    with_profile = CliRunner().invoke(app, ["evaluate", str(config), "--requests", "2", "--profile", str(SHIPPED)])
    assert with_profile.exit_code == 0 and "quick profile" not in with_profile.stderr


def test_show_refuses_a_non_positive_thread_count(tmp_path):
    path = _edited_shipped(tmp_path, lambda d: d["fingerprint"].update(threads=-3))
    line = _one_error_line(CliRunner().invoke(app, ["profile", "--show", str(path)]))
    assert line == f"error: {path}: fingerprint.threads: expected a positive count, got -3"


def test_show_names_the_model_in_its_header(tmp_path):
    """The header had named the machine but not the model; a profile of a model this skistune has no preset
    for is still shown (a viewer), and evaluate refuses it."""
    shown = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["profile", "--show", str(SHIPPED)])
    assert shown.exit_code == 0 and "cpu-smollm2-135m: smollm2-135m on " in shown.stdout
    path = _edited_shipped(tmp_path, lambda d: d.update(model="gpt-17"))
    other = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["profile", "--show", str(path)])
    assert other.exit_code == 0 and ": gpt-17 on " in other.stdout
    config = tmp_path / "kv.yaml"
    config.write_text("{}\n")
    evaluated = CliRunner().invoke(app, ["evaluate", str(config), "--model", "gpt-17", "--profile", str(path)])
    assert evaluated.exit_code == 2 and "unknown preset" in _one_error_line(evaluated)
    # (with the default model: no "give --model gpt-17", which is then refused)
    default = CliRunner().invoke(app, ["evaluate", str(config), "--profile", str(path)])
    assert default.exit_code == 2 and _one_error_line(default).endswith(
        "was measured for gpt-17, not smollm2-135m: a model this skistune has no preset for; measure one with "
        "`skistune profile --model smollm2-135m`")


def test_the_fingerprint_warning_points_at_the_callers_line(monkeypatch):
    """It had pointed at skistune's own call inside `sim_target`."""
    import skistune
    import skistune.profile.profile as profile_module
    from skistune.profile import FingerprintWarning

    monkeypatch.setattr(profile_module, "fingerprint_diff", lambda a, b: ["cpu_model: elsewhere -> here"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        skistune.sim_target("smollm2-135m", str(SHIPPED))
    [found] = [w for w in caught if issubclass(w.category, FingerprintWarning)]
    assert found.filename == __file__


def test_show_says_a_one_row_padding_rule_as_one_row_not_a_range(tmp_path):
    """A machine's measured rule may pad only products one row short: `--show` printed "1-1 rows short"."""
    def one_row(data):
        data["step"]["cost_model"]["rows"] = {"flip_max_rows": 64, "pad_short_by": 1, "single_row_padded": False}

    r = CliRunner().invoke(app, ["profile", "--show", str(_edited_shipped(tmp_path, one_row))])
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.replace("│", " ").split())  # (the table wraps the cell onto a second line)
    assert "ran as w @ x.T from 2 to 64 rows, padded to a multiple of 16 when 1 row short" in text
    assert "1-1" not in text


def test_a_padding_rule_reads_as_a_range_only_when_it_is_one():
    from skistune.kernels.rows import ProjectionRule
    from skistune.profile.cli import rule_text

    assert rule_text(ProjectionRule(64, 1, False)) == ("w @ x.T from 2 to 64 rows, padded to a multiple of 16 when "
                                                       "1 row short")
    assert rule_text(ProjectionRule(256, 4, True)) == ("w @ x.T from 2 to 256 rows, padded to a multiple of 16 when "
                                                       "1-4 rows short, one row as two")


def test_evaluate_json_carries_the_fingerprint_warning(tmp_path):
    """A profile measured elsewhere was said on stderr alone: `evaluate --json` had none of it (optimize's JSON had)."""
    path = _edited_shipped(tmp_path, lambda d: d["fingerprint"].update(cpu_count=4096))
    config = tmp_path / "kv.yaml"
    config.write_text("{}\n")
    result = CliRunner().invoke(app, ["evaluate", str(config), "--requests", "5", "--profile", str(path), "--json"])
    assert result.exit_code == 0, result.output
    warned = json.loads(result.stdout.strip().splitlines()[-1])["warnings"]
    assert any("cpu_count: 4096 -> " in n for n in warned)
    assert "warning:" in result.stderr and "cpu_count: 4096 -> " in result.stderr
