"""The combination model on a hand-made profile: every prediction computed by hand from `synthetic`."""
import json
import math

import pytest

from skistune.config import KVConfig
from skistune.objectives import NO_LOSS
from skistune.quality import QualityProfile
from skistune.quality.model import knob_key

from quality_synthetic import _entry, profile_data, spread

BITS4 = {"bitwidth.key_bits": 4, "bitwidth.value_bits": 4}


def h2o(fraction, **extra):
    return {"eviction.policy": "h2o", "eviction.budget_fraction": fraction, **extra}


@pytest.fixture(scope="module")
def qp():
    return QualityProfile(profile_data())


def mean_loss(qp, knobs):
    return math.log1p(qp.predict(KVConfig().with_knobs(knobs)).ppl_mean)


def test_lossless_configs_lose_exactly_nothing(qp):
    assert qp.predict(KVConfig()) is NO_LOSS
    assert qp.predict(KVConfig().with_knobs({"batching.max_num_seqs": 8, "offload.host_kv_bytes": 1 << 30})) is NO_LOSS


def test_keys_and_values_add_in_log_perplexity_per_window(qp):
    loss = qp.predict(KVConfig().with_knobs(BITS4))
    windows = [a + b for a, b in zip(spread(0.01), spread(0.02))]
    assert loss.ppl_mean == pytest.approx(math.exp(sum(windows) / 2) - 1)
    assert loss.ppl_worst == pytest.approx(math.exp(max(windows)) - 1)
    assert loss.ppl_worst > loss.ppl_mean and loss.basis == "measured"
    margin = 6.313752 * 0.02 / math.sqrt(2) / math.sqrt(2)  # t(0.95, 1 dof) x sd of [0.02, 0.04] / sqrt(2)
    assert loss.ppl_mean_bound == pytest.approx(math.exp(0.03 + margin) - 1, rel=1e-5)
    assert loss.guarded_mean == loss.ppl_mean_bound


@pytest.mark.parametrize("knobs, expected", [
    ({**BITS4, "bitwidth.full_precision_window": 128}, 0.03 * 0.25),
    ({**BITS4, "bitwidth.full_precision_window": 64}, 0.03 * 0.625),  # linear between 0 and 128
    ({**BITS4, "bitwidth.full_precision_window": 1024}, 0.03 * 0.25),  # held at the largest measured
    ({**BITS4, "bitwidth.group_size": 16}, 0.03),  # no group 16 measured: the next larger (32)
    ({**BITS4, "bitwidth.group_size": 128}, 0.01 + 0.03),  # none larger: the largest (64)
    ({"bitwidth.key_bits": 2, "bitwidth.value_bits": 16}, 0.2),
    ({"bitwidth.key_bits": 8, "bitwidth.value_bits": 2}, 0.001 + 0.3),
])
def test_bits_read_the_single_side_grids_conservatively(qp, knobs, expected):
    assert mean_loss(qp, knobs) == pytest.approx(expected)


@pytest.mark.parametrize("knobs, expected", [
    (h2o(0.25), 0.06), (h2o(0.375), 0.04), (h2o(0.75), 0.01), (h2o(1.0), 0.0),
    ({"eviction.policy": "h2o", "eviction.budget_tokens": 500}, 0.02),  # 500 of the profile's 1000-token windows
    # recent windows at the variants' budget (0.25): log2 between the measured 16 / 64 / 256, held outside
    (h2o(0.25, **{"eviction.recent_window": 16}), 0.06 * 1.5),
    (h2o(0.25, **{"eviction.recent_window": 32}), 0.06 * 1.25),
    (h2o(0.25, **{"eviction.recent_window": 4096}), 0.06 * 0.5),
    # at twice that budget a window takes half the share: 128 reads as 64 (adds 0) and the default 64 as 32
    # (adds 0.015, halfway in log2 to 16's 0.03), against which the base curve was measured; above the
    # variants' budget the difference fades to 0 at 1.0 (2/3 of it at 0.5)
    (h2o(0.5, **{"eviction.recent_window": 128}), 0.02 + (0.0 - 0.015) * 2 / 3),
    (h2o(0.5, **{"eviction.layer_schedule": "pyramid"}), 0.02 + (0.06 * 0.8 - 0.06) * 2 / 3),
    ({"eviction.policy": "streaming", "eviction.budget_fraction": 0.25, "eviction.sink_tokens": 0}, 0.5),
    ({"eviction.policy": "streaming", "eviction.budget_fraction": 0.25, "eviction.sink_tokens": 2}, 0.5),
    ({**BITS4, **h2o(0.5)}, 0.03 + 0.02),
])
def test_eviction_interpolates_the_budget_and_scales_by_measured_variants(qp, knobs, expected):
    assert mean_loss(qp, knobs) == pytest.approx(expected)


