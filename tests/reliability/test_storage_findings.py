"""Storage, resume and worker processes: an in-memory SQLite URL is refused in one line; two runs of one study
started together do not propose the same configs, and each counts and notes only its own trials; every
trial records the process that ran it; a resumed study says which trials a stopped process left running;
SIGTERM stops a search as Ctrl-C does; the workers of `--jobs` stop when their parent is killed and share
one timeout with it; `skistune worker` takes its study as `skistune report` does; storage errors name
the missing driver, or say that journal files are not supported."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import optuna
import pytest
import sqlalchemy.exc
from reliability_helpers import PROFILE, SLO, create_study, skistune_cmd, stored_trials, subprocess_env, wait_for
from typer.testing import CliRunner

import skistune.optimize as opt
import skistune.search as search_module
import skistune.study_storage as study_storage
from skistune.cli import app
from skistune.optimize import build_problem, open_storage, solve
from skistune.search import running_notes
from skistune.workloads import load_workload

COMPLETE, RUNNING, FAIL = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING,
                           optuna.trial.TrialState.FAIL)
IN_MEMORY = "an in-memory SQLite database can be neither shared with workers nor resumed"


def cli(*args):
    return CliRunner().invoke(app, list(args))


def error_lines(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.strip()]


# ---- 1. in-memory SQLite ---------------------------------------------------------------------------------
@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///", "sqlite:///:memory:", "sqlite:///file::memory:"])
def test_an_in_memory_sqlite_url_is_refused(url):
    with pytest.raises(ValueError, match=f"storage {url}: {IN_MEMORY}; give a SQLite file"):
        open_storage(url)


def test_optimize_on_in_memory_sqlite_is_one_line_and_exit_2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = cli("optimize", "--slo", SLO, "--requests", "8", "--trials", "1", "--validate", "0", "--profile",
            str(PROFILE), "--storage", "sqlite:///", "--study", "X")
    assert r.exit_code == 2, r.output
    assert error_lines(r)[-1].startswith(f"error: storage sqlite:///: {IN_MEMORY}")
    assert "Traceback" not in r.output and "adds trials" not in r.output
    assert not (tmp_path / "skistune-tuned.yaml").exists()


# ---- 2. two runs of one study at once ----------------------------------------------------------------------
def _two_handles(tmp_path):
    """One study opened twice, as two processes would."""
    storage = open_storage(f"sqlite:///{tmp_path / 'two.db'}")
    optuna.create_study(study_name="two", storage=storage)
    return [optuna.load_study(study_name="two", storage=storage) for _ in range(2)]


def test_two_runs_started_together_propose_different_params(tmp_path):
    """Seeded alike (the same seed, the same study size), they take turns: each sees the other's trial
    number first and switches to a random seed before sampling, so no config is proposed twice."""
    def make(seed):
        return optuna.samplers.RandomSampler(seed=seed)

    a, b = _two_handles(tmp_path)
    runs = opt._RunSampler(a, make, 5), opt._RunSampler(b, make, 5)
    for _ in range(3):
        for study in (a, b):
            study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    xs = [t.params["x"] for t in a.get_trials()]
    assert len(set(xs)) == 6, xs
    assert [r.joined for r in runs] == [2, 1]  # a's second trial is number 2; b's first is number 1
    assert isinstance(a.sampler, optuna.samplers.RandomSampler)  # (still the sampler's own type)


def test_a_run_alone_keeps_the_sequence_of_its_seed(tmp_path):
    def make(seed):
        return optuna.samplers.RandomSampler(seed=seed)

    study, _ = _two_handles(tmp_path)
    run = opt._RunSampler(study, make, 5)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
    reference = optuna.create_study(sampler=make(5))
    reference.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
    assert run.joined is None and run.note() is None
    assert [t.params for t in study.get_trials()] == [t.params for t in reference.get_trials()]


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # (ask and tell, as another process)
def test_a_run_counts_its_own_trials_and_notes_another_process(tmp_path, profile):
    """Another process's trial, made while this run searches: the progress does not count it, the run's
    next trial samples with a new seed, and the result says so."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    problem = build_problem(load_workload("chat", requests=16), slo=SLO, profile=profile)
    done = []

    def progress(p):
        done.append(p.done)
        if len(done) == 1:  # "another process": a trial of its own, tagged with its host and pid
            other = optuna.load_study(study_name="shared", storage=open_storage(url))
            trial = other.ask()
            trial.set_user_attr("worker", {"host": "elsewhere", "pid": 1, "seed": 0})
            other.tell(trial, 1.0)

    result = solve(problem, n_trials=3, storage=url, study_name="shared", validate=0, progress=progress)
    assert done == [1, 2, 3]  # (was [1, 3, 4]: the other process's trial counted as this run's)
    joined = [n for n in result.notes if n.startswith("another process searched study shared")]
    assert len(joined) == 1 and "(from trial 2)" in joined[0], result.notes
    tags = [t.user_attrs["worker"] for t in stored_trials(url, "shared")[:4]]
    assert [tag["pid"] for tag in tags] == [os.getpid(), 1, os.getpid(), os.getpid()]
    assert tags[0]["seed"] == 1 and tags[2]["seed"] == tags[3]["seed"] != 1  # seed 0 + 1 trial (the baseline)


