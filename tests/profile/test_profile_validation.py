"""A profile file that cannot be read back is a one-line error naming the file and the field: from the
API as ``ValueError``, from the CLI with exit code 2 and no traceback."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skistune.cli import app
from skistune.profile import load_profile


def _set(path: tuple, value):
    def edit(data):
        target = data
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return edit


def _drop(path: tuple):
    def edit(data):
        target = data
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return edit


BAD_EDITS = {
    "wrong type of a timing": (_set(("step", "points", 0, "timing", "median_s"), "fast"),
                               "step.points[0].timing.median_s: expected a finite number"),
    "negative time": (_set(("step", "points", 2, "timing", "median_s"), -1.0), "step.points[2].timing.median_s"),
    "missing power": (_drop(("power",)), "profile.power: missing"),
    "missing fingerprint field": (_drop(("fingerprint", "torch_version")), "fingerprint.torch_version: missing"),
    "fingerprint field of the wrong type": (_set(("fingerprint", "cpu_count"), "two"),
                                            "fingerprint.cpu_count: expected int"),
    "negative coefficient": (_set(("step", "cost_model", "coef", 1), -1e-3), "non-negative coefficient"),
    "cost model without its knee": (_drop(("step", "cost_model", "knee_tokens")),
                                    "step.cost_model.knee_tokens: missing"),
    "shape with a stray field": (_set(("step", "points", 0, "shape", "num_blocks"), 3), "step.points[0].shape"),
    "unknown step kind": (_set(("step", "points", 0, "kind"), "verify"), "step.points[0].kind: 'verify'"),
    "unknown device": (_set(("device",), "tpu"), "profile.device: 'tpu' is not one of cpu, cuda"),
    "unknown transfer link": (_set(("transfers", "host_to_cloud"), {}), "transfers.host_to_cloud: unknown link"),
    "unknown power source": (_set(("power", "source"), "guess"), "power.source: 'guess'"),
    "no step points": (_set(("step", "points"), []), "step.points: empty"),
    "another format": (_set(("format",), "vidur-profile"), "format: 'vidur-profile'"),
    "a newer version": (_set(("version",), 99), "version: 99"),
    "free disk space as text": (_set(("disk_free_bytes",), "70GB"), "profile.disk_free_bytes: expected an integer"),
    "negative free disk space": (_set(("disk_free_bytes",), -1), "profile.disk_free_bytes: -1 is below 0"),
    "drift of an unknown kind": (_set(("drift",), {"mixed": 1.0}), "profile.drift: expected an object"),
    "drift that is not a number": (_set(("drift",), {"decode": "x1.2"}), "profile.drift.decode: expected a finite"),
}


@pytest.mark.parametrize("case", sorted(BAD_EDITS))
def test_bad_field_names_the_file_and_the_field(edited, case):
    edit, message = BAD_EDITS[case]
    path = edited(edit)
    with pytest.raises(ValueError) as info:
        load_profile(path, check_fingerprint=False)
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)


def _bad_files(tmp_path: Path, good: Path) -> dict[str, tuple[Path, str]]:
    text = good.read_text()
    cases = {"truncated": (text[: len(text) // 2], "not valid JSON"), "empty": ("", "not valid JSON"),
             "a list": ("[1, 2]", "profile: expected an object"), "not text": (b"\xff\xfe\x00garbage", "not UTF-8")}
    out = {}
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name.replace(' ', '-')}.json"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        out[name] = (path, message)
    out["missing"] = (tmp_path / "absent.json", "cannot read profile")
    return out


def test_corrupted_files_are_one_line_errors(tmp_path, edited):
    for name, (path, message) in _bad_files(tmp_path, edited()).items():
        with pytest.raises(ValueError, match=message) as info:
            load_profile(path)
        assert str(info.value).startswith(str(path)) and "\n" not in str(info.value), name


def test_cli_show_exits_2_with_one_line_and_no_traceback(tmp_path, edited):
    bad = _bad_files(tmp_path, edited())
    bad["wrong type"] = (edited(_set(("kv_bytes_per_token",), 12.5), "typed.json"), "kv_bytes_per_token")
    for name, (path, message) in bad.items():
        result = CliRunner().invoke(app, ["profile", "--show", str(path)])
        assert result.exit_code == 2, (name, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (name, result.stderr)
        assert "Traceback" not in result.output


# Each was read as it converted: a knee of -3 (or 2.5, "8") changed every prediction past it; a string
# coefficient was a bare "could not convert string to float: 'a'" naming no field.
COST_MODEL_EDITS = {
    "negative knee": (("knee_tokens",), -3, "step.cost_model.knee_tokens: -3 is negative"),
    "fractional knee": (("knee_tokens",), 2.5, "step.cost_model.knee_tokens: expected an integer, got 2.5"),
    "knee as text": (("knee_tokens",), "8", "step.cost_model.knee_tokens: expected an integer, got '8'"),
    "knee as a flag": (("knee_tokens",), True, "step.cost_model.knee_tokens: expected an integer, got True"),
    "coefficient as text": (("coef", 2), "a", "step.cost_model.coef[2]: expected a finite number, got 'a'"),
    "coefficient as a flag": (("coef", 0), False, "step.cost_model.coef[0]: expected a finite number, got False"),
    "coefficients not a list": (("coef",), 0.1, "step.cost_model.coef: expected a list, got float"),
    "small_rows of zero": (("small_rows",), 0, "step.cost_model.small_rows: 0 is below 1"),
    "rule of unknown fields": (("rows",), {"flip": 1}, "step.cost_model.rows: projection rule: expected the fields"),
    "not an object": ((), [1, 2], "step.cost_model: expected an object, got list"),
}


def _edit_cost_model(path: tuple, value):
    def edit(data):
        if not path:
            data["step"]["cost_model"] = value
        else:
            _set(("step", "cost_model", *path), value)(data)
    return edit


def _coef_count(data, n):
    data["step"]["cost_model"]["coef"] = data["step"]["cost_model"]["coef"][:n]


@pytest.mark.parametrize("case", sorted(COST_MODEL_EDITS))
def test_a_bad_cost_model_field_is_one_line_naming_it_through_show(edited, case):
    path, value, message = COST_MODEL_EDITS[case]
    bad = edited(_edit_cost_model(path, value), "bad.json")
    result = CliRunner().invoke(app, ["profile", "--show", str(bad)])
    assert result.exit_code == 2, (case, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {bad}: {message}"), result.stderr
    assert "Traceback" not in result.output


def test_a_coefficient_count_that_is_not_the_feature_count_is_named(edited):
    bad = edited(lambda d: _coef_count(d, 5), "short.json")
    result = CliRunner().invoke(app, ["profile", "--show", str(bad)])
    n = len(json.loads(edited().read_text())["step"]["cost_model"]["features"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {bad}: step.cost_model.coef: needs one coefficient per feature ({n}), got 5"]


def test_the_projection_table_is_checked_field_by_field(edited):
    table = {"rows": [1, "2"], "layers_s": [0.01, 0.02], "head_s": [0.001, 0.002]}
    with pytest.raises(ValueError) as info:
        load_profile(edited(_set(("step", "cost_model", "projection_table"), table), "t.json"),
                     check_fingerprint=False)
    assert str(info.value).endswith(": step.cost_model.projection_table.rows[1]: expected an integer, got '2'")
    table = {"rows": [2, 1], "layers_s": [0.01, 0.02], "head_s": [0.001, 0.002]}
    with pytest.raises(ValueError, match=r"step\.cost_model\.projection_table: rows must increase"):
        load_profile(edited(_set(("step", "cost_model", "projection_table"), table), "u.json"),
                     check_fingerprint=False)


def test_a_knee_of_zero_still_loads(edited):
    """Every token past the knee: the arithmetic holds (a knee is a count of tokens, not a flag)."""
    assert load_profile(edited(_set(("step", "cost_model", "knee_tokens"), 0)), check_fingerprint=False) \
        .step_cost.knee == 0


def test_cli_rejects_unknown_model_and_device():
    for args, message in ((["--model", "gpt-9"], "unknown preset"), (["--device", "tpu"], "--device 'tpu'")):
        result = CliRunner().invoke(app, ["profile", *args])
        assert result.exit_code == 2 and message in result.stderr, result.output


def test_a_valid_file_still_loads(edited):
    assert load_profile(edited(), check_fingerprint=False).name == "cpu-tiny"
    assert json.loads(edited().read_text())["format"] == "skistune.hardware_profile"


def test_a_step_fit_that_misses_its_held_out_points_is_noted_wherever_it_predicts(tmp_path):
    """A quick profile whose step fit missed its held-out points by 94% at the median (R² 0.27) had been used by
    evaluate and optimize with no word; only `skistune profile --show` flagged it."""
    import json
    import warnings

    from skistune.profile import load_profile, shipped_profiles
    from skistune.simulator import target_from_profile

    data = json.loads(shipped_profiles()["cpu-smollm2-135m"].read_text())
    data["step"]["fit"]["held_out"] = {"r2": 0.27, "median_rel_error": 0.939, "max_rel_error": 0.981, "points": 15,
                                       "flagged": True}
    (tmp_path / "weak.json").write_text(json.dumps(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        profile = load_profile(tmp_path / "weak.json")
        shipped = load_profile("cpu-smollm2-135m")
    assert profile.step_fit_note == (
        f"profile {profile.name}: its step-time fit misses its held-out points by 94% at the median, R² 0.27: "
        "predictions from it carry errors that large; measure it again (`skistune profile`)")
    assert profile.step_fit_note in target_from_profile(profile, "smollm2-135m").notes
    assert shipped.step_fit_note is None and not any("step-time fit" in n for n in
                                                     target_from_profile(shipped, "smollm2-135m").notes)
