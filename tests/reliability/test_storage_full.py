"""A disk that fills during a search: every write of the study's SQLite database then fails with SQLite's own
"database or disk is full" (injected here, deterministically, where the driver executes a statement, as
SQLAlchemy would see a full disk: a real tmpfs of 600 KiB gave the same message, checked by hand). Optuna's trial
loop had turned it into a traceback ending "Should not reach". Now `skistune optimize` (alone or with --jobs) and
`skistune worker` end with one line and exit code 2: what failed, how many finished trials the study keeps, and
the command that resumes it; that command, once the disk has room, loses none of them."""
import contextlib
import json
import shlex
import sqlite3
import threading

import optuna
import pytest
import sqlalchemy
import sqlalchemy.exc
from reliability_helpers import PROFILE, SLO, create_study, finished, stored_trials
from typer.testing import CliRunner

import skistune.optimize as opt
import skistune.study_storage as study_storage
from skistune.cli import app

FULL = "database or disk is full"
WRITES = ("INSERT", "UPDATE", "DELETE")


@contextlib.contextmanager
def disk_full_after(completed: int):
    """Every write of this process fails as on a full disk once ``completed`` trials have stored their values here
    (a forked worker counts its own, from what the parent had counted when it forked)."""
    seen = [0]

    def execute(cursor, statement, parameters, context):
        if not statement.lstrip().upper().startswith(WRITES):
            return False
        if seen[0] >= completed:
            raise sqlite3.OperationalError(FULL)
        seen[0] += statement.lstrip().upper().startswith("INSERT INTO TRIAL_VALUES")
        return False  # (SQLAlchemy runs the statement)

    sqlalchemy.event.listen(sqlalchemy.engine.Engine, "do_execute", execute)
    sqlalchemy.event.listen(sqlalchemy.engine.Engine, "do_executemany", execute)
    try:
        yield seen
    finally:
        sqlalchemy.event.remove(sqlalchemy.engine.Engine, "do_execute", execute)
        sqlalchemy.event.remove(sqlalchemy.engine.Engine, "do_executemany", execute)


def cli(*args):
    return CliRunner().invoke(app, list(args))


def one_error_line(r, url: str, study: str, kept: int | None = None) -> str:
    """The run's one error line, checked: what failed, how many finished trials are kept; returns the command it
    gives to resume."""
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert "Traceback" not in r.output and "Should not reach" not in r.output and "Exception in" not in r.output
    stored = sum(t.state == optuna.trial.TrialState.COMPLETE for t in stored_trials(url, study))
    assert kept is None or stored == kept
    prefix = (f"error: the study's storage {url} could not write (sqlite3.OperationalError: {FULL}); study {study} "
              f"keeps its {stored} finished trial{'s' * (stored != 1)}; free space for it, then resume with: skistune ")
    assert lines[0].startswith(prefix), lines[0]
    return lines[0].split("then resume with: ", 1)[1]


def resume(command: str):
    """The printed command, run as it is (``skistune`` is the CLI here)."""
    words = shlex.split(command)
    assert words[0] == "skistune"
    return cli(*words[1:])


def test_optimize_ends_in_one_line_keeps_every_finished_trial_and_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'full.db'}"
    with disk_full_after(3):
        r = cli("optimize", "--slo", SLO, "--requests", "16", "--trials", "8", "--validate", "0", "--profile",
                str(PROFILE), "--storage", url, "--json")
    name = opt.default_study_name(_problem())
    command = one_error_line(r, url, name, kept=3)
    assert command == (f"skistune optimize --slo {SLO} --requests 16 --profile {PROFILE} --trials 8 --storage {url} "
                       f"--validate 0 --json --study {name}")
    error = next(line for line in r.stderr.splitlines() if line.startswith("error: "))
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"error": error[len("error: "):], "exit_code": 2}
    before = finished(stored_trials(url, name))
    assert not (tmp_path / "skistune-tuned.yaml").exists()
    again = resume(command)  # (the disk has room again)
    assert again.exit_code == 0, again.output
    after = finished(stored_trials(url, name))
    assert {n: after[n] for n in before} == before and len(after) >= len(before) + 8
    assert json.loads(again.stdout.strip().splitlines()[-1])["trials"] == len(after)


def _problem():
    from skistune.workloads import load_workload

    return opt.build_problem(load_workload("chat", requests=16), slo=SLO, profile=str(PROFILE))


