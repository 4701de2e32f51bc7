"""With --json, a bad input's one line is also the last line of stdout as JSON, so that a script reading that line
learns why (it found nothing there: a tester's script could not tell bad input from a crash)."""
import json

import pytest
from typer.testing import CliRunner

from skistune.cli import app


@pytest.mark.parametrize("args, error", [
    (["optimize", "--objective", "latency"], "objective 'latency': use capacity"),  # a domain error
    (["evaluate", "--bogus"], "No such option: --bogus (see skistune evaluate --help)"),  # click's usage error
    (["workload", "show", "nope"], "workload 'nope': neither a preset"),
    (["profile", "--model", "nope"], "model 'nope': unknown preset"),
    (["export", "/nonexistent/kv.yaml", "--to", "vllm"], "/nonexistent/kv.yaml"),
])
def test_bad_input_with_json_ends_stdout_with_the_error_and_exit_code(args, error):
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 2, r.output
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["exit_code"] == 2 and last["error"].startswith(error)
    assert r.stderr.strip() == f"error: {last['error']}"  # (the same line on stderr)
    plain = CliRunner().invoke(app, args)
    assert plain.exit_code == 2 and plain.stdout == ""  # (without --json, stdout stays empty)


def test_version_prints_the_installed_version_and_exits_0():
    from importlib.metadata import version

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"skistune {version('skistune')}\n"