def _with(data: dict, *entries: tuple[str, dict, float]) -> QualityProfile:
    for kind, knobs, loss in entries:
        key, entry = _entry(kind, knobs, loss)
        data["perplexity"][key] = entry
    return QualityProfile(data)


def test_variants_measured_at_two_budgets_are_interpolated_between_them():
    # the pyramid adds -0.012 at 0.25 (0.8x of 0.06, from the synthetic profile) and +0.004 at 0.5 (1.2x of 0.02)
    qp2 = _with(profile_data(), ("evict-variant", h2o(0.5, **{"eviction.layer_schedule": "pyramid"}), 0.02 * 1.2))
    pyramid = {"eviction.layer_schedule": "pyramid"}
    assert mean_loss(qp2, h2o(0.25, **pyramid)) == pytest.approx(0.06 * 0.8)
    assert mean_loss(qp2, h2o(0.375, **pyramid)) == pytest.approx(0.04 - 0.004)  # halfway: (-0.012 + 0.004) / 2
    assert mean_loss(qp2, h2o(0.5, **pyramid)) == pytest.approx(0.02 * 1.2)
    assert mean_loss(qp2, h2o(0.75, **pyramid)) == pytest.approx(0.01 + 0.004 / 2)  # fading to 0 at 1.0
    # a reference loss near zero does not blow the variant up (a ratio would: 0.004 / 1e-6)
    near_zero = _with(profile_data(), ("evict", h2o(0.5, **{"eviction.sink_tokens": 4}), 1e-6),
                      ("evict-variant", h2o(0.5, **pyramid), 0.004))
    assert mean_loss(near_zero, h2o(0.5, **pyramid)) == pytest.approx(0.004)


def test_a_loss_that_rises_with_the_budget_is_read_at_the_larger_loss_below_it():
    # h2o measured 0.06 at 0.25 and 0.02 at 0.5; a 0.75 point at 0.03 (above 0.5's: noise, or which tokens a
    # compaction kept) lifts 0.5 to 0.03 and the budgets between, never the reverse
    qp2 = _with(profile_data(), ("evict", h2o(0.75, **{"eviction.sink_tokens": 4}), 0.03))
    assert mean_loss(qp2, h2o(0.75)) == pytest.approx(0.03)
    assert mean_loss(qp2, h2o(0.5)) == pytest.approx(0.03)
    assert mean_loss(qp2, h2o(0.6)) == pytest.approx(0.03)
    assert mean_loss(qp2, h2o(0.375)) == pytest.approx(0.045)  # halfway between 0.06 and the lifted 0.03
    assert mean_loss(qp2, h2o(0.9)) == pytest.approx(0.03 * 0.4)  # then linearly to 0 at 1.0
    losses = [mean_loss(qp2, h2o(f / 100)) for f in range(25, 101)]
    assert all(b <= a + 1e-12 for a, b in zip(losses, losses[1:]))


