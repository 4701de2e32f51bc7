"""A study on a real MariaDB server (`mysql_server.MariaDBServer`), as the PostgreSQL tests run one: MySQL's TEXT
column holds 65,535 bytes, and a study's recipe on a big trace is longer (65 KB of JSON for 400 Mooncake requests,
550 KB for 8,000), so it is stored in parts: the creator, a worker and the report all read it back whole.

Where no server binaries or no driver exist these tests fail with the reason (`running_server`): .ci/run installs
both."""

import optuna
import pytest
import sqlalchemy.exc
from mysql_server import MariaDBServer, unavailable_reason
from reliability_helpers import running_server
from test_study_attr_size import ATTR_TABLES, LIMIT, MOONCAKE

from skistune.optimize import build_problem, solve
from skistune.study_recipe import RECIPE_ATTR, join_study, run_worker
from skistune.workloads import load_workload


@pytest.fixture(scope="module")
def mariadb():
    yield from running_server("MariaDB", unavailable_reason(), MariaDBServer)


def max_attr_bytes(server: MariaDBServer, database: str) -> dict[str, int]:
    """The longest stored attribute of each table, in bytes, as the server holds them."""
    conn = server.connect(database)
    try:
        with conn.cursor() as cur:
            sizes = {}
            for table in ATTR_TABLES:
                cur.execute(f"SELECT COALESCE(MAX(LENGTH(value_json)), 0) FROM {table}")
                sizes[table] = cur.fetchone()[0]
            return sizes
    finally:
        conn.close()


def test_the_64_kib_limit_is_real_on_this_server(mariadb):
    """What the split guards against: Optuna's own storage refuses an attribute past the TEXT column."""
    _, url = mariadb.database()
    plain = optuna.storages.RDBStorage(url)
    study = optuna.create_study(study_name="plain", storage=plain)
    with pytest.raises(optuna.exceptions.StorageInternalError) as raised:
        study.set_user_attr("big", "x" * 70_000)
    assert isinstance(raised.value.__cause__, sqlalchemy.exc.DataError)
    assert "Data too long for column 'value_json'" in str(raised.value.__cause__)


def test_a_study_of_a_big_trace_is_created_joined_and_reported_on_mariadb(mariadb, profile):
    database, url = mariadb.database()
    workload = load_workload(str(MOONCAKE), first=400)
    problem = build_problem(workload, slo="tbt:p99<=10s", max_queue_s=None, profile=profile)
    created = solve(problem, n_trials=2, validate=0, storage=url, study_name="big")
    assert created.feasible and created.trials == 2
    sizes = max_attr_bytes(mariadb, database)
    assert all(size < LIMIT for size in sizes.values()), sizes
    # a worker rebuilds the problem from the stored recipe alone, and adds its trial
    job = join_study(url, "big", seed=1)
    assert job.problem.identity() == problem.identity()
    assert run_worker(job, n_trials=1).complete_in_study == 3
    # the report reads the recipe through `open_storage` too
    from skistune.report import load_study

    study, reported, _ = load_study("big", url)
    assert reported.identity() == problem.identity() and len(study.trials) == 3
    assert RECIPE_ATTR in study.user_attrs and not any("#" in key for key in study.user_attrs)


def test_a_default_chat_study_resumes_on_mariadb(mariadb, profile):
    _, url = mariadb.database()
    problem = build_problem(load_workload("chat", requests=16), slo="p99=200ms", profile=profile)
    first = solve(problem, n_trials=2, validate=0, storage=url, study_name="chat")
    again = solve(problem, n_trials=2, validate=0, storage=url, study_name="chat")
    assert first.trials == 2 and again.trials == 4
