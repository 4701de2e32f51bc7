"""Validation on the real runtime: the clock that skips idle waits, the KV pool cap that changes nothing
for the slice, and (slow: the real SmolLM2 model) the top config and the baseline replayed at the rate the
simulator chose, predicted next to measured, the winner chosen by measurement."""
import time
from dataclasses import replace

import optuna
import pytest

import skistune
import skistune.optimize as opt
import skistune.validation as validation
from skistune.workloads import load_workload

optuna.logging.set_verbosity(optuna.logging.WARNING)


def test_skip_idle_clock_jumps_over_waits_and_keeps_real_time_otherwise():
    clock = validation.SkipIdleClock()
    started = time.perf_counter()
    clock.wait_until(100.0)
    assert time.perf_counter() - started < 0.5 and 100.0 <= clock.now() < 100.5
    clock.wait_until(50.0)  # the past: nothing to skip
    before = clock.now()
    time.sleep(0.01)
    assert clock.now() - before >= 0.01


def test_replay_pool_is_capped_only_where_the_simulator_sees_no_difference(profile):
    problem = opt.build_problem(load_workload("chat", requests=16), slo="p99=200ms", profile=profile)
    requests = validation.validation_requests(problem, 4)
    predicted = opt.score(problem, opt.baseline_config(), requests, precision=0.1)
    replayed = validation.replay_config(problem, predicted, requests)
    assert replayed.offload.device_kv_bytes == max(2 * predicted.figures["kv_peak_bytes"],
                                                   validation.VALIDATE_MIN_POOL_BYTES)
    assert replayed.with_knobs({"offload.device_kv_bytes": None}) == predicted.config
    tight = predicted.config.with_knobs({"offload.device_kv_bytes": 4 << 20})
    assert validation.replay_config(problem, opt.score(problem, tight, requests), requests) == tight  # already small


def _validation(problem, config, rate, violation):
    def ev(v):
        return opt.Evaluation(config, 1.0, (rate,), {"tbt:p99<=200ms": v}, {})

    return validation.Validation(config, rate, ev(-0.5), ev(violation), 1.0)


def test_the_winner_is_chosen_by_measurement(profile):
    problem = opt.build_problem(load_workload("chat", requests=16), slo="p99=200ms", profile=profile)
    a, b, c = (opt.baseline_config().with_knobs({"batching.max_num_seqs": n}) for n in (8, 16, 32))
    ranked = [opt.Evaluation(x, 1.0, (r,), {}, {}) for x, r in ((a, 3.0), (b, 2.0), (c, 1.0))]
    held = [_validation(problem, a, 3.0, +0.2), _validation(problem, b, 2.0, -0.1), _validation(problem, c, 1.0, -0.3)]
    order = validation._measured_order(problem, held)
    assert [v.config for v in order] == [b, c, a]  # predicted best broke its SLO on the runtime: b wins
    best, notes = opt._chosen(ranked, order)
    assert [e.config for e in best] == [b, a, c] and notes == []
    # both broke: which broke less is the machine's noise at the SLO's edge, the search's order stands
    broken = validation._measured_order(problem, [_validation(problem, a, 3.0, +0.4),
                                                  _validation(problem, b, 2.0, +0.1)])
    best, notes = opt._chosen(ranked[:2], broken)
    assert best[0].config == a and "the search's best is kept" in notes[0]


