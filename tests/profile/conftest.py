"""Fixtures for the profile tests: a profile measured once per session on a tiny random Llama (a few
seconds), the shipped SmolLM2 profile, a writer for edited copies of a profile file, and the measurement of
`skistune profile` replaced by the tiny profile (`fake_measure`: no test measures for minutes)."""
from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
from profile_tiny import SHIPPED, TINY_GRID, tiny_runtime

from skistune.profile import FingerprintWarning, HardwareProfile, load_profile, measure
from skistune.profile.measure import measure_profile


@pytest.fixture(scope="session")
def tiny_profile() -> HardwareProfile:
    return measure_profile(tiny_runtime(), TINY_GRID, name="cpu-tiny", model="tiny", quick=True)


@pytest.fixture(scope="session")
def shipped() -> HardwareProfile:
    """The profile shipped in profiles/: part of the repository, so it must be there (never skipped).
    Loaded quietly: on another machine it warns, its fingerprint being the measuring machine's."""
    assert SHIPPED.is_file(), f"shipped profile missing: {SHIPPED}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FingerprintWarning)
        return load_profile(SHIPPED)


@pytest.fixture
def edited(tmp_path: Path, tiny_profile: HardwareProfile):
    """Write the tiny profile's JSON after ``edit(data)`` changed it; returns the file's path."""

    def _edited(edit=lambda data: None, name: str = "edited.json") -> Path:
        data = tiny_profile.to_dict()
        edit(data)
        path = tmp_path / name
        path.write_text(json.dumps(data))
        return path

    return _edited


@pytest.fixture
def steady_profile(tiny_profile):
    """The tiny profile as measured on a quiet machine: its drift and its fit's misses are the test machine's
    load while it was measured (a busy CI host had made the quick profile 'unreliable': drift x2.80 once, a fit
    missing its steps by 31% at the median another time), which these tests do not check."""
    fit = tiny_profile.step_fit
    quiet_fit = replace(fit, train=replace(fit.train, median_rel_error=min(fit.train.median_rel_error, 0.05)))
    return replace(tiny_profile, drift={kind: 1.0 for kind in tiny_profile.drift}, step_fit=quiet_fit)


@pytest.fixture
def fake_measure(monkeypatch, steady_profile):
    """Replace the real measurement (a minute for SmolLM2) with the tiny profile; record the calls."""
    calls = []

    def profile_model(model, *, device="cpu", quick=False, disk_dir=None, progress=None, grid=None):
        calls.append((model, device, quick, disk_dir))
        if progress is not None:
            progress("decode step: batch 1, context 32", 1, 2)
            progress("power: modeled", 2, 2)
        return steady_profile

    monkeypatch.setattr(measure, "profile_model", profile_model)
    return calls
