"""`skistune profile`'s options: where it writes is checked before it measures, an option the chosen mode does
not read is refused, and what its table and lists say (how long it measured, which fits are flagged). The
measurement is `fake_measure`'s tiny profile: no test measures for real."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skistune.cli import app
from skistune.profile import cached_profile_path, load_profile, machine_fingerprint
from skistune.profile.fit import FitQuality


def _one_error_line(result) -> str:
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0].removeprefix("error: ")


def _json_error(result) -> str:
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert last["exit_code"] == 2
    return last["error"]


# ---- finding 1: --out and --disk-dir before the measurement ----------------------------------------------------

@pytest.mark.parametrize("where, message", [case for case in [
    (lambda d: ["--out", str(d / "outdir")], "--out {d}/outdir: is a directory (give a file name"),
    (lambda d: ["--out", str(d / "somefile.csv" / "x.json")],
     "--out {d}/somefile.csv/x.json: {d}/somefile.csv is a file, not a folder"),
    (lambda d: ["--out", str(d / "typo" / "x.json")], "--out {d}/typo/x.json: folder {d}/typo does not exist"),
    (lambda d: ["--out", "/proc/x.json"], "--out /proc/x.json: cannot create a file in /proc"),
    (lambda d: ["--disk-dir", "/nonexistent/dd", "--out", str(d / "x.json")],
     "--disk-dir /nonexistent/dd: no such directory (give an existing one)"),
    (lambda d: ["--disk-dir", str(d / "somefile.csv"), "--out", str(d / "x.json")],
     "--disk-dir {d}/somefile.csv: not a directory"),
    (lambda d: ["--disk-dir", "/proc", "--out", str(d / "x.json")], "--disk-dir /proc: cannot create a file in /proc"),
] if "/proc" not in case[1] or Path("/proc").is_dir()])  # (a folder no one may write in, even root: Linux's /proc)
def test_out_and_disk_dir_are_refused_before_anything_is_measured(tmp_path, fake_measure, where, message):
    """Both were checked after the measurement (80 s of it on a 2-core host), which was then lost: a folder given as
    --out failed as `[Errno 21] Is a directory: '.outdir.11774.73c17f15.tmp' -> 'outdir'`."""
    (tmp_path / "outdir").mkdir()
    (tmp_path / "somefile.csv").write_text("a,b\n")
    result = CliRunner().invoke(app, ["profile", "--quick", *where(tmp_path), "--json"])
    line = _one_error_line(result)
    assert line.startswith(message.format(d=tmp_path)) and _json_error(result) == line
    assert fake_measure == []  # (refused before the measurement, not after it)
    assert not (tmp_path / "x.json").exists() and list((tmp_path / "outdir").iterdir()) == []


def test_the_disk_folder_from_the_environment_and_its_free_space_are_checked_before_measuring(tmp_path, fake_measure,
                                                                                            monkeypatch):
    """A tester's read-only $SKISTUNE_DISK_DIR and 4 MiB tmpfs failed only after the measurement (56 and 72 s), the
    profile lost with a bare errno message."""
    import skistune.profile.transfers as transfers

    monkeypatch.setenv("SKISTUNE_DISK_DIR", "/proc")
    line = _one_error_line(CliRunner().invoke(app, ["profile", "--quick", "--out", str(tmp_path / "x.json")]))
    assert line.startswith("$SKISTUNE_DISK_DIR /proc: cannot create a file in /proc")
    monkeypatch.setenv("SKISTUNE_DISK_DIR", str(tmp_path))
    monkeypatch.setattr(transfers, "disk_free_bytes", lambda folder: 4 << 20)
    line = _one_error_line(CliRunner().invoke(app, ["profile", "--quick", "--out", str(tmp_path / "x.json")]))
    assert line == (f"$SKISTUNE_DISK_DIR {tmp_path}: 4.0 MiB free, and the disk tier's timings write up to 16 MiB "
                    "there: free some space, or give --disk-dir on another drive")
    assert fake_measure == []


def test_a_memory_backed_disk_folder_is_told(tmp_path):
    from skistune.profile.measure import memory_backed

    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda1 / ext4 rw 0 0\ntmpfs /tmp tmpfs rw 0 0\ntmpfs /tmpx/shm tmpfs rw 0 0\n")
    assert memory_backed("/tmp/a/b", str(mounts)) == "tmpfs"
    assert memory_backed("/tmpx", str(mounts)) is None and memory_backed("/work", str(mounts)) is None


def test_the_default_out_folder_is_checked_before_measuring(tmp_path, fake_measure, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "profiles").write_text("not a folder\n")
    line = _one_error_line(CliRunner().invoke(app, ["profile", "--quick"]))
    assert line == "the default --out profiles/cpu-smollm2-135m-quick.json: profiles is a file, not a folder"
    assert fake_measure == []


def test_a_bad_model_makes_no_default_folder(tmp_path, fake_measure, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "unknown preset" in _one_error_line(CliRunner().invoke(app, ["profile", "--model", "nope"]))
    assert not (tmp_path / "profiles").exists() and fake_measure == []


def test_cache_checks_its_disk_dir_before_measuring(tmp_path, fake_measure, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    line = _one_error_line(CliRunner().invoke(app, ["profile", "--cache", "--disk-dir", str(tmp_path / "none")]))
    assert line == f"--disk-dir {tmp_path / 'none'}: no such directory (give an existing one)" and fake_measure == []
    ok = CliRunner().invoke(app, ["profile", "--cache", "--quick", "--disk-dir", str(tmp_path)])
    assert ok.exit_code == 0, ok.output
    assert fake_measure == [("smollm2-135m", "cpu", True, tmp_path)]
    assert cached_profile_path("smollm2-135m", "cpu", machine_fingerprint("cpu")).is_file()


@pytest.mark.parametrize("out, message", [
    ("outdir", "--out {d}/outdir: is a directory (give a file name"),
    ("somefile.csv/x.json", "--out {d}/somefile.csv/x.json: {d}/somefile.csv is a file, not a folder"),
])
def test_refit_checks_its_out_before_writing(tmp_path, steady_profile, out, message):
    """`--refit P --out DIR` had failed on the rename of its temporary file, with the raw OS error."""
    (tmp_path / "outdir").mkdir()
    (tmp_path / "somefile.csv").write_text("a,b\n")
    path = steady_profile.save(tmp_path / "p.json")
    before = path.read_text()
    result = CliRunner().invoke(app, ["profile", "--refit", str(path), "--out", str(tmp_path / out), "--json"])
    line = _one_error_line(result)
    assert line.startswith(message.format(d=tmp_path)) and _json_error(result) == line
    assert path.read_text() == before and list((tmp_path / "outdir").iterdir()) == []


# ---- finding 2: options the mode does not read -------------------------------------------------------------------

@pytest.mark.parametrize("mode, extra, message", [
    ("--show", ["--quick"], "--show prints the profile as it is: --quick does not apply to it (drop it)"),
    ("--show", ["--out", "{d}/foo.json"], "--show prints the profile as it is: --out does not apply to it (drop it)"),
    ("--show", ["--model", "smollm2-135m", "--disk-dir", "{d}"],  # (the default's value, given: still refused)
     "--show prints the profile as it is: --model, --disk-dir do not apply to it (drop them)"),
    ("--refit", ["--out", "{d}/r.json", "--model", "llama-3-8b"],
     "--refit fits the file's own step points again: --model does not apply to it (drop it)"),
    ("--refit", ["--device", "cpu"], "--refit fits the file's own step points again: --device does not apply to it"),
    ("--check", ["--quick"], "--check times the file's own steps again, on its own model and device: --quick does "
                             "not apply to it (drop it)"),
    ("--check", ["--device", "cpu", "--out", "{d}/c.json"],
     "--check times the file's own steps again, on its own model and device: --device, --out do not apply to it"),
])
def test_an_option_the_mode_does_not_read_is_refused(tmp_path, steady_profile, monkeypatch, mode, extra, message):
    """`--show P --quick`, `--refit P --out R --model llama-3-8b` and `--show P --out F` had exited 0, the option
    unused; as `--cache --out` is refused."""
    from skistune.profile import check as check_module

    monkeypatch.setattr(check_module, "speed_check", lambda *a, **k: pytest.fail("timed the steps"))
    path = steady_profile.save(tmp_path / "p.json")
    before = path.read_text()
    args = ["profile", mode, str(path), *(a.format(d=tmp_path) for a in extra), "--json"]
    result = CliRunner().invoke(app, args)
    line = _one_error_line(result)
    assert line.startswith(message) and _json_error(result) == line
    assert path.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


def test_the_options_each_mode_reads_are_still_taken(tmp_path, steady_profile, fake_measure, monkeypatch):
    path = steady_profile.save(tmp_path / "p.json")
    assert CliRunner().invoke(app, ["profile", "--show", str(path), "--json"]).exit_code == 0
    refit = CliRunner().invoke(app, ["profile", "--refit", str(path), "--out", str(tmp_path / "r.json"), "--json"])
    assert refit.exit_code == 0 and (tmp_path / "r.json").is_file(), refit.output
    out = tmp_path / "m.json"
    measured = CliRunner().invoke(app, ["profile", "--model", "smollm2-135m", "--device", "cpu", "--quick", "--out",
                                        str(out), "--disk-dir", str(tmp_path)])
    assert measured.exit_code == 0 and out.is_file() and len(fake_measure) == 1, measured.output


# ---- finding 3: what the table and the flagged lists say ----------------------------------------------------------

def test_the_table_says_what_its_duration_counts(tmp_path, steady_profile, fake_measure):
    """A header read "measured ... in 73 s" for a run of 101 s: the profile's duration is its timing alone, without
    loading the model; a fresh measurement also shows the command's own time (and --json gives it as wall_s)."""
    profile = replace(steady_profile, duration_s=73.2)
    path = profile.save(tmp_path / "p.json")
    shown = CliRunner(env={"COLUMNS": "300"}).invoke(app, ["profile", "--show", str(path), "--json"])
    assert shown.exit_code == 0, shown.output
    assert "timed in 73 s (loading the model not counted)" in " ".join(shown.stdout.split())
    summary = json.loads(shown.stdout.strip().splitlines()[-1])
    assert summary["duration_s"] == 73.2 and summary["wall_s"] is None
    measured = CliRunner(env={"COLUMNS": "300"}).invoke(app, ["profile", "--out", str(tmp_path / "m.json"), "--json"])
    assert measured.exit_code == 0, measured.output
    wall_s = json.loads(measured.stdout.strip().splitlines()[-1])["wall_s"]
    assert wall_s >= 0 and f"({wall_s:.0f} s with loading the model)" in " ".join(measured.stdout.split())


