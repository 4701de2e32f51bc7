"""Running `skistune workload show` in the tests: its output, its JSON, and its one-line errors."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from skistune.cli import app


def run_show(*args: str, terminal_width: int | None = None):
    return CliRunner().invoke(app, ["workload", "show", *args], terminal_width=terminal_width)


def show_json(*args: str) -> dict:
    result = run_show(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def one_line_error(result, *fragments: str) -> None:
    """Exit code 2 and one ``error:`` line on stderr holding each fragment; no traceback."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
