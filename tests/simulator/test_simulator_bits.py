"""Quantized KV in the simulator: the pool holds more blocks at fewer bits, a step reads its context's bytes
at the configured bits and pays the profile's dequantization and quantize-on-append terms (both machines'
behaviours: bytes that cost time, conversions that cost more), a step that completes blocks pays for packing
them, fast-forward still equals stepping."""
import dataclasses
import warnings
from pathlib import Path

import numpy as np
import pytest

from skistune.config import KVConfig
from skistune.profile import FingerprintWarning, load_profile
from skistune.profile.cost import FEATURES, StepCostModel, decode_shape
from skistune.runtime.kv_layout import kv_block_bytes, kv_traffic, ring_bytes
from skistune.runtime.presets import PRESETS
from skistune.runtime.request import Request
from skistune.simulator import SimTarget, build_engine, simulate, target_from_profile
from skistune.workloads import load_workload, to_requests

SPEC = PRESETS["smollm2-135m"]
SHIPPED = Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json"


def cost(*, tokens=0.0, kv=0.0, decode_dequant=0.0, prefill_dequant=0.0, quantize=0.0, packing=(0.0, 0.0), **plain):
    c = dict.fromkeys(FEATURES, 0.0) | plain | {"tokens": tokens, "decode_kv_bytes": kv, "prefill_kv_bytes": kv}
    return StepCostModel(tuple(c[f] for f in FEATURES), 512, (decode_dequant, prefill_dequant, quantize, 0.0, 0.0),
                         packing_coef=packing)


def target(step_cost, device_bytes=1 << 30):
    return SimTarget(SPEC, step_cost, kv_itemsize=2, device_free_bytes=device_bytes)


def bits(b: int, **knobs) -> KVConfig:
    return KVConfig().with_knobs({"bitwidth.key_bits": b, "bitwidth.value_bits": b, "batching.max_num_seqs": 16,
                                  **knobs})


def test_the_pool_holds_more_blocks_at_fewer_bits():
    blocks = {b: build_engine(bits(b), target(cost()))[0].kv.pool.num_blocks for b in (16, 8, 4, 2)}
    assert blocks[16] < blocks[8] < blocks[4] < blocks[2]
    pool = int(0.9 * (1 << 30))  # device_memory_fraction of the target's free bytes
    assert blocks[4] == (pool - ring_bytes(bits(4), SPEC, 2)) // kv_block_bytes(SPEC, 16, 2, bits(4))
    assert blocks[4] > 2.5 * blocks[16]  # 4-bit codes plus 16-bit scales and zero points per group


def first_decode_s(config: KVConfig, step_cost: StepCostModel) -> float:
    m = simulate(config, [Request("a", list(range(3, 67)), 2)], target(step_cost))
    return m.e2e_s.max - m.ttft_s.max  # the one decode step after the 64-token prefill


def test_decode_step_time_falls_with_fewer_kv_bytes_when_bytes_cost_time():
    bandwidth_bound = cost(tokens=1e-3, kv=1e-9)
    times = {b: first_decode_s(bits(b), bandwidth_bound) for b in (16, 8, 4, 2)}
    assert times[16] > times[8] > times[4] > times[2]
    kv = kv_traffic(bits(4), SPEC, 2)  # the decode reads 65 tokens: the prompt's and its own
    assert times[4] == pytest.approx(1e-3 + 1e-9 * (65 * kv.bytes_per_token + kv.ring_bytes_per_seq))


def test_dequantization_can_cost_more_than_the_bytes_save():
    """A CPU that dequantizes the gathered context: quantized decode is slower; the append term counts too."""
    converting = cost(tokens=1e-3, kv=1e-10, decode_dequant=1e-7, quantize=1e-6)
    assert first_decode_s(bits(4), converting) > first_decode_s(bits(16), converting)
    kv = kv_traffic(bits(4), SPEC, 2)
    expected = 1e-3 + 1e-10 * (65 * kv.bytes_per_token + kv.ring_bytes_per_seq) \
        + 1e-7 * 65 * kv.quantized_elements_per_token + 1e-6 * kv.quantized_elements_per_token
    assert first_decode_s(bits(4), converting) == pytest.approx(expected)


