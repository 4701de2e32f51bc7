"""Ranking against the baseline (float noise and ties below the resolution put the defaults first, with one
objective or several, and keep them on the front), the knob groups a multi-objective winner does not need,
user callables that return a non-finite value or raise (one clear error), an objective the space cannot
change, and what the command says of a short, timed-out or unmeetable search."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import optuna
import pytest
import yaml
from typer.testing import CliRunner

import skistune
import skistune.optimize as opt
import skistune.search as search_module
from skistune.cli import app
from skistune.objectives import NAMED, ReturnValueError
from skistune.workloads import load_workload

PROFILE = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json")
GiB = 1 << 30
SLO = "tbt:p99<=200ms"


@pytest.fixture(scope="module")
def workload():
    return load_workload("chat", requests=16, seed=0)


@pytest.fixture(scope="module")
def slow():
    """Arrivals slow enough that configs scored at the workload's own rate meet the SLO and the queue guard."""
    return load_workload("chat", requests=6, max_input=64, max_output=8, seed=0, rate_scale=0.05)


def ev(config, values, trial, energy=0.5):
    return opt.Evaluation(config, 1.0, tuple(values), {SLO: -0.1}, {"energy_j_per_token": energy}, trial=trial)


def invoke(*args):
    return CliRunner().invoke(app, ["optimize", *args])


# ---- the baseline first on a tie ---------------------------------------------------------------------------
def test_configs_that_serve_alike_are_ranked_once(workload, profile):
    """A tester's best-configs table listed #1 and #2 with the same figures: trial 18 differed from trial 9 only by
    a quantization group size, which does nothing at 16 bits (`KVConfig.effective`)."""
    problem = opt.build_problem(workload, slo="p99=200ms", profile=profile)
    chunked = problem.base.with_knobs({"batching.chunk_size": 1694})
    inert = chunked.with_knobs({"bitwidth.group_size": 128})
    assert inert != chunked and inert.effective() == chunked.effective()
    other = problem.base.with_knobs({"batching.chunk_size": 1024})
    evaluations = [ev(chunked, (0.5,), 9), ev(inert, (0.5,), 18), ev(other, (0.4,), 20)]
    assert [e.trial for e in opt.ranked(problem, evaluations)] == [9, 20]


def test_energy_lower_by_float_noise_does_not_rank_a_tiered_config_before_the_baseline(workload, profile):
    """The tester's run: trial 5 (an unused 8 GiB host tier) tied the defaults on every objective but came
    first, by 0.673538355530488 against 0.6735383555304882 J/token, and so took the defaults' place on the
    front (of equal points the front keeps the first)."""
    problem = opt.build_problem(workload, slo="p99=200ms", objective="capacity,energy,memory", profile=profile)
    tiered = problem.base.with_knobs({"offload.host_kv_bytes": 8 * GiB, "prefix_reuse.enabled": False})
    noisy = ev(tiered, (0.4995, 0.673538355530488, 88473600.0), 5, energy=0.673538355530488)
    base = ev(problem.base, (0.4995, 0.6735383555304882, 88473600.0), 0, energy=0.6735383555304882)
    assert [e.trial for e in opt.ranked(problem, [noisy, base])] == [0, 5]
    assert [e.trial for e in opt.pareto_front(problem, [noisy, base])] == [0]
    lower = ev(tiered, (0.4995, 0.6735, 88473600.0), 5, energy=0.6735)  # a real difference still counts
    assert [e.trial for e in opt.ranked(problem, [lower, base])] == [5, 0]


def test_with_several_objectives_the_baseline_ranks_first_when_the_best_beats_it_on_none(workload, profile):
    """The API's energy,memory run wrote trial 5 for 0.7% less memory (and the same energy): below the 2% the
    search resolves on every objective, so the defaults go first; a gain above it on one objective keeps it."""
    problem = opt.build_problem(workload, slo="p99=200ms", objective="energy,memory", profile=profile)
    other = problem.base.with_knobs({"batching.max_num_seqs": 105})
    base = ev(problem.base, (0.5, 100e6), None)
    evaluations = [ev(problem.base, (0.5, 100e6), 0), ev(other, (0.5, 99.3e6), 5)]
    tie = [ev(other, (0.4999, 99.3e6), 5)]
    ranked, notes = opt._baseline_on_ties(problem, tie, base, evaluations)
    assert [e.config for e in ranked] == [problem.base] and ranked[0].trial == 0
    assert notes == ["the best config (trial 5) is predicted better than the baseline by no more than 2% on every "
                     "objective (energy 0.4999 vs 0.5, memory 9.93e+07 vs 1e+08): a tie, so the baseline is ranked "
                     "first"]
    clear = [ev(other, (0.5, 97e6), 5)]  # 3% less memory
    assert opt._baseline_on_ties(problem, clear, base, evaluations) == (clear, [])


