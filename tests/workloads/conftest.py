"""Fixtures for the workload tests."""
from __future__ import annotations

from pathlib import Path

import pytest

from workload_paths import TRACES


@pytest.fixture(scope="session", autouse=True)
def traces_present() -> None:
    """The samples are part of the test setup: fail loudly (never skip) when they are missing."""
    assert TRACES.is_dir(), f"trace samples not found at {TRACES.resolve()}"


@pytest.fixture
def write(tmp_path: Path):
    """Write a small trace file into tmp_path and return its path."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return _write
