"""`skistune.optimize`: objectives by name and by callable, constraints, Pareto fronts, infeasible problems,
determinism, the search space cut to modeled knobs, and the tuned file. Small workloads, the shipped
profile, in-memory storage, no validation (see test_optimize_storage.py and test_optimize_validate.py)."""
import math
import re

import optuna
import pytest

import skistune
from skistune.config import KVConfig, load_config
from skistune.objectives import NO_LOSS, parse_quality, predict_quality
from skistune.optimize import DEFAULT_TRIALS, OptimizeResult, baseline_config, build_problem, pareto_front, score
from skistune.problem import modeled_space, not_modeled_note
from skistune.searchspace import load_space
from skistune.simulator import MODELED_KNOBS
from skistune.workloads import load_workload

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def workload():
    return load_workload("chat", requests=16, seed=0)


@pytest.fixture(scope="module")
def slow():
    """Arrivals slow enough for this CPU: objectives scored at the workload's own rate meet the SLOs and the
    queueing guard (at 0.002 the shipped AVX2 profile's longest prefill queued the next arrival 5.05 s)."""
    return load_workload("chat", requests=16, seed=0, rate_scale=0.0005)


def run(workload, profile=None, **kw) -> OptimizeResult:
    kw = {"slo": "p99=200ms", "n_trials": 4, "validate": 0, "storage": optuna.storages.InMemoryStorage(),
          "profile": profile, **kw}
    return skistune.optimize(workload, **kw)


def test_capacity_by_name_starts_from_the_baseline_and_reports_the_gain(workload, profile):
    r = run(workload, profile)
    trials = r.study.get_trials()
    assert trials[0].user_attrs["enqueued"] == "baseline"
    assert KVConfig.from_dict(trials[0].user_attrs["config"]) == baseline_config()
    assert r.feasible and r.trials == 4 and r.config == r.best[0].config
    best, base = r.best[0], r.baseline
    assert best.feasible and best.values[0] == pytest.approx(best.figures["rate_rps"]) and best.values[0] > 0
    assert r.gain()["capacity"] == pytest.approx(best.values[0] / base.values[0])
    assert best.figures["slo_s"]["tbt:p99<=200ms"] <= 0.2  # met at the capacity it reports
    assert best.figures["kv_peak_bytes"] <= best.figures["kv_capacity_bytes"]
    assert best.figures["quality_loss"] == 0.0 and best.metrics is not None  # refined: full metrics kept
    # a notebook shows one line, not the problem's every prompt token (the dataclass repr was ~0.5 MB)
    assert repr(r).startswith(f"OptimizeResult(study={r.study.study_name!r}, trials=4, best: capacity=")
    assert len(repr(r)) < 300


def test_objective_by_callable_of_metrics_or_of_metrics_and_config(slow, profile):
    r = run(slow, profile, objective=lambda m: m.e2e_s.p99)
    assert [o.direction for o in r.problem.objectives] == ["minimize"]
    assert not r.problem.at_capacity  # a callable alone is scored at the workload's own rate
    assert r.best[0].values[0] == pytest.approx(r.best[0].figures["e2e_p99_s"])

    def fewest_seqs(metrics, config):
        return config.batching.max_num_seqs

    r = run(slow, profile, objective=fewest_seqs, slo=())
    seqs = [KVConfig.from_dict(t.user_attrs["config"]).batching.max_num_seqs for t in r.study.get_trials()]
    assert r.problem.objectives[0].name == "fewest_seqs" and r.best[0].config.batching.max_num_seqs == min(seqs)


def test_callable_returning_a_tuple_needs_one_direction_per_value(slow, profile):
    r = run(slow, profile, objective=lambda m: (m.e2e_s.p99, m.kv_peak_bytes),
            direction=["minimize", "minimize"], slo=())
    assert [o.name for o in r.problem.objectives] == ["custom[0]", "custom[1]"]
    assert len(r.study.directions) == 2 and r.pareto
    with pytest.raises(ValueError, match="one direction per value"):
        run(slow, profile, objective=lambda m: (1.0, 2.0), slo=())


