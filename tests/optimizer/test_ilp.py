"""The PuLP programs against brute force and hand-computed optima."""
import itertools

import pytest

from skistune.config import KVConfig
from skistune.ilp import (
    DEFAULT_ALLOWED,
    SolverStats,
    solve_layer_bits,
    solve_tier_fractions,
)

GB = 1e9
# bytes one token costs in one layer: proportional to key_bits + value_bits (head_dim 64, 2 heads)
BYTES = {pair: (pair[0] + pair[1]) * 64 * 2 / 8 for pair in DEFAULT_ALLOWED}
# layer 0 is fragile, layer 2 robust; the odd digits keep every total distinct, so optima are unique
LOSS_PER_BIT_DROP = {0: 0.0731, 1: 0.0217, 2: 0.0043}


def _sensitivity(n_layers=3):
    return {(layer, k, v): LOSS_PER_BIT_DROP[layer] * ((16 - k) + 1.37 * (16 - v)) ** 1.2
            for layer in range(n_layers) for k, v in DEFAULT_ALLOWED}


def _brute_force(sensitivity, budget, n_layers=3):
    best = None
    for combo in itertools.product(DEFAULT_ALLOWED, repeat=n_layers):
        loss = sum(sensitivity[(layer, *pair)] for layer, pair in enumerate(combo))
        if loss <= budget:
            key = (sum(BYTES[p] for p in combo), loss)
            if best is None or key < best[0]:
                best = (key, combo)
    return best


@pytest.mark.parametrize("budget", [0.0, 0.3, 1.0, 2.5, 6.0, 15.0, 40.0])
def test_layer_bits_matches_brute_force(budget):
    sensitivity = _sensitivity()
    (want_bytes, want_loss), want_bits = _brute_force(sensitivity, budget)
    got = solve_layer_bits(sensitivity, BYTES, budget, n_layers=3)
    assert got.status == "optimal" and got.feasible
    assert got.layer_bits == want_bits
    assert got.kv_bytes_per_token == pytest.approx(want_bytes)
    assert got.predicted_loss == pytest.approx(want_loss) and got.predicted_loss <= budget + 1e-9


def test_layer_bits_spends_the_budget_on_the_robust_layer():
    # two layers, only (16,16) and (2,2): the budget allows quantizing exactly one of them
    sensitivity = {(0, 2, 2): 5.0, (1, 2, 2): 1.0}
    got = solve_layer_bits(sensitivity, BYTES, 1.5, n_layers=2, allowed=[(16, 16), (2, 2)])
    assert got.layer_bits == ((16, 16), (2, 2))
    assert got.kv_bytes_per_token == BYTES[16, 16] + BYTES[2, 2] and got.predicted_loss == 1.0
    # the solution is a valid per-layer override of the config
    assert KVConfig().with_knobs({"bitwidth.layer_bits": got.layer_bits}).bitwidth.bits_for_layer(1) == (2, 2)


def test_layer_bits_breaks_byte_ties_by_loss():
    # (8, 4) and (4, 8) cost the same bytes; the cheaper-in-loss one must win
    sensitivity = {(0, 8, 4): 0.2, (0, 4, 8): 0.1}
    got = solve_layer_bits(sensitivity, {(16, 16): 32, (8, 4): 12, (4, 8): 12}, 1.0, n_layers=1,
                           allowed=[(16, 16), (8, 4), (4, 8)])
    assert got.layer_bits == ((4, 8),) and got.predicted_loss == pytest.approx(0.1)


def test_layer_bits_infeasible_budget_is_a_result_and_counted():
    stats = SolverStats()
    got = solve_layer_bits(_sensitivity(), BYTES, -0.1, n_layers=3, stats=stats)
    assert got.status == "infeasible" and not got.feasible
    assert got.layer_bits is None and got.kv_bytes_per_token is None and got.predicted_loss is None
    # without full precision allowed, even the least lossy choice exceeds a small budget
    got = solve_layer_bits(_sensitivity(), BYTES, 0.01, n_layers=3, allowed=[(8, 8), (4, 4)], stats=stats)
    assert got.status == "infeasible"
    solve_layer_bits(_sensitivity(), BYTES, 5.0, n_layers=3, stats=stats)
    assert stats.calls == 3 and stats.by_status == {"infeasible": 2, "optimal": 1}
    assert stats.total_s > 0 and stats.mean_s == pytest.approx(stats.total_s / 3) and stats.max_s <= stats.total_s
    assert set(stats.as_dict()) == {"calls", "total_s", "mean_s", "max_s", "by_status"}


