"""The edges of the CLI contract that the bad-input corpus does not show: the loaders name a file that is
not UTF-8 text, and turning click's usage errors into one line leaves help, ``no_args_is_help`` and the
exit codes of commands as they were."""
import re

import pytest
import typer
from typer.testing import CliRunner

from skistune.cli import app, cli_errors
from skistune.config import load_config
from skistune.searchspace import load_space

NOT_UTF8 = b"\xff\xfe\x00garbage"


@pytest.mark.parametrize("name", ["tuned.yaml", "tuned.json"])
def test_load_config_names_a_file_that_is_not_utf8(tmp_path, name):
    (tmp_path / name).write_bytes(NOT_UTF8)
    with pytest.raises(ValueError, match="^" + re.escape(f"{tmp_path / name}: not a config (not UTF-8 text")):
        load_config(str(tmp_path / name))


def test_load_space_names_a_file_that_is_not_utf8(tmp_path):
    (tmp_path / "space.yaml").write_bytes(NOT_UTF8)
    with pytest.raises(ValueError, match="^" + re.escape(f"{tmp_path / 'space.yaml'}: not a search space (not UTF-8")):
        load_space(tmp_path / "space.yaml")


def test_help_and_no_args_print_the_help_as_before():
    runner = CliRunner()
    shown = runner.invoke(app, ["--help"])
    assert shown.exit_code == 0 and "Usage:" in shown.stdout and "optimize" in shown.stdout and not shown.stderr
    sub = runner.invoke(app, ["optimize", "--help"])
    assert sub.exit_code == 0 and "--slo" in sub.stdout and not sub.stderr
    for argv in ([], ["workload"]):  # no_args_is_help: the help on stdout, exit code 2, no "error:"
        bare = runner.invoke(app, argv)
        assert bare.exit_code == 2 and "Usage:" in bare.stdout and "error:" not in bare.output, argv


def test_help_reflows_docstrings_and_shows_every_placeholder_and_default():
    """Docstrings are wrapped at 110 columns: help reflows them instead of breaking lines where the source
    does, and no ``<...>`` placeholder or ``[default: ...]`` text is swallowed as markup."""
    def words(*argv: str) -> str:  # the help's words, without the panels' borders
        shown = CliRunner().invoke(app, list(argv), env={"COLUMNS": "200"}).stdout  # (no token cut at "…")
        return " ".join(shown.replace("│", " ").split())

    assert "the paged KV cache; print the completions and the measured metrics" in words("--help")
    for argv, text in ((["report", "--help"], "skistune-STUDY.db"), (["optimize", "--help"], "skistune-STUDY.db"),
                       (["quality", "--help"], "[default: profiles/quality-MODEL.json")):
        assert text in words(*argv), argv


def test_exit_codes_of_commands_and_their_errors_pass_through():
    probe = typer.Typer(cls=type(typer.main.get_command(app)))

    @probe.command()
    @cli_errors
    def run(code: int = 0, fail: str = "") -> None:
        if fail:
            raise ValueError(fail)
        raise typer.Exit(code)

    @probe.command()
    def other() -> None:  # two commands: a group, as skistune is
        pass

    runner = CliRunner()
    assert runner.invoke(probe, ["run", "--code", "3"]).exit_code == 3
    assert runner.invoke(probe, ["run"]).exit_code == 0
    failed = runner.invoke(probe, ["run", "--fail", "[1, 2] and a[b]"])
    assert failed.exit_code == 2 and failed.stderr == "error: [1, 2] and a[b]\n"
    usage = runner.invoke(probe, ["run", "--code", "x"])
    assert usage.exit_code == 2 and usage.stderr.startswith("error: Invalid value for '--code'")
    assert usage.stderr.endswith("(see skistune run --help)\n") and usage.stderr.count("\n") == 1


def test_json_summaries_are_strict_json_with_null_for_infinite_figures(capsys):
    import json
    import math

    import numpy as np

    from skistune.cli import print_json

    print_json({"gain": {"capacity": math.inf}, "loss": [1.5, math.nan, np.float64(2.5)], "n": np.int64(3)})
    line = capsys.readouterr().out.strip()

    def strict(token):
        raise ValueError(token)
    assert json.loads(line, parse_constant=strict) == {"gain": {"capacity": None}, "loss": [1.5, None, 2.5], "n": 3}


def test_user_text_in_messages_is_printed_as_it_is(tmp_path):
    """Rich reads ':b:' in 'a:b:c' as an emoji code (escape() leaves those alone): a trace whose first line is
    'a:b:c' was reported as 'a🅱c'."""
    weird = tmp_path / "weird.csv"
    weird.write_text("a:b:c\n1:2:3\n")
    r = CliRunner().invoke(app, ["workload", "show", str(weird)])
    assert r.exit_code == 2 and "(first line 'a:b:c')" in r.stderr
