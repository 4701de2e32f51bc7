"""Hostile search-space files: YAML nested thousands deep and alias bombs (refused in one line, as config files
are: the same loader reads both), 100,000 choices (the duplicate check was quadratic: 60,000 took over 90 s),
and huge values in messages (cut to their first characters)."""
from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skistune.cli import app
from skistune.config import MAX_YAML_DEPTH
from skistune.searchspace import MAX_SWITCH_NAME, load_space, parse_space

POLICY = "batching.policy: {choices: [fcfs]"


def _space(switch_choices: str, when: str = "") -> str:
    return f"switches:\n  s: {{choices: {switch_choices}}}\nknobs:\n  {POLICY}{when}}}\n"


def test_a_hundred_thousand_choices_parse_in_under_two_seconds():
    n = 100_000
    values = ", ".join(str(i) for i in range(1, n + 1))
    text = f"knobs:\n  batching.max_num_batched_tokens:\n    choices: [{values}]\n"
    start = time.process_time()
    space = parse_space(text)
    assert time.process_time() - start < 2.0
    assert space.param("batching.max_num_batched_tokens").choices == tuple(range(1, n + 1))
    with pytest.raises(ValueError, match=r"batching.max_num_batched_tokens: choice 77 is listed twice"):
        parse_space(text.replace("]", ", 77]"))


def test_conditions_over_many_values_are_checked_in_linear_time():
    n = 100_000
    values = "[" + ", ".join(str(i) for i in range(n)) + "]"
    start = time.process_time()
    space = parse_space(_space(values, f", when: {{s: {values}}}"))
    assert time.process_time() - start < 4.0  # (two lists of 100,000; comparing each with each took minutes)
    assert len(space.param("batching.policy").when[0][1]) == n


@pytest.mark.parametrize("choices, duplicate", [
    ("[1, 1.0]", "1.0"),  # equal numbers are one choice
    ("[0.0, -0.0]", "-0.0"),
    ("[a, b, a]", "'a'"),
    ("[null, 3, null]", "None"),
    ("[true, yes]", "True"),  # (YAML 1.1: yes is true)
])
def test_equal_choices_are_refused(choices: str, duplicate: str):
    with pytest.raises(ValueError, match=rf"s: choice {duplicate} is listed twice"):
        parse_space(_space(choices))


@pytest.mark.parametrize("choices, kept", [
    ("[1, true]", (1, True)),  # true is no 1 here, nor 0 false
    ("[0, false, 1.5, '1.5']", (0, False, 1.5, "1.5")),
])
def test_choices_that_only_compare_equal_in_python_are_kept_apart(choices: str, kept: tuple):
    assert parse_space(_space(choices)).param("s").choices == kept


def test_nan_choices_are_each_their_own():  # (NaN equals nothing: the old check let two through, so does this)
    choices = parse_space(_space("[.nan, .nan]")).param("s").choices
    assert len(choices) == 2 and all(math.isnan(c) for c in choices)


@pytest.mark.parametrize("when, error", [
    ("[true]", "True is not one of its values (1, 2)"),
    ("[[1]]", "[1] is not one of its values (1, 2)"),
    ("[.nan]", "nan is not one of its values (1, 2)"),
])
def test_condition_values_must_be_choices_of_what_they_test(when: str, error: str):
    with pytest.raises(ValueError, match=re.escape(f"batching.policy: when s: {error}")):
        parse_space(_space("[1, 2]", f", when: {{s: {when}}}"))
    assert parse_space(_space("[1, 2]", ", when: {s: [2.0]}")).param("batching.policy").when == (("s", (2.0,)),)


def test_hostile_space_files_are_one_line_errors(tmp_path: Path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("knobs: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ValueError, match=rf"^{deep}: not valid YAML \(nested more than {MAX_YAML_DEPTH} levels"):
        load_space(deep)
    bomb = tmp_path / "bomb.yaml"
    lines, prev = ["a: &a [x, x, x, x, x, x, x, x, x]"], "a"
    for name in "bcdefghi":
        lines.append(f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]")
        prev = name
    bomb.write_text("description:\n" + "\n".join("  " + line for line in lines) + "\nknobs:\n  " + POLICY + "}\n")
    start = time.process_time()
    with pytest.raises(ValueError, match=rf"^{bomb}: not valid YAML \(aliases expand to more than"):
        load_space(bomb)
    assert time.process_time() - start < 5


@pytest.mark.parametrize("name", ["deep", "bomb"])
def test_optimize_refuses_a_hostile_space_with_exit_2(tmp_path: Path, name: str):
    path = tmp_path / f"{name}.yaml"
    path.write_text("knobs: " + "[" * 5000 + "]" * 5000 if name == "deep" else
                    "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
                        f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdef", "bcdefg")))
    r = CliRunner().invoke(app, ["optimize", "--space", str(path), "--json"])
    assert r.exit_code == 2, r.output
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["error"].startswith(f"{path}: not valid YAML (") and r.stderr.strip() == f"error: {last['error']}"


@pytest.mark.parametrize("text, start, end", [
    ("knobs:\n  batching.policy: {choices: [" + "x" * (1 << 20) + "]}\n", "batching.policy: choice 'xxx",
     "…(1,048,576 characters) is not one of fcfs, prefix, edf"),
    ("knobs:\n  batching.policy: {choices: [[" + ", ".join(["1"] * 1000) + "]]}\n",
     "batching.policy: choice [1, 1,", "…(1,000 items) is not a str"),
    ("switches:\n  ? " + "s" * 5000 + "\n  : {choices: [1]}\nknobs:\n  " + POLICY + "}\n", "switches: sss",
     f"…(5,000 characters): a switch name is a plain identifier without dots, of at most {MAX_SWITCH_NAME} "
     "characters (dotted names are knobs; list those under knobs)"),
    (_space("[" + ", ".join(map(str, range(1000))) + "]", ", when: {s: [-1]}"), "batching.policy: when s: -1 is not "
     "one of its values (0, 1, 2,", "characters))"),
])
def test_space_errors_repeat_the_start_of_a_huge_value_only(text: str, start: str, end: str):
    with pytest.raises(ValueError) as info:
        parse_space(text, source="big.yaml")
    message = str(info.value).removeprefix("big.yaml: ")
    assert message.startswith(start) and message.endswith(end), message[:300]
    assert len(message) < 300
