"""`skistune.optimize` checks its objective and constraints up front (a callable with the documented
signature, `inspect.signature`), and a callable that returns something other than a number stops the
search with one clear error naming it, not a float() TypeError inside an Optuna trial and its traceback.
The tuned file's provenance lists under ``not_modeled`` only knobs the simulator cannot price."""
from __future__ import annotations

import logging

import numpy as np
import optuna
import pytest

import skistune
from skistune.objectives import ReturnValueError, parse_objectives, user_constraint
from skistune.workloads import load_workload


@pytest.fixture(scope="module")
def workload():
    return load_workload("chat", requests=6, max_input=64, max_output=8, seed=0, rate_scale=0.05)


def run(workload, profile, **kw):
    kw = {"n_trials": 3, "validate": 0, "storage": optuna.storages.InMemoryStorage(), "profile": profile, **kw}
    return skistune.optimize(workload, **kw)


@pytest.mark.parametrize("objective, message", [
    (42, r"objective: 42 \(int\) is not an objective: use capacity, goodput"),
    (None, r"objective: None \(NoneType\) is not an objective"),
    (lambda a, b, c: 1.0,
     r"objective custom: takes \(a, b, c\), but is called as f\(metrics\) or f\(metrics, config\)"),
    (lambda m, *, scale: 1.0, r"objective custom: takes \(m, \*, scale\)"),
    (lambda: 1.0, r"objective custom: takes \(\)"),
    # (text, as --objective gives it, cannot be a callable: the hint is for Python's lists only)
    ("capacity,speed", r"objective 'speed': use capacity, goodput, energy, memory, quality or a comma-separated "
                       r"tuple of them$"),
    (["capacity", "speed"], r"objective 'speed': .* tuple of them, or a callable of the metrics$"),
])
def test_a_bad_objective_is_a_value_error_before_anything_runs(objective, message):
    with pytest.raises(ValueError, match=message):
        parse_objectives(objective)


def test_a_bad_constraint_signature_is_refused_up_front():
    with pytest.raises(ValueError, match=r"constraint constraint1: takes \(a, b, c\)"):
        user_constraint(lambda a, b, c: 0.0, 1)
    with pytest.raises(ValueError, match="constraint constraint2: 5 is not callable"):
        user_constraint(5, 2)


def test_signatures_that_bind_choose_how_the_callable_is_called():
    from skistune.objectives import Point, _metrics_call

    point = Point(config="C", metrics="M", rate_rps=0, energy_j_per_token=0, goodput_rps=0, quality=None,
                  queue_reference_s=0)
    assert _metrics_call(lambda m: m)(point) == "M"
    assert _metrics_call(lambda m, c: (m, c))(point) == ("M", "C")
    assert _metrics_call(lambda m, c=None, *, k=1: (m, c))(point) == ("M", "C")
    assert _metrics_call(lambda *args: args)(point) == ("M", "C")


def test_optimize_refuses_bad_objectives_and_workloads_before_any_trial(workload, profile, monkeypatch):
    import skistune.optimize as opt
    import skistune.search as search_module
    import skistune.validation as validation

    for scorer in (search_module, opt, validation):  # (each module that scores a config: trials, refining, replays)
        monkeypatch.setattr(scorer, "score", lambda *a, **k: pytest.fail("a config was scored"))
    for kwargs, message in ((dict(objective=42), "objective: 42"),
                            (dict(objective=lambda a, b, c: 1.0), r"takes \(a, b, c\)"),
                            (dict(constraints=[lambda a, b, c: 0.0]), r"takes \(a, b, c\)")):
        with pytest.raises(ValueError, match=message):
            run(workload, profile, **kwargs)
    with pytest.raises(ValueError, match=r"workload: 3 \(int\) is not a workload: give a preset name"):
        run(3, profile)


@pytest.mark.parametrize("kwargs, message", [
    (dict(objective=lambda m, c: None), "objective custom: returned None, not a number"),
    (dict(objective=lambda m: "fast"), "objective custom: returned 'fast', not a number"),
    (dict(slo="p99=200ms", constraints=[lambda m, c: None]),
     r"constraint constraint1: returned None, not a number \(<= 0 is feasible\)"),
    # a bool had read as 1.0 (broken) when the test it writes held: the constraint inverted, silently
    (dict(slo="p99=200ms", constraints=[lambda m: m.kv_peak_bytes < 2**40]),
     r"constraint constraint1: returned True, a bool, not a number \(<= 0 is feasible\): return a margin"),
    (dict(objective=lambda m: np.bool_(m.kv_peak_bytes > 0)), r"objective custom: returned (np\.)?True(_)?, a bool"),
])
def test_a_non_numeric_return_value_stops_the_search_with_one_clear_error(workload, profile, caplog, capsys,
                                                                           kwargs, message):
    storage = optuna.storages.InMemoryStorage()
    with caplog.at_level(logging.WARNING, logger="optuna"):
        with pytest.raises(ReturnValueError, match=message):
            run(workload, profile, storage=storage, n_trials=5, **kwargs)
    assert not [r for r in caplog.records if r.exc_info], "Optuna logged a failed trial's traceback"
    assert "Traceback" not in capsys.readouterr().err
    trials = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage).get_trials()
    assert len(trials) == 1 and trials[0].state == optuna.trial.TrialState.PRUNED  # stopped at the first


