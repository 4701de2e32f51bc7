"""Golden files: each exporter's output for the configs in tests/export/configs/, per engine version,
compared byte for byte. ``golden/<target>-<version>/<config>.yaml`` is the file; ``summary.json`` holds
the command lines, warnings, notes and out-of-scope knobs of that target and version.

After an intended change, regenerate them and review the diff:

    SKISTUNE_UPDATE_GOLDEN=1 python -m pytest -q tests/export/test_export_golden.py
    git diff tests/export/golden
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from export_cases import GOLDEN, GOLDEN_CONFIGS, TARGET_VERSIONS, TV_IDS, golden_config
from skistune.export import ExportResult, export

UPDATE = os.environ.get("SKISTUNE_UPDATE_GOLDEN") == "1"


def summary(result: ExportResult) -> dict:
    data = result.to_dict()
    del data["text"]
    return data


def check(path: Path, actual: str) -> None:
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(actual.encode("utf-8"))
        return
    assert path.exists(), f"{path} missing: regenerate with SKISTUNE_UPDATE_GOLDEN=1"
    assert path.read_bytes() == actual.encode("utf-8"), (
        f"{path} differs from the exporter's output; if the change is intended, regenerate with "
        "SKISTUNE_UPDATE_GOLDEN=1 and review the diff")


@pytest.mark.parametrize(("target", "version"), TARGET_VERSIONS, ids=TV_IDS)
def test_golden_files(target, version):
    folder = GOLDEN / f"{target}-{version}"
    summaries = {}
    for name in GOLDEN_CONFIGS:
        result = export(golden_config(name), target, version)
        check(folder / f"{name}.yaml", result.text)
        summaries[name] = summary(result)
    check(folder / "summary.json", json.dumps(summaries, indent=2, sort_keys=True) + "\n")


def test_no_stale_golden_folders():
    expected = {f"{t}-{v}" for t, v in TARGET_VERSIONS}
    assert {p.name for p in GOLDEN.iterdir() if p.is_dir()} <= expected