# ---- 3. resume after a kill; SIGTERM; the workers of a killed parent ----------------------------------------
def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # (ask and tell, as another process)
def test_a_resume_says_which_trials_a_stopped_process_left_running(tmp_path, profile):
    url = f"sqlite:///{tmp_path / 'r.db'}"
    study = create_study(url, "r", profile).study
    host = socket.gethostname()
    for pid in (_dead_pid(), os.getpid()):  # a killed process's trial, and one of a process still running
        trial = study.ask()
        trial.set_user_attr("worker", {"host": host, "pid": pid, "seed": 0})
    assert running_notes(study) == [
        "trial 1 left running by a stopped process: retried once its heartbeat is 20 s stale (by this run if it "
        "lasts that long, else by the next)",
        "another process is running study r (1 trial running, or left by a process stopped less than 20 s ago): "
        "this run adds its trials to the same study"]


def _optimize_cmd(tmp_path, study, *extra):
    return skistune_cmd("optimize", "--slo", SLO, "--requests", "48", "--trials", "300", "--validate", "0",
                        "--profile", str(PROFILE), "--storage", f"sqlite:///{tmp_path / 'sig.db'}", "--study", study,
                        "--out", str(tmp_path / "never.yaml"), *extra)


def _complete(url, study, n):
    def enough():
        try:
            return len([t for t in stored_trials(url, study) if t.state == COMPLETE]) >= n
        except (KeyError, sqlalchemy.exc.SQLAlchemyError):  # not created yet
            return False
    return enough