def test_a_constraint_the_slices_own_prediction_breaks_is_not_judged_by_its_replay(profile):
    """An energy budget met on the workload but broken by the prediction of the validation slice (short prompts:
    fixed costs over fewer tokens) made every run exit 4 and blame the simulator: the replay checks what the
    prediction of the same replay met."""
    config = opt.baseline_config()

    def ev(tbt, energy):
        return opt.Evaluation(config, 1.0, (1.0,), {"tbt:p99<=200ms": tbt, "energy<=1J/token": energy}, {})

    v = validation.Validation(config, 1.0, ev(-0.5, +0.29), ev(-0.4, +0.30), 1.0)
    assert v.holds and v.untested == ["energy<=1J/token"] and v.broken == []
    assert "energy<=1J/token: not tested on the real runtime" in validation.untested_note(v)
    import io

    from rich.console import Console

    from skistune.optimize_cli import validation_table

    problem = opt.build_problem(load_workload("chat", requests=16), slo="p99=200ms", energy="1J/token",
                                profile=profile)
    figures = {"requests": 6, "slo_s": {str(problem.slos[0]): 0.07}, "energy_j_per_token": 1.23}
    judged = opt.Evaluation(config, 1.0, (1.0,), {str(problem.slos[0]): -0.5, "energy<=1J/token": 0.23}, figures)
    table = type("R", (), {"problem": problem, "best": [judged],
                           "validated": [validation.Validation(config, 1.0, judged, judged, 1.0)]})()
    console = Console(width=300, record=True, file=io.StringIO())
    console.print(validation_table(table))
    assert "1.230 / 1.230 (not judged)" in console.export_text()  # (a J/token over the budget beside "yes")
    broke = validation.Validation(config, 1.0, ev(-0.5, +0.29), ev(+0.1, +0.30), 1.0)
    assert not broke.holds and broke.broken == ["tbt:p99<=200ms"]  # (what the prediction met is judged)
    assert validation.validation_record(broke)["binding"] == ["tbt:p99<=200ms"]


def test_the_baseline_replayed_at_the_winners_rate_is_judged_on_what_the_simulator_says_it_breaks(profile, monkeypatch):
    """The baseline is replayed at the winner's rate, where the simulator predicts it to break the SLO (that is
    the gain): its measured break was left out as untested, and optimize printed "the baseline holds every
    constraint too" beside a TBT p99 over the SLO. Only what the winner's own replay could not test is left out."""
    problem = opt.build_problem(load_workload("chat", requests=16), slo="p99=200ms", profile=profile)
    slo = str(problem.slos[0])
    tuned, base = opt.baseline_config().with_knobs({"batching.max_num_seqs": 8}), problem.base

    def ev(config, tbt):
        return opt.Evaluation(config, 1.0, (1.0,), {slo: tbt}, {})

    winner = validation.Validation(tuned, 1.0, ev(tuned, -0.5), ev(tuned, -0.3), 1.0)
    monkeypatch.setattr(validation, "score_at", lambda problem, config, requests, scale: ev(config, +0.5))
    replays = []

    def measure(problem, runtime, predicted, requests, role):
        replays.append(role)
        return validation.Validation(predicted.config, 1.0, predicted, ev(predicted.config, +0.6), 1.0, role)

    monkeypatch.setattr(validation, "_measure", measure)
    out, cut = validation._and_baseline(problem, None, [winner], None, None, None)
    assert replays == ["baseline"] * validation.VALIDATE_REPEATS and cut is None
    assert out[-1].role == "baseline" and not out[-1].holds and out[-1].broken == [slo]
    # what the winner's replay could not test stays untested for the baseline too
    untestable = replace(winner, predicted=ev(tuned, +0.1))
    out, _ = validation._and_baseline(problem, None, [untestable], None, None, None)
    assert out[-1].holds and out[-1].untested == [slo]


def test_among_configs_that_held_a_measured_difference_within_a_tie_keeps_the_search_order(profile):
    problem = opt.build_problem(load_workload("chat", requests=16), slo="p99=200ms", profile=profile)
    a, b = (opt.baseline_config().with_knobs({"batching.max_num_seqs": n}) for n in (8, 16))
    close = validation._measured_order(problem, [_validation(problem, a, 2.0, -0.1),
                                                 _validation(problem, b, 2.03, -0.1)])
    assert [v.config for v in close] == [a, b]  # 1.5% more measured: a tie
    clear = validation._measured_order(problem, [_validation(problem, a, 2.0, -0.1),
                                                 _validation(problem, b, 2.1, -0.1)])
    assert [v.config for v in clear] == [b, a]  # 5% more: measured better