def test_a_decode_step_that_completes_a_block_pays_for_packing_it():
    packing = cost(tokens=1e-3, packing=(5e-3, 1e-3))
    m = simulate(bits(4), [Request("a", list(range(3, 43)), 40)], target(packing))  # 40-token prompt, 40 decodes
    # the 40-token prefill completes 2 blocks; decodes reading slots 48 and 64 complete one each
    assert m.ttft_s.max == pytest.approx(40e-3 + 5e-3 + 2e-3)
    assert m.e2e_s.max - m.ttft_s.max == pytest.approx(39 * 1e-3 + 2 * 6e-3)
    assert m.tbt_s.max == pytest.approx(7e-3) and m.tbt_s.p50 == pytest.approx(1e-3)
    assert simulate(bits(16), [Request("a", list(range(3, 43)), 40)], target(packing)).tbt_s.max == pytest.approx(1e-3)


def test_a_full_precision_window_reads_more_ring_bytes():
    bandwidth_bound = cost(kv=1e-9)
    assert first_decode_s(bits(4, **{"bitwidth.full_precision_window": 128}), bandwidth_bound) \
        > first_decode_s(bits(4), bandwidth_bound)


@pytest.mark.parametrize("config", [bits(4), bits(8, **{"bitwidth.full_precision_window": 32}),
                                    bits(4, **{"eviction.policy": "h2o", "eviction.budget_tokens": 200})],
                         ids=["int4", "int8-window32", "int4-h2o"])
def test_fast_forward_equals_stepping_with_quantized_kv(config):
    w = load_workload("../shared/traces/azure_llm_2023_conv/AzureLLMInferenceTrace_conv.csv", first=150,
                      rate_scale=4.0)
    reqs = to_requests(w, vocab_size=SPEC.vocab_size)
    step_cost = cost(fixed=2e-3, seqs=1e-4, tokens=2e-5, kv=1e-12, samples=1e-5, decode_dequant=1e-10,
                     prefill_dequant=2e-10, quantize=1e-9, packing=(3e-3, 1e-3))  # (a run's steps that fill blocks)
    runs = [build_engine(config, target(step_cost, 256 << 20), fast_forward=ff) for ff in (True, False)]
    (fast, ex_fast), (slow, ex_slow) = runs
    fast.replay(reqs), slow.replay(reqs)
    assert ex_fast.num_steps == ex_slow.num_steps and ex_fast.num_fast_forwards > 0
    for a, b in zip(fast.records, slow.records):
        np.testing.assert_allclose(a.token_times_s, b.token_times_s, rtol=1e-9, atol=1e-9)


def test_the_profile_kv_bytes_must_match_the_models_layout():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FingerprintWarning)
        profile = load_profile(SHIPPED)
    assert target_from_profile(profile).kv_itemsize == 4  # float32 on the CPU
    with pytest.raises(ValueError, match="measure it again"):
        target_from_profile(dataclasses.replace(profile, kv_bytes_per_token=profile.kv_bytes_per_token // 2))


def test_four_bit_contexts_cost_their_unpacking_where_the_profile_measured_it():
    base = cost(decode_dequant=1e-9)
    unpacking = StepCostModel(base.coef, base.knee, (1e-9, 0.0, 0.0, 2e-9, 0.0))
    kv8, kv4 = (kv_traffic(KVConfig().with_knobs({"bitwidth.key_bits": b, "bitwidth.value_bits": b}), SPEC, 2)
                for b in (8, 4))
    for model in (base, unpacking):
        t8, t4 = (model.predict_s(decode_shape(8, 8 * 1024, kv)) for kv in (kv8, kv4))
        assert (t4 > t8) == (model is unpacking), (t8, t4)
