"""The bad-input corpus (`bad_inputs.CASES`) through the CLI: exit code 2, one line on stderr naming what
is wrong, no traceback, and the existing study and tuned file byte-identical afterwards."""
import pytest
from bad_inputs import CASES, prepare, run_case


@pytest.fixture(scope="module")
def paths(tmp_path_factory, profile):
    return prepare(tmp_path_factory.mktemp("bad-input"), profile)


def test_the_corpus_covers_every_kind_of_input():
    kinds = {c.kind for c in CASES}
    assert len(CASES) >= 30 and len({c.name for c in CASES}) == len(CASES)
    assert {"trace", "slo", "energy", "quality", "space", "config", "profile", "storage", "study"} <= kinds


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_line_exit_2_and_touches_nothing(paths, case):
    outcome = run_case(case, paths)
    assert outcome.exit_code == 2, outcome
    assert not outcome.traceback and len(outcome.stderr_lines) == 1, outcome.stderr_lines
    assert case.expect in outcome.stderr_lines[0]
    assert outcome.untouched, "the existing study or tuned file changed"
