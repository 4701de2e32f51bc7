"""This machine's cached quick profile (`default_profile`) when the cache is not what it should be: a damaged or
untrusted entry is measured again with one line saying so, an unwritable cache folder still gives the measured
profile (one warning naming the folder; it had failed the command after the minute of measuring, on every run),
and two processes with no cached profile measure it once: the second waits on the lock, then reads the first's
(a killed measurer leaves nobody waiting)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
from profile_tiny import SHIPPED
from typer.testing import CliRunner

from skistune.cli import app
from skistune.profile import (
    FingerprintWarning,
    ProfileCacheWarning,
    cached_profile_path,
    default_profile,
    load_profile,
    machine_fingerprint,
    measure,
)

MODEL = "smollm2-135m"


def _path(folder: Path | None = None) -> Path:
    return cached_profile_path(MODEL, "cpu", machine_fingerprint("cpu"), folder)


def _cache_lines(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, ProfileCacheWarning)]


def _truncated(p, path):
    path.write_text(json.dumps(p.to_dict())[:300])


def _garbage(p, path):
    path.write_bytes(b"\x00\xff\xfe\x9c" * 64)


def _wrong_shape(p, path):
    path.write_text("[1, 2, 3]")


def _field_missing(p, path):
    data = p.to_dict()
    del data["step"]
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("damage, why", [
    (_truncated, "(not valid JSON at line 1 column "), (_garbage, "(not a profile (not UTF-8 text; corrupted?)"),
    (_wrong_shape, "(profile: expected an object, got list)"), (_field_missing, "step")])
def test_a_damaged_entry_is_measured_again_with_one_line_saying_why(tmp_path, fake_measure, steady_profile,
                                                                    damage, why):
    path = _path(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    damage(steady_profile, path)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = default_profile(MODEL, "cpu", folder=tmp_path)
    [line] = _cache_lines(record)
    assert line.startswith(f"the cached profile {path} is damaged (") and line.endswith("); measuring it again")
    assert why in line and line.count(str(path)) == 1  # (the path once: not repeated inside the reason)
    assert len(fake_measure) == 1 and got == steady_profile and load_profile(path) == steady_profile  # replaced


def test_an_untrusted_entry_is_measured_again_with_one_line(tmp_path, fake_measure, steady_profile):
    path = _path(tmp_path)
    replace(steady_profile, drift={"decode": 13.99}).save(path)
    with pytest.warns(ProfileCacheWarning, match=r"cannot be trusted \(decode steps ran x13.99 .*; measuring it again"):
        default_profile(MODEL, "cpu", folder=tmp_path)
    assert len(fake_measure) == 1 and load_profile(path) == steady_profile


def test_an_unwritable_cache_folder_gives_the_measured_profile_with_one_warning(tmp_path, monkeypatch, fake_measure,
                                                                                steady_profile):
    """XDG_CACHE_HOME naming a regular file (as a read-only mount: the folder cannot be written): said before
    measuring, and the measurement is used."""
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_folder))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = default_profile(MODEL, "cpu")
    assert got == steady_profile and len(fake_measure) == 1
    assert _cache_lines(record) == [
        f"this machine's quick profile is not cached: cannot write {not_a_folder}/skistune/profiles (Not a directory); "
        "it is measured for this run only and again on the next (make the folder writable, set XDG_CACHE_HOME to "
        "one that is, or keep one with `skistune profile --quick --out FILE` and pass --profile FILE)"]


def test_a_profile_that_cannot_be_written_is_used_with_one_warning(tmp_path, monkeypatch, fake_measure,
                                                                   steady_profile):
    """The folder takes the lock, then the write fails (a read-only remount, a full disk): as above."""
    from skistune.profile.profile import HardwareProfile

    def read_only(self, path):
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(HardwareProfile, "save", read_only)
    with pytest.warns(ProfileCacheWarning, match=rf"not cached: cannot write {tmp_path} \(Read-only file system\)"):
        assert default_profile(MODEL, "cpu", folder=tmp_path) == steady_profile


@pytest.fixture
def measured_profile(tmp_path, monkeypatch) -> Path:
    """The shipped profile as this machine's fresh measurement (a model `evaluate` accepts)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FingerprintWarning)
        shipped = load_profile(SHIPPED)
    monkeypatch.setattr(measure, "profile_model", lambda model, **kw: shipped)
    config = tmp_path / "kv.yaml"
    config.write_text("offload: {host_kv_bytes: 1GB}\n")
    return config