def test_custom_constraint_rules_out_configs_and_is_counted(workload, profile):
    def at_most_8_seqs(metrics, config):
        return config.batching.max_num_seqs - 8

    r = run(workload, profile, constraints=[at_most_8_seqs], n_trials=6)
    assert "at_most_8_seqs" in r.problem.identity()["constraints"]
    assert all(e.config.batching.max_num_seqs <= 8 for e in r.best)
    trials = r.study.get_trials()
    assert trials[0].user_attrs["violations"]["at_most_8_seqs"] == 256 - 8  # the baseline breaks it
    assert trials[0].constraints["at_most_8_seqs"] == 248  # and Optuna sees it as a constraint


def test_a_direction_for_a_named_objective_must_agree_with_its_own():
    """``objective="capacity", direction="minimize"`` was ignored (the study still maximised): refused."""
    from skistune.objectives import parse_objectives

    with pytest.raises(ValueError, match=r"capacity has its own direction \(maximize\)"):
        parse_objectives("capacity", "minimize")
    with pytest.raises(ValueError, match=r"energy has its own direction \(minimize\), given maximize"):
        parse_objectives("capacity,energy", ["maximize", "maximize"])
    assert [o.name for o in parse_objectives("capacity,energy", ["maximize", "minimize"])] == ["capacity", "energy"]


def test_energy_objective_and_budget_at_the_workloads_rate(slow, profile):
    r = run(slow, profile, objective="energy", energy="50J/token", slo=(), max_queue_s=None)
    best = r.best[0]
    assert best.values[0] == pytest.approx(best.figures["energy_j_per_token"])
    assert best.violations["energy<=50J/token"] == pytest.approx(best.values[0] / 50 - 1)
    assert best.rate_scale == 1.0 and "queue" not in " ".join(best.violations)
    assert any("modeled" in n for n in r.notes)


def test_goodput_objective_counts_requests_meeting_their_slos(slow, profile):
    r = run(slow, profile, objective="goodput", slo="e2e:p99<=1000s")
    best = r.best[0]
    assert best.values[0] == pytest.approx(best.figures["finished"] / best.metrics.duration_s)


def test_several_objectives_give_a_pareto_front(workload, profile):
    r = run(workload, profile, objective="capacity,energy", n_trials=6)
    assert isinstance(r.study.sampler, optuna.samplers.NSGAIISampler)
    front = r.pareto
    assert front and all(e.feasible for e in front)
    for a in front:  # nobody on the front is dominated by another trial
        for b in r.study.get_trials():
            if all(v <= 0 for v in b.user_attrs["violations"].values()):
                assert not (b.values[0] >= a.values[0] and b.values[1] <= a.values[1]
                            and (b.values[0] > a.values[0] or b.values[1] < a.values[1]))
    assert pareto_front(r.problem, r.best) == [e for e in pareto_front(r.problem, r.best)]
    assert len({tuple(e.values) for e in front}) == len(front)  # equal points: one, the simplest


def test_of_equal_points_on_the_front_the_one_without_tiers_stays(workload, profile):
    import skistune.optimize as opt

    problem = build_problem(workload, slo="p99=200ms", objective="capacity,memory", profile=profile)
    tiered = problem.base.with_knobs({"offload.host_kv_bytes": 8 << 30})

    def ev(config, values, trial):
        return opt.Evaluation(config, 1.0, values, {"tbt:p99<=200ms": -0.1}, {}, trial=trial)

    front = pareto_front(problem, [ev(tiered, (0.2, 600.0), 3), ev(problem.base, (0.2, 600.0), 0),
                                   ev(tiered.with_knobs({"batching.max_num_seqs": 8}), (0.1, 300.0), 5)])
    assert [e.trial for e in front] == [0, 5]