@pytest.mark.slow
def test_top_config_and_baseline_are_measured_on_the_real_runtime(profile, monkeypatch, tmp_path):
    monkeypatch.setattr(validation, "VALIDATE_REQUESTS", 3)
    for module in (validation, opt):  # (the slice's caps, and the provenance that records them)
        monkeypatch.setattr(module, "VALIDATE_MAX_INPUT", 48)
        monkeypatch.setattr(module, "VALIDATE_MAX_OUTPUT", 6)
    r = skistune.optimize(load_workload("chat", requests=16), slo="p99=200ms", n_trials=2, validate=1,
                          storage=optuna.storages.InMemoryStorage(), profile=profile)
    assert [v.role for v in r.validated] == ["candidate", "baseline"]
    tuned, base = r.validated
    assert tuned.config == r.config and base.config == opt.baseline_config()
    assert base.rate_rps == pytest.approx(tuned.rate_rps)  # the baseline replays at the winner's rate
    for v in r.validated:
        m = v.measured.metrics
        assert m.num_finished == m.num_requests == 3 and m.output_tokens == 3 * 6
        assert v.measured.figures["requests"] == 3 and set(v.measured.violations) == set(v.predicted.violations)
        assert v.wall_s < m.duration_s or v.rate_rps > 1  # waits for arrivals were skipped, not slept
    prov = r.provenance()["measured"]
    assert prov["requests"] == 3 and len(prov["runs"]) == 2 and prov["runs"][0]["measured"]["tbt_p99_s"] > 0
    assert set(r.measured_gain()) >= {"rate_rps", "tuned_holds", "baseline_holds"}
    assert r.write(tmp_path / "t.yaml").is_file()


def test_configs_predicted_to_run_the_same_schedule_are_replayed_once(profile, monkeypatch):
    """Near the SLO's edge one replay holds and its twin's breaks by a few percent of the machine's speed. Top
    configs the simulator predicts to run the same schedule of the slice are replayed once, as the first in
    the search's order; a baseline predicted to run the winner's schedule is not replayed to be compared."""
    from skistune.optimize_cli import gain_lines, twin_lines

    problem = opt.build_problem(load_workload("chat", requests=16), slo="p99=200ms", profile=profile)
    twin = opt.baseline_config().with_knobs({"offload.device_memory_fraction": 0.93})
    other = opt.baseline_config().with_knobs({"batching.max_num_seqs": 1})
    figures = {"rate_rps": 0.3, "ttft_p99_s": 0.37, "tbt_p99_s": 0.064, "e2e_p99_s": 1.06, "kv_peak_bytes": 13 << 20}
    predicted = {problem.base: figures, twin: figures, other: {**figures, "tbt_p99_s": 0.07}}

    def fake_score(problem_, config, requests=None, **kw):
        return opt.Evaluation(config, 1.0, (0.3,), {"tbt:p99<=200ms": -0.5}, predicted[config])

    replays = []

    def fake_measure(problem_, runtime, p, requests, role, quality=None):
        replays.append(p.config)
        violation = +0.9 if p.config == problem.base else -0.6  # the baseline breaks, the others hold
        measured = opt.Evaluation(p.config, 1.0, (0.3,), {"tbt:p99<=200ms": violation}, {})
        return validation.Validation(p.config, 0.3, p, measured, 1.0, role)

    monkeypatch.setattr(validation, "score", fake_score)
    monkeypatch.setattr(validation, "score_at",
                        lambda problem_, config, requests, scale, **kw: fake_score(problem_, config))
    monkeypatch.setattr(validation, "_measure", fake_measure)
    monkeypatch.setattr(validation, "held_out_quality", lambda *a, **k: {})
    requests = validation.validation_requests(problem, 2)
    out = validation.validate(problem, [twin, problem.base, other], runtime=object(), requests=requests)
    assert problem.base not in replays and replays.count(twin) == 1  # one replay for twin and baseline, held
    assert [(v.config, v.role, v.twins) for v in out] == [(twin, "candidate", (problem.base,)),
                                                          (other, "candidate", ())]
    result = opt.OptimizeResult(problem, None, "", [fake_score(problem, c) for c in (twin, other)], [],
                                fake_score(problem, problem.base), validated=out)
    assert result.measured_gain() == {}  # no replay of the baseline to compare with
    assert twin_lines(result) == ["the baseline: the simulator predicts the same schedule of the slice as #1, so "
                                  "not replayed (their replays would only measure the machine's noise: at the "
                                  "SLO's edge a few percent of its speed flips a verdict)"]
    assert not any("measured" in line for line in gain_lines(result))

    replays.clear()  # the baseline not among the candidates, but predicted the winner's schedule: not replayed
    out = validation.validate(problem, [twin, other], runtime=object(), requests=requests)
    assert replays == [twin, other] and out[0].twins == (problem.base,) and len(out) == 2
    predicted[problem.base] = {**figures, "e2e_p99_s": 1.2}  # another schedule: replayed, at the winner's rate
    replays.clear()
    out = validation.validate(problem, [twin, other], runtime=object(), requests=requests)
    assert replays[-1] == problem.base and out[-1].role == "baseline" and out[0].twins == ()
    result = opt.OptimizeResult(problem, None, "", [fake_score(problem, twin)], [], out[-1].predicted, validated=out)
    gain = result.measured_gain()
    assert gain["same_schedule"] is False and gain["baseline_predicted_holds"] and not gain["baseline_holds"]
    # predicted to hold there too, the baseline's break is not shown as evidence of the gain
    assert any("predicted the baseline to hold at this rate too" in line for line in gain_lines(result))


