"""The front `optimize` returns is the study's: the trials that simplified the best config are on it where they
belong, and its figures are of one precision, so that it holds no config another on it beats and no point twice."""
from __future__ import annotations

import optuna

import skistune
from skistune.optimize import completed, pareto_front
from skistune.workloads import load_workload


def test_the_front_is_the_studys_and_no_member_beats_another(profile):
    """A tester's 3-objective front left out a simplifying trial that beat 4 of its 7 members (the front was taken
    before the simplifying trials ran), and mixed refined figures with the search's (a config shown beside one
    that beat it at equal precision, and one config twice)."""
    workload = load_workload("chat", requests=30, max_input=256, max_output=32, seed=0)
    result = skistune.optimize(workload, slo=["p99=200ms"], objective=("capacity", "memory", "quality"),
                               n_trials=30, validate=0, profile=profile, seed=7,
                               storage=optuna.storages.InMemoryStorage())
    problem = result.problem
    searched_front = {e.trial for e in pareto_front(problem, completed(result.study))}
    shown = result.pareto
    assert len(shown) >= 3
    assert {e.trial for e in shown} - {result.best[0].trial} <= searched_front
    signs = [1 if o.maximize else -1 for o in problem.objectives]

    def beats(a, b):
        x, y = ([s * v for s, v in zip(signs, e.values)] for e in (a, b))
        return all(p >= q for p, q in zip(x, y)) and x != y

    for a in shown:
        assert not any(beats(b, a) for b in shown), (a.trial, a.values)
    assert len({tuple(e.values) for e in shown}) == len(shown)