def _flags_in_file(data) -> int:
    """How many fits the profile's file marks ``"flagged": true``."""
    if isinstance(data, dict):
        return int(data.get("flagged") is True) + sum(_flags_in_file(v) for v in data.values())
    if isinstance(data, list):
        return sum(_flags_in_file(v) for v in data)
    return 0


def test_a_flagged_held_out_fit_is_in_the_flagged_list_and_lines(tmp_path, steady_profile, shipped):
    """The held-out step fit was marked `flagged: true` in the JSON (R² 0.917, median error 19%) and missing from
    the `flagged` list and the stderr lines."""
    fit = steady_profile.step_fit
    weak = replace(steady_profile, step_fit=replace(
        fit, train=replace(fit.train, r2=0.99), held_out=FitQuality(r2=0.917, median_rel_error=0.19,
                                                                    max_rel_error=0.4, points=5)))
    path = weak.save(tmp_path / "weak.json")
    result = CliRunner().invoke(app, ["profile", "--show", str(path), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["step"]["held_out"]["flagged"] and "held-out step points (R² 0.917)" in summary["flagged"]
    assert "flagged: held-out step points (R² 0.917) is below the R² threshold" in result.stderr
    assert not any(name.startswith("step") for name in summary["flagged"])  # (the training points' fit is fine)
    # the list names every fit the file marks flagged, no more
    for profile in (weak, steady_profile, shipped, load_profile(path)):
        assert len(profile.flagged_fits()) == _flags_in_file(profile.to_dict())
    lines = [line for line in result.stderr.splitlines() if line.startswith("flagged:") and "R² threshold" in line]
    assert len(lines) == len(summary["flagged"]) == _flags_in_file(json.loads(path.read_text()))
