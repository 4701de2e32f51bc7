"""Quality floors in the optimizer: lossy knobs searched only under a floor, priced by a quality profile
(a hand-made one here), per-layer bits from the integer program, and held-out validation."""
import math
import warnings
from pathlib import Path

import optuna
import pytest

import skistune
from skistune.config import KVConfig
from skistune.optimize import Evaluation, baseline_config, build_problem, score
from skistune.profile import load_profile
from skistune.search import layer_bits_solvers
from skistune.study_recipe import problem_from_recipe, problem_recipe
from skistune.validation import held_out_quality
from skistune.quality import QualityProfile
from skistune.workloads import load_workload

from quality_synthetic import profile_data

SHIPPED_PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json"
LOSSY = {"eviction.policy": "h2o", "eviction.budget_fraction": 0.5, "bitwidth.key_bits": 4, "bitwidth.value_bits": 4}


@pytest.fixture(scope="module")
def hw():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_profile(SHIPPED_PROFILE)


@pytest.fixture(scope="module")
def qp():
    return QualityProfile(profile_data(n_layers=30))


@pytest.fixture(scope="module")
def workload():
    return load_workload("chat", requests=16, seed=0)


def problem(workload, hw, qp, **kw):
    return build_problem(workload, **{"slo": "p99=200ms", "quality": "ppl+5%", "profile": hw, "quality_profile": qp,
                                      **kw})


def test_without_a_floor_the_search_is_lossless_and_says_so(workload, hw):
    p = build_problem(workload, slo="p99=200ms", profile=hw)
    assert p.quality_profile is None
    assert "eviction.policy" not in p.space.knob_names() and "bitwidth.key_bits" not in p.space.knob_names()
    assert any(n.startswith("lossless search (no --quality floor), left at defaults: eviction.*, bitwidth.*")
               for n in p.notes)


def test_a_floor_adds_the_lossy_knobs_and_prices_them(workload, hw, qp):
    p = problem(workload, hw, qp)
    assert {"eviction.policy", "eviction.budget_fraction", "bitwidth.key_bits"} <= set(p.space.knob_names())
    assert not any("lossless" in n for n in p.notes)
    e = score(p, baseline_config().with_knobs(LOSSY))
    expected = qp.predict(e.config)
    assert e.figures["quality_loss"] == pytest.approx(expected.ppl_mean)
    assert e.figures["quality_bound"] == pytest.approx(expected.ppl_mean_bound)
    assert expected.ppl_mean_bound > expected.ppl_mean
    assert e.violations["ppl+5%"] == pytest.approx((expected.ppl_mean_bound - 0.05) / 0.05)  # the bound, relative
    assert e.figures["quality_basis"] == "measured" and score(p, baseline_config()).figures["quality_basis"] == "exact"


def test_configs_outside_the_profile_violate_the_floor(workload, hw, qp):
    e = score(problem(workload, hw, qp), baseline_config().with_knobs({"eviction.policy": "tova",
                                                                       "eviction.budget_fraction": 0.5}))
    assert e.violations["ppl+5%"] == math.inf and e.figures["quality_loss"] is None


def test_every_feasible_trial_is_within_the_floor(workload, hw, qp):
    result = skistune.optimize(workload, slo="p99=200ms", quality="ppl+5%", quality_profile=qp, profile=hw,
                               n_trials=16, validate=0, storage=optuna.storages.InMemoryStorage())
    evaluations = [Evaluation.from_trial(t) for t in result.study.get_trials() if "config" in t.user_attrs]
    assert evaluations[0].config == baseline_config()  # the enqueued baseline: no solver fills its layer bits
    assert any(e.config.eviction.policy != "none" or e.config.bitwidth.key_bits != 16 for e in evaluations)
    for e in evaluations:
        if e.feasible:
            assert e.figures["quality_bound"] <= 0.05
    assert result.best[0].figures["quality_loss"] <= 0.05
    # the per-layer bits program ran inside trials that turned mixed precision on (not where eviction alone
    # spends the floor), and the result says how often
    ran = [t for t in result.study.get_trials() if "skistune.ilp" in t.user_attrs]
    mixed = [t for t in result.study.get_trials() if t.params.get("mixed_precision")]
    assert ran and {t.number for t in ran} <= {t.number for t in mixed}
    calls = sum(t.user_attrs["skistune.ilp"]["layer_bits"]["calls"] for t in ran)
    trials = len(result.study.get_trials())  # (the search's 16, and those that simplified its best config)
    assert any(n.startswith(f"layer_bits integer program solved {calls} times in {len(ran)} of {trials} trials")
               and n.endswith(" ms each on average") for n in result.notes)
    # the tuned file keeps how often, not the solve times (which differ from run to run of the same seed)
    from skistune.optimize import provenance
    assert f"layer_bits integer program solved {calls} times in {len(ran)} of {trials} trials" in provenance(result)[
        "notes"]
    # which measurements priced the lossy knobs (a tester could not trace a run to the 2-window quick profile it used)
    assert provenance(result)["quality_profile"] == {"path": qp.path, "digest": qp.digest(), "model": qp.model,
                                                     "grid": qp.data["protocol"].get("grid")}