def test_evaluate_with_an_unwritable_cache_runs_on_the_measured_profile(tmp_path, monkeypatch, measured_profile):
    """The tester's `optimize` failed with `error: [Errno 30] Read-only file system` after measuring (`evaluate`
    reads the profile through the same `profile_or_measure`)."""
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_folder))
    r = CliRunner().invoke(app, ["evaluate", str(measured_profile), "--workload", "chat", "--requests", "2"])
    assert r.exit_code == 0, r.output
    warned = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert warned == [f"warning: this machine's quick profile is not cached: cannot write {not_a_folder}/skistune/"
                      "profiles (Not a directory); it is measured for this run only and again on the next (make the "
                      "folder writable, set XDG_CACHE_HOME to one that is, or keep one with `skistune profile "
                      "--quick --out FILE` and pass --profile FILE)"]
    assert "error" not in r.stderr
    # (the line before measuring had promised "once (cached in ...)", the warning after it said the opposite)
    assert "quick profile for smollm2-135m: up to a minute, more on a busy machine, for this run only" in r.stderr
    assert "cached in" not in r.stderr


def test_evaluate_says_it_measures_a_damaged_cached_profile(tmp_path, monkeypatch, measured_profile):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = _path()
    path.parent.mkdir(parents=True)
    path.write_text('{"format": "skistune.hardware_pro')
    r = CliRunner().invoke(app, ["evaluate", str(measured_profile), "--workload", "chat", "--requests", "2"])
    assert r.exit_code == 0, r.output
    said = [line for line in r.stderr.splitlines() if "profile" in line]
    assert said[0] == (f"measuring this machine's quick profile for {MODEL}: up to a minute, more on a busy machine, "
                       f"once (cached in {path})")
    assert said[1].startswith(f"warning: the cached profile {path} is damaged (not valid JSON") and \
        said[1].endswith("; measuring it again") and len(said) == 2
    assert path.is_file() and json.loads(path.read_text())["model"] == MODEL  # measured again and cached


# a process that measures the quick profile: its measurement logs its pid, sleeps, and returns a saved profile
CHILD = """
import os, sys, time, types, warnings
from skistune.profile import default_profile, load_profile
log, source, sleep_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
def profile_model(model, **kw):
    with open(log, "a") as fh:
        fh.write(f"measuring {os.getpid()}\\n")
    time.sleep(sleep_s)
    return load_profile(source)
fake = types.ModuleType("skistune.profile.measure")
fake.profile_model = profile_model
sys.modules["skistune.profile.measure"] = fake
warnings.simplefilter("always")
print(default_profile("smollm2-135m", "cpu").name, flush=True)
"""


def _child(tmp_path: Path, source: Path, sleep_s: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "log"), str(source), str(sleep_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})


def _measuring(tmp_path: Path, child: subprocess.Popen) -> None:
    """Wait until ``child`` measures (so holds the lock)."""
    log, deadline = tmp_path / "log", time.monotonic() + 120
    while not (log.is_file() and f"measuring {child.pid}" in log.read_text()):
        assert child.poll() is None and time.monotonic() < deadline, child.communicate()
        time.sleep(0.05)


def test_two_processes_measure_once_the_second_waits_and_reads_the_first(tmp_path, steady_profile):
    source = steady_profile.save(tmp_path / "measured.json")
    first = _child(tmp_path, source, 4)
    _measuring(tmp_path, first)
    second = _child(tmp_path, source, 0)
    outs = [c.communicate(timeout=120) for c in (first, second)]
    assert [c.returncode for c in (first, second)] == [0, 0], outs
    assert [out.strip() for out, _ in outs] == ["cpu-tiny", "cpu-tiny"]
    assert (tmp_path / "log").read_text() == f"measuring {first.pid}\n"  # measured once
    assert "waiting for another skistune process measuring this machine's quick profile " \
           f"(pid {first.pid})" in outs[1][1]
    assert "waiting" not in outs[0][1]


def test_a_killed_measurer_leaves_nobody_waiting(tmp_path, monkeypatch, fake_measure, steady_profile):
    source = steady_profile.save(tmp_path / "measured.json")
    killed = _child(tmp_path, source, 600)
    _measuring(tmp_path, killed)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert default_profile(MODEL, "cpu") == steady_profile
    assert len(fake_measure) == 1 and _cache_lines(record) == [] and _path().is_file()
