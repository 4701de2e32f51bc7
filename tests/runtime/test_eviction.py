"""Eviction policies: one contract suite that every policy passes, hand-made attention patterns per policy,
the statistics they score with, and the per-layer budget schedules."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from skistune.config import EvictionConfig
from skistune.runtime.eviction import (POLICIES, EvictionStats, H2OPolicy, SnapKVPolicy, StreamingPolicy,
                                       TovaPolicy, layer_budgets, make_policy, protected_counts)

ALL = sorted(POLICIES)


def policy_of(name):
    return make_policy(EvictionConfig(policy=name, budget_tokens=8))


def scores_of(*rows):
    return torch.tensor(rows, dtype=torch.float32)


# ---- the contract every policy passes -----------------------------------------------------------------
@st.composite
def selections(draw):
    n_heads, kv_len = draw(st.integers(1, 3)), draw(st.integers(1, 48))
    values = draw(st.lists(st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0, 2.0]), min_size=n_heads * kv_len,
                           max_size=n_heads * kv_len))  # few values: many ties
    scores = torch.tensor(values).view(n_heads, kv_len)
    return scores, draw(st.integers(1, kv_len + 4)), draw(st.integers(0, 6)), draw(st.integers(0, 16))


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=100, deadline=None)
@given(case=selections())
def test_contract_every_policy(name, case):
    scores, keep, sinks, recent = case
    policy = policy_of(name)
    n_heads, kv_len = scores.shape
    kept = policy.select(scores, keep, sinks, recent)
    assert kept.dtype == torch.long and kept.shape == (n_heads, min(keep, kv_len))  # never above the budget
    n_sinks, n_recent = protected_counts(kv_len, keep, sinks, recent)
    for row in kept.tolist():
        assert row == sorted(set(row)) and all(0 <= i < kv_len for i in row)  # ascending, unique, in range
        assert set(range(n_sinks)) <= set(row)  # sinks (every policy keeps them)
        assert set(range(kv_len - n_recent, kv_len)) <= set(row)  # the recent window
    assert torch.equal(kept, policy.select(scores.clone(), keep, sinks, recent))  # deterministic
    for h in range(n_heads):  # each KV head chooses from its own scores alone
        assert torch.equal(kept[h], policy.select(scores[h:h + 1], keep, sinks, recent)[0])


@pytest.mark.parametrize("name", ALL)
def test_contract_budget_wins_over_the_protected_tokens(name):
    # 4 sinks + 6 recent do not fit in 7: the recent window is clipped first, then the sinks
    kept = policy_of(name).select(torch.zeros(1, 20), 7, 4, 6)
    assert kept.tolist() == [[0, 1, 2, 3, 17, 18, 19]]
    assert policy_of(name).select(torch.zeros(1, 20), 3, 4, 6).tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("name", ALL)
def test_contract_ties_keep_the_newer_tokens(name):
    kept = policy_of(name).select(torch.ones(2, 12), 5, 1, 1)
    assert kept.tolist() == [[0, 8, 9, 10, 11]] * 2


def test_make_policy_none_and_names():
    assert make_policy(EvictionConfig()) is None
    assert {n: type(policy_of(n)) for n in ALL} == {"h2o": H2OPolicy, "snapkv": SnapKVPolicy,
                                                   "streaming": StreamingPolicy, "tova": TovaPolicy}


# ---- one hand-made attention pattern per policy --------------------------------------------------------
def test_streaming_keeps_exactly_the_sinks_and_the_newest():
    heavy = scores_of([0, 0, 9, 9, 9, 0, 0, 0, 0, 0])  # scores are ignored
    assert StreamingPolicy().select(heavy, 5, 2, 1).tolist() == [[0, 1, 7, 8, 9]]
    assert not StreamingPolicy().needs_attention


def test_h2o_keeps_the_largest_accumulated_attention():
    stats = EvictionStats(H2OPolicy())
    # token 3 is attended to a little at every step, token 5 a lot once: 3 accumulates more
    for step in range(4):
        row = [0.1, 0, 0, 0.3, 0, 0.5 if step == 0 else 0.0, 0, 0]
        stats.observe(0, "s", scores_of(row), scores_of(row))
    acc = stats.scores("s", 0, 8, 1)
    assert acc[0, 3].item() == pytest.approx(1.2) and acc[0, 5].item() == pytest.approx(0.5)
    assert H2OPolicy().select(acc, 3, 1, 1).tolist() == [[0, 3, 7]]
    assert H2OPolicy().select(acc, 4, 1, 1).tolist() == [[0, 3, 5, 7]]


def test_tova_drops_the_lowest_current_attention():
    stats = EvictionStats(TovaPolicy())
    stats.observe(0, "s", scores_of([0, 0.9, 0, 0, 0, 0]), scores_of([0, 0.9, 0, 0, 0, 0]))  # old favourite
    current = scores_of([0.1, 0.01, 0.3, 0.05, 0.2, 0.34])
    stats.observe(0, "s", current, current)
    kept = TovaPolicy().select(stats.scores("s", 0, 6, 1), 5, 0, 0)
    assert kept.tolist() == [[0, 2, 3, 4, 5]]  # slot 1, lowest now, goes (h2o would keep it)
    assert H2OPolicy().select(scores_of([0.1, 0.91, 0.3, 0.05, 0.2, 0.34]), 5, 0, 0).tolist() == [[0, 1, 2, 4, 5]]


def test_snapkv_keeps_the_pooled_neighbours_of_the_observation_peak():
    window = torch.zeros(1, 40)
    window[0, 20] = 1.0  # the observation window's votes peak at slot 20
    window[0, 5] = 0.4  # a lesser peak
    kept = SnapKVPolicy().select(window, 2 + 5 + 2, 2, 2)
    assert kept.tolist() == [[0, 1, 18, 19, 20, 21, 22, 38, 39]]  # max pooling spreads slot 20 over 18..22
    kept = SnapKVPolicy().select(window, 2 + 10 + 2, 2, 2)
    assert kept.tolist() == [[0, 1, 3, 4, 5, 6, 7, 18, 19, 20, 21, 22, 38, 39]]


def test_snapkv_scores_only_the_prompts_last_queries():
    p = SnapKVPolicy()
    assert p.observation_window == 32
    assert p.scored_queries(100, 0, 64) == 0  # a chunk before the window
    assert p.scored_queries(100, 64, 36) == 32  # the prompt's last chunk: its last 32 queries
    assert p.scored_queries(100, 60, 20) == 12 and p.scored_queries(100, 80, 20) == 20  # the window spans two chunks
    assert p.scored_queries(100, 100, 1) == 0  # decode steps: the scores are frozen after the prompt
    assert H2OPolicy().scored_queries(100, 64, 36) == 36 and TovaPolicy().scored_queries(100, 64, 36) == 0


def test_each_kv_head_keeps_its_own_tokens():
    scores = scores_of([0, 5, 0, 0, 0, 0], [0, 0, 0, 5, 0, 0])
    for policy in (H2OPolicy(), TovaPolicy()):
        assert policy.select(scores, 2, 0, 1).tolist() == [[1, 5], [3, 5]]


# ---- statistics -------------------------------------------------------------------------------------
def test_stats_extend_with_zeros_compact_and_drop():
    stats = EvictionStats(H2OPolicy())
    stats.observe(0, "s", scores_of([1, 2], [3, 4]), scores_of([1, 2], [3, 4]))
    stats.observe(0, "s", scores_of([1, 1, 1], [1, 1, 1]), scores_of([1, 1, 1], [1, 1, 1]))  # a new token
    assert stats.scores("s", 0, 4, 2).tolist() == [[2, 3, 1, 0], [4, 5, 1, 0]]
    stats.compact("s", 0, torch.tensor([[0, 2], [1, 2]]), dst_first_slot=1)  # moved to slots 1..2
    assert stats.scores("s", 0, 3, 2).tolist() == [[0, 2, 1], [0, 5, 1]]
    with pytest.raises(ValueError, match="2 slots known|3 slots known"):
        stats.scores("s", 0, 2, 2)
    assert stats.scores("s", 1, 3, 2).tolist() == [[0, 0, 0]] * 2  # a layer never observed
    stats.drop("s")
    assert stats.scores("s", 0, 2, 2).tolist() == [[0, 0]] * 2


# ---- per-layer budgets ---------------------------------------------------------------------------------
def cfg(**kw):
    return EvictionConfig(**{"policy": "h2o", **kw})


def test_uniform_budgets_in_tokens_or_as_a_fraction_of_the_context():
    assert layer_budgets(cfg(budget_tokens=100), 4, 5000) == [100] * 4
    assert layer_budgets(cfg(budget_fraction=0.1), 3, 30) == [3] * 3  # not 4: 0.1 is read as 1/10
    assert layer_budgets(cfg(budget_fraction=0.25), 2, 1001) == [251] * 2  # rounded up


@pytest.mark.parametrize("budget,protected,n_layers", [(100, 68, 30), (500, 68, 30), (1000, 4, 7), (77, 10, 2)])
def test_pyramid_has_the_mean_budget_and_decreases_linearly(budget, protected, n_layers):
    b = layer_budgets(cfg(budget_tokens=budget, sink_tokens=4, recent_window=protected - 4,
                          layer_schedule="pyramid"), n_layers, 0)
    assert sum(b) == budget * n_layers  # the mean is exactly the budget
    assert all(x >= y for x, y in zip(b, b[1:])) and b[0] > b[-1]
    compressible = budget - protected
    assert b[0] - protected in (int(compressible * 39 / 20), int(compressible * 39 / 20) + 1)  # hi = 2c - c/20
    assert b[-1] - protected in (int(compressible / 20), int(compressible / 20) + 1)  # lo = c/20
    assert max(b) == b[0]  # the bottom layer sets the blocks a sequence holds


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(1, 5000), sinks=st.integers(0, 64), recent=st.integers(0, 512), n_layers=st.integers(1, 96))
def test_pyramid_mean_is_exact_and_budgets_never_increase(budget, sinks, recent, n_layers):
    b = layer_budgets(cfg(budget_tokens=budget, sink_tokens=sinks, recent_window=recent, layer_schedule="pyramid"),
                      n_layers, 0)
    assert len(b) == n_layers and sum(b) == budget * n_layers
    assert all(x >= y for x, y in zip(b, b[1:])) and min(b) >= min(budget, sinks + recent)


def test_pyramid_is_uniform_when_nothing_can_move():
    assert layer_budgets(cfg(budget_tokens=60, sink_tokens=4, recent_window=64, layer_schedule="pyramid"), 5, 0) == [60] * 5
    assert layer_budgets(cfg(budget_tokens=200, layer_schedule="pyramid"), 1, 0) == [200]
    assert layer_budgets(cfg(budget_tokens=200, sink_tokens=4, recent_window=16, layer_schedule="pyramid"), 3, 0) == \
        [4 + 16 + 351, 4 + 16 + 180, 4 + 16 + 9]  # c = 180: 351, 180, 9
