"""Where studies live: an Optuna storage opened from a URL (a SQLite file, PostgreSQL, MySQL/MariaDB) with
heartbeats, so that the trial of a killed worker is failed and retried once; study attributes of any size (split
in parts where the database's column is too small); and a failure of the storage mid-run said in one line, with
what the study keeps (`StorageWriteError`).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import re
import warnings
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

HEARTBEAT_S = 5  # RDB storages: a trial whose worker stopped beating this long x 4 is marked failed


# ---- opening a storage ------------------------------------------------------------------------------------
STUDY_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def default_storage(study_name: str) -> str:
    """The SQLite file in this folder named after the study. A name that a file name or a URL would change is
    refused: 'x%41' made skistune-xA.db (another study's file), 'a/b' a raw sqlite error, 'r-a,b' a URL printed
    with %2C that named no file in sight."""
    if not STUDY_FILE_NAME.fullmatch(study_name):
        raise ValueError(f"study name {study_name!r}: the default storage is a file named after it "
                         "(skistune-NAME.db), so start it with a letter or digit and use only those, '.', '_' and '-', or give --storage "
                         "URL for any name")
    return default_storage_url(f"skistune-{study_name}.db")


def default_storage_url(file_name: str) -> str:
    """The URL of a file of this folder as `default_storage` writes it (how `open_storage` tells the default
    storage, whose message then says to run elsewhere or give --storage)."""
    return f"sqlite:///{Path.cwd() / file_name}"


class _NoStudies(Exception):
    """A database without Optuna's tables, opened not to create them."""


def _has_optuna_tables(url: str, engine_kwargs: dict) -> bool:
    import sqlalchemy

    engine = sqlalchemy.create_engine(url, **engine_kwargs)
    try:
        return sqlalchemy.inspect(engine).has_table("studies")
    finally:
        engine.dispose()


def open_storage(storage, create: bool = True):
    """An Optuna storage object: a URL (SQLite, PostgreSQL, MySQL; heartbeats on, so trials of killed
    workers are failed, and each such trial is retried once by the next worker) or any storage object.
    ``create`` False leaves a database without Optuna's tables as it is (a worker joins, never creates)."""
    import sqlalchemy.exc

    if not isinstance(storage, str):
        return storage
    if "://" not in storage:
        raise ValueError(f"storage {storage!r}: give an Optuna storage URL, e.g. sqlite:///study.db or "
                         "postgresql://user@host/db")
    url = _with_installed_driver(storage)
    _check_lasting(url, storage)
    # a wrong host or port should fail in seconds, not hang the command
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else \
        {"connect_args": {"connect_timeout": 10}} if url.startswith(("postgresql+psycopg", "mysql+pymysql")) else {}
    _check_sqlite_folder(url, storage, create)
    try:
        if not create and not _has_optuna_tables(url, engine_kwargs):
            raise _NoStudies
        return _rdb_storage(url, engine_kwargs, create)
    except _NoStudies:
        raise ValueError(f"storage {_storage_label(storage)}: holds no Optuna study; create the study first with "
                         "skistune optimize --storage URL --study NAME") from None
    except ImportError as exc:
        driver = exc.name or getattr(exc.__cause__, "name", None)  # (Optuna raises its own, from SQLAlchemy's)
        hint = f"{driver}: pip install {DRIVER_PACKAGES.get(driver, driver)}" if driver else exc
        raise ValueError(f"storage {_storage_label(storage)}: its database driver is not installed ({hint})") from None
    except sqlalchemy.exc.NoSuchModuleError:
        kind = storage.partition("://")[0]
        why = " (Optuna's journal files are not supported: with no heartbeat, a killed worker's trial would stay " \
              "running forever)" if kind.startswith("journal") else ""
        raise ValueError(f"storage {_storage_label(storage)}: cannot open ({kind!r} is not a database SQLAlchemy "
                         f"knows{why}); give {STORAGE_KINDS}") from None
    except (sqlalchemy.exc.SQLAlchemyError, ValueError) as exc:  # ValueError: e.g. a port that is no number
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"storage {_storage_label(storage)}: cannot open ({reason})") from None


SCHEMA_TRIES = 6  # openings of a new database whose tables another process creates at the same moment
SCHEMA_BACKOFF_S = 0.05  # the first wait between them (doubled each time, with jitter: about 3 s in all)


