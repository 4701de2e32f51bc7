"""The local moves of a TPE search (`skistune.local_moves`): neighbours of the best trials, never repeated."""
from __future__ import annotations

import optuna
import pytest

from skistune.local_moves import MOVE_ATTR, LocalMovesSampler

KNOBS = {"a": [0, 1, 2, 3], "b": ["x", "y", "z"], "c": [False, True]}


def _feasible(trial) -> bool:
    return trial.user_attrs.get("feasible", True)


def _objective(trial) -> float:
    a = trial.suggest_categorical("a", KNOBS["a"])
    b = trial.suggest_categorical("b", KNOBS["b"])
    c = trial.suggest_categorical("c", KNOBS["c"])
    if c:  # a knob that exists only when c is on, as an eviction budget exists only with a policy
        trial.suggest_float("budget", 0.1, 0.9, log=True)
    trial.set_user_attr("feasible", b != "z")  # the best value (a=3, b=z) is infeasible
    return float(a) + (b == "z") * 10


def _study(seed: int, share: float = 0.5, n_trials: int = 40, **options) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    tpe = optuna.samplers.TPESampler(seed=seed, n_startup_trials=5)
    sampler = LocalMovesSampler(tpe, seed=seed, feasible=_feasible, share=share, start_after=5, **options)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    study.optimize(_objective, n_trials=n_trials)
    return study


def _moves(study):
    return [t for t in study.trials if MOVE_ATTR in t.system_attrs]


def test_local_trials_are_neighbours_of_a_best_feasible_trial_so_far():
    study = _study(seed=3)
    moves = _moves(study)
    assert len(moves) >= 8  # half the trials after the fifth, give or take the draw
    for trial in moves:
        move = trial.system_attrs[MOVE_ATTR]
        start = study.trials[move["from"]]
        assert start.number < trial.number and start.user_attrs["feasible"]
        before = [t for t in study.trials[:trial.number] if t.state.is_finished() and t.user_attrs["feasible"]]
        assert start.value == max(t.value for t in before)  # an incumbent, not any trial
        assert 1 <= len(move["knobs"]) <= 2
        changed = {k for k in KNOBS if trial.params[k] != start.params[k]}
        assert changed == set(move["knobs"]) - {"budget"}


def test_a_move_never_repeats_parameters_already_tried():
    study = _study(seed=5, share=1.0, n_trials=30)
    for trial in _moves(study):
        earlier = [t.params for t in study.trials[:trial.number]]
        assert trial.params not in earlier


def test_a_knob_the_move_switches_on_is_sampled_and_one_switched_off_is_not_asked():
    study = _study(seed=1, share=1.0, n_trials=30)
    switched = [t for t in _moves(study) if "c" in t.system_attrs[MOVE_ATTR]["knobs"]]
    assert switched
    for trial in switched:
        assert ("budget" in trial.params) == trial.params["c"]
        if trial.params["c"]:
            assert 0.1 <= trial.params["budget"] <= 0.9


def test_seeded_searches_repeat_and_share_zero_is_the_wrapped_sampler():
    first, again = _study(seed=7), _study(seed=7)
    assert [t.params for t in first.trials] == [t.params for t in again.trials]
    plain = _study(seed=7, share=0.0)
    assert not _moves(plain)
    tpe = optuna.create_study(direction="maximize",
                              sampler=optuna.samplers.TPESampler(seed=7, n_startup_trials=5))
    tpe.optimize(_objective, n_trials=40)
    assert [t.params for t in plain.trials] == [t.params for t in tpe.trials]


def test_the_search_reaches_the_feasible_optimum():
    for seed in range(3):
        study = _study(seed=seed)
        best = max(t.value for t in study.trials if t.user_attrs["feasible"])
        assert best == 3.0


def test_a_numeric_knob_moves_within_its_range():
    sampler = LocalMovesSampler(optuna.samplers.RandomSampler(seed=0), seed=0, feasible=_feasible)
    for distribution, value in ((optuna.distributions.FloatDistribution(0.1, 0.9, log=True), 0.3),
                                (optuna.distributions.IntDistribution(16, 1024, log=True), 64),
                                (optuna.distributions.IntDistribution(0, 100, step=10), 50)):
        moved = [sampler._moved(distribution, value) for _ in range(200)]
        assert all(m is not None and m != value and distribution.low <= m <= distribution.high for m in moved)
        if isinstance(distribution, optuna.distributions.IntDistribution):
            assert all(isinstance(m, int) for m in moved)
            if distribution.step != 1:
                assert all(m % 10 == 0 for m in moved)
    assert sampler._moved(optuna.distributions.CategoricalDistribution([4]), 4) is None


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_a_share_outside_zero_one_is_refused(share):
    with pytest.raises(ValueError, match="share"):
        LocalMovesSampler(optuna.samplers.RandomSampler(), seed=0, feasible=_feasible, share=share)


def test_an_enqueued_trial_is_never_taken_for_a_move():
    """Enqueued parameters (the baseline, the simplifying trials after a search) win over any sampler: such a
    trial marked as a move would misreport what the moves did."""
    study = _study(seed=2, share=1.0, n_trials=12)
    study.enqueue_trial({"a": 0, "b": "x", "c": False})
    study.optimize(_objective, n_trials=1)
    last = study.trials[-1]
    assert last.params == {"a": 0, "b": "x", "c": False} and MOVE_ATTR not in last.system_attrs
