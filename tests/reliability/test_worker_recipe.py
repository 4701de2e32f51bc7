"""What a study stores for `skistune worker`: the recipe rebuilds the creator's exact problem (workload,
profile, SLOs, energy and quality specs, a search space from a file) from JSON alone, and what cannot be
carried (Python callables, a study made without skistune) is refused with one line."""
import json

import optuna
import pytest

from skistune.objectives import EnergyBudget
from skistune.optimize import build_problem
from skistune.study_recipe import join_study, problem_from_recipe, problem_recipe
from skistune.workloads import load_workload

SPACE = """name: two-knobs
description: a small space from a file
knobs:
  batching.max_num_seqs: {choices: [4, 16, 64]}
  batching.policy: {choices: [fcfs, edf]}
"""


def test_recipe_rebuilds_the_same_problem_from_json(tmp_path, profile):
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    problem = build_problem(load_workload("chat", requests=12, seed=3), slo=["p99=200ms", "ttft:p90<=1.25s"],
                            energy=EnergyBudget(0.123456789), quality=["ppl+1%", "needle>=0.9"], profile=profile,
                            space=str(space), max_queue_s=2.5)
    recipe = json.loads(json.dumps(problem_recipe(problem, sampler="tpe", seed=5, n_trials=9)))  # as stored
    rebuilt, search = problem_from_recipe(recipe)
    assert rebuilt.identity() == problem.identity() and search == {"sampler": "tpe", "seed": 5, "n_trials": 9}
    assert rebuilt.workload.digest() == problem.workload.digest() and rebuilt.full_space == problem.full_space
    assert [c.name for c in rebuilt.constraints] == [c.name for c in problem.constraints]
    assert rebuilt.constraints[3].value.__self__ == EnergyBudget(0.123456789)  # exact, not a rounded string


def test_python_callables_cannot_travel_and_the_worker_says_so(profile):
    problem = build_problem(load_workload("chat", requests=12), objective=lambda m: m.duration_s, profile=profile)
    recipe = problem_recipe(problem, sampler="auto", seed=0)
    with pytest.raises(ValueError, match=r"uses Python callables \(custom\); run more workers from Python"):
        problem_from_recipe(recipe)


def test_a_study_made_without_skistune_is_refused(tmp_path):
    url = f"sqlite:///{tmp_path / 'plain.db'}"
    optuna.create_study(storage=url, study_name="plain")
    with pytest.raises(ValueError, match="holds no skistune recipe"):
        join_study(url, "plain")


def test_a_worker_leaves_a_database_of_something_else_as_it_was(tmp_path):
    """A worker pointed at another application's SQLite file (or an empty file) refuses with one line and
    writes nothing: Optuna's tables were created in it before the refusal."""
    import sqlite3

    other = tmp_path / "other.db"
    with sqlite3.connect(other) as db:
        db.execute("create table mydata (x)")
    before = other.read_bytes()
    with pytest.raises(ValueError, match="holds no Optuna study; create the study first"):
        join_study(f"sqlite:///{other}", "w1")
    assert other.read_bytes() == before
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="holds no Optuna study"):
        join_study(f"sqlite:///{empty}", "w1")
    assert empty.read_bytes() == b""


def test_a_study_an_earlier_skistune_described_differently_is_refused_by_a_worker_saying_so(tmp_path, profile):
    """A study made by a skistune that keyed the same profile differently (a CPU profile's key had once held the
    Triton version): the worker rebuilds the problem from the study's own recipe, so 'created for another problem;
    pass another study name' made no sense for it."""
    import skistune
    from skistune.search import PROBLEM_ATTR

    url = f"sqlite:///{tmp_path / 's.db'}"
    skistune.optimize(load_workload("chat", requests=8, seed=0), slo="p99=200ms", n_trials=1, validate=0,
                      profile=profile, storage=url, study_name="old")
    study = optuna.load_study(study_name="old", storage=url)
    study.set_user_attr(PROBLEM_ATTR, {**study.user_attrs[PROBLEM_ATTR], "profile": "f4f4284a3ea5"})
    with pytest.raises(ValueError) as refused:
        join_study(url, "old")
    assert str(refused.value) == (
        "study 'old' was made by an earlier skistune: this one rebuilds its problem from its recipe and describes it "
        "differently (differs in: profile), so its workers cannot add to it; add trials with the skistune that made "
        "it, or start a new study with skistune optimize")
    with pytest.raises(ValueError, match=r"^study 'old' was created for another problem, or by an earlier skistune "
                                         r"that described it differently \(differs in: profile\); pass another"):
        skistune.optimize(load_workload("chat", requests=8, seed=0), slo="p99=200ms", n_trials=1, validate=0,
                          profile=profile, storage=url, study_name="old")