def test_an_slo_below_the_fastest_step_is_refused_before_any_search(workload, profile):
    """Every latency spans at least one step: an SLO below the fastest one the profile predicts (one-token
    decodes, no context, at 16 bits) cannot be met by any config, at any rate."""
    from skistune.profile.cost import decode_shape
    from skistune.runtime.kv_layout import kv_traffic

    import skistune.optimize as opt
    from skistune.problem import slo_floor_s

    problem = build_problem(workload, slo="p99=200ms", profile=profile)
    floor_s = slo_floor_s(problem.target)
    kv = kv_traffic(opt.baseline_config(), problem.target.spec, problem.target.kv_itemsize)
    assert 0 < floor_s <= problem.target.step_cost.predict_s(decode_shape(1, 0, kv))
    assert floor_s <= min(opt.score(problem, problem.base).figures["tbt_p99_s"], 0.2)
    for slo in (f"p99={floor_s * 1e3 * 0.9:.3f}ms", f"ttft:p50<={floor_s * 1e3 * 0.5:.3f}ms", "e2e:mean<=1ms"):
        with pytest.raises(opt.UnmeetableSLO, match="the fastest step the profile predicts"):
            build_problem(workload, slo=slo, profile=profile)
    build_problem(workload, slo=f"p99={floor_s * 1e3 * 1.01:.3f}ms", profile=profile)  # at the floor: searched


def test_infeasible_names_the_binding_constraint_and_the_closest_configs(workload, profile):
    r = run(workload, profile, slo="ttft:p99<=55ms", n_trials=3)  # above any step, below any prefill
    assert not r.feasible and r.best == [] and r.pareto == []
    assert r.binding["ttft:p99<=55ms"] == r.trials == 3
    assert [e.total_violation for e in r.closest] == sorted(e.total_violation for e in r.closest)
    assert all(e.values[0] == 0.0 for e in r.closest)  # capacity 0: no rate meets the SLO
    with pytest.raises(ValueError, match="no config met"):
        _ = r.config


def test_same_seed_same_best(workload, profile):
    a = run(workload, profile, seed=3, n_trials=6)
    b = run(workload, profile, seed=3, n_trials=6)
    assert [t.params for t in a.study.get_trials()] == [t.params for t in b.study.get_trials()]
    assert a.config == b.config and a.best[0].values == b.best[0].values


def test_only_modeled_knobs_are_searched_and_the_rest_is_reported():
    space, left_out = modeled_space(load_space("default"), baseline_config())
    searched = {p.name for p in space.params if not p.is_switch}
    assert searched == {k for k in load_space("default").knob_names() if k in MODELED_KNOBS}
    assert {"eviction.policy", "bitwidth.key_bits"} <= set(left_out)
    assert {"offload.host_kv_bytes", "prefetch.unit"} <= searched  # tiers priced by the profile's transfer fits
    note = not_modeled_note(left_out)
    assert note.startswith("lossless search (no --quality floor), left at defaults: eviction.*, bitwidth.*")
    assert "not modeled" not in note  # every knob of the default space is modeled
    assert "offload.host_kv_bytes" not in note and "offload.device_memory_fraction" not in note


def test_the_search_grows_with_the_modeled_knobs():
    grown = MODELED_KNOBS | {"eviction.policy", "eviction.budget_fraction"}
    space, left_out = modeled_space(load_space("default"), baseline_config(), grown)
    assert {"eviction.policy", "eviction.budget_fraction"} <= set(space.knob_names())
    assert space.param("eviction.budget_fraction").when  # its condition still reads the policy
    assert "eviction.policy" not in left_out


def test_engine_space_keeps_modeled_fixed_knobs_and_lists_unmodeled_ones():
    space, left_out = modeled_space(load_space("vllm"), baseline_config())
    fixed = dict(space.fixed)
    assert fixed["batching.policy"] == "fcfs" and fixed["offload.write_policy"] == "write_through"
    assert "bitwidth.key_bits" in left_out  # lossy: searched only under a quality floor


