"""Every command's module can be imported first, before `skistune.cli` (a script importing
`skistune.workloads.cli` for its option types had hit a circular import): what they share lives in
`skistune.cli_base`, which imports no command."""
from __future__ import annotations

import subprocess
import sys

import pytest

COMMAND_MODULES = ("skistune.workloads.cli", "skistune.optimize_cli", "skistune.evaluate_cli", "skistune.profile.cli",
                   "skistune.export_cli", "skistune.worker_cli", "skistune.quality_cli", "skistune.report_cli")


@pytest.mark.parametrize("module", COMMAND_MODULES)
def test_a_command_module_imports_first_and_the_program_is_whole(module):
    code = (f"import {module}\nimport skistune.cli\n"
            "import typer.main\n"
            "print(' '.join(sorted(typer.main.get_command(skistune.cli.app).commands)))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == sorted(["demo", "profile", "optimize", "evaluate", "export", "worker", "quality",
                                         "report", "workload"])


def _openmp_after(code: str, **env: str) -> list[str]:
    """OMP_WAIT_POLICY, skistune.openmp_wait() and skistune.TORCH_LOADED_FIRST in a fresh process running
    ``code`` then printing them, with the policy variables cleared and ``env`` set."""
    import os

    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "SKISTUNE_OMP_WAIT")}
    code += ("\nimport os, skistune\n"
             "print(os.environ.get('OMP_WAIT_POLICY'), skistune.openmp_wait(), skistune.TORCH_LOADED_FIRST, sep='|')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**clean, **env})
    assert run.returncode == 0, run.stderr
    return run.stdout.strip().splitlines()[-1].split("|")


def test_skistune_sets_openmp_to_sleep_only_before_torch_loads():
    """OpenMP reads its wait policy when torch loads it: set after that, it would be recorded in profiles but
    not in effect."""
    assert _openmp_after("import skistune") == ["PASSIVE", "passive", "False"]
    assert _openmp_after("import torch") == ["None", "default", "True"]
    assert _openmp_after("import skistune", SKISTUNE_OMP_WAIT="spin") == ["None", "default", "False"]
    assert _openmp_after("import skistune", OMP_WAIT_POLICY="active", GOMP_SPINCOUNT="100") == [
        "active", "active, spin count 100", "False"]


def test_benchmarks_import_skistune_before_torch():
    """A benchmark that loaded torch first ran its replays with spinning OpenMP threads against a profile the
    command line measured with sleeping ones (x0.6 of its decode steps on an Intel host). `bench_args`
    imports skistune: each script imports it, or skistune, before torch."""
    import ast
    from pathlib import Path

    late = []
    for script in sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py")):
        names = []
        for node in ast.parse(script.read_text()).body:
            if isinstance(node, ast.Import):
                names += [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.append(node.module.split(".")[0])
        if "torch" in names:
            first = min((names.index(n) for n in ("bench_args", "skistune") if n in names), default=len(names))
            if first > names.index("torch"):
                late.append(script.name)
    assert late == []