def test_below_the_variants_budgets_a_loss_grows_with_the_policy_an_improvement_does_not():
    # h2o at 0.1 loses 0.18, three times its 0.06 at 0.25, where the pyramid measured 0.8x (-0.012) and a
    # 16-token window 1.5x (+0.03): the window's added loss grows to +0.09, the pyramid's gain stays -0.012
    qp2 = _with(profile_data(), ("evict", h2o(0.1, **{"eviction.sink_tokens": 4}), 0.18))
    assert mean_loss(qp2, h2o(0.1)) == pytest.approx(0.18)
    assert mean_loss(qp2, h2o(0.1, **{"eviction.recent_window": 16})) == pytest.approx(0.18 + 3 * 0.03)
    assert mean_loss(qp2, h2o(0.1, **{"eviction.layer_schedule": "pyramid"})) == pytest.approx(0.18 - 0.012)
    # each window keeps its measured difference to the mean effect (the spread is not amplified)
    deltas = qp2.window_deltas(KVConfig().with_knobs(h2o(0.1, **{"eviction.recent_window": 16})))
    assert deltas == pytest.approx([a + b + 2 * 0.03 for a, b in zip(spread(0.18), spread(0.03))])


def test_composed_differences_stay_above_the_measurements_noise_per_window():
    # the pyramid measured lossless at 0.5 (-0.02 against h2o's 0.02) and h2o lossless at 0.75: at 0.75 the
    # difference, faded to half, would take both windows below zero, where no measurement of h2o ever went
    qp2 = _with(profile_data(), ("evict", h2o(0.75, **{"eviction.sink_tokens": 4}), 0.0),
                ("evict-variant", h2o(0.5, **{"eviction.layer_schedule": "pyramid"}), 0.0))
    assert mean_loss(qp2, h2o(0.5, **{"eviction.layer_schedule": "pyramid"})) == pytest.approx(0.0)
    deltas = qp2.window_deltas(KVConfig().with_knobs(h2o(0.75, **{"eviction.layer_schedule": "pyramid"})))
    assert deltas == pytest.approx([0.0, 0.0])  # (summed: -0.0067 and -0.0133)


def test_a_recent_window_measured_at_the_second_budget_is_read_there():
    # at 0.5 a 256-token window measured at 0.6x the reference; 16 not measured there (held at 1.0 below 64)
    qp2 = _with(profile_data(), ("evict-variant", h2o(0.5, **{"eviction.recent_window": 256}), 0.02 * 0.6))
    assert mean_loss(qp2, h2o(0.5, **{"eviction.recent_window": 256})) == pytest.approx(0.02 * 0.6)
    assert mean_loss(qp2, h2o(0.5, **{"eviction.recent_window": 128})) == pytest.approx(0.02 * 0.8)  # log2 midway