def _rdb_storage(url: str, engine_kwargs: dict, create: bool):
    """The RDB storage of ``url``, its tables created if missing (``create``). Two processes opening one new
    database at once (two `skistune optimize` started together in an empty folder) both create Optuna's
    tables, and the slower one failed ("table studies already exists", "UNIQUE constraint failed:
    alembic_version.version_num"): it tries again after a short wait, and then finds the tables the other
    made (creation skips what exists)."""
    import random
    import time

    import optuna

    for attempt in range(SCHEMA_TRIES):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return split_attr_storage_class()(url, engine_kwargs=engine_kwargs, heartbeat_interval=HEARTBEAT_S,
                                                  grace_period=4 * HEARTBEAT_S, skip_table_creation=not create,
                                                  **_retry_stale_trials())
        except Exception as exc:
            if not create or attempt == SCHEMA_TRIES - 1 or not _creation_race(exc):
                raise
            # (jitter: two processes that collided once should not wake together again)
            time.sleep(SCHEMA_BACKOFF_S * 2 ** attempt * (1 + random.random()))
    raise AssertionError("unreachable")


def create_or_load_study(storage, study_name: str, directions: Sequence[str], sampler=None) -> tuple[Any, bool]:
    """The study named ``study_name``, created if missing, and whether this call created it: of processes
    creating the same study at the same moment (two runs started together), exactly one creates it (the name
    is unique in the storage) and the others load it, so that only the creator sets it up (`created_attr`
    tells the others when it has). Where the other's study cannot be read yet, or the insert fails as a race
    does (`_creation_race`), this tries again after a short wait."""
    import random
    import time

    import optuna
    from optuna.study import StudyDirection

    storage = optuna.storages.get_storage(storage)  # (one storage, its cache shared by the calls below)
    wanted = [d if isinstance(d, StudyDirection) else StudyDirection[d.upper()] for d in directions]
    for attempt in range(SCHEMA_TRIES):
        last = attempt == SCHEMA_TRIES - 1
        created = False
        try:
            storage.create_new_study(wanted, study_name)
            created = True
        except optuna.exceptions.DuplicatedStudyError:
            pass  # (another process made it: loaded below)
        except optuna.exceptions.StorageInternalError as exc:
            if last or not _creation_race(exc):
                raise
            time.sleep(SCHEMA_BACKOFF_S * 2 ** attempt * (1 + random.random()))
            continue
        try:
            return optuna.load_study(study_name=study_name, storage=storage, sampler=sampler), created
        except KeyError:  # (its name was taken by a study not readable yet, or deleted since)
            if last:
                raise
        time.sleep(SCHEMA_BACKOFF_S * 2 ** attempt * (1 + random.random()))
    raise AssertionError("unreachable")


CREATOR_WAIT_S = 10.0  # how long a run that loaded a new study waits for its creator to set it up


def created_attr(study, key: str, timeout_s: float = CREATOR_WAIT_S) -> Any:
    """The study attribute ``key`` that the process which created ``study`` a moment ago sets up (a run
    that started with it, `create_or_load_study`), once it is there; None after ``timeout_s`` (a creator
    stopped before it set it: the caller sets it up itself)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        value = study.user_attrs.get(key)
        if value is not None or time.monotonic() >= deadline:
            return value
        time.sleep(0.05)


# what another process creating the same tables at the same moment makes fail: a duplicate row (Optuna's
# version row, alembic's revision), a table or type that exists by the time this one creates it, or a server that
# chose this one's DDL as a deadlock's victim (MySQL)
_RACE_WORDS = ("already exists", "duplicate", "deadlock")


def _creation_race(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from: Optuna wraps a failed commit) is what creating a database's
    tables fails with when another process creates them too; never a wrong URL, a refused login or a lost
    server, which fail the same way each time (those are said at once)."""
    import sqlalchemy.exc

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, sqlalchemy.exc.IntegrityError):
            return True
        if isinstance(exc, sqlalchemy.exc.DBAPIError) and any(w in str(exc.orig).lower() for w in _RACE_WORDS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _check_sqlite_folder(url: str, storage: str, create: bool) -> None:
    """Say in one line why a SQLite file cannot be made, where SQLite only says "unable to open database
    file": its folder missing (``sqlite:///~/x.db`` names a folder ``~`` in this one: a URL expands no ``~``) or
    one that takes no new file (tried: root passes every permission check, a read-only mount does not). A file
    that exists is left to SQLite (reading one needs no writable folder)."""
    import sqlalchemy.exc
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        return  # RDBStorage reports it
    database = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or not database or database.startswith("file:") \
            or parsed.query.get("uri") or Path(database).exists():
        return
    path = Path(database)
    folder = path.parent
    label = _storage_label(storage)
    if not folder.is_dir():
        tilde = " (a ~ is not expanded in a URL: give the full path)" if "~" in database else ""
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise ValueError(f"storage {label}: folder {folder} {what}{tilde}")
    if not create:
        return
    why = folder_refusal(folder)
    if why is None:
        return
    if path.name.startswith("skistune-") and storage == default_storage_url(path.name):
        raise ValueError(f"storage {label}: cannot create the study's file in {folder} ({why}); run from a "
                         "writable folder or give --storage")
    if why == "read-only":
        raise ValueError(f"storage {label}: folder {folder} is not writable")
    raise ValueError(f"storage {label}: cannot create the study's file in {folder} ({why})")


def folder_refusal(folder: Path) -> str | None:
    """Why a new file cannot be made in ``folder`` ("read-only", or the system's reason), or None if it can:
    tried with a probe file, as root passes every permission check and a read-only mount does not."""
    import errno

    from skistune.paths import probe_folder

    exc = probe_folder(folder)
    if exc is None:
        return None
    # (ENOENT in a folder that exists: /proc and the like, which take no new file)
    refused = exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT)
    return "read-only" if refused else (exc.strerror or str(exc))