def test_layer_bits_rejects_missing_inputs():
    with pytest.raises(ValueError, match=r"sensitivity: no loss .*\(1, 8, 8\)"):
        solve_layer_bits({(0, 8, 8): 0.1}, BYTES, 1.0, n_layers=2, allowed=[(16, 16), (8, 8)])
    with pytest.raises(ValueError, match=r"bytes_per_token: no size for pairs \[\(4, 2\)\]"):
        solve_layer_bits(_sensitivity(), {(16, 16): 1}, 1.0, n_layers=1, allowed=[(16, 16), (4, 2)])
    with pytest.raises(ValueError, match="n_layers"):
        solve_layer_bits({}, BYTES, 1.0, n_layers=0)


# ---- tiers ----------------------------------------------------------------------------------------
def test_tiers_spill_to_host_without_overlap():
    # 100 GB of KV, 60 GB fit on the device: 40 GB read at 20 GB/s = 2 s, after 1 s of compute
    got = solve_tier_fractions(100 * GB, {"device": 60 * GB, "host": 200 * GB}, {"device": 1e15, "host": 20 * GB},
                               compute_s=1.0, overlap=False)
    assert got.status == "optimal"
    assert got.fractions == pytest.approx({"device": 0.6, "host": 0.4})
    assert got.transfer_s == pytest.approx(2.0) and got.step_s == pytest.approx(3.0)


def test_tiers_spill_to_host_with_overlap():
    got = solve_tier_fractions(100 * GB, {"device": 60 * GB, "host": 200 * GB}, {"host": 20 * GB},
                               compute_s=1.0, overlap=True)
    assert got.fractions == pytest.approx({"device": 0.6, "host": 0.4})
    assert got.step_s == pytest.approx(2.0)  # max(1 s compute, 2 s transfer)


def test_tiers_fill_faster_tiers_first_then_disk():
    # device 50, host 30 at 25 GB/s, disk the rest at 5 GB/s: 1.2 s + 4 s of reads
    caps = {"device": 50 * GB, "host": 30 * GB, "disk": 1000 * GB}
    bw = {"host": 25 * GB, "disk": 5 * GB}
    got = solve_tier_fractions(100 * GB, caps, bw, compute_s=0.5, overlap=False)
    assert got.fractions == pytest.approx({"device": 0.5, "host": 0.3, "disk": 0.2})
    assert got.step_s == pytest.approx(0.5 + 5.2)
    assert solve_tier_fractions(100 * GB, caps, bw, compute_s=0.5, overlap=True).step_s == pytest.approx(5.2)


def test_tiers_hidden_transfers_still_prefer_the_device():
    # any split with transfer <= compute gives the same step; the device must still be filled first
    got = solve_tier_fractions(100 * GB, {"device": 90 * GB, "host": 200 * GB}, {"host": 100 * GB},
                               compute_s=1.0, overlap=True)
    assert got.step_s == pytest.approx(1.0)
    assert got.fractions == pytest.approx({"device": 0.9, "host": 0.1})
    fits = solve_tier_fractions(10 * GB, {"device": 90 * GB, "host": 200 * GB}, {"host": 1 * GB}, 0.25, False)
    assert fits.fractions == pytest.approx({"device": 1.0, "host": 0.0}) and fits.step_s == pytest.approx(0.25)


def test_tiers_infeasible_and_bad_inputs():
    stats = SolverStats()
    got = solve_tier_fractions(100 * GB, {"device": 10 * GB, "host": 20 * GB}, {"host": GB}, 1.0, True, stats=stats)
    assert got.status == "infeasible" and got.fractions is None and got.step_s is None
    assert stats.calls == 1
    with pytest.raises(ValueError, match="no 'device' tier"):
        solve_tier_fractions(GB, {"gpu": GB}, {}, 1.0, True)
    with pytest.raises(ValueError, match=r"read_bytes_per_s\['host'\]"):
        solve_tier_fractions(GB, {"device": GB, "host": GB}, {}, 1.0, True)
    gpu = solve_tier_fractions(GB, {"gpu": GB}, {}, 1.0, True, device_tier="gpu")
    assert gpu.fractions == pytest.approx({"gpu": 1.0})
