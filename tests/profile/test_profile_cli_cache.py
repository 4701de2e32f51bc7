"""`skistune profile` writing a profile (the measurement replaced by the tiny one), and the quick profile
that `default_profile` caches per fingerprint and model."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from profile_tiny import SHIPPED as SHIPPED_FILE

from skistune.cli import app
from skistune.profile import (
    cache_dir,
    cached_profile_path,
    default_profile,
    load_profile,
    machine_fingerprint,
    measure,
)


def test_cli_measures_writes_and_prints(tmp_path, fake_measure):
    out = tmp_path / "p.json"
    result = CliRunner().invoke(app, ["profile", "--quick", "--out", str(out), "--disk-dir", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    assert fake_measure == [("smollm2-135m", "cpu", True, tmp_path)]
    assert load_profile(out).name == "cpu-tiny"
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["path"] == str(out) and summary["power"]["source"] == "modeled"
    assert set(summary["transfers"]) == {"device_to_host", "host_to_device", "host_to_disk", "disk_to_host"}
    for label in ("step fit R²", "held-out", "scheduler overhead", "transfer host to disk",
                  "power idle / busy (modeled)"):
        assert label in result.stdout


def test_cli_default_output_is_named_after_device_and_model(tmp_path, fake_measure, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["profile"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "profiles" / "cpu-tiny.json").is_file()


@pytest.mark.parametrize("args, message", [(["--model", "nope"], "unknown preset"),
                                           (["--device", "tpu"], "expected one of cpu, cuda")])
def test_bad_model_or_device_is_one_line_before_any_progress(tmp_path, monkeypatch, fake_measure, args, message):
    monkeypatch.chdir(tmp_path)  # (where a wrongly measured profile would be written)
    result = CliRunner().invoke(app, ["profile", "--quick", *args])
    assert result.exit_code == 2 and fake_measure == []
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1  # no "loading" bar line


def test_default_profile_measures_once_then_reads_the_cache(tmp_path, fake_measure):
    first = default_profile("smollm2-135m", "cpu", folder=tmp_path)
    path = cached_profile_path("smollm2-135m", "cpu", machine_fingerprint("cpu"), tmp_path)
    assert path.is_file() and path.name.startswith("quick-cpu-smollm2-135m-")
    second = default_profile("smollm2-135m", "cpu", folder=tmp_path)
    assert second == first and len(fake_measure) == 1


def test_a_damaged_cache_entry_is_measured_again(tmp_path, fake_measure):
    path = cached_profile_path("smollm2-135m", "cpu", machine_fingerprint("cpu"), tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"format": "skistune.hardware_pro')
    default_profile("smollm2-135m", "cpu", folder=tmp_path)
    assert len(fake_measure) == 1 and load_profile(path).name == "cpu-tiny"


def test_a_cache_entry_from_before_quantized_kv_is_used_with_its_note(tmp_path, fake_measure, steady_profile):
    """Measuring again would make a user's next `skistune optimize` wait minutes for knobs it may not search."""
    path = cached_profile_path("smollm2-135m", "cpu", machine_fingerprint("cpu"), tmp_path)
    old = replace(steady_profile, steps=tuple(p for p in steady_profile.steps if p.grid["bits"] == 16))
    old.save(path)
    got = default_profile("smollm2-135m", "cpu", folder=tmp_path)
    assert len(fake_measure) == 0 and not got.measures_quantized_kv and got.quantized_kv_note is not None