# what `pip install` gets a missing database driver (by the module SQLAlchemy failed to import)
# (a bare postgresql:// takes whichever of psycopg2 and psycopg is installed (`_with_installed_driver`): with neither,
# the postgres extra is what the README installs)
DRIVER_PACKAGES = {"psycopg2": "psycopg2-binary, the postgres extra of skistune",
                   "psycopg": "psycopg2-binary (the postgres extra of skistune) or 'psycopg[binary]'",
                   "MySQLdb": "mysqlclient, or PyMySQL with a mysql+pymysql:// URL", "pymysql": "PyMySQL"}
# (Optuna's journal files are not among the storages: they have no heartbeat, so a killed worker's trial would
# stay running forever instead of being retried)
STORAGE_KINDS = ("a SQLite file (sqlite:///study.db) or a server (postgresql://user@host/db, "
                 "mysql+pymysql://user@host/db)")


def _check_lasting(url: str, storage: str) -> None:
    """Refuse an in-memory SQLite URL: each connection opens its own empty database (the heartbeat thread's
    finds no tables), and it is gone when the command ends, so no worker can share it and nothing resumes."""
    import sqlalchemy.exc
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        return  # RDBStorage reports it
    database = parsed.database or ""
    in_memory = database in ("", ":memory:") or database.startswith("file::memory:") \
        or parsed.query.get("mode") == "memory"
    if parsed.get_backend_name() == "sqlite" and in_memory:
        raise ValueError(f"storage {storage}: an in-memory SQLite database can be neither shared with workers nor "
                         f"resumed; give {STORAGE_KINDS} (from Python, storage=optuna.storages.InMemoryStorage() "
                         "keeps a study in memory)")


def _retry_stale_trials() -> dict[str, Any]:
    """The storage option that queues a trial again, once, when its worker stopped beating (killed):
    ``heartbeat_stale_trial_callback`` from Optuna 4.9, ``failed_trial_callback`` before."""
    import optuna

    if hasattr(optuna.storages, "RetryHeartbeatStaleTrialCallback"):
        return {"heartbeat_stale_trial_callback": optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1)}
    return {"failed_trial_callback": optuna.storages.RetryFailedTrialCallback(max_retry=1)}


def fail_trials_that_never_beat(study, now: datetime | None = None) -> list[int]:
    """Fail, and retry once as a stale trial is, each running trial that never recorded a heartbeat and
    started more than the grace period ago; returns their numbers. Optuna's heartbeat thread records its
    first beat while the trial function already runs, and its stale check skips a trial with no beat: a
    worker killed in between would leave its trial running for ever. A live trial beats within its first
    interval, so one silent past the grace is dead (whatever host ran it). Reads Optuna's heartbeat table
    (no public call says whether a trial has a beat); on a storage without one, nothing is done."""
    import optuna
    import sqlalchemy.exc

    storage = study._storage
    backend = getattr(storage, "_backend", storage)  # (a study wraps an RDB storage in a cache)
    interval = getattr(backend, "heartbeat_interval", None)
    if not isinstance(backend, optuna.storages.RDBStorage) or interval is None:
        return []
    grace = backend.grace_period or 2 * interval
    now = now or datetime.now()  # (Optuna stamps a trial's start with its process's local time)
    old = {t._trial_id: t.number for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
           if t.datetime_start is not None and (now - t.datetime_start).total_seconds() > grace}
    if not old:
        return []
    try:
        from optuna.storages._rdb.models import TrialHeartbeatModel

        session = backend.scoped_session()
        try:
            beaten = {row[0] for row in session.query(TrialHeartbeatModel.trial_id)
                      .filter(TrialHeartbeatModel.trial_id.in_(list(old)))}
        finally:
            backend.scoped_session.remove()
    except (ImportError, AttributeError, sqlalchemy.exc.SQLAlchemyError):  # (another Optuna's tables, a lost
        return []  # connection: the heartbeat's own check stays)
    return [old[t] for t in _fail_and_retry(study, sorted(set(old) - beaten))]