def test_same_prediction_reads_the_schedule_and_every_margin_not_the_kv_peak():
    """Block sizes of 16 and 32 tokens round the same steps' KV differently: the same schedule. A constraint or
    objective that differs (one reading the KV peak, say) tells two predictions apart."""
    figures = {"rate_rps": 0.3, "ttft_p99_s": 0.37, "tbt_p99_s": 0.064, "e2e_p99_s": 1.06, "kv_peak_bytes": 13 << 20}
    config = opt.baseline_config()

    def ev(values=(0.3,), violations=None, **changed):
        return opt.Evaluation(config, 1.0, values, violations or {"tbt:p99<=200ms": -0.5}, {**figures, **changed})

    assert validation.same_prediction(ev(), ev(kv_peak_bytes=14 << 20))
    assert not validation.same_prediction(ev(), ev(tbt_p99_s=0.065))
    assert not validation.same_prediction(ev(), ev(values=(0.31,)))
    assert not validation.same_prediction(ev(), ev(violations={"tbt:p99<=200ms": -0.5, "kv": 1.0}))
    assert not validation.same_prediction(opt.Evaluation(config, 1.0, (0.3,), {}, {}), ev())


def test_a_winning_baseline_is_replayed_once_and_reported_as_the_baseline(profile, monkeypatch):
    """When the measured winner is the baseline itself, its one replay stands for both roles: a second
    replay of the same config would only show the machine's noise as a 'gain' (or a loss)."""
    problem = opt.build_problem(load_workload("chat", requests=16), slo="p99=200ms", profile=profile)
    other = opt.baseline_config().with_knobs({"batching.chunk_size": 16})  # another schedule of the slice
    replays = []

    def fake_measure(problem_, runtime, predicted, requests, role, quality=None):
        replays.append((predicted.config, role))
        violation = -0.5 if predicted.config == problem.base else +0.5  # the baseline holds, the other breaks
        return _validation(problem, predicted.config, 1.0, violation)

    monkeypatch.setattr(validation, "_measure", fake_measure)
    monkeypatch.setattr(validation, "held_out_quality", lambda *a, **k: {})
    requests = validation.validation_requests(problem, 2)
    out = validation.validate(problem, [other, problem.base], runtime=object(), requests=requests)
    assert [(v.config, v.role) for v in out] == [(problem.base, "candidate"), (other, "candidate"),
                                                 (problem.base, "baseline")]
    n = validation.VALIDATE_REPEATS
    # replays interleaved; only the config that broke its SLO is replayed again (`_replay_again`)
    assert replays == [(other, "candidate"), (problem.base, "candidate")] + [(other, "candidate")] * (n - 1)
    assert out[-1].measured is out[0].measured
    assert [v.replays for v in out] == [1, n, 1]  # (recorded: the table and the provenance say a replay was repeated)
    replays.clear()
    out = validation.validate(problem, [other], runtime=object(),  # another winner: baseline replayed
                              requests=requests)
    assert [r[1] for r in replays] == ["candidate"] * n + ["baseline"] and out[-1].config == problem.base


