"""Quantized KV in profiles: a measured profile has the bitwidth points and says nothing is extrapolated;
a profile measured before quantized KV existed (the shipped ones, and any such file) still loads, with
zero quantized-KV terms and a note that says its quantized KV is extrapolated and to re-profile."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from skistune.config import KVConfig
from skistune.profile import FingerprintWarning, HardwareProfile, load_profile
from skistune.profile.cost import ALL_FEATURES, FEATURES, QUANT_FEATURES
from skistune.profile.records import kv_bits
from skistune.runtime.request import Request
from skistune.simulator import simulate, target_from_profile

PROFILES = sorted((Path(__file__).resolve().parents[2] / "profiles").glob("*.json"))
HARDWARE_PROFILES = [p for p in PROFILES if not p.name.startswith("quality-")]


def test_a_measured_profile_has_the_bitwidth_points_and_no_note(tiny_profile: HardwareProfile):
    assert tiny_profile.measures_quantized_kv and tiny_profile.quantized_kv_note is None
    assert {kv_bits(p.grid) for p in tiny_profile.steps} == {16, 8, 4}
    assert tiny_profile.step_cost.to_dict()["features"] == list(ALL_FEATURES)
    assert tiny_profile.quantize.fit.names == ("fixed", "elements")


def _as_measured_before_quantized_kv(data: dict) -> None:
    """The file as the profiler wrote it before quantized KV: 16-bit points only, no bits coordinates, nine
    features, no quantize-on-append kernel."""
    step = data["step"]
    step["points"] = [p for p in step["points"] if p["grid"]["bits"] == 16]
    for p in step["points"]:
        del p["grid"]["bits"]
        for field in QUANT_FEATURES:
            del p["shape"][field]
    model = step["cost_model"]
    model["features"], model["coef"] = list(FEATURES), model["coef"][:len(FEATURES)]
    attention = data["kernels"]["paged_attention"]
    attention["points"] = [p for p in attention["points"] if p["grid"].pop("bits") == 16]
    del data["kernels"]["quantize_append"]


def test_an_old_profile_loads_with_zero_quantized_terms_and_a_note(edited, tiny_profile: HardwareProfile):
    old = load_profile(edited(_as_measured_before_quantized_kv), check_fingerprint=False)
    assert not old.measures_quantized_kv and old.quantize is None
    assert old.step_cost.coef == tiny_profile.step_cost.coef  # the nine terms as written
    assert old.step_cost.quant_coef == (0.0,) * len(QUANT_FEATURES)
    assert "extrapolated" in old.quantized_kv_note and "re-profile" in old.quantized_kv_note


def test_unknown_cost_features_are_still_an_error(edited):
    def edit(data):
        data["step"]["cost_model"]["features"] = list(FEATURES[:-1]) + ["hbm_bytes"]

    with pytest.raises(ValueError, match=r"step\.cost_model\.features: \[.*'hbm_bytes'\] are not"):
        load_profile(edited(edit), check_fingerprint=False)


@pytest.fixture(params=HARDWARE_PROFILES, ids=lambda p: p.name)
def shipped_profile(request) -> HardwareProfile:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FingerprintWarning)
        return load_profile(request.param)


def test_shipped_profiles_load_and_say_whether_quantized_kv_is_measured(shipped_profile: HardwareProfile):
    measured = any(kv_bits(p.grid) != 16 for p in shipped_profile.steps)
    assert shipped_profile.measures_quantized_kv == measured
    assert (shipped_profile.quantized_kv_note is None) == measured
    target = target_from_profile(shipped_profile)
    assert target.kv_itemsize == {"float32": 4, "bfloat16": 2}[shipped_profile.dtype]


def test_a_quantized_config_simulated_on_an_old_profile_carries_the_note(shipped_profile: HardwareProfile):
    target = target_from_profile(shipped_profile)
    reqs = [Request("a", list(range(3, 200)), 4)]
    int4 = KVConfig().with_knobs({"bitwidth.key_bits": 4, "bitwidth.value_bits": 4, "batching.max_num_seqs": 8})
    note = shipped_profile.quantized_kv_note
    assert (note in simulate(int4, reqs, target).notes) == (note is not None)
    assert note is None or note not in simulate(KVConfig(), reqs, target).notes


def _as_measured_before_unpacking_terms(data: dict) -> None:
    """The file as the profiler wrote it until 2026-12-01: three quantized terms, no unpacking ones."""
    step = data["step"]
    for p in step["points"]:
        for field in QUANT_FEATURES[3:]:
            del p["shape"][field]
    model = step["cost_model"]
    kept = len(FEATURES) + 3
    model["features"], model["coef"] = list(ALL_FEATURES[:kept]), model["coef"][:kept]


def test_a_profile_without_unpacking_terms_loads_with_them_at_zero(edited, tiny_profile: HardwareProfile):
    old = load_profile(edited(_as_measured_before_unpacking_terms), check_fingerprint=False)
    assert old.step_cost.quant_coef[:3] == tiny_profile.step_cost.quant_coef[:3]
    assert old.step_cost.quant_coef[3:] == (0.0, 0.0) and old.measures_quantized_kv


def test_unpacking_work_per_bitwidth():
    from skistune.config import KVConfig
    from skistune.runtime.kv_layout import kv_traffic, unpack_work
    from skistune.runtime.presets import PRESETS

    assert [unpack_work(b) for b in (16, 8, 4, 2)] == [0, 0, 1, 3]
    spec = PRESETS["smollm2-135m"]
    per_side = spec.n_layers * spec.n_kv_heads * spec.head_dim

    def traffic(k, v):
        return kv_traffic(KVConfig().with_knobs({"bitwidth.key_bits": k, "bitwidth.value_bits": v}), spec, 4)

    assert traffic(8, 8).unpacked_elements_per_token == 0 and traffic(16, 16).unpacked_elements_per_token == 0
    assert traffic(4, 4).unpacked_elements_per_token == 2 * per_side
    assert traffic(2, 16).unpacked_elements_per_token == 3 * per_side  # keys at 2 bits, values at full precision