def _fail_and_retry(study, trial_ids: Sequence[int]) -> list[int]:
    """Fail these running trials (by id) and queue each again once, as the storage's stale-trial callback
    does; returns the ids this call failed (another process may have ended one first)."""
    import copy

    import optuna

    storage = study._storage
    backend = getattr(storage, "_backend", storage)
    failed = []
    for trial_id in trial_ids:
        with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):  # (another process failed it first)
            if storage.set_trial_state_values(trial_id, state=optuna.trial.TrialState.FAIL):
                failed.append(trial_id)
    retry = getattr(backend, "get_heartbeat_stale_trial_callback", None) or getattr(
        backend, "get_failed_trial_callback", lambda: None)
    callback = retry()
    for trial_id in failed:
        if callback is not None:
            callback(study, copy.deepcopy(storage.get_trial(trial_id)))
    return failed


def _with_installed_driver(url: str) -> str:
    """A bare ``postgresql://`` URL with a driver that is installed: SQLAlchemy 2.0 defaults to psycopg2
    and 2.1 to psycopg (3); the ``[postgres]`` extra installs psycopg2-binary. (A bare ``mysql://`` stays
    SQLAlchemy's mysqlclient: the ``[mysql]`` extra's PyMySQL is named in the URL, ``mysql+pymysql://``.)"""
    from importlib.util import find_spec

    import sqlalchemy.exc
    from sqlalchemy.dialects import postgresql
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        return url  # RDBStorage reports it
    if parsed.drivername != "postgresql":
        return url
    found = next((d for d in (postgresql.dialect.driver, "psycopg2", "psycopg") if find_spec(d)), None)
    return url if found is None else parsed.set(drivername=f"postgresql+{found}").render_as_string(hide_password=False)


def _existing_sqlite(storage: Any) -> None:
    """Workers never create a storage: a SQLite URL must name a file that exists (opening one creates it)."""
    import sqlalchemy.exc
    from sqlalchemy.engine import make_url

    if not isinstance(storage, str) or not storage.startswith("sqlite"):
        return
    try:
        database = make_url(storage).database
    except (sqlalchemy.exc.ArgumentError, ValueError):  # malformed: `open_storage` names what is wrong
        return
    if database and database != ":memory:" and not Path(database).is_file():
        # (a misspelt study name reads as a missing file of the default storage: name the studies beside it)
        near = sorted(p.name for p in Path(database).parent.glob("skistune-*.db"))
        here = f" (study files in that folder: {', '.join(near[:8])}{' ...' if len(near) > 8 else ''})" if near else \
            " (a ~ is not expanded in a URL: give the full path)" if "~" in database else ""
        raise ValueError(f"storage {storage}: no such database file{here}; create the study first with skistune "
                         "optimize --storage URL --study NAME")


def _storage_label(storage) -> str:
    if not isinstance(storage, str):
        return type(storage).__name__
    import sqlalchemy.exc
    from sqlalchemy.engine import make_url

    # (a path's bytes that an ASCII file-system encoding could not decode, as surrogates: their UTF-8 text, which
    # the URL had held under a UTF-8 locale; SQLAlchemy refused the surrogates, and "sqlite://..." went into files)
    text = storage.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    try:
        return make_url(text).render_as_string(hide_password=True)
    except (sqlalchemy.exc.ArgumentError, ValueError):  # not a URL SQLAlchemy reads: show only its scheme
        return f"{text.partition('://')[0]}://..." if "://" in text else repr(text)


