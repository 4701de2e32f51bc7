"""`skistune profile --refit` refuses step points that do not cover what the fit predicts; `--show` flags such
a file, prints the projection passes the profile timed, and points a quality profile to `skistune quality`."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skistune.cli import app
from skistune.profile.profile import step_coverage_gaps

QUALITY = Path(__file__).resolve().parents[2] / "profiles" / "quality-smollm2-135m.json"
BATCH = "decode steps of more than one sequence"
CONTEXTS = "decode steps at two or more context lengths"
PREFILL = "prefill chunks of two or more sizes"
MIXED = "mixed steps (decodes with a prefill chunk)"


def _kept(profile, keep):
    """The profile with only the step points ``keep`` accepts, all of them training points."""
    return replace(profile, steps=tuple(replace(p, held_out=False) for p in profile.steps if keep(p)))


@pytest.mark.parametrize("keep, gaps", [
    (lambda p: p.kind == "decode" and p.grid["batch"] == 1 and p.grid["context"] == 16,
     [BATCH, CONTEXTS, PREFILL, MIXED]),
    (lambda p: p.kind == "decode" and p.grid["batch"] == 1, [BATCH, PREFILL, MIXED]),
    (lambda p: p.kind == "decode", [PREFILL, MIXED]),
    (lambda p: p.kind != "mixed", [MIXED]),
])
def test_refit_refuses_points_that_do_not_cover_the_steps_it_predicts(tmp_path, tiny_profile, keep, gaps):
    """A refit on five batch-1 decodes put a whole step in the fixed cost (27 ms for any batch and any prefill)
    and wrote the profile, unflagged."""
    few = _kept(tiny_profile, keep)
    assert step_coverage_gaps(few.steps) == gaps
    path, out = few.save(tmp_path / "few.json"), tmp_path / "refit.json"
    r = CliRunner().invoke(app, ["profile", "--refit", str(path), "--out", str(out)])
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.output
    assert "cannot refit the step cost model" in r.stderr and f"have no {', no '.join(gaps)}," in r.stderr
    assert not out.exists()
    with pytest.raises(ValueError, match="cannot refit"):
        few.refit_steps()


def test_the_measured_grids_cover_what_the_fit_predicts(tiny_profile, shipped):
    assert step_coverage_gaps(tiny_profile.steps) == [] and step_coverage_gaps(shipped.steps) == []
    assert tiny_profile.step_coverage_note is None


def test_show_flags_a_profile_whose_points_do_not_cover_its_steps(tmp_path, tiny_profile):
    path = _kept(tiny_profile, lambda p: p.kind != "mixed").save(tmp_path / "few.json")
    r = CliRunner().invoke(app, ["profile", "--show", str(path), "--json"])
    assert r.exit_code == 0, r.output
    assert f"flagged: profile cpu-tiny: its step fit's training points have no {MIXED}:" in " ".join(r.stderr.split())
    assert json.loads(r.stdout.strip().splitlines()[-1])["step_coverage"].startswith("profile cpu-tiny: its step")
    full = CliRunner().invoke(app, ["profile", "--show", str(tiny_profile.save(tmp_path / "full.json")), "--json"])
    assert "training points have no" not in full.stderr
    assert json.loads(full.stdout.strip().splitlines()[-1])["step_coverage"] is None


def test_show_prints_the_projection_passes_it_timed(tmp_path, tiny_profile):
    table = tiny_profile.step_cost.table
    assert table.rows == (1, 2, 3, 4, 8, 16, 64)  # (the tiny grid's)
    path = tiny_profile.save(tmp_path / "p.json")
    r = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["profile", "--show", str(path)])
    assert r.exit_code == 0, r.output
    lines = [" ".join(line.replace("│", " ").split()) for line in r.stdout.splitlines()]
    for label, rows in (("projection pass timed (all layers / LM head), 7 sizes: at 1 row", 1),
                        ("... at 16 rows", 16), ("... at 64 rows", 64)):
        figures = f"{table.layers(rows) * 1e3:.1f} / {table.head(rows) * 1e3:.1f} ms"
        assert any(line.startswith(label) and line.endswith(figures) for line in lines), (label, figures)
    assert any(line.startswith("quantize-on-append (one layer) R²") for line in lines)


def test_show_of_a_quality_profile_names_the_command_that_shows_it():
    r = CliRunner().invoke(app, ["profile", "--show", str(QUALITY)])
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.output
    assert f"a quality profile, not a hardware profile: print it with `skistune quality --show {QUALITY}`" in \
        " ".join(r.stderr.split())