def test_cli_cache_measures_the_quick_profile_again_where_optimize_reads_it(tmp_path, fake_measure, monkeypatch,
                                                                          steady_profile):
    """A drifted cached profile names the command that replaces it; that command writes nothing else."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    path = cached_profile_path("smollm2-135m", "cpu", machine_fingerprint("cpu"))
    drifted = replace(steady_profile, quick=True, drift={"decode": 1.4})
    drifted.save(path)
    named = "" if drifted.model == "smollm2-135m" else f" --model {drifted.model}"
    assert f"`skistune profile --cache{named}` replaces" in drifted.drift_note
    assert "--out FILE" in replace(drifted, quick=False).drift_note
    # (a GPU's quick profile is not the one optimize keeps for this machine: --cache would not replace it)
    gpu = replace(drifted, device="cuda").drift_note
    assert "--cache" not in gpu and f"`skistune profile --device cuda{named} --quick --out FILE` on the machine" in gpu
    result = CliRunner().invoke(app, ["profile", "--cache"])
    assert result.exit_code == 0, result.output
    assert fake_measure == [("smollm2-135m", "cpu", True, None)]  # the quick grid
    assert load_profile(path) == steady_profile and not (tmp_path / "profiles").exists()
    bad = CliRunner().invoke(app, ["profile", "--cache", "--out", str(tmp_path / "x.json")])
    assert bad.exit_code == 2 and "--cache writes the quick profile" in bad.stderr and len(fake_measure) == 1


def test_a_quick_profile_measured_on_a_busy_machine_is_not_kept(tmp_path, monkeypatch, steady_profile):
    """Measured beside a busy process, a quick profile drifted x14 within itself and every later search read it:
    `default_profile` refuses it (one line, nothing cached), re-measures such a cached entry, and `profile --cache`
    leaves the cache as it was; `profile --out` writes it with a warning."""
    busy = replace(steady_profile, quick=True, drift={"decode": 13.99, "prefill": 1.1})
    assert busy.unreliable == "decode steps ran x13.99 at the end against the start" and steady_profile.unreliable is None
    calls = []

    def profile_model(model, **kw):
        calls.append(model)
        return busy

    monkeypatch.setattr(measure, "profile_model", profile_model)
    path = cached_profile_path("smollm2-135m", "cpu", machine_fingerprint("cpu"), tmp_path)
    with pytest.raises(ValueError, match=r"cannot be trusted \(decode steps ran x13.99 .*skistune profile --cache"):
        default_profile("smollm2-135m", "cpu", folder=tmp_path)
    assert not path.exists()
    busy.save(path)  # (one cached before the check existed) is measured again
    with pytest.raises(ValueError, match="cannot be trusted"):
        default_profile("smollm2-135m", "cpu", folder=tmp_path)
    assert calls == ["smollm2-135m"] * 4  # (each measured twice: a busy moment may pass)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    r = CliRunner().invoke(app, ["profile", "--cache"])
    assert r.exit_code == 2 and "the cached quick profile is left as it was" in r.stderr
    assert not cached_profile_path("smollm2-135m", "cpu", machine_fingerprint("cpu")).exists()
    out = tmp_path / "busy.json"
    r = CliRunner().invoke(app, ["profile", "--quick", "--out", str(out)])
    assert r.exit_code == 0 and out.is_file() and "warning: this profile cannot be trusted" in r.stderr


def test_a_busy_moment_is_measured_again_before_the_command_fails(tmp_path, monkeypatch, steady_profile):
    """A fresh install's first `skistune optimize` beside a busy process had exited 2 after its minute of
    measuring; the run after it succeeded. A second measurement is taken, and kept when it is steady."""
    busy = replace(steady_profile, quick=True, drift={"decode": 2.34, "prefill": 1.0})
    measured = iter([busy, steady_profile])
    monkeypatch.setattr(measure, "profile_model", lambda model, **kw: next(measured))
    profile = default_profile("smollm2-135m", "cpu", folder=tmp_path)
    assert profile.unreliable is None
    assert cached_profile_path("smollm2-135m", "cpu", machine_fingerprint("cpu"), tmp_path).is_file()


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "skistune" / "profiles"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir().parts[-3:] == (".cache", "skistune", "profiles")


def test_refit_fits_the_same_points_again_with_this_versions_model(tmp_path, steady_profile):
    """A refit keeps the projection rule the points were measured with, and says it."""
    from skistune.kernels.rows import LEGACY_RULE
    from skistune.profile.cost import StepCostModel

    old = replace(steady_profile, step_fit=replace(steady_profile.step_fit, model=StepCostModel(
        tuple(c * 2 for c in steady_profile.step_cost.coef), steady_profile.step_cost.knee,
        steady_profile.step_cost.quant_coef, LEGACY_RULE)))
    path = old.save(tmp_path / "old.json")
    out = tmp_path / "new.json"
    result = CliRunner().invoke(app, ["profile", "--refit", str(path), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert "refitted (projections: w @ x.T from 2 to 256 rows, padded to a multiple of 16 when 1-4 rows short, " \
           "one row as two)" in " ".join(result.stderr.split())
    refitted = load_profile(out, check_fingerprint=False)
    assert refitted.step_cost.rows == LEGACY_RULE and refitted.steps == old.steps
    assert refitted.step_cost.coef != old.step_cost.coef  # fitted again
    assert load_profile(path, check_fingerprint=False).step_cost.coef == old.step_cost.coef  # --out: input kept
    both = CliRunner().invoke(app, ["profile", "--refit", str(path), "--show", str(path)])
    assert both.exit_code == 2 and "give one" in both.stderr


def test_a_cache_entry_of_an_older_format_is_not_read(tmp_path, fake_measure, steady_profile):
    """Quick profiles cached before the projection rule was measured per machine ran their steps with a fixed
    rule: the new name leaves them aside, and the profile is measured again."""
    from skistune.profile.profile import QUICK_CACHE_FORMAT

    path = cached_profile_path("smollm2-135m", "cpu", machine_fingerprint("cpu"), tmp_path)
    assert path.name.endswith(f"-v{QUICK_CACHE_FORMAT}.json")
    replace(steady_profile, name="older").save(path.with_name(path.name.replace(f"-v{QUICK_CACHE_FORMAT}", "")))
    assert default_profile("smollm2-135m", "cpu", folder=tmp_path).name == "cpu-tiny" and len(fake_measure) == 1


def test_a_drifting_quick_profile_is_measured_once_more_and_the_steadier_kept(tmp_path, monkeypatch, steady_profile):
    """A quick profile whose steps drifted x0.68 within it (usable, noted) had put the chat baseline's capacity
    8x below another of the same host: measured for a command, it is measured once more, the steadier kept."""
    drifting = replace(steady_profile, quick=True, drift={"decode": 0.68, "prefill": 0.79})
    worse = replace(steady_profile, quick=True, drift={"decode": 1.6, "prefill": 1.0})
    busy = replace(steady_profile, quick=True, drift={"decode": 2.5, "prefill": 1.0})
    assert drifting.unreliable is None and drifting.drift_factor == pytest.approx(1 / 0.68)
    for second, kept in ((steady_profile, steady_profile), (worse, drifting), (busy, drifting)):
        measured, calls = iter([drifting, second]), []
        monkeypatch.setattr(measure, "profile_model", lambda model, **kw: calls.append(model) or next(measured))
        folder = tmp_path / f"{len(calls)}-{second.drift['decode']}"
        assert default_profile("smollm2-135m", "cpu", folder=folder).drift == kept.drift and len(calls) == 2
    calls = []
    monkeypatch.setattr(measure, "profile_model", lambda model, **kw: calls.append(model) or steady_profile)
    default_profile("smollm2-135m", "cpu", folder=tmp_path / "steady")
    assert len(calls) == 1  # a steady first profile is not measured again


def test_a_cached_profile_fitted_before_the_parallel_terms_is_refitted_and_kept(tmp_path, shipped):
    """A quick profile cached before the terms for elementwise ops going parallel (`cost.parallel_rows`) is
    fitted again from its own points when read, and written back: no minute of measuring."""
    from skistune.profile.profile import read_cached_profile

    before = replace(shipped.step_cost, parallel_coef=(0.0, 0.0, 0.0), parallel_rows=())
    old = replace(shipped, step_fit=replace(shipped.step_fit, model=before))
    assert old.fitted_before_parallel_terms and not shipped.fitted_before_parallel_terms
    path = old.save(tmp_path / "quick.json")
    read, problem = read_cached_profile(path, check_fingerprint=False)
    assert problem is None and read.steps == old.steps
    assert read.step_cost.parallel_rows == (170, 56, 21) and any(read.step_cost.parallel_coef)

    def worst_miss(model) -> float:  # (over the 16-bit points, whose steps the terms price: a packing point can
        # miss more, 17.8% at 8 bits in the shipped profile, which one per-block term for every bitwidth leaves)
        return max(abs(model.predict_s(p.shape) / p.timing.median_s - 1) for p in shipped.steps
                   if p.grid.get("bits", 16) == 16)

    # (the shipped fit's own worst point, and less than half the miss without the terms)
    assert worst_miss(read.step_cost) == pytest.approx(worst_miss(shipped.step_cost), rel=1e-6)
    assert worst_miss(read.step_cost) < 0.5 * worst_miss(before)
    assert load_profile(path, check_fingerprint=False).step_cost == read.step_cost  # written back


def test_show_prints_the_parallel_terms_or_how_to_fit_them(tmp_path, shipped):
    shown = CliRunner().invoke(app, ["profile", "--show", str(SHIPPED_FILE)])
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.stdout.split())
    assert all(f"ms past {n}" in text for n in (170, 56, 21)), text
    before = replace(shipped.step_cost, parallel_coef=(0.0, 0.0, 0.0), parallel_rows=())
    path = replace(shipped, step_fit=replace(shipped.step_fit, model=before)).save(tmp_path / "old.json")
    old = CliRunner().invoke(app, ["profile", "--show", str(path)])
    assert old.exit_code == 0 and "not fitted" in old.stdout and "--refit" in old.stdout


def _before_the_mixed_term(profile, path):
    """``profile`` written as a version before the mixed term (`cost.MIXED_FEATURES`) wrote it: without it."""
    data = json.loads(profile.save(path).read_text())
    model = data["step"]["cost_model"]
    # (the packing, scored-prefill and parallel-compaction terms came after)
    assert model["features"][-6:] == ["mixed_paths", "packing_steps", "packed_blocks", "scored_prefill_tokens",
                                      "scored_prefill_pairs", "parallel_compactions"]
    model["features"], model["coef"] = model["features"][:-6], model["coef"][:-6]
    path.write_text(json.dumps(data))
    return path


def test_a_cached_profile_fitted_before_the_mixed_term_is_refitted_and_kept(tmp_path, shipped):
    """A quick profile cached before the term for decode rows beside a prefill chunk is fitted again from its
    own points (which have such steps) when read, and written back; `--show` says how to fit it meanwhile."""
    from skistune.profile.profile import read_cached_profile

    path = _before_the_mixed_term(shipped, tmp_path / "quick.json")
    old = load_profile(path, check_fingerprint=False)
    assert old.fitted_before_mixed_term and old.fitted_before_current_terms and old.step_cost.mixed_coef == (0.0,)
    assert not shipped.fitted_before_mixed_term and not shipped.fitted_before_current_terms
    shown = CliRunner().invoke(app, ["profile", "--show", str(path)])
    assert shown.exit_code == 0 and shown.stdout.count("not fitted") == 1 and "--refit" in shown.stdout  # (its row:
    # the parallel terms are fitted)
    read, problem = read_cached_profile(path, check_fingerprint=False)
    assert problem is None and read.steps == old.steps and not read.fitted_before_mixed_term
    assert read.step_cost.mixed_coef == shipped.refit_steps().step_cost.mixed_coef
    assert load_profile(path, check_fingerprint=False).step_cost == read.step_cost  # written back
    unmixed = replace(shipped, steps=tuple(p for p in shipped.steps if p.kind != "mixed"))
    assert not load_profile(_before_the_mixed_term(unmixed, tmp_path / "unmixed.json"),
                            check_fingerprint=False).fitted_before_mixed_term  # (a refit could not fit it)