def test_keys_lose_more_under_eviction_by_the_measured_interaction():
    # keys at 2 bits under h2o at 0.5 measured 0.2 (keys) + 0.02 (h2o) + 0.1 on top; with a 128-token window
    # 0.05 + 0.02 + 0.06: the window cuts the keys' own loss to a quarter, their excess only to 0.6 of it
    data = profile_data()
    qp2 = _with(data, ("key-evict", {"bitwidth.key_bits": 2, **h2o(0.5)}, 0.2 + 0.02 + 0.1),
                ("key-evict", {"bitwidth.key_bits": 2, "bitwidth.full_precision_window": 128, **h2o(0.5)},
                 0.05 + 0.02 + 0.06))
    assert mean_loss(qp2, {"bitwidth.key_bits": 2, **h2o(0.5)}) == pytest.approx(0.2 + 0.1 + 0.02)
    assert mean_loss(qp2, {"bitwidth.key_bits": 2, **h2o(0.25)}) == pytest.approx(0.2 + 0.1 + 0.06)  # any budget
    fp = "bitwidth.full_precision_window"
    assert mean_loss(qp2, {"bitwidth.key_bits": 2, fp: 128, **h2o(0.5)}) == pytest.approx(0.05 + 0.06 + 0.02)
    assert mean_loss(qp2, {"bitwidth.key_bits": 2, fp: 64, **h2o(0.5)}) == pytest.approx(0.125 + 0.08 + 0.02)
    assert mean_loss(qp2, {"bitwidth.key_bits": 2, fp: 1024, **h2o(0.5)}) == pytest.approx(0.05 + 0.06 + 0.02)
    # values keep their grid through a compaction; 4-bit keys read the 2-bit point, scaled by their own loss
    assert mean_loss(qp2, {**BITS4, **h2o(0.5)}) == pytest.approx(0.01 + 0.1 * 0.01 / 0.2 + 0.02 + 0.02)
    # no eviction, or another policy without a key-evict point: no interaction
    assert mean_loss(qp2, {"bitwidth.key_bits": 2}) == pytest.approx(0.2)
    streaming = {"eviction.policy": "streaming", "eviction.budget_fraction": 0.5}
    assert mean_loss(qp2, {"bitwidth.key_bits": 2, **streaming}) == pytest.approx(0.2 + 0.01)
    # per layer: each layer's share of it
    first_at_2 = [[2, 2], [16, 16], [16, 16], [16, 16]]
    assert mean_loss(qp2, {"bitwidth.layer_bits": first_at_2, **h2o(0.5)}) == pytest.approx(
        0.5 * (0.2 + 0.1 + 0.3) + 0.02)


def test_a_snapkv_config_reads_its_bits_on_the_decoded_tokens_like_its_own_loss():
    data = profile_data()
    ppl = data["perplexity"]
    full = ppl["{}"]
    for e in ppl.values():  # the bits measurements lose twice as much on the decoded tokens
        if e["kind"] in ("key", "value"):
            e["nll"] = [f + 2 * (x - f) for f, x in zip(full["nll"], e["nll_all_positions"])]
    for fraction in (0.25, 0.5):
        key, entry = _entry("evict", {"eviction.policy": "snapkv", "eviction.budget_fraction": fraction,
                                      "eviction.sink_tokens": 4}, 0.01)
        ppl[key] = entry
    qp = QualityProfile(data)
    assert mean_loss(qp, {**BITS4, "eviction.policy": "snapkv", "eviction.budget_fraction": 0.5}) == pytest.approx(
        2 * (0.01 + 0.02) + 0.01)
    assert mean_loss(qp, {**BITS4, **h2o(0.5)}) == pytest.approx(0.01 + 0.02 + 0.02)  # all positions


@pytest.mark.parametrize("knobs", [h2o(0.1), h2o(0.5, **{"eviction.sink_tokens": 0}),
                                   {"eviction.policy": "tova", "eviction.budget_fraction": 0.5}])
def test_outside_the_grid_is_infinite_loss_not_a_guess(qp, knobs):
    loss = qp.predict(KVConfig().with_knobs(knobs))
    assert loss.ppl_mean == math.inf and loss.needle_retained == 0.0 and "outside" in loss.basis


def test_per_layer_bits_weight_layers_by_measured_sensitivity(qp):
    uniform = [[4, 4]] * 4
    assert mean_loss(qp, {"bitwidth.layer_bits": uniform}) == pytest.approx(mean_loss(qp, BITS4))
    assert qp.shares(4) == pytest.approx([0.5, 0.0, 0.25, 0.25])
    first_at_2 = [[2, 2], [16, 16], [16, 16], [16, 16]]
    assert mean_loss(qp, {"bitwidth.layer_bits": first_at_2}) == pytest.approx(0.5 * (0.2 + 0.3))
    second_at_2 = [[16, 16], [2, 2], [16, 16], [16, 16]]
    assert mean_loss(qp, {"bitwidth.layer_bits": second_at_2}) == pytest.approx(0.0)