def test_the_baseline_among_the_candidates_at_the_winners_rate_is_not_replayed_again(profile, monkeypatch):
    problem = opt.build_problem(load_workload("chat", requests=16), slo="p99=200ms", profile=profile)
    other = opt.baseline_config().with_knobs({"batching.chunk_size": 16})  # another schedule of the slice
    replays = []

    def fake_measure(problem_, runtime, predicted, requests, role, quality=None):
        replays.append((predicted.config, role))  # both hold; the other serves more (the winner)
        return _validation(problem, predicted.config, 2.0 if predicted.config == other else 1.0, -0.5)

    monkeypatch.setattr(validation, "_measure", fake_measure)
    monkeypatch.setattr(validation, "held_out_quality", lambda *a, **k: {})
    out = validation.validate(problem, [problem.base, other], runtime=object(),
                              requests=validation.validation_requests(problem, 2))
    assert [(v.config, v.role) for v in out] == [(other, "candidate"), (problem.base, "candidate"),
                                                 (problem.base, "baseline")]
    assert replays == [(problem.base, "candidate"), (other, "candidate")] and out[2].measured is out[1].measured


def test_a_config_that_held_is_replayed_again_only_under_an_objective_read_off_its_timing(profile, monkeypatch):
    replays = []

    def fake_measure(problem_, runtime, predicted, requests, role, quality=None):
        replays.append(predicted.config)
        return _validation(problem_, predicted.config, 1.0, -0.5)  # every replay holds

    monkeypatch.setattr(validation, "_measure", fake_measure)
    monkeypatch.setattr(validation, "held_out_quality", lambda *a, **k: {})
    monkeypatch.setattr(validation, "VALIDATE_REPEATS", 2)
    other = opt.baseline_config().with_knobs({"batching.chunk_size": 16})  # another schedule of the slice
    for objective, replays_each in (("capacity", 1), ("energy", 2)):
        problem = opt.build_problem(load_workload("chat", requests=16), slo="p99=200ms", objective=objective,
                                    profile=profile)
        replays.clear()
        validation.validate(problem, [other], runtime=object(), requests=validation.validation_requests(problem, 2))
        assert replays == [other] * replays_each + [problem.base] * replays_each, objective


def test_the_better_of_two_replays_counts(profile, monkeypatch):
    """A stall that breaks one replay of a config does not decide its validation; a config slow in every
    replay still breaks."""
    problem = opt.build_problem(load_workload("chat", requests=16), slo="p99=200ms", profile=profile)
    other = opt.baseline_config().with_knobs({"batching.chunk_size": 16})  # another schedule of the slice
    violations = {problem.base: iter([+0.5, -0.2, +0.3, -0.1]), other: iter([+0.4, +0.6])}

    def fake_measure(problem_, runtime, predicted, requests, role, quality=None):
        return _validation(problem, predicted.config, 1.0, next(violations[predicted.config]))

    monkeypatch.setattr(validation, "_measure", fake_measure)
    monkeypatch.setattr(validation, "held_out_quality", lambda *a, **k: {})
    monkeypatch.setattr(validation, "VALIDATE_REPEATS", 2)
    out = validation.validate(problem, [other, problem.base], runtime=object(),
                              requests=validation.validation_requests(problem, 2))
    assert [(v.config, v.holds) for v in out] == [(problem.base, True), (other, False), (problem.base, True)]
    assert out[0].measured.violations["tbt:p99<=200ms"] == -0.2 and out[1].measured.violations["tbt:p99<=200ms"] == 0.4