def test_optimize_with_jobs_ends_in_one_line_too(tmp_path):
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    with disk_full_after(3):  # (each forked worker fails after its own 2: the parent ran the baseline first)
        r = cli("optimize", "--slo", SLO, "--requests", "16", "--trials", "20", "--jobs", "2", "--validate", "0",
                "--profile", str(PROFILE), "--storage", url, "--study", "jobs")
    command = one_error_line(r, url, "jobs")
    assert command == (f"skistune optimize --slo {SLO} --requests 16 --profile {PROFILE} --trials 20 --storage {url} "
                       "--study jobs --jobs 2 --validate 0")
    kept = finished(stored_trials(url, "jobs"))
    assert 3 <= len(kept) < 20
    again = resume(command.replace("--trials 20", "--trials 2"))
    assert again.exit_code == 0, again.output
    after = finished(stored_trials(url, "jobs"))
    assert {n: after[n] for n in kept} == kept and len(after) > len(kept)


def test_worker_ends_in_one_line_and_the_same_command_goes_on(tmp_path, profile):
    url = f"sqlite:///{tmp_path / 'w.db'}"
    create_study(url, "W", profile)
    with disk_full_after(2):
        r = cli("worker", "W", "--storage", url, "--trials", "10")
    command = one_error_line(r, url, "W", kept=3)  # the creator's baseline and the worker's 2
    assert command == f"skistune worker W --storage {url} --trials 10"
    kept = finished(stored_trials(url, "W"))
    again = resume(command.replace("--trials 10", "--trials 2"))
    assert again.exit_code == 0, again.output
    after = finished(stored_trials(url, "W"))
    assert {n: after[n] for n in kept} == kept and len(after) == len(kept) + 2


def test_from_python_the_error_names_the_study_and_what_it_keeps(tmp_path, profile):
    url = f"sqlite:///{tmp_path / 'api.db'}"
    problem = opt.build_problem(_problem().workload, slo=SLO, profile=profile)
    with disk_full_after(2), pytest.raises(opt.StorageWriteError) as raised:
        opt.solve(problem, n_trials=6, validate=0, storage=url, study_name="api")
    e = raised.value
    assert (e.reason, e.writing, e.study_name, e.kept) == (f"sqlite3.OperationalError: {FULL}", True, "api", 2)
    assert str(e).endswith("keeps its 2 finished trials; free space for it, then resume with study_name='api' and "
                           "the same storage")


def test_a_heartbeat_that_cannot_write_prints_no_traceback(monkeypatch):
    """A trial longer than a heartbeat: its heartbeat thread's write fails first; that thread ends quietly (the
    trial's own next write fails and says it in one line), while any other thread's error is printed as ever."""
    def fails(error):
        def run():
            raise error
        return run

    printed = []  # (what the hook in place, Python's own, would print)
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append((args.thread.name, args.exc_type)))
    full = sqlalchemy.exc.OperationalError("UPDATE trial_heartbeats", {}, sqlite3.OperationalError(FULL))
    before = threading.excepthook
    with study_storage._quiet_heartbeat_failures():
        for name, error in (("Thread-7 (_record_heartbeat)", full), ("Thread-8 (other)", full),
                            ("Thread-9 (_record_heartbeat)", KeyError("a bug"))):
            t = threading.Thread(target=fails(error), name=name)
            t.start()
            t.join()
    assert printed == [("Thread-8 (other)", sqlalchemy.exc.OperationalError), ("Thread-9 (_record_heartbeat)", KeyError)]
    assert threading.excepthook is before  # (put back)


def test_errors_that_are_not_the_storages_pass_through():
    assert study_storage.storage_failure(ValueError("bad input")) is None
    try:
        try:
            raise sqlalchemy.exc.OperationalError("SELECT 1", {}, sqlite3.OperationalError("no such table"))
        except sqlalchemy.exc.OperationalError:
            raise ValueError("storage x: cannot open") from None  # (our own one line already: not re-read)
    except ValueError as exc:
        assert study_storage.storage_failure(exc) is None
    wrapped = AssertionError("Should not reach.")
    wrapped.__context__ = optuna.exceptions.StorageInternalError("commit failed")
    wrapped.__context__.__cause__ = sqlalchemy.exc.OperationalError("UPDATE trials", {}, sqlite3.OperationalError(FULL))
    assert study_storage.storage_failure(wrapped) == (f"sqlite3.OperationalError: {FULL}", True)
    lost = sqlalchemy.exc.OperationalError("SELECT x", {}, Exception("server closed the connection"))
    assert study_storage.storage_failure(lost) == ("builtins.Exception: server closed the connection", False)