def test_quality_floor_is_zero_loss_without_structural_knobs_and_unknown_without_a_profile(workload, profile):
    assert predict_quality(baseline_config()) == NO_LOSS
    lossy = baseline_config().with_knobs({"eviction.policy": "h2o", "eviction.budget_fraction": 0.5})
    assert predict_quality(lossy) is None
    problem = build_problem(workload, slo="p99=200ms", quality=["ppl+1%", "needle>=0.95"], profile=profile)
    assert score(problem, baseline_config()).violations["ppl+1%"] == pytest.approx(-1.0)  # relative: no loss at all
    assert score(problem, baseline_config()).violations["needle>=0.95"] == pytest.approx(-0.05 / 0.95)
    assert str(parse_quality("worst:ppl+3%")) == "worst:ppl+3%"


@pytest.mark.parametrize("kwargs, match", [
    ({"slo": "p99<200ms"}, "SLO"), ({"energy": "lots"}, "energy"), ({"quality": "ppl<1%"}, "quality"),
    ({"space": "nope"}, "nope"), ({"objective": "speed"}, "objective 'speed'"), ({"target": "trt"}, "target"),
    ({"profile": "/no/such/profile.json"}, "cannot read profile"), ({"storage": "nowhere"}, "storage"),
    ({"n_trials": 0}, "n_trials"), ({"sampler": "cma"}, "sampler"), ({"max_queue_s": -1.0}, "max_queue_s"),
])
def test_bad_inputs_raise_value_error_before_any_trial(workload, profile, kwargs, match):
    with pytest.raises(ValueError, match=match):
        run(workload, **{"profile": profile, **kwargs})


def test_tuned_file_is_written_atomically_with_provenance(workload, profile, tmp_path):
    r = run(workload, profile)
    path = r.write(tmp_path / "tuned.yaml")
    assert load_config(str(path)) == r.config
    assert [p.name for p in tmp_path.iterdir()] == ["tuned.yaml"]  # no temporary file left
    prov = r.provenance()
    assert prov["workload"]["digest"] == workload.digest()
    assert prov["profile"]["fingerprint"] == profile.fingerprint.key() and prov["profile"]["power"] == "modeled"
    assert prov["search_space"]["name"] == "default" and prov["search"]["seed"] == 0
    assert prov["predicted"]["objectives"]["capacity"] > 0 and prov["measured"] is None
    assert math.isfinite(prov["baseline"]["gain"]["capacity"])
    assert DEFAULT_TRIALS >= 1


def test_a_baseline_within_the_refined_precision_of_the_best_ranks_first(workload, profile):
    import skistune.optimize as opt

    problem = opt.build_problem(workload, slo="p99=200ms", profile=profile)
    other = baseline_config().with_knobs({"batching.max_num_seqs": 8})

    def ev(config, capacity, trial):
        return opt.Evaluation(config, 1.0, (capacity,), {"tbt:p99<=200ms": -0.1}, {}, trial=trial)

    base, evaluations = ev(problem.base, 1.0, None), [ev(problem.base, 1.0, 0), ev(other, 1.0, 1)]
    tie = [ev(other, 1.0 * (1 + opt.REFINE_PRECISION) * 0.999, 1)]
    ranked, notes = opt._baseline_on_ties(problem, tie, base, evaluations)
    assert [e.config for e in ranked] == [problem.base] and ranked[0].trial == 0 and "a tie" in notes[0]
    clear = [ev(other, 1.0 * (1 + opt.REFINE_PRECISION) * 1.001, 1)]
    assert opt._baseline_on_ties(problem, clear, base, evaluations) == (clear, [])  # a gain above the precision
    assert opt._baseline_on_ties(problem, tie, base, evaluations[1:]) == (tie, [])  # the baseline no trial here


def test_a_winner_simplified_into_a_tie_with_the_baseline_leaves_the_baseline_first(workload, profile, monkeypatch):
    import skistune.optimize as opt

    problem = opt.build_problem(workload, slo="p99=200ms", profile=profile)
    wide, narrow = (baseline_config().with_knobs({"batching.max_num_seqs": n}) for n in (8, 9))

    def ev(config, capacity, trial):
        return opt.Evaluation(config, 1.0, (capacity,), {"tbt:p99<=200ms": -0.1}, {}, trial=trial)

    base, evaluations = ev(problem.base, 1.0, None), [ev(problem.base, 1.0, 0), ev(wide, 1.022, 1)]
    simplified = ev(narrow, 1.011, 2)  # 2.2% over the baseline, simplified to 1.1% over it: a tie
    monkeypatch.setattr(opt, "_simplify", lambda problem, study, refined, stage: ([simplified], ["simplified"]))
    ranked, notes = opt._ties_and_simpler(problem, None, [evaluations[1]], base, evaluations, lambda m: None)
    assert [e.config for e in ranked] == [problem.base] and notes[0] == "simplified" and "a tie" in notes[1]