def test_the_layer_bits_program_fills_per_layer_bits_within_the_floor(workload, hw, qp):
    p = problem(workload, hw, qp)
    solve = layer_bits_solvers(p)["layer_bits"]
    config = baseline_config().with_knobs({"eviction.policy": "h2o", "eviction.budget_fraction": 0.9})
    bits = solve(config)
    assert len(bits) == 30 and any(pair != [16, 16] for pair in bits)
    chosen = qp.predict(config.with_knobs({"bitwidth.layer_bits": bits}))
    # the program budgets the mean, solved again until the bound the floor reads holds too
    assert chosen.ppl_mean < chosen.guarded_mean <= 0.05 + 1e-9
    assert score(p, config.with_knobs({"bitwidth.layer_bits": bits})).violations["ppl+5%"] <= 1e-9
    half = baseline_config().with_knobs({"eviction.policy": "h2o", "eviction.budget_fraction": 0.5})
    assert qp.predict(half).guarded_mean > 0.05 and solve(half) is None  # eviction's bound alone breaks it
    assert solve(baseline_config().with_knobs({"eviction.policy": "streaming", "eviction.budget_fraction": 0.25,
                                               "eviction.sink_tokens": 0})) is None  # eviction alone breaks it
    assert layer_bits_solvers(build_problem(workload, slo="p99=200ms", profile=hw)) is None


def test_a_config_whose_pool_cannot_be_laid_out_is_unservable_not_an_error(workload, hw, qp):
    huge_rings = baseline_config().with_knobs({"bitwidth.key_bits": 4, "bitwidth.value_bits": 4,
                                               "bitwidth.full_precision_window": 4096, "batching.max_num_seqs": 4096,
                                               "offload.device_memory_fraction": 0.01})
    e = score(problem(workload, hw, qp), huge_rings)
    assert e.violations["served"] == math.inf and not e.feasible and "rings" in e.figures["unservable"]


def test_workers_rebuild_the_same_quality_profile(workload, hw, qp):
    p = problem(workload, hw, qp)
    rebuilt, _ = problem_from_recipe(problem_recipe(p, sampler="tpe", seed=0))
    assert rebuilt.quality_profile.digest() == qp.digest() and rebuilt.identity() == p.identity()


def test_missing_quality_profile_is_bad_input(workload, hw):
    with pytest.raises(ValueError, match="cannot read quality profile"):
        build_problem(workload, slo="p99=200ms", quality="ppl+1%", profile=hw, quality_profile="/no/such.json")


def test_lossless_configs_need_no_held_out_measurement(workload, hw, qp):
    assert held_out_quality(problem(workload, hw, qp), [KVConfig(), baseline_config()]) == {}


def test_passkeys_not_run_leave_the_share_kept_unknown(workload, hw, qp, monkeypatch):
    """Passkeys run only for a needle floor: without one the held-out share kept had read 1.0, as if measured."""
    import skistune.quality.measure as measure

    asked = []

    def measured(runtime, configs, needle=False, progress=None):
        asked.append(needle)
        return [{"ppl_mean": 0.01, "ppl_worst": 0.02, **({"needle_retained": 0.75} if needle else {})}
                for _ in configs]

    monkeypatch.setattr(measure, "measure_quality", measured)
    lossy = baseline_config().with_knobs(LOSSY)

    class Runtime:  # (a runtime with a tokenizer and the problem's model: none is loaded)
        tokenizer = object()

        class spec:
            name = "smollm2-135m"

    without = held_out_quality(problem(workload, hw, qp), [lossy], runtime=Runtime)[lossy]
    with_floor = held_out_quality(problem(workload, hw, qp, quality=["ppl+5%", "needle>=0.5"]), [lossy],
                                  runtime=Runtime)[lossy]
    assert asked == [False, True]
    assert without.needle_retained is None and without.ppl_mean == 0.01 and without.basis == "held-out"
    assert with_floor.needle_retained == 0.75
