"""The shipped CPU profile, loaded once for the optimizer tests (its fingerprint names this machine's
kind, not necessarily this machine: the mismatch warning is expected here)."""
import warnings
from pathlib import Path

import pytest

from skistune.profile import load_profile

SHIPPED_PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json"


@pytest.fixture(scope="session")
def profile():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_profile(SHIPPED_PROFILE)


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A fresh working directory: the default storage is a SQLite file in it."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