def test_a_deeper_model_maps_layers_by_relative_depth(qp):
    shares = qp.shares(8)
    assert sum(shares) == pytest.approx(1.0)
    assert shares == pytest.approx([0.25, 0.25, 0.0, 0.0, 0.125, 0.125, 0.125, 0.125])


def test_layer_sensitivities_sum_to_the_predicted_loss_of_an_assignment(qp):
    config = KVConfig()
    sens = qp.layer_sensitivity(config, 4, [(4, 4), (2, 2), (16, 16)])
    assignment = [(2, 2), (4, 4), (16, 16), (4, 4)]
    total = sum(sens[layer, *pair] for layer, pair in enumerate(assignment))
    assert total == pytest.approx(mean_loss(qp, {"bitwidth.layer_bits": [list(p) for p in assignment]}))
    assert qp.layer_sensitivity(config, 4, [(4, 3)]) is None  # 3 bits were never measured


@pytest.mark.parametrize("knobs, kept", [
    (BITS4, 0.75), ({"bitwidth.key_bits": 8, "bitwidth.value_bits": 8}, 1.0), ({"bitwidth.key_bits": 2}, 0.0),
    ({"bitwidth.key_bits": 16, "bitwidth.value_bits": 4}, 0.75),  # the lowest bits any side uses
    (h2o(0.3), 0.25), (h2o(0.2), 0.0), (h2o(0.6), 0.5),  # the largest measured budget not above
    ({"eviction.policy": "tova", "eviction.budget_fraction": 0.9}, 0.0),  # never measured: nothing assumed
    ({**BITS4, **h2o(0.5)}, 0.375),  # independent failures: shares multiply
])
def test_passkey_share_kept_is_conservative_between_measurements(qp, knobs, kept):
    assert qp.predict(KVConfig().with_knobs(knobs)).needle_retained == pytest.approx(kept)


def test_another_model_is_a_proxy(qp):
    assert qp.predict(KVConfig().with_knobs(BITS4), "llama-3-8b").basis == "proxy: smollm2-135m"


def test_combination_checks_compare_joint_measurements_with_predictions():
    joint = (({**BITS4, **h2o(0.5)}, 0.05), ({"bitwidth.key_bits": 4, **h2o(0.25)}, 0.2))
    checks = QualityProfile(profile_data(joint=joint)).combination_checks()
    exact, off = checks
    assert exact["within_goal"] and exact["error_pp"] == pytest.approx(0.0, abs=1e-9)
    assert off["predicted"] == pytest.approx(math.exp(0.07) - 1)
    assert off["measured"] == pytest.approx(math.exp(0.2) - 1) and not off["within_goal"]