def test_the_chosen_config_is_on_the_front_in_place_of_the_configs_it_ties(workload, profile):
    problem = opt.build_problem(workload, slo="p99=200ms", objective="energy,memory", profile=profile)
    near = ev(problem.base.with_knobs({"batching.max_num_seqs": 105}), (0.5, 99.3e6), 5)  # within 2% of base
    apart = ev(problem.base.with_knobs({"batching.max_num_seqs": 8}), (0.9, 50e6), 7)  # another trade-off
    base = ev(problem.base, (0.5, 100e6), 0)
    assert [e.trial for e in opt.pareto_front(problem, [near, apart, base])] == [5, 7]  # (exactly: 5 beats 0)
    assert [e.trial for e in opt.front_with(problem, [near, apart], base)] == [0, 7]
    assert opt.front_with(problem, [base, apart], base) == [base, apart]
    # the report's front has axes beyond the objectives: a config that beats the chosen one there by more than
    # 2% stays beside it (a tester's front had dropped one at the same capacity and 2.8% less energy)
    joules = {0: 0.145, 5: 0.141, 7: 0.144}  # (5: 2.8% less than 0; 7: 0.7%, a tie)
    gains = (lambda e: (-joules[e.trial],))
    near_tied = ev(near.config, (0.5, 100e6), 7)
    assert [e.trial for e in opt.front_with(problem, [near, near_tied], base, gains=gains)] == [0, 5]


def test_a_multi_objective_winner_keeps_no_knob_group_its_gain_does_not_need(workload, profile):
    """As with one objective (test_optimize_api): host and disk tiers that change no figure go back to the
    baseline's, now kept only where the winner beats the simpler config on no objective."""
    problem = opt.build_problem(workload, slo="p99=200ms", objective="capacity,memory", profile=profile)
    study = opt.open_study(problem, optuna.storages.InMemoryStorage(), "s", sampler=None)
    host, disk = (max(problem.space.param(n).choices) for n in ("offload.host_kv_bytes", "offload.disk_kv_bytes"))
    study.enqueue_trial({**opt._baseline_params(problem), "offload.host_kv_bytes": host, "offload.disk_kv_bytes": disk,
                         "batching.max_num_batched_tokens": 8192, "batching.chunk_size": 512})
    study.optimize(opt._trial_function(problem, study), n_trials=2)  # the baseline, then the tiered config
    best = opt._refine(problem, [e for e in opt.completed(study) if e.trial == 1])
    assert best[0].config.offload.host_kv_bytes == host and best[0].feasible
    simpler, notes = opt._simplify(problem, study, best, lambda stage: None)
    kept = simpler[0].config
    assert kept.offload.host_kv_bytes == 0 and kept.offload.disk_kv_bytes == 0
    assert kept.batching.max_num_batched_tokens == 8192  # (the gain's own knobs stay)
    assert notes[0].startswith("trial 2, trial 1 with its KV tiers set back to the baseline's, is predicted no more "
                               "than 2% worse on any objective (capacity ")
    assert not opt.beats_anywhere(problem, best[0], simpler[0])


# ---- user callables ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(constraints=[lambda m: math.nan]), r"constraint constraint1: returned nan, not a finite number \(e\.g\. a "
                                             r"latency percentile of a run in which no request finished\) \(<= 0 is "
                                             r"feasible\)"),
    (dict(constraints=[lambda m: math.inf]), r"constraint constraint1: returned inf, not a finite number \(<= 0"),
    (dict(constraints=[lambda m: [0.0, -math.inf]]), r"constraint constraint1: returned -inf, not a finite"),
    (dict(objective=lambda m: math.inf), r"^objective custom: returned inf, not a finite number$"),
    (dict(objective=lambda m: (1.0, math.nan), direction=["minimize", "minimize"]),
     r"objective custom\[1\]: returned nan, not a finite number"),
])
def test_a_non_finite_value_from_a_user_callable_is_one_error_naming_it(slow, profile, kwargs, message):
    """A NaN constraint had been read as violated (inf, "binding") while a NaN objective raised; an infinite
    objective had been accepted (gain nan, YAML .inf)."""
    storage = optuna.storages.InMemoryStorage()
    with pytest.raises(ReturnValueError, match=message):
        skistune.optimize(slow, n_trials=3, validate=0, storage=storage, profile=profile, **kwargs)
    trials = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage).get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.PRUNED]  # stopped at the first


