"""The simulation target of the shipped CPU profile, built once for the simulator tests (its fingerprint names
the machine it was measured on, not necessarily this one: the mismatch warning is expected here)."""
import warnings
from pathlib import Path

import pytest

from skistune.evaluate import sim_target

PROFILE = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json")


@pytest.fixture(scope="session")
def shipped_target():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sim_target("smollm2-135m", PROFILE)