def test_provenance_lists_only_unmodeled_knobs_as_not_modeled():
    """Eviction and KV bits are modeled (the simulator prices them), just not searched without a quality
    floor: they are listed under their own key, not as ``not_modeled``."""
    from skistune.optimize import left_out_provenance
    from skistune.simulator import LOSSY_KNOBS, MODELED_KNOBS

    left = ("bitwidth.key_bits", "eviction.policy", "future.knob")
    out = left_out_provenance(left)
    assert out == {"not_modeled": ["future.knob"], "not_searched_lossless": ["bitwidth.key_bits", "eviction.policy"]}
    assert not set(out["not_modeled"]) & (LOSSY_KNOBS | MODELED_KNOBS)


def test_the_tuned_files_provenance_says_lossy_knobs_were_not_searched(workload, profile):
    r = run(workload, profile, slo="p99=200ms", n_trials=2)
    space = r.provenance()["search_space"]
    assert space["not_modeled"] == []  # every knob of the default space is modeled
    assert "eviction.policy" in space["not_searched_lossless"] and "bitwidth.key_bits" in space["not_searched_lossless"]


def test_goodput_checks_a_tbt_slo_at_p99_9_of_each_requests_own_gaps():
    """`tbt:p99.9<=200ms` crashed the search after it ran (int('99.9')); the README lists p99.9."""
    from skistune.objectives import goodput_rps
    from skistune.runtime.request import RequestRecord
    from skistune.slo import parse_slo

    ticks = [0.1 * i for i in range(1, 101)]  # 99 gaps of 100 ms
    steady = RequestRecord("a", 0.0, 4, ticks, finish_s=10.0)
    spiky = RequestRecord("b", 0.0, 4, ticks + [10.5], finish_s=10.5)  # and one of 500 ms
    assert goodput_rps([steady, spiky], 10.0, [parse_slo("tbt:p99.9<=200ms")]) == 0.1  # b's p99.9 is ~460 ms
    assert goodput_rps([steady, spiky], 10.0, [parse_slo("p99=200ms")]) == 0.2  # its p99, ~104 ms, holds


def test_goodput_checks_each_requests_tpot_ttft_and_e2e_by_their_definitions():
    """Guards against a TPOT that divides a request's decode time by its tokens instead of its gaps (or a TTFT or
    E2E measured from the wrong instants), which lets a request over a TPOT limit count as good."""
    from skistune.objectives import goodput_rps
    from skistune.runtime.request import RequestRecord
    from skistune.slo import parse_slo

    record = RequestRecord("a", 0.0, 4, [1.0, 2.0, 3.0], finish_s=3.0)  # TPOT 1 s (2 s over 2 gaps), TTFT 1 s, E2E 3 s
    for metric, value in (("tpot", 1.0), ("ttft", 1.0), ("e2e", 3.0)):
        just_under = f"{metric}:p50<={value * 1000 - 100:g}ms"
        assert goodput_rps([record], 4.0, [parse_slo(just_under)]) == 0.0, just_under
        assert goodput_rps([record], 4.0, [parse_slo(f"{metric}:p50<={value:g}s")]) == 0.25, metric


def test_energy_per_token_charges_busy_time_at_full_power_and_the_rest_at_idle_power():
    """Guards against swapping the busy and idle times given to the power model, which charges the idle
    seconds at full power."""
    from skistune.objectives import energy_j_per_token
    from skistune.profile.power import PowerModel
    from skistune.runtime.metrics import compute_metrics
    from skistune.runtime.request import RequestRecord

    record = RequestRecord("a", 0.0, 4, [1.0, 2.0, 3.0], finish_s=3.0)
    metrics = compute_metrics([record], duration_s=4.0, kv_peak_bytes=0, kv_capacity_bytes=0, preemptions=0,
                              busy_s=1.0)
    power = PowerModel("t", idle_w=50.0, dynamic_w=100.0, note="")
    assert energy_j_per_token(metrics, power) == 100.0  # (150 W x 1 s busy + 50 W x 3 s idle) / 3 tokens


