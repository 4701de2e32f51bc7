"""`skistune report` on a study that `skistune optimize` still writes: every count comes from one reading of
the trials (read apart, the title had said "15 trials" and the constraints table "0 of 7"), and a note says
that another process still runs the study, so that the report is a snapshot."""
import re

import optuna
import pytest
from report_fixtures import make_study
from typer.testing import CliRunner

import skistune.report as report_module
from skistune.cli import app
from skistune.report import build_report, report_lines, report_tables, summary


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return make_study(tmp_path_factory.mktemp("snapshot"), seed=2)


class GrowingStudy:
    """A study that another process keeps adding finished trials to: each reading of its trials finds one more
    (of the real study's), as reads a few seconds apart did while optimize ran."""

    def __init__(self, study, first: int = 1) -> None:
        self._study, self._all, self.shown, self.reads = study, study.get_trials(deepcopy=False), first, 0

    def get_trials(self, deepcopy: bool = True, states=None):
        self.reads += 1
        trials = self._all[:self.shown]
        self.shown = min(self.shown + 1, len(self._all))
        return [t for t in trials if states is None or t.state in states]

    @property
    def trials(self):
        return self.get_trials()

    def __getattr__(self, name):
        return getattr(self._study, name)


def counts_shown(rep) -> tuple[int, set[int]]:
    """The trials the best configs' title counts, and the totals the constraints table says ("x of N")."""
    tables = {t.title.split(" ")[0]: t for t in report_tables(rep)}
    title = re.search(r"\((\d+) trials?", tables["Best"].title)
    cells = list(tables["Constraints:"].columns[1].cells)
    return int(title.group(1)), {int(c.split(" of ")[1]) for c in cells}


def test_every_count_of_the_report_comes_from_one_reading_of_the_trials(study, monkeypatch):
    _, storage = study
    real = report_module.load_study
    growing = []

    def load_while_running(name, storage=None):
        found, problem, label = real(name, storage)
        growing.append(GrowingStudy(found))
        return growing[0], problem, label

    monkeypatch.setattr(report_module, "load_study", load_while_running)
    rep = build_report("t", storage=storage)
    assert growing[0].reads == 1  # the trials read once: nothing else asked the storage
    title, totals = counts_shown(rep)
    assert rep.searched_trials + rep.simplifying_trials == len(rep.evaluations) == 1
    assert title == 1 and totals == {1}
    assert summary(rep, {})["trials"] == 1


def test_a_study_another_process_still_runs_is_reported_as_a_snapshot(study, tmp_path):
    _, storage = study
    before = build_report("t", storage=storage)
    assert before.running_trials == 0 and not any("still running" in line for line in report_lines(before))
    running = optuna.load_study(study_name="t", storage=storage)
    trial = running.ask()  # (another process's trial, started and not finished)
    try:
        rep = build_report("t", storage=storage)
        notes = [line for line in report_lines(rep) if "still running" in line]
        assert notes == ["note: another process is still running study t (1 trial running, or left by a process "
                         "stopped less than 20 s ago): this report is a snapshot of the trials finished when it was "
                         "read; run it again when the search ends"]
        # the counts are the finished trials', as before the trial started
        assert rep.searched_trials == before.searched_trials and len(rep.evaluations) == len(before.evaluations)
        assert summary(rep, {})["running_trials"] == 1
        r = CliRunner().invoke(app, ["report", "t", "--storage", storage, "--out-dir", str(tmp_path / "out")])
        assert r.exit_code == 0, r.output
        assert "another process is still running study t" in " ".join(r.output.split())
        assert "still running" in (tmp_path / "out" / "report.html").read_text()
    finally:
        running.tell(trial, state=optuna.trial.TrialState.FAIL)
