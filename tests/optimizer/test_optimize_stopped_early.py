"""Ctrl-C or SIGTERM before `skistune optimize` starts its search (reading a trace, measuring a profile, serving
the baseline alone) had ended with the exit code and nothing else: now one line says nothing was written and
how to start again, and --json ends with the stop's object, as a stop during the search does."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import skistune.optimize_cli as optimize_cli
from skistune.cli import app
from skistune.signals import Terminated

PROFILE = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json")


@pytest.mark.parametrize("stop, code, stopped", [(KeyboardInterrupt, 130, "interrupted"),
                                                 (Terminated, 143, "terminated")])
def test_a_stop_before_the_search_writes_nothing_and_says_so(tmp_path, monkeypatch, stop, code, stopped):
    def slow_check(problem):  # the last step before the search: the baseline served alone
        raise stop()

    monkeypatch.setattr(optimize_cli, "_warn_broken_alone", slow_check)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "tuned.yaml"
    result = CliRunner().invoke(app, ["optimize", "--requests", "16", "--trials", "3", "--validate", "0",
                                      "--profile", PROFILE, "--study", "s", "--out", str(out), "--json"])
    assert result.exit_code == code, result.output
    assert f"{stopped}: the search had not started: nothing written; run the same command to start it" in result.stderr
    assert "Traceback" not in result.output
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "stopped": stopped, "exit_code": code, "out": None, "study": "s", "storage": None}
    assert not out.exists()