def test_declared_kv_memory_sizes_the_pool_the_simulator_and_the_runtime_use(profile):
    """``kv_memory``: the device pool is the config's fraction of it, in the simulation, in the config a
    replay runs, and in the written file (so an engine gets bytes, not a fraction of its own device)."""
    workload = load_workload("chat", requests=16)
    small = opt.build_problem(workload, slo="p99=200ms", profile=profile, kv_memory="64MiB")
    assert small.target.device_free_bytes == 64 << 20 and small.kv_memory == 64 << 20
    base = opt.baseline_config()  # device_memory_fraction 0.9
    deployed = validation.deployable(small, base)
    assert deployed.offload.device_kv_bytes == int(0.9 * (64 << 20))
    assert opt.score(small, deployed).figures == opt.score(small, base).figures  # the same pool either way
    requests = validation.validation_requests(small, 4)
    predicted = opt.score(small, base, requests, precision=0.1)
    assert validation.replay_config(small, predicted, requests).offload.device_kv_bytes <= int(0.9 * (64 << 20))
    default = opt.build_problem(workload, slo="p99=200ms", profile=profile)
    assert validation.deployable(default, base) == base  # no declared memory: the deployment's own device decides
    pools = [opt.score(p, base).figures["kv_capacity_bytes"] for p in (default, small)]
    assert pools[0] > 8 * pools[1]
    assert small.identity() != default.identity()  # a study with another memory is another problem


@pytest.mark.parametrize("bad", ["lots", "12", 5, True, 2.5])
def test_kv_memory_rejects_what_is_not_a_size_of_at_least_a_mebibyte(profile, bad):
    with pytest.raises(ValueError, match="kv_memory"):
        opt.build_problem(load_workload("chat", requests=4), profile=profile, kv_memory=bad)


def test_a_broken_validation_times_the_profiles_steps_again_and_says_how_fast_the_machine_ran(profile, monkeypatch):
    """A replay that breaks its SLO on a machine running x2 slower than when it was profiled (a busy neighbour)
    is the machine, not the simulator: the profile's own steps are timed again on the same runtime and the
    note says so, as `evaluate --mode compare` does."""
    import skistune.profile.check as check

    problem = opt.build_problem(load_workload("chat", requests=16), slo="p99=200ms", profile=profile)
    point = check.CheckedPoint("decode", {"batch": 1, "context": 64}, 0.030, 0.060)
    timed = []
    monkeypatch.setattr(check, "speed_check", lambda prof, runtime: timed.append(runtime) or check.SpeedCheck((point,)))
    stages = []
    notes = validation._speed_after_validation(problem, "the runtime", stages.append)
    assert timed == ["the runtime"] and stages == ["timing a few of the profile's steps again"]
    assert notes == ["the replays broke a constraint; right after them, this machine runs the profile's steps x2.000 "
                     "(median of 1; decode x2.000): decode steps x2.00: this machine runs them 100% slower than the "
                     "profile says, so its predictions of them are optimistic (about 50% short of today's times)"]

    def no_points(prof, runtime):
        raise ValueError("no 16-bit step points")

    monkeypatch.setattr(check, "speed_check", no_points)
    assert validation._speed_after_validation(problem, "the runtime", stages.append) == []
    # wired: only a chosen config that broke a constraint costs the check
    calls = []
    monkeypatch.setattr(opt, "_speed_after_validation", lambda *a: calls.append(a) or ["timed again"])
    for violation, expected in ((-0.5, 0), (+0.5, 1)):
        monkeypatch.setattr(opt, "validate", lambda p, configs, **k: [_validation(p, configs[0], 1.0, violation)])
        r = skistune.optimize(load_workload("chat", requests=16), slo="p99=200ms", profile=profile, n_trials=2,
                              storage=optuna.storages.InMemoryStorage(), validate=1)
        assert len(calls) == expected and ("timed again" in r.notes) == bool(expected)


def test_a_profile_of_a_device_this_machine_lacks_is_searched_but_not_validated(monkeypatch):
    """An H200 profile tuned on a CPU laptop: the search runs, and the winners are not replayed here (an 8B
    model's validation on a 23 GiB host was killed for memory after the whole search, nothing written)."""
    import warnings
    from pathlib import Path

    import torch

    from skistune.profile import load_profile

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h200 = load_profile(Path(opt.__file__).resolve().parents[1] / "profiles" / "cuda-llama-3-8b-quick.json")
    loads = []
    monkeypatch.setattr(validation, "load_runtime", lambda problem: loads.append(problem))
    r = skistune.optimize(load_workload("chat", requests=16), slo="p99=200ms", model="llama-3-8b", profile=h200,
                          n_trials=3, storage=optuna.storages.InMemoryStorage(), validate=2)
    assert loads == [] and r.validated == []
    assert ("not validated on the real runtime (this machine has no CUDA device; profile cuda-llama-3-8b-quick is of "
            "llama-3-8b on cuda): the winner is the simulator's") in " ".join(r.notes)
    assert validation.validation_unavailable(r.problem) is not None


def test_the_best_configs_are_the_same_whatever_the_validation_count(monkeypatch, profile):
    """A tester saw the table shrink to the --validate count (#1 only with --validate 1, out of 6 feasible
    trials): the top three are refined and shown whatever number of them is replayed."""
    monkeypatch.setattr(opt, "validate", lambda p, configs, **k: [_validation(p, configs[0], 1.0, -0.5)])
    runs = {v: skistune.optimize(load_workload("chat", requests=16), slo="p99=200ms", profile=profile, n_trials=8,
                                 storage=optuna.storages.InMemoryStorage(), validate=v) for v in (0, 1)}
    assert len(runs[0].best) == opt.DEFAULT_TOP_K
    assert [e.config for e in runs[1].best] == [e.config for e in runs[0].best]


@pytest.mark.parametrize("objective", ["capacity", "goodput"])
def test_the_validation_table_names_the_rate_it_replayed_at_and_a_ceiling_as_one(profile, objective):
    """Under goodput the slice is replayed at its own arrival rate (the header had said 'capacity'); a rate at the
    capacity search's ceiling (every rate held: a slice arriving in one burst) is said to be one, not a capacity."""
    import io

    from rich.console import Console

    from skistune.optimize_cli import validation_table
    from skistune.simulator import MAX_RATE_SCALE

    problem = opt.build_problem(load_workload("chat", requests=16), slo="p99=200ms", profile=profile,
                                objective=objective)
    slo = str(problem.slos[0])
    figures = {"requests": 6, "slo_s": {slo: 0.07}, "energy_j_per_token": 0.3}
    ev = opt.Evaluation(problem.base, MAX_RATE_SCALE, (1.0,), {slo: -0.5}, figures)
    result = type("R", (), {"problem": problem, "best": [ev],
                            "validated": [validation.Validation(problem.base, 3215.0, ev, ev, 1.0)]})()
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(validation_table(result))
    text = " ".join(console.export_text().split())  # (the title wraps at the table's width)
    rate = "own predicted capacity" if objective == "capacity" else "own arrival rate"
    assert f"replayed at the slice's {rate}" in text
    assert ("every rate held: the search's ceiling" in text) == (objective == "capacity")
