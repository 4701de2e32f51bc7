"""The combination model on the shipped profile (`profiles/quality-smollm2-135m.json`, measured on the real
SmolLM2-135M): relations any prediction must keep whatever the measurements' noise, over the search space.

A larger budget never predicts more loss; a recent window below the default never predicts less loss than a
larger one where the measurements say smaller windows lose more; composing measured differences never
predicts eviction to beat the full cache by more than the measurements' own noise; and a measured config is
predicted at its measurement (or, where that breaks the first relation, above it)."""
import math
from functools import lru_cache
from pathlib import Path

import pytest

from skistune.config import KVConfig
from skistune.quality import QualityProfile
from skistune.quality.grid import POLICIES

SHIPPED = Path(__file__).resolve().parents[2] / "profiles" / "quality-smollm2-135m.json"
BUDGETS = [round(0.1 + 0.02 * i, 2) for i in range(46)] + [1.0]
WINDOWS = (16, 32, 48, 64, 256, 1024)
SINKS = (0, 4, 16)
SCHEDULES = ("uniform", "pyramid")
# The 95% bounds add a margin from the spread between windows, which need not shrink as the mean does:
# they are held to within 0.2 percentage points (they moved by up to 0.1 on this profile; by 1.3 before).
BOUND_SLACK = 0.002


QP = QualityProfile.load(SHIPPED)


@pytest.fixture(scope="module")
def qp():
    return QP


def evict(policy, fraction, **extra):
    return KVConfig().with_knobs({"eviction.policy": policy, "eviction.budget_fraction": fraction,
                                  **{f"eviction.{k}": v for k, v in extra.items()}})


@lru_cache(maxsize=None)
def _predict(policy, fraction, sinks, window, schedule):
    config = evict(policy, fraction, sink_tokens=sinks, recent_window=window, layer_schedule=schedule)
    return QP.predict(config), QP.window_deltas(config)


def test_the_testers_repro_a_smaller_snapkv_window_at_a_tenth_is_not_lossless(qp):
    """Budget 0.1, 4 sinks: window 64 predicted +14.8%, 16-48 +0.00% (per-window deltas down to -0.97). The
    real model lost +34% with window 17 (held-out windows); a smaller window must not read as better."""
    default = qp.predict(evict("snapkv", 0.1, recent_window=64)).ppl_mean
    assert default > 0.1
    previous = math.inf
    for window in (16, 17, 24, 32, 40, 48):
        config = evict("snapkv", 0.1, recent_window=window)
        loss = qp.predict(config).ppl_mean
        assert loss >= default, (window, loss, default)
        assert loss <= previous + 1e-12
        previous = loss
        assert min(qp.window_deltas(config)) > -0.1  # (was -0.97 at window 16)
    # and a 10% budget does not look better than 20%
    assert qp.predict(evict("snapkv", 0.1, recent_window=16)).ppl_mean >= qp.predict(
        evict("snapkv", 0.2, recent_window=16)).ppl_mean


@pytest.mark.parametrize("policy", POLICIES)
def test_a_larger_budget_never_predicts_more_loss(policy):
    for sinks in SINKS:
        for schedule in SCHEDULES:
            for window in WINDOWS:
                prev = None
                for fraction in BUDGETS:
                    loss, _ = _predict(policy, fraction, sinks, window, schedule)
                    if prev is not None:
                        where = (policy, sinks, schedule, window, fraction)
                        assert loss.ppl_mean <= prev.ppl_mean + 1e-12, where
                        assert loss.ppl_worst <= prev.ppl_worst + 1e-12, where
                        assert loss.ppl_mean_bound <= prev.ppl_mean_bound + BOUND_SLACK, where
                        assert loss.ppl_worst_bound <= prev.ppl_worst_bound + BOUND_SLACK, where
                    prev = loss


def _smaller_windows_lose_more(qp, policy):
    """Whether the profile says so: at every budget the variants were measured at, the 16-token window lost
    more (mean over windows) than the policy with its default 64."""
    refs = qp._variant_fractions(policy)
    return bool(refs) and all(sum(qp._variant_delta(policy, "eviction.recent_window", 16, r) or [-1]) > 0
                              for r in refs)


def test_the_profile_says_smaller_windows_lose_more_for_h2o_and_snapkv_not_tova(qp):
    assert _smaller_windows_lose_more(qp, "h2o") and _smaller_windows_lose_more(qp, "snapkv")
    assert not _smaller_windows_lose_more(qp, "tova")  # (16 lost a little less than 64 at both budgets)


# The composition reads each window's measured difference, noise and all, and the budget envelope lifts
# some windows more than others: the mean may wiggle by a few hundredths of a point between windows.
WINDOW_SLACK = 0.001


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "streaming"])
def test_a_larger_recent_window_below_the_default_never_predicts_more_loss(qp, policy):
    assert policy == "streaming" or _smaller_windows_lose_more(qp, policy)
    for sinks in SINKS:
        for schedule in SCHEDULES:
            for fraction in BUDGETS:
                losses = [_predict(policy, fraction, sinks, w, schedule)[0].ppl_mean for w in (16, 32, 48, 64)]
                for a, b in zip(losses, losses[1:]):
                    assert b <= a + WINDOW_SLACK, (policy, sinks, schedule, fraction, losses)
                assert losses[0] >= losses[-1] - 1e-6, (policy, sinks, schedule, fraction, losses)


