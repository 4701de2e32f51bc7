"""Studies in storage: `--study` resumes and adds trials, another problem under the same name is refused,
and a study whose process is killed with SIGKILL resumes with every finished trial kept."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import sqlalchemy.exc

import skistune
from skistune.workloads import load_workload

optuna.logging.set_verbosity(optuna.logging.WARNING)
PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json"
COMPLETE = optuna.trial.TrialState.COMPLETE


def run(storage, profile, **kw):
    kw = {"slo": "p99=200ms", "n_trials": 2, "validate": 0, "profile": profile, **kw}
    return skistune.optimize(load_workload("chat", requests=16), storage=storage, **kw)


def finished(url, name):
    """The search's finished trials (not those that try the best config with knobs back at the defaults)."""
    from skistune.optimize import SIMPLIFIES_ATTR

    return {t.number: (t.params, t.values) for t in
            optuna.load_study(study_name=name, storage=url).get_trials(states=(COMPLETE,))
            if SIMPLIFIES_ATTR not in t.user_attrs}


def test_study_resumes_and_adds_trials_keeping_the_old_ones(tmp_path, profile):
    url = f"sqlite:///{tmp_path / 's.db'}"
    first = run(url, profile, study_name="s", n_trials=3)
    before = finished(url, "s")
    second = run(url, profile, study_name="s", n_trials=2)
    after = finished(url, "s")
    assert len(before) == 3 and len(after) == 5 and {k: after[k] for k in before} == before
    assert first.trials == 3 and second.trials == 5
    assert second.study.get_trials()[0].user_attrs["enqueued"] == "baseline"  # queued once, not again


def test_default_name_resumes_the_same_problem_and_separates_others(tmp_path, monkeypatch, profile):
    monkeypatch.chdir(tmp_path)
    a = run(None, profile)
    b = run(None, profile)
    assert a.study.study_name == b.study.study_name and b.trials == 4
    assert (tmp_path / f"skistune-{a.study.study_name}.db").is_file()
    c = run(None, profile, slo="p99=300ms")
    assert c.study.study_name != a.study.study_name and c.trials == 2


def test_a_study_of_another_problem_is_refused(tmp_path, profile):
    url = f"sqlite:///{tmp_path / 's.db'}"
    run(url, profile, study_name="s")
    with pytest.raises(ValueError, match=r"another problem, or by an earlier skistune that described it differently "
                                         r"\(differs in: slo \(the study's \[\"tbt:p99<=200ms\"\], this run's "
                                         r"\[\"tbt:p99<=300ms\"\]\)"):
        run(url, profile, study_name="s", slo="p99=300ms")


def test_sigkill_mid_study_loses_no_finished_trial(tmp_path, profile):
    url = f"sqlite:///{tmp_path / 'k.db'}"
    cmd = [sys.executable, "-m", "skistune", "optimize", "--slo", "p99=200ms", "--requests", "16", "--trials", "500",
           "--validate", "0", "--profile", str(PROFILE), "--storage", url, "--study", "k",
           "--out", str(tmp_path / "never.yaml")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.3)
            try:
                if len(finished(url, "k")) >= 3:
                    break
            except (KeyError, sqlalchemy.exc.SQLAlchemyError):  # the study or its tables are not there yet
                continue
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    before = finished(url, "k")
    assert len(before) >= 3
    resumed = run(url, profile, study_name="k", n_trials=2)
    after = finished(url, "k")
    assert {k: after[k] for k in before} == before and len(after) == len(before) + 2
    assert resumed.feasible and not (tmp_path / "never.yaml").exists()