# ---- storage: study attributes of any size ----------------------------------------------------------------
# Optuna's RDB storage keeps each attribute's JSON in a TEXT column: 65,535 bytes on MySQL/MariaDB, where a study
# of a large trace had failed to store its recipe (550 KB of JSON for 8,000 Mooncake requests: "Data too long for
# column 'value_json'"). A study attribute whose JSON is longer than `ATTR_PART_CHARS` is stored compressed, in
# parts of at most that many characters, under keys ``KEY#a0``, ``KEY#a1``, ... and ``KEY`` itself holds a
# marker naming them (`SPLIT_MARK`), written last. The storages `open_storage` opens join them again, so every
# reader (optimize, worker, report) sees the whole value; a value stored whole (any older study) reads as it is.
ATTR_PART_CHARS = 50_000  # well under MySQL's 65,535 bytes (the JSON is ASCII: Optuna escapes the rest)
SPLIT_MARK = "skistune.parts"
_PART_KEY = re.compile(r"(?P<key>.+)#(?P<slot>[ab])(?P<index>\d+)")


def _pack(data: bytes) -> str:
    """Bytes as compact ASCII text (zlib, then base64): a split attribute's parts, and the arrays, workload and
    profiles of a study's recipe (`study_recipe.problem_recipe`)."""
    import base64
    import zlib

    return base64.b64encode(zlib.compress(data, 9)).decode("ascii")


def _unpack(text: str) -> bytes:
    import base64
    import zlib

    return zlib.decompress(base64.b64decode(text.encode("ascii")))


def _split_marker(value: Any) -> Mapping[str, Any] | None:
    if isinstance(value, Mapping) and len(value) == 1 and isinstance(value.get(SPLIT_MARK), Mapping):
        return value[SPLIT_MARK]
    return None


def split_attr(key: str, value: Any, current: Any = None) -> list[tuple[str, Any]]:
    """The (key, value) rows that store ``value`` under ``key``: the value itself when its JSON fits one
    attribute, else its compressed parts, then the marker that names them. ``current``: what ``key`` holds now;
    the parts go to the other of two slots (a, b) than the ones it names, so that a run stopped between the rows
    leaves the value before it whole."""
    text = json.dumps(value)
    if len(text) <= ATTR_PART_CHARS:
        return [(key, value)]
    packed = _pack(text.encode())
    slot = "b" if (_split_marker(current) or {}).get("slot") == "a" else "a"
    parts = [packed[i:i + ATTR_PART_CHARS] for i in range(0, len(packed), ATTR_PART_CHARS)]
    marker = {"slot": slot, "parts": len(parts), "sha256": hashlib.sha256(packed.encode()).hexdigest()}
    return [(f"{key}#{slot}{i}", part) for i, part in enumerate(parts)] + [(key, {SPLIT_MARK: marker})]


