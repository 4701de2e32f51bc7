"""The simulator with KV tiers: the runtime's own tier accounting, transfers priced by the profile's
transfer fits, prefetch overlapped with the step."""
from dataclasses import dataclass

import pytest

from skistune.config import KVConfig
from skistune.profile.cost import FEATURES, StepCostModel
from skistune.profile.fit import FitQuality
from skistune.runtime.presets import PRESETS
from skistune.runtime.request import Request
from skistune.simulator import MODELED_KNOBS, SimTarget, build_engine, simulate

SPEC = PRESETS["smollm2-135m"]
BLOCK_BYTES = 2 * 30 * 3 * 64 * 2 * 16  # K and V, 30 layers, 3 KV heads, 64 dims, 2 bytes, 16 tokens


@dataclass(frozen=True)
class Link:
    latency_s: float
    bytes_per_s: float
    quality: FitQuality = FitQuality(r2=0.99, median_rel_error=0.01, max_rel_error=0.02, points=8)

    def time_s(self, nbytes: int, calls: int = 1) -> float:  # as `TransferFit`: latency per copy call
        return calls * self.latency_s + nbytes / self.bytes_per_s


# latency per copy call: a 16-bit transfer of this layout's 60 part tensors (keys and values of 30 layers) pays
# 10 µs besides its bytes
LINKS = {name: Link(1e-5 / 60, 1e10) for name in ("device_to_host", "host_to_device", "host_to_disk", "disk_to_host")}


def target():
    c = dict(fixed=1e-3, seqs=0.0, tokens=1e-5, tokens_past_knee=0.0, multi_token=0.0, decode_kv_bytes=0.0,
             prefill_kv_bytes=0.0, prefill_pairs=0.0, samples=0.0)
    return SimTarget(SPEC, StepCostModel(tuple(c[f] for f in FEATURES), 512), kv_itemsize=2,
                     device_free_bytes=1 << 30, transfers=LINKS)


def prefix_heavy(n=24, prefixes=4, spacing_s=0.5):
    """Requests one after another, cycling over a few 256-token prefixes (16 blocks each)."""
    base = [[1000 + 300 * p + i for i in range(256)] for p in range(prefixes)]
    return [Request(f"r{i}", base[i % prefixes] + [5 + i] * 16, 8, arrival_s=i * spacing_s) for i in range(n)]


def config(**knobs):
    return KVConfig().with_knobs({"offload.device_kv_bytes": 40 * BLOCK_BYTES, **knobs})


def test_host_tier_keeps_prefixes_the_device_cannot():
    reqs = prefix_heavy()
    without = simulate(config(), reqs, target())
    with_host = simulate(config(**{"offload.host_kv_bytes": 80 * BLOCK_BYTES}), reqs, target())
    assert without.tiers is None and without.prefix_hit_tokens == 0  # the device keeps two prefixes of four
    assert with_host.prefix_hit_tokens == 20 * 256  # every request after the first four hits its prefix
    assert with_host.tiers.promotions == 20 * 16 and with_host.tiers.transfer_s > 0
    assert with_host.tiers.peak_bytes["host"] <= 80 * BLOCK_BYTES
    assert with_host.e2e_s.mean < without.e2e_s.mean  # copying 16 blocks beats recomputing 256 tokens here


def test_transfers_add_time_and_prefetch_overlaps_them():
    reqs = prefix_heavy(spacing_s=0.0)  # all waiting at once: prefetch has sequences to work ahead for
    knobs = {"offload.host_kv_bytes": 80 * BLOCK_BYTES, "batching.max_num_seqs": 1}  # room to work ahead
    plain = simulate(config(**knobs), reqs, target())
    ahead = simulate(config(**knobs, **{"prefetch.enabled": True, "prefetch.depth": 16}), reqs, target())
    assert plain.tiers.stall_s == pytest.approx(plain.tiers.transfer_s)  # nothing overlaps without prefetch
    assert ahead.tiers.prefetched > 0 and ahead.tiers.prefetch_hit_rate > 0
    assert ahead.tiers.stall_s < plain.tiers.stall_s


def test_layer_wise_loading_overlaps_the_copies_with_the_step():
    reqs = prefix_heavy()
    knobs = {"offload.host_kv_bytes": 80 * BLOCK_BYTES}
    plain = simulate(config(**knobs), reqs, target())
    layered = simulate(config(**knobs, **{"prefetch.enabled": True, "prefetch.unit": "layers"}), reqs, target())
    assert layered.tiers.promotions == plain.tiers.promotions > 0  # the same copies...
    assert layered.tiers.transfer_s == pytest.approx(plain.tiers.transfer_s)
    assert layered.tiers.prefetched == 0  # (no blocks promoted ahead: `layers` loads within the step)
    # ... of which only the first layer's share stalls a step whose compute is longer than its copies
    assert layered.tiers.stall_s < plain.tiers.stall_s / 5  # (moves inside fast-forwarded runs stay whole)
    assert layered.ttft_s.mean < plain.ttft_s.mean