def test_ties_go_to_the_config_that_reserves_less_for_kv_tiers(workload, profile):
    """Equal capacity and energy: the config without (or with smaller) host and disk tiers ranks first, even
    from a later trial; energy still comes before the tiers."""
    import skistune.optimize as opt
    from skistune.config import KVConfig

    problem = build_problem(workload, slo="p99=200ms", profile=profile)
    GiB = 1 << 30

    def ev(trial, host, disk, energy=0.5):
        config = KVConfig().with_knobs({"offload.host_kv_bytes": host, "offload.disk_kv_bytes": disk})
        return opt.Evaluation(config, 1.0, (0.2,), {"tbt:p99<=200ms": -0.1}, {"energy_j_per_token": energy},
                              trial=trial)

    evaluations = [ev(0, 8 * GiB, 256 * GiB), ev(1, 8 * GiB, 0), ev(2, 0, 0), ev(3, 32 * GiB, 0, energy=0.4)]
    assert [e.trial for e in opt.ranked(problem, evaluations)] == [3, 2, 1, 0]


def test_the_best_config_keeps_no_knob_group_its_gain_does_not_need(workload, profile):
    """A host and a disk tier that the workload never fills change no figure: the best config is tried with
    each knob group as the baseline's, in trials of the study, and the tiers go; a gain that needs a group
    keeps it. Run again (a resumed study), the tries are read back, not added again."""
    import skistune.optimize as opt

    problem = build_problem(workload, slo="p99=200ms", profile=profile)
    study = opt.open_study(problem, optuna.storages.InMemoryStorage(), "s", sampler=None)
    host, disk = (max(problem.space.param(n).choices) for n in ("offload.host_kv_bytes", "offload.disk_kv_bytes"))
    tiered = {**opt._baseline_params(problem), "offload.host_kv_bytes": host, "offload.disk_kv_bytes": disk,
              "batching.max_num_batched_tokens": 8192, "batching.chunk_size": 512}
    study.enqueue_trial(tiered)
    study.optimize(opt._trial_function(problem, study), n_trials=2)  # the baseline, then the tiered config
    best = opt._refine(problem, [e for e in opt.completed(study) if e.trial == 1])
    assert best[0].config.offload.host_kv_bytes == host and best[0].feasible
    simpler, notes = opt._simplify(problem, study, best, lambda stage: None)
    kept = simpler[0].config
    assert kept.offload.host_kv_bytes == 0 and kept.offload.disk_kv_bytes == 0 and "KV tiers" in notes[0]
    assert not opt.beats(problem, best[0].values[0], simpler[0].values[0])  # within a tie of the best
    assert simpler[0].trial is not None and opt.SIMPLIFIES_ATTR in study.trials[simpler[0].trial].user_attrs
    before = len(study.trials)
    assert opt._simplify(problem, study, best, lambda stage: None) == (simpler, notes)
    assert len(study.trials) == before and opt._search_trials(study) == 2