def joined_attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Stored attributes with each split value (`split_attr`) whole again and its parts left out."""
    out = {}
    for key, value in attrs.items():
        part = _PART_KEY.fullmatch(key)
        if part is not None and part["key"] in attrs:
            continue
        marker = _split_marker(value)
        out[key] = value if marker is None else _joined(key, marker, attrs)
    return out


def _joined(key: str, marker: Mapping[str, Any], attrs: Mapping[str, Any]) -> Any:
    parts = [attrs.get(f"{key}#{marker.get('slot')}{i}") for i in range(int(marker.get("parts", 0)))]
    packed = "".join(p for p in parts if isinstance(p, str))
    if None in parts or hashlib.sha256(packed.encode()).hexdigest() != marker.get("sha256"):
        raise ValueError(f"study attribute {key}: its {len(parts)} stored parts are incomplete or damaged (edited "
                         "by hand?); start another study")
    return json.loads(_unpack(packed))


@functools.cache
def split_attr_storage_class():
    """Optuna's RDB storage, with study attributes of any size (`split_attr`, `joined_attrs`): the class
    `open_storage` opens URLs with (made on first use: Optuna is imported only when a study runs)."""
    import optuna

    class SplitAttrRDBStorage(optuna.storages.RDBStorage):
        __doc__ = split_attr_storage_class.__doc__

        def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
            current = super().get_study_user_attrs(study_id).get(key) if len(json.dumps(value)) > ATTR_PART_CHARS \
                else None
            for k, v in split_attr(key, value, current):
                super().set_study_user_attr(study_id, k, v)

        def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
            return joined_attrs(super().get_study_user_attrs(study_id))

        def get_all_studies(self) -> list:
            studies = super().get_all_studies()
            for s in studies:
                s.user_attrs = joined_attrs(s.user_attrs)
            return studies

    SplitAttrRDBStorage.__module__, SplitAttrRDBStorage.__qualname__ = __name__, "SplitAttrRDBStorage"
    return SplitAttrRDBStorage


def __getattr__(name: str) -> Any:
    if name == "SplitAttrRDBStorage":  # (where pickle looks the class up)
        return split_attr_storage_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- storage: a failure mid-run ---------------------------------------------------------------------------
class StorageWriteError(OSError):
    """The study's storage failed while a run used it (a full disk, a lost database server, a value the
    database refused). Every trial that finished before is in it. ``reason``: the database's own message;
    ``kept``: the study's finished trials (None when the storage could not even be read); `line` says it all
    in one line, with the command that resumes when the caller knows it."""

    def __init__(self, reason: str, *, writing: bool = True, storage: str | None = None,
                 study_name: str | None = None, kept: int | None = None):
        self.reason, self.writing, self.storage, self.study_name, self.kept = reason, writing, storage, study_name, kept
        super().__init__(self.line())

    def line(self, resume: str | None = None) -> str:
        where = f"the study's storage{f' {self.storage}' if self.storage else ''}"
        what = f"{where} could not write ({self.reason})" if self.writing else f"{where} failed ({self.reason})"
        if self.study_name is None:
            return what
        kept = "every trial finished before" if self.kept is None else \
            f"its {self.kept} finished trial{'s' * (self.kept != 1)}"
        full = any(w in self.reason.lower() for w in ("full", "no space", "quota"))
        when = "free space for it" if full else "once it works again"
        how = f"resume with: {resume}" if resume else \
            f"resume with study_name={self.study_name!r} and the same storage"
        return f"{what}; study {self.study_name} keeps {kept}; {when}, then {how}"


_WRITES = ("INSERT", "UPDATE", "DELETE", "COMMIT", "CREATE", "ALTER", "DROP")


def storage_failure(exc: BaseException) -> tuple[str, bool] | None:
    """The database's message and whether it failed writing, when ``exc`` is, or was caused by, a failure of
    the storage (a driver's error as SQLAlchemy wraps it, Optuna's wrapper of a failed commit, or a
    `StorageWriteError`); else None. Optuna's trial loop turns a failed write into "Should not reach": the
    failure is found in what that exception happened during."""
    import sqlite3

    import optuna
    import sqlalchemy.exc

    seen, found = set(), None
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, StorageWriteError):
            return exc.reason, exc.writing
        if isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.orig is not None:
            orig = exc.orig
            statement = (exc.statement or "").lstrip().upper()
            return _error_text(orig), not statement or statement.startswith(_WRITES)
        if isinstance(exc, sqlite3.Error):
            return _error_text(exc), True
        if found is None and isinstance(exc, (optuna.exceptions.StorageInternalError, sqlalchemy.exc.SQLAlchemyError)):
            found = (_error_text(exc), True)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return found


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    name = f"{type(exc).__module__.split('.')[0]}.{type(exc).__name__}"
    return f"{name}: {text}" if text else name


def _finished_in(storage: Any, study_name: str) -> int | None:
    """The finished trials of a study, read through a new connection (None where the storage cannot be read)."""
    import optuna

    try:
        opened = open_storage(storage, create=False) if isinstance(storage, str) else storage
        study = optuna.load_study(study_name=study_name, storage=opened)
        return len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))
    except Exception:  # (a storage that cannot be read now: the message says "every trial finished before")
        return None


@contextlib.contextmanager
def storage_failures(storage: Any, study_name: str):
    """A failure of the study's storage inside the block, however Optuna wrapped it, as one `StorageWriteError`
    that says what failed and how many finished trials the study keeps."""
    try:
        yield
    except Exception as exc:
        found = storage_failure(exc)
        if found is None:
            raise
        raise StorageWriteError(found[0], writing=found[1], storage=_storage_label(storage), study_name=study_name,
                                kept=_finished_in(storage, study_name)) from None


@contextlib.contextmanager
def _quiet_heartbeat_failures():
    """A heartbeat thread that fails to write (a full disk) ends without printing its traceback: the trial's own
    next write fails too, and `storage_failures` says it in one line."""
    import threading

    previous = threading.excepthook

    def hook(args) -> None:
        if not ("_record_heartbeat" in getattr(args.thread, "name", "") and args.exc_value is not None
                and storage_failure(args.exc_value) is not None):
            previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous
