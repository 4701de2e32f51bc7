"""Two runs started at the same moment on a new study: both create Optuna's tables, and the slower one had failed
at once ("UNIQUE constraint failed: alembic_version.version_num", "table studies already exists"; 5 of 9 pairs
of `skistune optimize` in an empty folder), or both set the study up and the baseline ran twice. And an SQLite
file that cannot be made is said in one line (a raw "unable to open database file" had been all)."""
from __future__ import annotations

import multiprocessing
import sqlite3
import subprocess
import warnings

import optuna
import pytest
import sqlalchemy.exc
from reliability_helpers import PROFILE, SLO, skistune_cmd, subprocess_env

from skistune.problem import build_problem
from skistune.search import open_study
from skistune.study_storage import _creation_race, _existing_sqlite, default_storage, open_storage
from skistune.workloads import load_workload

ROUNDS = 10  # (without the retry, a round failed about every other time: 10 fail all but 1 in 1,000 runs)


@pytest.fixture(scope="module")
def problem(profile):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_problem(load_workload("chat", requests=16, seed=0), slo=SLO, profile=profile)


def _open_at_once(url: str, problem, barrier, results) -> None:
    """One run's start: open the storage and the study the moment the other process does."""
    barrier.wait()
    try:
        storage = open_storage(url)
        open_study(problem, storage, "k", sampler=None)
        results.put("ok")
    except BaseException as exc:  # (the test names what failed)
        results.put(f"{type(exc).__name__}: {exc}")


def race(url: str, problem, processes: int = 2) -> list[str]:
    """``processes`` forked processes opening the same storage and study at the same moment: what each said."""
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(processes, timeout=60), ctx.Queue()
    procs = [ctx.Process(target=_open_at_once, args=(url, problem, barrier, results)) for _ in range(processes)]
    for p in procs:
        p.start()
    said = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return said


def baselines(url: str) -> list[int]:
    """The trials of study k that queue the baseline (one per study)."""
    study = optuna.load_study(study_name="k", storage=open_storage(url, create=False))
    trials = [t.number for t in study.get_trials(deepcopy=False) if t.user_attrs.get("enqueued") == "baseline"]
    study._storage._backend.engine.dispose()
    return trials


def test_two_runs_creating_a_new_sqlite_file_at_once_both_open_it(tmp_path, problem):
    for round in range(ROUNDS):
        url = f"sqlite:///{tmp_path / f'r{round}.db'}"
        assert race(url, problem) == ["ok", "ok"], f"round {round}"
        assert optuna.get_all_study_names(url) == ["k"] and len(baselines(url)) == 1, f"round {round}"


def test_two_runs_creating_a_study_at_once_queue_its_baseline_once(tmp_path, problem):
    """The tables made before (a file of other studies): only the study is new. Both runs had set it up, and
    the baseline was queued twice in about every other round."""
    for round in range(ROUNDS):
        url = f"sqlite:///{tmp_path / f'r{round}.db'}"
        open_storage(url).engine.dispose()  # (no connection of this process shared with the forked ones)
        assert race(url, problem) == ["ok", "ok"], f"round {round}"
        assert len(baselines(url)) == 1, f"round {round}"


def test_three_runs_on_a_new_postgresql_database_all_open_it(pg_url, problem):
    assert race(pg_url, problem, processes=3) == ["ok"] * 3
    assert len(baselines(pg_url)) == 1


def test_only_what_a_concurrent_creation_fails_with_is_tried_again():
    def wrapped(orig, kind=sqlalchemy.exc.OperationalError):
        return kind("CREATE TABLE studies", {}, orig)

    assert _creation_race(wrapped(sqlite3.OperationalError("table studies already exists")))
    assert _creation_race(wrapped(sqlite3.IntegrityError("UNIQUE constraint failed: alembic_version.version_num"),
                                  sqlalchemy.exc.IntegrityError))
    try:  # (as Optuna raises a failed commit: its own error, from SQLAlchemy's)
        raise optuna.exceptions.StorageInternalError("commit failed") from wrapped(
            sqlite3.IntegrityError("UNIQUE constraint failed: version_info.version_info_id"),
            sqlalchemy.exc.IntegrityError)
    except optuna.exceptions.StorageInternalError as exc:
        assert _creation_race(exc)
    # a wrong path or server fails the same way each time: said at once, not after seconds of retries
    assert not _creation_race(wrapped(sqlite3.OperationalError("unable to open database file")))
    assert not _creation_race(wrapped(ConnectionRefusedError("connection refused")))
    assert not _creation_race(ValueError("already exists"))


# ---- an SQLite file that cannot be made ---------------------------------------------------------------------
def test_a_tilde_in_a_sqlite_url_is_said_to_be_a_folder_that_does_not_exist(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = "storage sqlite:///~/x.db: folder ~ does not exist (a ~ is not expanded in a URL: give the full path)"
    for create in (True, False):
        with pytest.raises(ValueError) as exc:
            open_storage("sqlite:///~/x.db", create=create)
        assert str(exc.value) == line
    with pytest.raises(ValueError, match=r"no such database file \(a ~ is not expanded in a URL: give the full path\)"):
        _existing_sqlite("sqlite:///~/x.db")  # (a worker's or report's check)
    assert list(tmp_path.iterdir()) == []  # (nothing made: no folder named ~, no empty database)


def test_a_missing_or_unwritable_folder_is_said_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    cases = {f"sqlite:///{tmp_path}/nodir/x.db": f"folder {tmp_path}/nodir does not exist",
             f"sqlite:///{tmp_path}/file/x.db": f"folder {tmp_path}/file is a file, not a folder",
             # (Linux's /proc takes no new file, even from root, whom permission bits never stop)
             "sqlite:////proc/x.db": "folder /proc is not writable"}
    for url, said in cases.items():
        with pytest.raises(ValueError) as exc:
            open_storage(url)
        assert str(exc.value) == f"storage {url}: {said}"
    monkeypatch.chdir("/proc")  # the default storage: the study's file in this folder
    url = default_storage("k")
    with pytest.raises(ValueError) as exc:
        open_storage(url)
    assert str(exc.value) == (f"storage {url}: cannot create the study's file in /proc (read-only); run from a "
                              "writable folder or give --storage")
    monkeypatch.chdir(tmp_path)
    open_storage(f"sqlite:///{tmp_path}/ok.db").engine.dispose()  # (a writable folder: the file made as before)
    assert (tmp_path / "ok.db").is_file() and {p.name for p in tmp_path.iterdir()} == {"file", "ok.db"}


@pytest.mark.parametrize("where, storage, said", [
    ("tmp", ["--storage", "sqlite:///~/x.db"],
     "error: storage sqlite:///~/x.db: folder ~ does not exist (a ~ is not expanded in a URL: give the full path)"),
    ("/proc", [], "error: the study is kept in a SQLite file in the working folder /proc, which cannot take a new "
                  "file (read-only): run from a writable folder, or give --storage URL"),  # (before any work)
])
def test_optimize_says_it_in_one_line_and_exits_2(tmp_path, where, storage, said):
    r = subprocess.run(skistune_cmd("optimize", "--slo", SLO, "--trials", "2", "--validate", "0", "--requests", "16",
                                    "--profile", str(PROFILE), "--study", "k", "--out", str(tmp_path / "o.yaml"),
                                    *storage),
                       cwd=tmp_path if where == "tmp" else where, capture_output=True, text=True,
                       env=subprocess_env(), timeout=300)
    lines = [line for line in r.stderr.splitlines() if not line.startswith("warning:")]
    assert r.returncode == 2 and lines == [said], r.stderr