def test_host_tiers_larger_than_the_profiled_machine_can_hold_are_not_searched(workload, profile):
    """A tuned file must not ask a 24 GB machine for a 32 GiB host tier: the space is cut to what fits in 70%
    of the profiled machine's memory (less, on a CPU, the weights and the device KV pool), with a note."""
    from dataclasses import replace

    def on(memory):
        return replace(profile, fingerprint=replace(profile.fingerprint, host_memory_bytes=memory))

    GiB = 1 << 30
    problem = build_problem(workload, slo="p99=200ms", profile=on(64 * GiB))
    assert problem.space.param("offload.host_kv_bytes").choices == (0, 8 * GiB, 32 * GiB)
    assert any("128GiB left out of the search" in n and "70% of its 64GiB" in n for n in problem.notes)
    small = build_problem(workload, slo="p99=200ms", profile=on(8 * GiB))  # 5.6 GiB less the 4 GiB pool
    assert small.space.param("offload.host_kv_bytes").choices == (0,)
    assert build_problem(workload, slo="p99=200ms", profile=on(1 << 40)).space.param(
        "offload.host_kv_bytes").choices == (0, 8 * GiB, 32 * GiB, 128 * GiB)
    foreign = replace(profile, fingerprint=replace(profile.fingerprint, cpu_model="Imaginary CPU 9000",
                                                   host_memory_bytes=None))
    unknown = build_problem(workload, slo="p99=200ms", profile=foreign)
    assert len(unknown.space.param("offload.host_kv_bytes").choices) == 4
    assert any("not checked against the profiled machine's memory" in n for n in unknown.notes)


def test_disk_tiers_larger_than_the_profiled_disk_are_not_searched(workload, profile):
    """Nor a 1 TiB disk tier on a disk with 70 GB free: disk tiers are cut to 90% of the free space the
    profile recorded where it timed its disk; a foreign profile that predates the record is not cut, and says
    so; this machine's own profile without it is checked against this machine's disk now."""
    from dataclasses import replace

    from skistune.profile.fingerprint import machine_fingerprint
    from skistune.profile.transfers import disk_free_bytes

    GiB = 1 << 30
    roomy = replace(profile, fingerprint=replace(profile.fingerprint, host_memory_bytes=1 << 40))

    def disk_choices(p):
        problem = build_problem(workload, slo="p99=200ms", profile=p)
        return problem.space.param("offload.disk_kv_bytes").choices, problem.notes

    choices, notes = disk_choices(replace(roomy, disk_free_bytes=300 * GiB))  # 270 GiB may be used
    assert choices == (0, 256 * GiB)
    assert any("1TiB left out of the search" in n and "90% of the 300GiB free" in n for n in notes)
    assert disk_choices(replace(roomy, disk_free_bytes=2 << 40))[0] == (0, 256 * GiB, 1 << 40)
    assert disk_choices(replace(roomy, disk_free_bytes=10 * GiB))[0] == (0,)
    foreign = replace(roomy, fingerprint=replace(roomy.fingerprint, cpu_model="Imaginary CPU 9000"))
    choices, notes = disk_choices(replace(foreign, disk_free_bytes=None))
    assert len(choices) == 3 and any("offload.disk_kv_bytes: not checked against the profiled machine's free "
                                     "disk space" in n for n in notes)
    mine = machine_fingerprint("cpu")
    here = replace(roomy, fingerprint=replace(roomy.fingerprint, cpu_model=mine.cpu_model, cpu_arch=mine.cpu_arch,
                                              cpu_count=mine.cpu_count))
    expected = tuple(v for v in (0, 256 * GiB, 1 << 40) if v <= 0.9 * disk_free_bytes(None))
    assert disk_choices(replace(here, disk_free_bytes=None))[0] == expected


def test_a_profile_taken_while_the_machine_moved_is_noted(workload, profile):
    from dataclasses import replace

    notes = build_problem(workload, slo="p99=200ms", profile=replace(profile, drift={"decode": 0.8})).notes
    assert any("the machine's speed moved while it was measured (decode steps x0.80" in n for n in notes)
    still = replace(profile, drift={"decode": 1.03, "prefill": 0.98})  # (within `profile.DRIFT_NOTE_AT`)
    assert not any("moved while" in n for n in build_problem(workload, slo="p99=200ms", profile=still).notes)


