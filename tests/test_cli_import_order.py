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