def test_context_tokens_p90_is_the_90th_percentile_of_prompt_plus_output():
    """Guards against another percentile (or the prompt alone) being taken as the context an eviction budget
    fraction is of."""
    from skistune.objectives import context_tokens_p90
    from skistune.runtime.request import Request

    requests = [Request(f"r{i}", [1] * i, 10) for i in range(1, 101)]  # contexts 11..110 tokens
    assert context_tokens_p90(requests) == 100  # np.percentile(11..110, 90) = 100.1
    assert context_tokens_p90([]) == 0


def test_directions_of_a_list_of_objectives_go_one_to_each_in_order():
    """A tester's `objective=["capacity", f], direction=["maximize", "minimize"]` had maximised f (every callable in
    a list took the first direction)."""
    def f(metrics):
        return metrics.busy_s

    def g(metrics):
        return metrics.duration_s

    mixed = parse_objectives(["capacity", f], ["maximize", "minimize"])
    assert [o.maximize for o in mixed] == [True, False]
    two = parse_objectives([f, g], ["minimize", "maximize"])
    assert [o.maximize for o in two] == [False, True]
    with pytest.raises(ValueError, match="1 given for 2 objectives"):
        parse_objectives([f, g], ["minimize"])
    with pytest.raises(ValueError, match="capacity has its own direction"):
        parse_objectives(["capacity", f], ["minimize", "minimize"])
    assert [o.maximize for o in parse_objectives(["capacity", f], "maximize")] == [True, True]  # one: the callables'


def test_a_constraint_may_return_an_array_and_not_an_empty_sequence():
    """A tester's numpy array was refused as "not a number"; an empty list had read as met."""
    from skistune.objectives import Point

    point = Point(config="C", metrics="M", rate_rps=0, energy_j_per_token=0, goodput_rps=0, quality=None,
                  queue_reference_s=0)
    assert user_constraint(lambda m: np.array([-1.0, 0.5]), 1).value(point) == 0.5
    with pytest.raises(ReturnValueError, match="returned an empty list"):
        user_constraint(lambda m: [], 1).value(point)


SCALE = 12.0


def test_code_digest_tells_a_changed_callable_from_the_same_one():
    from skistune.objectives import code_digest

    def make(watts):
        return lambda m: m.busy_s * watts

    def scaled(m):
        return m.busy_s * SCALE

    assert code_digest(lambda m: m.busy_s * 12) == code_digest(lambda m: m.busy_s * 12)
    assert code_digest(lambda m: m.busy_s * 12) != code_digest(lambda m: m.busy_s * 1200)
    assert code_digest(make(12)) == code_digest(make(12)) != code_digest(make(1200))  # a closure's value
    before = code_digest(scaled)
    globals()["SCALE"] = 1200.0  # a global the function reads
    try:
        assert code_digest(scaled) != before
    finally:
        globals()["SCALE"] = 12.0
    import functools
    assert code_digest(functools.partial(max, 1)) != code_digest(functools.partial(max, 2))


def test_a_study_resumes_only_with_the_callables_it_was_scored_with(workload, profile):
    """A tester's study resumed silently after its objective was scaled 100x and its constraint tightened (both
    lambdas, named alike): the study mixed objective values 100x apart, and its winner broke the new constraint."""
    storage = optuna.storages.InMemoryStorage()
    run(workload, profile, objective=lambda m: m.busy_s * 12, storage=storage, study_name="s", n_trials=2)
    run(workload, profile, objective=lambda m: m.busy_s * 12, storage=storage, study_name="s", n_trials=2)
    with pytest.raises(ValueError, match=r"differs in: callables \(the code or values of an objective"):
        run(workload, profile, objective=lambda m: m.busy_s * 1200, storage=storage, study_name="s", n_trials=2)


def test_a_worker_stopped_mid_trial_logs_no_traceback():
    """A tester's `n_jobs=2` run whose objective raised printed, one run in five, Optuna's 45-line "Trial 3 failed
    ... Terminated()" warning before the error: the other worker, stopped mid-trial."""
    import logging
    import sys

    from skistune.search import quiet_stops
    from skistune.signals import Terminated

    def record(error):
        try:
            raise error
        except BaseException:
            return logging.LogRecord("optuna.study._optimize", logging.WARNING, __file__, 1, "Trial 3 failed", None,
                                     sys.exc_info())

    quiet_stops()
    quiet_stops()
    logger = logging.getLogger("optuna.study._optimize")
    assert len([f for f in logger.filters if type(f).__name__ == "_StopRecords"]) == 1
    assert not logger.filter(record(Terminated()))
    assert logger.filter(record(ValueError("a real failure")))
