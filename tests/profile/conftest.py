"""Fixtures for the profile tests: a profile measured once per session on a tiny random Llama (a few
seconds), the shipped SmolLM2 profile, and a writer for edited copies of a profile file."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from profile_tiny import SHIPPED, TINY_GRID, tiny_runtime

from skistune.profile import FingerprintWarning, HardwareProfile, load_profile
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