def test_sigterm_stops_a_search_as_ctrl_c_does(tmp_path):
    url = f"sqlite:///{tmp_path / 'sig.db'}"
    proc = subprocess.Popen(_optimize_cmd(tmp_path, "t", "--json"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=subprocess_env())
    try:
        wait_for(_complete(url, "t", 2), timeout_s=120, every_s=0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-2000:]
    line = err.rstrip().splitlines()[-1]
    done = re.fullmatch(r"terminated: study t keeps its finished trials \((\d+) from this run; nothing written\); "
                        r"rerun `(skistune optimize .*)` to resume", line)
    assert done, line
    assert "--study t" in done[2] and f"--storage {url}" in done[2]  # (the command that resumes, to paste)
    states = [t.state for t in stored_trials(url, "t")]
    assert RUNNING not in states and states.count(COMPLETE) >= 2  # the trial it stopped in is failed, not left
    assert not (tmp_path / "never.yaml").exists()
    # with --json, the last line says why there is no result, and where the kept trials are
    assert json.loads(out.splitlines()[-1]) == {"stopped": "terminated", "exit_code": 143, "out": None, "study": "t",
                                                "storage": url, "trials_this_run": int(done[1]), "rerun": done[2]}


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # (gone meanwhile)
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever adopted it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_workers_of_a_killed_parent_stop_too(tmp_path):
    url = f"sqlite:///{tmp_path / 'sig.db'}"
    proc = subprocess.Popen(_optimize_cmd(tmp_path, "j", "--jobs", "2"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=subprocess_env())
    workers = []
    try:
        wait_for(_complete(url, "j", 3), timeout_s=120, every_s=0.1)  # the baseline, then the workers' trials
        workers = _children(proc.pid)
        proc.kill()
        proc.wait(timeout=30)
        assert len(workers) == 2
        # (they ran on for all 300 trials before): each stops in the trial it is in
        wait_for(lambda: not any(_running(w) for w in workers), timeout_s=60, every_s=0.1)
    finally:
        for w in workers:
            if _running(w):
                os.kill(w, signal.SIGKILL)
    assert len([t for t in stored_trials(url, "j") if t.state == COMPLETE]) < 300


def test_a_killed_workers_running_trial_fails_at_once_and_this_process_runs_its_share(tmp_path, profile, monkeypatch):
    """A worker killed inside a trial (the kernel's OOM killer, a user's kill -9): the run still adds the trials
    it was asked for, and the trial it left running is failed and queued again at once, not 20 s later."""
    url = f"sqlite:///{tmp_path / 'take.db'}"
    first = tmp_path / "first"
    real_worker, real_trial_function = search_module._worker, search_module._trial_function

    def worker(*args):
        try:  # (forked: the first worker to get here dies inside its second trial)
            fd = os.open(first, os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return real_worker(*args)
        os.close(fd)

        def dying(problem, study):
            score, calls = real_trial_function(problem, study), []

            def trial_function(trial):
                calls.append(trial.number)
                if len(calls) == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                return score(trial)
            trial_function.failures = score.failures
            return trial_function
        search_module._trial_function = dying
        return real_worker(*args)

    monkeypatch.setattr(search_module, "_worker", worker)
    problem = build_problem(load_workload("chat", requests=16), slo=SLO, profile=profile)
    result = solve(problem, n_trials=9, n_jobs=2, storage=url, study_name="take", validate=0)
    trials = stored_trials(url, "take")
    assert [t.state for t in trials].count(RUNNING) == 0
    failed = [t for t in trials if t.state == FAIL]
    assert len(failed) == 1 and failed[0].user_attrs["worker"]["pid"] != os.getpid()
    retried = [t for t in trials if t.system_attrs.get("failed_trial") == failed[0].number]
    assert len(retried) == 1 and retried[0].state == COMPLETE  # (run here: queued again at once)
    assert retried[0].user_attrs["worker"]["pid"] == os.getpid()
    assert len([t for t in trials if t.state == COMPLETE and opt.SIMPLIFIES_ATTR not in t.user_attrs]) == 9
    note = [n for n in result.notes if n.startswith("worker ")]
    assert len(note) == 1 and "stopped (signal 9) after 1 of its 4 trials" in note[0], result.notes
    assert "this process ran 3 of the 3 it left" in note[0]
    # (the workers' trials took the numbers before those run here: this run's own, not another process's)
    assert not any(n.startswith("another process searched") for n in result.notes), result.notes


# ---- 4. every trial records its worker ---------------------------------------------------------------------
def test_every_trial_of_jobs_records_the_process_that_ran_it(tmp_path, profile):
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    problem = build_problem(load_workload("chat", requests=16), slo=SLO, profile=profile)
    result = solve(problem, n_trials=5, n_jobs=2, storage=url, study_name="jobs", validate=0)
    search = opt.provenance(result)["search"]  # (the tuned file must not claim its seed reproduces the run)
    assert search["seed"] == 0 and search["reproducible_from_seed"] is False
    assert search["not_reproducible"] == "2 worker processes sampled with random seeds"
    trials = [t for t in stored_trials(url, "jobs") if opt.SIMPLIFIES_ATTR not in t.user_attrs]
    tags = [t.user_attrs["worker"] for t in trials]
    assert len(trials) == 5 and {tag["host"] for tag in tags} == {socket.gethostname()}
    assert tags[0] == {"host": socket.gethostname(), "pid": os.getpid(), "seed": 1}  # the baseline, run here
    workers = {tag["pid"] for tag in tags[1:]}
    assert len(workers) == 2 and os.getpid() not in workers
    assert len({tag["seed"] for tag in tags[1:]}) == 2  # each worker its own seed
    again = opt.provenance(solve(problem, n_trials=1, storage=url, study_name="jobs", validate=0))["search"]
    assert again["reproducible_from_seed"] is False  # (a resumed run ranks the workers' trials too)
    assert again["not_reproducible"].startswith("trials of this study were proposed with random seeds before")


# ---- 5. one timeout for the whole search -------------------------------------------------------------------
def test_jobs_timeout_bounds_the_whole_search(tmp_path, profile, monkeypatch):
    """The workers are given the deadline of the search that started before the baseline ran, not a fresh
    timeout of their own after it."""
    seen = tmp_path / "deadlines"
    seen.mkdir()

    def worker(problem, storage_url, study_name, sampler_name, n_trials, deadline, parent, errors):
        (seen / str(os.getpid())).write_text(repr(deadline))

    monkeypatch.setattr(search_module, "_worker", worker)  # (forked: the children run this one)
    problem = build_problem(load_workload("chat", requests=16), slo=SLO, profile=profile)
    baseline_done = []
    started = time.monotonic()
    solve(problem, n_trials=5, n_jobs=2, timeout=30.0, storage=f"sqlite:///{tmp_path / 't.db'}", study_name="t",
          validate=0, progress=lambda p: baseline_done.append(time.monotonic()))
    deadlines = [float(f.read_text()) for f in seen.iterdir()]
    assert len(deadlines) == 2 and all(started + 30.0 < d < baseline_done[0] + 30.0 for d in deadlines)


# ---- 6. worker's study argument, drivers, journal files ----------------------------------------------------
def test_worker_takes_the_study_as_an_argument_or_option(tmp_path):
    missing = f"sqlite:///{tmp_path / 'none.db'}"
    for args in (["J"], ["--study", "J"]):
        r = cli("worker", *args, "--storage", missing)
        assert r.exit_code == 2 and error_lines(r) == [f"error: storage {missing}: no such database file; create "
                                                       "the study first with skistune optimize --storage URL "
                                                       "--study NAME"], r.output
    r = cli("worker", "A", "--study", "B", "--storage", missing)
    assert r.exit_code == 2 and error_lines(r) == ["error: two studies given: A and --study B; give one"]
    r = cli("worker", "--storage", missing)
    assert r.exit_code == 2 and error_lines(r)[0].startswith("error: no study given: skistune worker STUDY")



def test_a_misspelt_study_is_answered_with_the_study_files_beside_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "skistune-optimize-6e461e5a.db").touch()
    r = cli("report", "optimize-6e461e5b")
    assert r.exit_code == 2 and "no such database file (study files in that folder: skistune-optimize-6e461e5a.db)" \
        in error_lines(r)[0], r.output


def test_a_missing_driver_is_named_for_its_database(monkeypatch):
    monkeypatch.setitem(sys.modules, "MySQLdb", None)  # (import fails: not installed)
    monkeypatch.setitem(sys.modules, "pymysql", None)
    with pytest.raises(ValueError, match=r"^storage mysql://u@127.0.0.1/db: its database driver is not installed "
                                         r"\(MySQLdb: pip install mysqlclient, or PyMySQL with a mysql\+pymysql:// "
                                         r"URL\)$"):
        open_storage("mysql://u@127.0.0.1/db")
    with pytest.raises(ValueError, match=r"driver is not installed \(pymysql: pip install PyMySQL\)$"):
        open_storage("mysql+pymysql://u@127.0.0.1/db")


def test_a_journal_file_is_refused_saying_what_is_supported(tmp_path):
    url = f"journal:///{tmp_path / 'j.log'}"
    with pytest.raises(ValueError, match=r"cannot open \('journal' is not a database SQLAlchemy knows \(Optuna's "
                                         r"journal files are not supported: .*\); give a SQLite file"):
        open_storage(url)
    assert not (tmp_path / "j.log").exists()


# ---- a trial whose worker died before its first heartbeat ---------------------------------------------
@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_a_running_trial_that_never_beat_is_failed_and_retried_once_it_is_older_than_the_grace(tmp_path):
    """Optuna's stale check skips a trial with no heartbeat: a worker killed between a trial's start and its
    heartbeat thread's first beat left that trial running for ever (a crash test caught it in CI)."""
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}")
    study = optuna.create_study(study_name="s", storage=storage)
    silent = study.ask({"x": optuna.distributions.IntDistribution(0, 9)})  # (ask starts no heartbeat thread)
    beating = study.ask({"x": optuna.distributions.IntDistribution(0, 9)})
    storage.record_heartbeat(beating._trial_id)
    grace = storage.grace_period
    start = study.trials[silent.number].datetime_start
    young = start + timedelta(seconds=grace - 1)
    assert study_storage.fail_trials_that_never_beat(study, now=young) == []  # it may still beat
    old = start + timedelta(seconds=grace + 1)
    assert study_storage.fail_trials_that_never_beat(study, now=old) == [silent.number]
    trials = study.get_trials(deepcopy=False)
    assert trials[silent.number].state == FAIL and trials[beating.number].state == RUNNING  # the heartbeat's to judge
    retried = [t for t in trials if t.state == optuna.trial.TrialState.WAITING]
    assert len(retried) == 1 and retried[0].params == silent.params  # queued again, once, with its config
    assert study_storage.fail_trials_that_never_beat(study, now=old) == []  # nothing twice


def test_a_storage_url_under_an_ascii_file_system_encoding_keeps_its_path():
    """In a folder named with non-ASCII letters under LC_ALL=C (no UTF-8 mode), the study's URL held the name's
    bytes as surrogates; SQLAlchemy refused them and the tuned file's provenance said only `sqlite://...`."""
    from skistune.study_storage import _storage_label

    undecoded = "sqlite:////tmp/caf" + b"\xc3\xa9".decode("ascii", "surrogateescape") + "/s.db"
    assert _storage_label(undecoded) == _storage_label("sqlite:////tmp/café/s.db") == "sqlite:////tmp/caf%C3%A9/s.db"
    assert _storage_label("postgresql://u:secret@h/db") == "postgresql://u:***@h/db"


def test_a_postgresql_url_without_any_driver_names_the_postgres_extra(monkeypatch):
    """SQLAlchemy 2.1 reads a bare postgresql:// as psycopg (3): with no driver installed the hint had named only
    'psycopg[binary]', where the README installs the postgres extra (psycopg2-binary), which such a URL also takes."""
    import importlib.util

    from skistune.study_storage import open_storage

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("psycopg", "psycopg2") else real(name, *a))
    monkeypatch.setitem(__import__("sys").modules, "psycopg", None)
    monkeypatch.setitem(__import__("sys").modules, "psycopg2", None)
    with pytest.raises(ValueError) as refused:
        open_storage("postgresql://u@127.0.0.1:1/db")
    assert "its database driver is not installed" in str(refused.value)
    assert "psycopg2-binary (the postgres extra of skistune) or 'psycopg[binary]'" in str(refused.value)