def test_closest_to_feasible_ranks_configs_that_serve_every_request_first():
    """A config that serves nothing has every latency undefined (a violation of 1 each): it must not be shown
    as closer to feasible than one that serves every request, late."""
    from skistune.config import KVConfig
    from skistune.optimize import Evaluation, infeasibility

    def ev(trial, seqs, **violations):
        return Evaluation(KVConfig().with_knobs({"batching.max_num_seqs": seqs}), 1.0, (0.0,), violations, {},
                          trial=trial)

    serves_none = ev(0, 8, tbt=1.0, queue=1.0, served=1.0)
    late = ev(1, 16, tbt=-0.2, queue=13.5, served=0.0)
    later = ev(2, 32, tbt=0.5, queue=20.0, served=0.0)
    drops_some = ev(3, 64, tbt=0.1, queue=0.1, served=0.25)
    binding, closest = infeasibility([serves_none, late, later, drops_some], k=4)
    assert [e.trial for e in closest] == [1, 2, 3, 0]
    assert binding == {"tbt": 4 - 1, "queue": 4, "served": 2}


def test_objectives_beside_capacity_are_noted_as_judged_at_each_configs_capacity(workload, profile):
    """A tester read `--objective capacity,energy` as judging energy at the workload's rate (--rate 0.01) and
    got each config's energy at its own capacity: the run says which."""
    notes = build_problem(workload, slo="p99=200ms", objective="capacity,energy", profile=profile).notes
    assert any(n.startswith("energy: judged at each config's capacity") for n in notes)
    for objective in ("capacity", "energy"):
        assert not any("judged at each config's capacity" in n
                       for n in build_problem(workload, slo="p99=200ms", objective=objective, profile=profile).notes)
    # predicted quality loss is the same at every rate: nothing to say of it (a tester found the note misleading)
    for objective in ("capacity,quality", "energy,quality"):
        assert not any("judged at each config's capacity" in n
                       for n in build_problem(workload, slo="p99=200ms", objective=objective, profile=profile).notes)
    notes = build_problem(workload, slo="p99=200ms", objective="capacity,energy,quality", profile=profile).notes
    assert [n.split(":")[0] for n in notes if "judged at each config's capacity" in n] == ["energy"]


def test_simplifying_takes_no_other_commands_trial_and_skips_their_unfinished_tries(workload, profile):
    """Two commands on one study simplified at the same moment (a tester: 7 of 26 pairs crashed): `Study.ask`
    had taken the other command's enqueued trial, and a try the other was still running (no values yet) had
    been read as done. Here another command's waiting trial is left to it, and its running tries of the same
    config are made again, with the same outcome as alone."""
    import skistune.optimize as opt

    def searched():
        problem = build_problem(workload, slo="p99=200ms", profile=profile)
        study = opt.open_study(problem, optuna.storages.InMemoryStorage(), "s", sampler=None)
        host = max(problem.space.param("offload.host_kv_bytes").choices)
        study.enqueue_trial({**opt._baseline_params(problem), "offload.host_kv_bytes": host,
                             "batching.max_num_batched_tokens": 8192, "batching.chunk_size": 512})
        study.optimize(opt._trial_function(problem, study), n_trials=2)
        return problem, study, opt._refine(problem, [e for e in opt.completed(study) if e.trial == 1])

    problem, study, best = searched()
    alone = opt._simplify(problem, study, best, lambda stage: None)
    keys = [t.user_attrs[opt.SIMPLIFIES_ATTR] for t in study.trials if opt.SIMPLIFIES_ATTR in t.user_attrs]
    assert keys

    problem, study, best = searched()
    foreign = {"batching.max_num_seqs": 7}
    study.enqueue_trial(foreign)  # another command's, waiting for its own ask
    for key in keys:  # the other command's tries of the same config, still running
        study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING,
                                                  user_attrs={opt.SIMPLIFIES_ATTR: key, "config": {}}))
    simpler, notes = opt._simplify(problem, study, best, lambda stage: None)
    numbered = re.compile(r"trial \d+")  # (the tries are later trials here)
    assert simpler[0].config == alone[0][0].config
    assert [numbered.sub("trial N", n) for n in notes] == [numbered.sub("trial N", n) for n in alone[1]]
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert [t.system_attrs["fixed_params"] for t in waiting] == [foreign]