@pytest.mark.parametrize("policy", POLICIES)
def test_composition_never_predicts_a_window_better_than_the_measurements_noise(qp, policy):
    floor = qp._noise_floor(policy)  # (the lowest any measurement of the policy showed, per window)
    assert min(floor) > -0.06  # (what the noise reaches: SnapKV's 64 decoded tokens a window)
    for sinks in SINKS:
        for schedule in SCHEDULES:
            for window in WINDOWS:
                for fraction in BUDGETS:
                    _, deltas = _predict(policy, fraction, sinks, window, schedule)
                    assert all(d >= f - 1e-12 for d, f in zip(deltas, floor)), (
                        policy, sinks, schedule, window, fraction, deltas)


def test_no_eviction_config_with_a_small_budget_is_predicted_lossless():
    """The tester's scan: 54 SnapKV configs at budgets up to 0.3 (sinks 0/4/16, windows 16-48) read +0.00%."""
    for policy in POLICIES:
        for sinks in SINKS:
            for schedule in SCHEDULES:
                for window in WINDOWS:
                    for fraction in (b for b in BUDGETS if b <= 0.3):
                        loss, _ = _predict(policy, fraction, sinks, window, schedule)
                        assert loss.ppl_mean > 0.005, (policy, sinks, schedule, window, fraction)


def test_measured_configs_are_predicted_at_their_measurement_or_conservatively_above(qp):
    """At a grid point the prediction is the measurement, except where the budget envelope lifts a window to
    what it lost at a larger measured budget: never below it, and within noise of it for every config with
    sinks (SnapKV's decoded tokens are the noisiest: up to 1.6 points); H2O and TOVA without sinks lost less
    at 0.25 than at 0.5 (+89% against +99%), and are read at the larger loss."""
    lifted = []
    for kind in ("evict", "evict-variant"):
        for knobs, deltas in qp._table(kind):
            measured = max(0.0, math.exp(sum(deltas) / len(deltas)) - 1)
            worst = max(0.0, max(math.exp(d) - 1 for d in deltas))
            loss = qp.predict(KVConfig().with_knobs(knobs))
            assert loss.ppl_mean >= measured - 1e-9 and loss.ppl_worst >= worst - 1e-9, knobs
            if knobs.get("eviction.sink_tokens", 4) == 0 and knobs["eviction.policy"] in ("h2o", "tova"):
                assert loss.ppl_mean <= 1.25 * measured
            else:
                assert loss.ppl_mean - measured <= 0.02, (knobs, loss.ppl_mean, measured)
            if loss.ppl_mean - measured > 1e-9:
                lifted.append(knobs)
    # streaming's curve falls everywhere: exactly its measurements
    assert not [k for k in lifted if k["eviction.policy"] == "streaming"]


def test_quantized_kv_at_a_block_size_the_profile_did_not_measure_is_outside_the_grid():
    """Keys are quantized per channel over a block's tokens: a tester measured 2-bit keys +26% at blocks of 16 and +74%
    at 64, both predicted +25% (a floor of ppl+32% admitted the second, which validation alone caught)."""
    import math

    from skistune.quality import load_quality_profile

    qp = load_quality_profile()
    assert qp.block_size == 16
    k2 = KVConfig().with_knobs({"bitwidth.key_bits": 2})
    assert math.isfinite(qp.predict(k2).ppl_mean)
    assert math.isinf(qp.predict(k2.with_knobs({"prefix_reuse.block_size": 64})).ppl_mean)
    lossless_blocks = KVConfig().with_knobs({"prefix_reuse.block_size": 64, "eviction.policy": "h2o",
                                             "eviction.budget_fraction": 0.5})
    assert math.isfinite(qp.predict(lossless_blocks).ppl_mean)  # (16-bit KV: the block size changes no value)


@pytest.mark.parametrize("eviction", [{"eviction.policy": "snapkv", "eviction.budget_fraction": 0.9},
                                      {"eviction.policy": "h2o", "eviction.budget_fraction": 0.9},
                                      {"eviction.policy": "tova", "eviction.budget_fraction": 0.9}])
@pytest.mark.parametrize("bits", [{"bitwidth.value_bits": 2}, {"bitwidth.key_bits": 4, "bitwidth.value_bits": 4},
                                  {"bitwidth.key_bits": 4}])
def test_a_combination_never_reads_below_either_part(bits, eviction):
    """A near-lossless eviction lowered the loss and the bound of the quantization it was added to (int4 keys and
    values: bound 2.30% alone, 1.88% with TOVA at 0.9). SnapKV's losses are read on the decoded tokens, its bits'
    too (docs/quality.md): there the quantization part alone, read on every position, is no floor."""
    from skistune.quality import load_quality_profile

    qp = load_quality_profile()
    joint, quantized, evicted = (qp.predict(KVConfig().with_knobs(k)) for k in ({**bits, **eviction}, bits, eviction))
    for part in (quantized, evicted) if eviction["eviction.policy"] != "snapkv" else (evicted,):
        assert joint.ppl_mean >= part.ppl_mean - 1e-12
        assert joint.guarded_mean >= part.guarded_mean - 1e-12 and joint.guarded_worst >= part.guarded_worst - 1e-12
