"""Two runs in one folder both write skistune-tuned.yaml: the second says, in one line, which file it replaced and,
for a tuned config, which study it came from (the file's format is unchanged)."""
import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from skistune.cli import app

PROFILE = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json")


def run(*args):
    return CliRunner().invoke(app, ["optimize", "--slo", "p99=200ms", "--requests", "16", "--trials", "2",
                                    "--validate", "0", "--profile", PROFILE, "--json", *args])


def replaced_lines(r) -> list[str]:
    return [line for line in r.stderr.splitlines() if "existed and was replaced" in line]


def test_a_second_run_says_which_study_the_file_it_replaced_came_from(here):
    first = run("--study", "one")
    assert first.exit_code == 0, first.output
    assert replaced_lines(first) == [] and json.loads(first.stdout.splitlines()[-1])["replaced"] is None
    created = yaml.safe_load((here / "skistune-tuned.yaml").read_text())["provenance"]["created"]
    second = run("--study", "two")  # another problem's study, the same default --out
    assert second.exit_code == 0, second.output
    assert replaced_lines(second) == [f"note: skistune-tuned.yaml existed and was replaced: it held the tuned config "
                                      f"of study one, written {created}"]
    assert json.loads(second.stdout.splitlines()[-1])["replaced"] == {"study": "one", "created": created}
    assert yaml.safe_load((here / "skistune-tuned.yaml").read_text())["provenance"]["search"]["study"] == "two"
    created = yaml.safe_load((here / "skistune-tuned.yaml").read_text())["provenance"]["created"]
    third = run("--study", "two")
    assert third.exit_code == 0, third.output
    assert replaced_lines(third) == [f"note: skistune-tuned.yaml existed and was replaced: it held the tuned config "
                                     f"of this same study, an earlier run, written {created}"]


def test_an_explicit_out_that_is_not_a_tuned_config_is_named_too(here):
    (here / "mine.yaml").write_text("a: [1, 2\n")  # (not even YAML)
    r = run("--out", "mine.yaml")
    assert r.exit_code == 0, r.output
    assert replaced_lines(r) == ["note: mine.yaml existed and was replaced (it was not a skistune tuned config)"]
    assert json.loads(r.stdout.splitlines()[-1])["replaced"] == {"study": None, "created": None}
    assert "provenance" in yaml.safe_load((here / "mine.yaml").read_text())


def test_a_file_nested_thousands_deep_where_the_out_file_goes_is_named_not_a_traceback(tmp_path):
    """The file --out replaces may hold anything: reading it to name it had raised RecursionError (yaml.safe_load
    on 5,000 nested lists), which nothing caught."""
    from skistune.optimize_cli import replaced_file

    out = tmp_path / "t.yaml"
    out.write_text("provenance: " + "[" * 5000 + "]" * 5000 + "\n")
    assert replaced_file(out)["study"] is None  # (not a tuned config, named as such)
