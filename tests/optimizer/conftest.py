"""The shipped CPU profile, loaded once for the optimizer tests (its fingerprint names this machine's
kind, not necessarily this machine: the mismatch warning is expected here)."""
import importlib.util
import sys
import warnings
from pathlib import Path

import pytest

from skistune.profile import load_profile

SHIPPED_PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json"
SEARCH_EFFICIENCY = Path(__file__).resolve().parents[2] / "benchmarks" / "search_efficiency.py"


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


@pytest.fixture(scope="session")
def bench():
    """benchmarks/search_efficiency.py, imported as a module (it is a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("search_efficiency_bench", SEARCH_EFFICIENCY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)