@pytest.mark.parametrize("text, match", [
    ("{", "not valid JSON"), ("[]", "expected a JSON object"), ('{"format": "x"}', "not a skistune quality profile"),
    ('{"format": "skistune-quality-profile", "version": 0}', "version 0"),
])
def test_bad_files_raise_one_line_errors_naming_the_file(tmp_path, text, match):
    path = tmp_path / "q.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        QualityProfile.load(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_missing_file_and_incomplete_profile(tmp_path):
    with pytest.raises(ValueError, match="cannot read quality profile"):
        QualityProfile.load(tmp_path / "none.json")
    data = profile_data()
    del data["n_layers"]
    (tmp_path / "q.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="lacks 'n_layers'"):
        QualityProfile.load(tmp_path / "q.json")


@pytest.mark.parametrize("corrupt, match", [
    (lambda d: d.update(n_layers=0), "n_layers: expected a positive number of layers, got 0"),
    (lambda d: d.update(needle="lots"), "needle: expected an object of measurements, got str"),
    (lambda d: d["perplexity"].update({next(iter(d["perplexity"])): "x"}), r"perplexity\[.*\]: expected an object"),
    (lambda d: d["perplexity"][next(iter(d["perplexity"]))].update(nll=["a"]), r"\.nll: expected a list of numbers"),
])
def test_a_corrupted_profile_is_one_line_naming_where(tmp_path, corrupt, match):
    """Hand-edited files gave AttributeError, TypeError and IndexError tracebacks (exit 1)."""
    data = profile_data()
    corrupt(data)
    (tmp_path / "q.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match) as info:
        QualityProfile.load(tmp_path / "q.json")
    assert "\n" not in str(info.value)


KEY8 = knob_key({"bitwidth.key_bits": 8, "bitwidth.full_precision_window": 0})


def _set(field, values, key=KEY8):
    return lambda d: d["perplexity"][key].update({field: values})


@pytest.mark.parametrize("corrupt, where, what", [
    (_set("nll_all_positions", [float("nan"), 1.0]), f"perplexity[{KEY8!r}].nll_all_positions",
     "finite numbers, got nan at window 0"),
    (_set("nll", [2.0, float("inf")]), f"perplexity[{KEY8!r}].nll", "finite numbers, got inf at window 1"),
    (_set("nll_all_positions", [2.0, -0.5]), f"perplexity[{KEY8!r}].nll_all_positions",
     "non-negative NLLs, got -0.5 at window 1"),
    (_set("nll_all_positions", [2.0]), f"perplexity[{KEY8!r}].nll_all_positions", "one value per window (2), got 1"),
    (_set("nll", [2.0, 3.0, 4.0], key="{}"), "perplexity['{}'].nll", "one value per window (2), got 3"),
    (lambda d: d["perplexity"][KEY8].pop("nll"), f"perplexity[{KEY8!r}].nll", "a list of per-window NLLs, got none"),
    (lambda d: d["protocol"].update(windows=0), "protocol.windows", "a positive number of windows, got 0"),
])
def test_a_measurement_that_is_not_one_finite_nll_per_window_names_entry_and_field(tmp_path, corrupt, where, what):
    """NaN crashed `--show` in statistics.stdev; negative NLLs and short lists were read as measurements."""
    data = profile_data()
    corrupt(data)
    path = tmp_path / "q.json"
    path.write_text(json.dumps(data))  # (json writes NaN and Infinity, and reads them back)
    with pytest.raises(ValueError) as info:
        QualityProfile.load(path)
    assert str(info.value) == f"{path}: {where}: expected {what}"


def test_a_profile_without_a_declared_window_count_is_held_to_its_reference(tmp_path):
    data = profile_data()
    del data["protocol"]
    (tmp_path / "ok.json").write_text(json.dumps(data))
    assert QualityProfile.load(tmp_path / "ok.json").predict(KVConfig().with_knobs(BITS4)).ppl_mean > 0
    _set("nll_all_positions", [2.0])(data)
    (tmp_path / "q.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"nll_all_positions: expected one value per window \(2\), got 1"):
        QualityProfile.load(tmp_path / "q.json")


def test_a_token_budget_is_a_fraction_of_the_context_it_serves(qp):
    budget = KVConfig().with_knobs({"eviction.policy": "h2o", "eviction.budget_tokens": 1000})
    assert qp.fraction(budget) == 1.0  # the profile's 1000-token windows
    assert qp.fraction(budget, context_tokens=4000) == 0.25
    assert math.log1p(qp.predict(budget, context_tokens=4000).ppl_mean) == pytest.approx(0.06)


def test_the_worst_window_floor_reads_a_prediction_bound_for_unseen_windows(qp):
    loss = qp.predict(KVConfig().with_knobs(BITS4))
    margin = 6.313752 * 0.02 / math.sqrt(2) * math.sqrt(1.5)  # t(0.95, 1) x sd x sqrt(1 + 1/n)
    assert loss.ppl_worst_bound == pytest.approx(math.exp(0.03 + margin) - 1, rel=1e-5)
    assert loss.guarded_worst == max(loss.ppl_worst, loss.ppl_worst_bound) > loss.ppl_worst