def test_swap_preemption_in_the_simulator_avoids_recompute():
    reqs = [Request(f"r{i}", [7 + i] * 200, 120) for i in range(6)]
    base = {"offload.device_kv_bytes": 64 * BLOCK_BYTES, "prefix_reuse.enabled": False}
    recompute = simulate(config(**base), reqs, target())
    swap = simulate(config(**base, **{"offload.host_kv_bytes": 64 * BLOCK_BYTES, "batching.preemption": "swap"}),
                    reqs, target())
    assert recompute.preemptions > 0 and swap.num_finished == 6
    assert swap.tiers.swapped_out == swap.preemptions == swap.tiers.swapped_in
    assert swap.tiers.peak_bytes["host"] <= 64 * BLOCK_BYTES


def test_quantized_and_evicting_configs_swap_too_and_a_swap_moves_the_ring_rows():
    reqs = [Request(f"r{i}", [7 + i] * 200, 120) for i in range(6)]
    pressure = {"prefix_reuse.enabled": False, "batching.max_num_seqs": 8,
                "offload.host_kv_bytes": 64 * BLOCK_BYTES, "batching.preemption": "swap"}
    from skistune.runtime.kv_layout import kv_block_bytes

    int4 = {"bitwidth.key_bits": 4, "bitwidth.value_bits": 4}
    rings = 8 * 16 * 30 * 2 * 3 * 64 * 2  # 8 sequences' rings of 16 tokens (see below)
    int4_pool = rings + 30 * kv_block_bytes(SPEC, 16, 2, config(**int4))  # 30 blocks at 4 bits
    # (evicting: prompts of 100 tokens that grow to the 200-token budget; two are admitted, and outgrow 20 blocks)
    grow = [Request(f"g{i}", [7 + i] * 100, 150) for i in range(6)]
    for knobs, pool, work in ((int4, int4_pool, reqs),
                              ({"eviction.policy": "h2o", "eviction.budget_tokens": 200}, 20 * BLOCK_BYTES, grow)):
        m = simulate(config(**pressure, **knobs, **{"offload.device_kv_bytes": pool}), work, target())
        assert m.preemptions > 0 and m.tiers.swapped_out == m.preemptions == m.tiers.swapped_in
        assert m.tiers.swap_fallbacks == 0 and m.num_finished == 6
    # every swap of 4-bit KV also moves the sequence's ring (its newest 16 tokens of 30 x 2 sides x 3 x 64 at
    # 2 bytes), priced on the same links as the blocks
    engine, executor = build_engine(config(**pressure, **int4, **{"offload.device_kv_bytes": int4_pool}), target())
    assert executor.ring_swap_bytes == 16 * 30 * 2 * 3 * 64 * 2

    class Out:
        swapped, swapped_in = [object()] * 2, [object()]

    # one copy call per ring (60: keys and values of 30 layers) for each of the three sequences
    assert executor.ring_swap_s(Out()) == pytest.approx(3 * LINKS["device_to_host"].time_s(16 * 30 * 2 * 3 * 64 * 2,
                                                                                            60))


def test_tier_knobs_are_modelled_and_need_transfer_fits():
    assert {"offload.host_kv_bytes", "batching.preemption", "prefetch.depth", "prefetch.unit"} <= MODELED_KNOBS
    bare = SimTarget(SPEC, target().step_cost, kv_itemsize=2, device_free_bytes=1 << 30)
    with pytest.raises(ValueError, match="transfer fit"):
        build_engine(config(**{"offload.host_kv_bytes": 80 * BLOCK_BYTES}), bare)


def test_a_poor_fit_of_a_link_the_tiers_cross_is_a_note():
    reqs = [Request("a", list(range(64)), 4)]
    poor = FitQuality(r2=0.5, median_rel_error=0.3, max_rel_error=2.0, points=8)
    links = {**LINKS, "host_to_disk": Link(1e-5, 1e10, poor)}
    t = SimTarget(target().spec, target().step_cost, kv_itemsize=2, device_free_bytes=1 << 30, transfers=links)
    host_only = simulate(KVConfig().with_knobs({"offload.host_kv_bytes": 64 << 20}), reqs, t)
    with_disk = simulate(KVConfig().with_knobs({"offload.host_kv_bytes": 64 << 20, "offload.disk_kv_bytes": 1 << 30}),
                         reqs, t)
    assert not any("poor fits" in n for n in host_only.notes)  # its tiers do not cross that link
    assert any("poor fits of the profile: host_to_disk (R² 0.50)" in n for n in with_disk.notes)