def test_a_user_callable_that_raises_stops_the_search_with_its_own_error_logged_by_no_one(slow, profile, caplog,
                                                                                        capsys):
    def throughput(metrics):
        return 1 / 0

    storage = optuna.storages.InMemoryStorage()
    with caplog.at_level(logging.DEBUG, logger="optuna"):
        with pytest.raises(ZeroDivisionError) as raised:
            skistune.optimize(slow, objective=throughput, n_trials=3, validate=0, storage=storage, profile=profile)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []  # no "Trial 0 failed ..."
    assert "Traceback" not in capsys.readouterr().err
    assert skistune.objectives.raised_by(raised.value) == "objective throughput"
    trials = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage).get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.PRUNED]
    assert trials[0].user_attrs["skistune.error"].startswith("ZeroDivisionError: ")  # (why, for a dashboard)


def test_a_user_callable_that_raises_in_a_forked_worker_stops_every_worker_with_its_own_error(slow, profile, here,
                                                                                           capfd):
    """Workers forked by ``n_jobs`` had printed the error's traceback and the search had gone on: the command
    returned as if nothing had failed."""
    calls = []

    def throughput(metrics):  # the baseline (run by this process first) passes; every later config raises
        calls.append(1)
        if len(calls) > 1:
            raise ZeroDivisionError("boom")
        return metrics.throughput_tok_per_s

    url = f"sqlite:///{here / 'jobs.db'}"
    with pytest.raises(ZeroDivisionError, match="boom") as raised:
        skistune.optimize(slow, objective=throughput, n_trials=12, n_jobs=2, validate=0, storage=url,
                          study_name="jobs", profile=profile)
    assert skistune.objectives.raised_by(raised.value) == "objective throughput"
    assert "Traceback" not in capfd.readouterr().err
    states = [t.state for t in optuna.load_study(study_name="jobs", storage=url).get_trials()]
    assert states[0] == optuna.trial.TrialState.COMPLETE
    assert optuna.trial.TrialState.PRUNED in states and len(states) < 12  # stopped, not run to the end


def test_an_error_of_skistune_itself_is_not_taken_for_the_users(slow, profile, monkeypatch):
    monkeypatch.setattr(search_module, "score", lambda *a, **k: {}["no such figure"])  # (in the first trial)
    with pytest.raises(KeyError):
        skistune.optimize(slow, n_trials=2, validate=0, storage=optuna.storages.InMemoryStorage(), profile=profile)


def test_a_user_callable_that_fails_on_a_simpler_config_stops_with_its_error(workload, profile):
    def no_small_budget(metrics, config):  # fails on the simplified config only (tiers off, 8192 tokens)
        if config.offload.host_kv_bytes == 0 and config.batching.max_num_batched_tokens == 8192:
            raise RuntimeError("no_small_budget cannot tell")
        return -1.0

    problem = opt.build_problem(workload, slo="p99=200ms", profile=profile, constraints=[no_small_budget])
    study = opt.open_study(problem, optuna.storages.InMemoryStorage(), "s", sampler=None)
    host = max(problem.space.param("offload.host_kv_bytes").choices)
    study.enqueue_trial({**opt._baseline_params(problem), "offload.host_kv_bytes": host,
                         "batching.max_num_batched_tokens": 8192, "batching.chunk_size": 512})
    study.optimize(opt._trial_function(problem, study), n_trials=2)
    best = opt._refine(problem, [e for e in opt.completed(study) if e.trial == 1])
    with pytest.raises(RuntimeError, match="no_small_budget cannot tell"):
        opt._simplify(problem, study, best, lambda stage: None)
    assert study.trials[-1].state == optuna.trial.TrialState.PRUNED  # told, not left running


# ---- an objective the space cannot change -------------------------------------------------------------------
def test_a_quality_objective_over_a_space_without_lossy_knobs_is_refused(workload, profile, tmp_path):
    space = tmp_path / "lossless.yaml"
    space.write_text("name: lossless\nknobs:\n  batching.max_num_seqs: {low: 8, high: 1024, log: true}\n"
                     "  batching.policy: {choices: [fcfs, prefix, edf]}\n")
    for objective in ("quality", "capacity,quality"):
        with pytest.raises(ValueError, match=r"^objective quality: the lossless space varies no knob that changes "
                                             r"the model's outputs \(eviction\.\*, bitwidth\.\*\)"):
            opt.build_problem(workload, slo="p99=200ms", objective=objective, profile=profile, space=str(space))
    opt.build_problem(workload, slo="p99=200ms", objective="capacity", profile=profile, space=str(space))
    opt.build_problem(workload, slo="p99=200ms", objective="quality", profile=profile)  # default: eviction, bits


def test_the_quality_objective_prints_with_its_unit():
    from skistune.optimize_cli import _value

    assert _value(NAMED["quality"], 0.0123) == "+1.23% ppl"
    assert _value(NAMED["quality"], 0.0) == "+0.00% ppl"


# ---- what the command says ------------------------------------------------------------------------------------
def test_a_search_cut_short_says_so_and_a_baseline_verdict_says_after_how_many_trials(tmp_path, monkeypatch):
    """A timeout that no trial fits in is an error (a first trial past it had taken minutes on a big trace); on a
    study that has a trial, the search stops at it and the verdict counts the study's trials."""
    monkeypatch.chdir(tmp_path)
    common = ("--slo", "p99=200ms", "--requests", "16", "--validate", "0", "--profile", PROFILE, "--study", "cut",
              "--json")
    r = invoke(*common, "--trials", "5", "--timeout", "0.001")
    assert r.exit_code == 2 and "ran out before any trial finished" in r.output
    assert invoke(*common, "--trials", "1").exit_code == 0
    r = invoke(*common, "--trials", "5", "--timeout", "0.001")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    stopped = "the search stopped at its timeout (0.001 s) after 0 of 5 trials; the same search again adds trials to " \
              "the study"
    assert stopped in summary["notes"] and summary["trials"] == 1
    text = " ".join(r.stdout.split())
    assert ("the best config found is the baseline itself (vLLM defaults), in 1 trial: too few to conclude that "
            "nothing is to change (only the baseline was tried); the same command adds trials to the study "
            "(--trials N: how many)") in text


def test_the_baseline_verdict_is_plain_after_the_default_number_of_trials():
    from skistune.optimize_cli import baseline_verdict

    assert baseline_verdict(20, "vLLM defaults") == ("the best config found is the baseline itself (vLLM defaults), "
                                                     "in 20 trials: nothing to change for this workload on this "
                                                     "hardware")
    assert "(fewer than the default 20)" in baseline_verdict(7, "vLLM defaults")


def test_the_provenance_states_a_memory_objective_in_exact_bytes(slow, profile):
    r = skistune.optimize(slow, objective="memory", n_trials=2, validate=0,
                          storage=optuna.storages.InMemoryStorage(), profile=profile)
    prov = yaml.safe_load(r.to_yaml())["provenance"]
    for scored in (prov["predicted"], prov["baseline"]["predicted"]):
        assert scored["objectives"]["memory"] == scored["kv_peak_bytes"] and isinstance(scored["kv_peak_bytes"], int)


def test_a_capacity_at_the_searchs_ceiling_is_said_to_be_a_lower_bound(profile):
    """A loose SLO held at 1024x the workload's rate: 5,663 req/s had been printed as if it were a capacity."""
    from skistune.simulator import MAX_RATE_SCALE
    from skistune.workloads import load_workload

    problem = opt.build_problem(load_workload("chat", requests=16), slo="e2e:p99<=1000s", profile=profile)
    at_top = opt.Evaluation(problem.base, MAX_RATE_SCALE, (5663.0,), {}, {"rate_rps": 5663.0})
    assert opt.ceiling_note(problem, at_top).startswith("capacity at least 5663 req/s: every constraint held at "
                                                        "1024x the workload's rate")
    assert opt.ceiling_note(problem, dataclasses.replace(at_top, rate_scale=MAX_RATE_SCALE / 2)) is None
    goodput = opt.build_problem(load_workload("chat", requests=16), slo="e2e:p99<=1000s", objective="goodput",
                                profile=profile)
    assert opt.ceiling_note(goodput, at_top) is None  # (scored at the workload's own rate)


def test_an_energy_budget_the_refined_capacity_meets_is_not_reported_infeasible(workload, profile, tmp_path):
    """Trials are judged at the search's coarse capacity, where J/token is higher (idle power over fewer tokens):
    a tester's budget that the run without it had met (1.27 J/token against 1.251) ended the run infeasible.
    (Seed 1: the baseline's coarse and refined capacities differ, 0.079 and 0.085 req/s with the shipped profile;
    seed 0's landed on one rate, a point of both lattices, and the search met the budget itself.)"""
    from skistune.scoring import REFINE_PRECISION, score

    workload = load_workload("chat", requests=16, seed=1)
    problem = opt.build_problem(workload, slo="p99=200ms", profile=profile)
    refined = score(problem, problem.base, precision=REFINE_PRECISION).figures["energy_j_per_token"]
    budget = refined * 1.002
    result = skistune.optimize(workload, slo="p99=200ms", energy=f"{budget!r}J/token", n_trials=2, validate=0,
                               profile=profile, storage=f"sqlite:///{tmp_path / 's.db'}", study_name="e", seed=0)
    assert not opt.pareto_front(result.problem, opt.completed(result.study)), "the search itself met the budget"
    assert result.feasible and result.best[0].figures["energy_j_per_token"] <= budget
