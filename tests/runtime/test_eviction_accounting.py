"""Eviction through the torch-free scheduler and block accounting: when sequences are compacted and to how
much, copy-on-write of shared and cached blocks, no leaks, the simulator's memory and fast-forward. A small
reference executor stores each token's position as its "KV" (per layer and KV head) and runs the compaction
contract exactly as the model runner must, checking at every step what attention would read."""
from pathlib import Path

import numpy as np
import pytest
import torch

from skistune.config import KVConfig
from skistune.profile.cost import FEATURES, StepCostModel, step_shape
from skistune.runtime.block_manager import KVCacheManager, TokenList
from skistune.runtime.engine import Engine, VirtualClock
from skistune.runtime.eviction import SNAPKV_WINDOW, EvictionStats, kept_slots, make_policy
from skistune.runtime.request import Request
from skistune.runtime.presets import PRESETS
from skistune.simulator import SimTarget, build_engine
from skistune.workloads import load_workload, to_requests

STEP_S = 0.01
# the public trace sample next to the repository (as tests/workloads/workload_paths.py finds it)
AZURE_CONV = (Path(__file__).resolve().parents[2] / ".." / "shared" / "traces" / "azure_llm_2023_conv"
              / "AzureLLMInferenceTrace_conv.csv")
N_LAYERS, N_KV_HEADS, BLOCK = 3, 2, 4


def fake_attention(positions, layer, head):
    """Deterministic attention weights over slots holding ``positions`` (-1: an empty slot, weight 0)."""
    w = ((positions * 2654435761 + layer * 97 + head * 31) % 1000 + 1).float()
    w = torch.where(positions >= 0, w, torch.zeros_like(w))
    return w / w.sum()


class SlotExecutor:
    """The runner's side of eviction on a paged store whose "KV" is the token position: copies before the
    forward pass, statistics during it, selection and moves after it. Checks every sequence's visible slots."""

    def __init__(self, clock, num_blocks, config):
        self.clock = clock
        self.config = config.eviction
        self.policy = make_policy(self.config)
        self.stats = EvictionStats(self.policy) if self.policy is not None else None
        self.store = torch.full((N_LAYERS, num_blocks + 1, BLOCK, N_KV_HEADS), -1, dtype=torch.long)
        self.steps, self.compactions, self.max_blocks = [], [], {}

    def slots(self, kv, seq_id, begin, end):
        table = torch.tensor(kv.block_table(seq_id))
        idx = torch.arange(begin, end)
        return table[idx // BLOCK], idx % BLOCK

    def execute(self, out, kv):
        self.steps.append([(s.seq.seq_id, s.start, s.num_new_tokens, s.kv_start) for s in out.scheduled])
        for seq_id in [s.seq_id for s in out.preempted] + out.finished_seq_ids:
            if self.stats is not None:
                self.stats.drop(seq_id)
        for c in out.compactions:  # 1. copy-on-write copies, before the forward pass
            for src, dst in c.copies:
                self.store[:, dst] = self.store[:, src]
        for s in out.scheduled:  # 2. the forward pass: write the new tokens' KV, attend, observe
            self.max_blocks[s.seq.seq_id] = max(self.max_blocks.get(s.seq.seq_id, 0),
                                                len(kv.block_table(s.seq.seq_id)))
            blocks, offsets = self.slots(kv, s.seq.seq_id, s.kv_start, s.kv_start + s.num_new_tokens)
            self.store[:, blocks, offsets] = torch.arange(s.start, s.start + s.num_new_tokens)[:, None]
            self.attend(kv, s)
        for c in out.compactions:  # 3. after the forward pass: keep the prompt's blocks for the prefix cache,
            for src, dst in c.prefix_copies:  # then select and move, per layer and KV head
                self.store[:, dst] = self.store[:, src]
            self.compactions.append(c)
            self.compact(kv, c)
        self.clock.advance(STEP_S)
        return {s.seq.seq_id: (s.seq.token_ids[-1] + 1) % 1000 for s in out.scheduled if s.samples}

    def attend(self, kv, s):
        kv_len, end = s.kv_start + s.num_new_tokens, s.start + s.num_new_tokens
        blocks, offsets = self.slots(kv, s.seq.seq_id, 0, kv_len)
        for layer in range(N_LAYERS):
            first = s.seq.kv_first_slot[layer] if s.seq.kv_first_slot else 0
            visible = self.store[layer, blocks, offsets].clone()  # [kv_len, heads]
            visible[:first] = -1  # the slots a layer leaves empty are masked
            for h in range(N_KV_HEADS):
                pos = visible[first:, h]
                assert pos.tolist() == sorted(set(pos.tolist())) and pos[-1] == end - 1, (s, layer, h, pos)
                if s.kv_start == s.start:  # nothing evicted: slot i holds position i (prefix hits included)
                    assert pos.tolist() == list(range(end))
                if self.policy is not None:  # the sinks and the newest tokens are always there
                    sinks = min(self.config.sink_tokens, end)
                    assert pos[:sinks].tolist() == list(range(sinks))
                    recent = min(self.config.recent_window, len(pos) - sinks, s.num_new_tokens + 1)
                    assert pos[len(pos) - recent:].tolist() == list(range(end - recent, end))
            if self.stats is not None and self.policy.needs_attention:
                probs = torch.stack([fake_attention(visible[:, h], layer, h) for h in range(N_KV_HEADS)])
                n = self.policy.scored_queries(s.seq.num_prefill_tokens, s.start, s.num_new_tokens)
                self.stats.observe(layer, s.seq.seq_id, probs * n, probs)

    def compact(self, kv, c):
        blocks, offsets = self.slots(kv, c.seq_id, 0, c.kv_len)
        for layer in range(N_LAYERS):
            kept = kept_slots(self.policy, self.stats, c, layer, N_KV_HEADS, self.config.sink_tokens,
                              self.config.recent_window)  # [heads, keep]
            assert kept.shape == (N_KV_HEADS, c.keep_per_layer[layer])
            old = self.store[layer, blocks, offsets]  # [kv_len, heads]: read everything before writing
            moved = old.gather(0, kept.T)  # [keep, heads]
            dst_b, dst_o = self.slots(kv, c.seq_id, c.dst_first_slot[layer], c.new_num_kv_tokens)
            self.store[layer, dst_b, dst_o] = moved
            self.stats.compact(c.seq_id, layer, kept, c.dst_first_slot[layer])


def make_engine(num_blocks=64, **knobs):
    cfg = KVConfig().with_knobs({"prefix_reuse.block_size": BLOCK, **knobs})
    clock = VirtualClock()
    ex = SlotExecutor(clock, num_blocks, cfg)
    eng = Engine(cfg, num_blocks=num_blocks, block_bytes=100, max_context=4096, executor=ex, clock=clock,
                 n_layers=N_LAYERS)
    return eng, ex


def req(rid, prompt_len, out_len, base=0):
    return Request(rid, list(range(base, base + prompt_len)), out_len)


def h2o(budget=16, **more):
    return {"eviction.policy": "h2o", "eviction.budget_tokens": budget, "eviction.sink_tokens": 2,
            "eviction.recent_window": 4, **more}


def tova(budget=16, **more):
    """`h2o` knobs under TOVA, which takes prefix hits (H2O takes none: `EvictionBudget.max_hit_tokens`): for
    the tests of blocks shared between a compacted sequence and the prefix cache."""
    return h2o(budget, **{"eviction.policy": "tova", **more})


POLICY_KNOBS = [h2o(), h2o(**{"eviction.policy": "tova"}), h2o(**{"eviction.policy": "streaming"}),
                h2o(**{"eviction.policy": "snapkv"}), h2o(20, **{"eviction.layer_schedule": "pyramid"}),
                {**h2o(), "eviction.budget_tokens": None, "eviction.budget_fraction": 0.4}]


@pytest.mark.parametrize("knobs", POLICY_KNOBS, ids=["h2o", "tova", "streaming", "snapkv", "h2o-pyramid", "h2o-fraction"])
def test_every_policy_serves_a_mixed_workload_within_budget_and_frees_every_block(knobs):
    eng, ex = make_engine(**knobs, **{"batching.max_num_batched_tokens": 24, "batching.chunk_size": 8})
    for i in range(6):  # shared prefixes (prompts 0..), distinct tails, outputs long enough to compact
        eng.add_request(req(f"r{i}", 12 + 5 * i, 25 + 3 * i))
    eng.run_until_done()
    assert all(len(r.output_token_ids) == 25 + 3 * i for i, r in enumerate(eng.records))
    assert ex.compactions and eng.kv.pool.num_free() == eng.kv.pool.num_blocks  # no block leaks
    cap = max(eng.scheduler.eviction.budgets(100))
    for c in ex.compactions:
        assert c.new_num_kv_tokens == max(c.keep_per_layer) <= cap
    hits = [r.prefix_hit_tokens for r in eng.records]
    policy = knobs["eviction.policy"]
    if policy == "h2o":  # its scores need every prompt query: it takes no hit (`EvictionBudget.max_hit_tokens`)
        assert sum(hits) == 0
    elif policy == "snapkv":  # hits leave its observation window to compute
        assert all(h <= max(0, 12 + 5 * i - SNAPKV_WINDOW) for i, h in enumerate(hits))
    else:
        assert sum(hits) > 0  # the prompts' prefixes stay cached through their compactions
    if knobs["eviction.policy"] != "snapkv":  # snapkv keeps whole prompts until their end
        # the budget, less than a block of hysteresis, one chunk; or a prefix hit (held until the compaction
        # after its first chunk) and one chunk
        peak_slots = max(cap + BLOCK - 1, max(hits)) + 8
        assert max(ex.max_blocks.values()) <= eng.kv.blocks_for(peak_slots)


def test_same_workload_without_eviction_never_compacts_and_reads_every_token():
    eng, ex = make_engine(**{"batching.max_num_batched_tokens": 24, "batching.chunk_size": 8})
    for i in range(4):
        eng.add_request(req(f"r{i}", 12 + 5 * i, 20))
    eng.run_until_done()
    assert not ex.compactions and eng.scheduler.eviction is None
    assert all(kv_start == start for step in ex.steps for _, start, _, kv_start in step)
    assert eng.kv.pool.num_free() == 64


def test_compaction_keeps_whole_blocks_of_hysteresis_and_exact_keep_counts():
    eng, ex = make_engine(**h2o(16))
    eng.add_request(req("a", 10, 30, base=500))  # no prefix sharing
    eng.run_until_done()
    # slots: 10 after prefill, +1 per decode; due at 16 + 4 = 20 slots, back to 16: every 4 steps
    assert [c.kv_len for c in ex.compactions] == [20] * len(ex.compactions)
    assert all(c.new_num_kv_tokens == 16 and c.keep_per_layer == (16,) * N_LAYERS for c in ex.compactions)
    assert len(ex.compactions) == (10 + 29 - 20) // 4 + 1  # tokens 20, 24, ..., 36 (39 computed, the last finishes)
    assert ex.steps[-1] == [("a", 38, 1, 16 + (38 - 36))]  # KV slots after the last compaction, true position
    assert ex.max_blocks["a"] == 5


def test_pyramid_layers_leave_their_first_slots_empty():
    eng, ex = make_engine(**h2o(20, **{"eviction.layer_schedule": "pyramid"}))
    eng.add_request(req("a", 50, 6, base=500))
    eng.run_until_done()
    budgets = layer_budgets_of(eng, 50)
    assert budgets == (6 + 28, 6 + 14, 6 + 0)  # c = 14: 27.3, 14, 0.7 rounded down, the lost 1 to layer 0
    first = ex.compactions[0]
    assert first.keep_per_layer == budgets and first.new_num_kv_tokens == max(budgets)
    assert first.dst_first_slot == tuple(max(budgets) - b for b in budgets) and budgets[0] > budgets[-1]


def layer_budgets_of(eng, context):
    return eng.scheduler.eviction.budgets(context)


def test_snapkv_compacts_once_at_the_end_of_the_prompt_then_by_hysteresis():
    eng, ex = make_engine(**h2o(16, **{"eviction.policy": "snapkv"}),
                          **{"batching.max_num_batched_tokens": 8, "batching.chunk_size": 8})
    eng.add_request(req("a", 40, 12, base=500))
    eng.run_until_done()
    # chunks of 8 up to 40 tokens: no compaction while the prompt is computed, one when it ends
    assert ex.max_blocks["a"] == 10 and ex.compactions[0].kv_len == 40
    assert [c.kv_len for c in ex.compactions] == [40, 20, 20]  # then 16 + 4 slots, twice in 11 decodes


def test_copy_on_write_protects_a_running_sequences_shared_prefix():
    eng, ex = make_engine(**tova(16))
    eng.add_request(req("a", 12, 6))  # 12 + 6 tokens never reach 16 + 4 slots: never compacted
    eng.step()  # a's prompt fills blocks 1, 2, 3, now cached
    eng.add_request(req("b", 32, 4))  # the same first 12 tokens: hits a's 3 blocks, gets 4..8
    eng.step()  # b's prompt: 32 slots, due, compacted to 16 (blocks 0..3 of its table kept)
    c = ex.compactions[0]
    assert c.seq_id == "b" and eng.records[1].prefix_hit_tokens == 12
    assert [src for src, _ in c.copies] == [1, 2, 3]  # a's blocks, copied instead of rewritten in place
    assert eng.kv.block_table("b") == [10, 11, 12, 5]  # copies, then its own block and eng.kv.block_table("a") == [1, 2, 3, 4]
    assert [eng.kv.pool.ref_cnt[b] for b in (1, 2, 3)] == [1, 1, 1]
    eng.run_until_done()  # (SlotExecutor checks at every step that a's slot i still holds position i)
    assert eng.kv.pool.num_free() == 64


def test_cached_blocks_are_copied_so_the_prefix_cache_stays_valid():
    eng, ex = make_engine(**tova(16), **{"batching.max_num_batched_tokens": 8, "batching.chunk_size": 8})
    eng.add_request(req("a", 32, 3))
    eng.run_until_done()
    # chunks of 8: 16 tokens computed and cached in 4 blocks, the third chunk takes a to 24 slots: due.
    c = ex.compactions[0]  # the cached blocks it keeps are copied, the cache keeps the originals
    assert c.kv_len == 24 and c.new_num_kv_tokens == 16 and [src for src, _ in c.copies] == [1, 2, 3, 4]
    eng.add_request(req("b", 32, 2))  # the same prompt: hits the original (uncompacted) blocks
    eng.run_until_done()
    # ... and the third chunk's two blocks: past the 16 kept slots, the compaction left them as they were
    assert eng.records[1].prefix_hit_tokens == 24
    assert eng.kv.pool.num_free() == 64  # (SlotExecutor checked b's slot i holds position i)


@pytest.mark.parametrize("budget", [16, 28])
def test_a_prompt_compacted_at_the_end_of_its_prefill_stays_cached(budget):
    """A prompt of one chunk, compacted after it: its blocks were not cached when the compaction was planned.
    Those the compaction rewrites are copied first (then cached as they were), those past the kept slots are
    cached in place; the same prompt again hits all its full blocks, with the right KV in each slot."""
    eng, ex = make_engine(**tova(budget), **{"batching.chunk_size": 64})
    eng.add_request(req("a", 33, 3))
    eng.step()
    c = ex.compactions[0]
    kept_blocks = eng.kv.blocks_for(c.new_num_kv_tokens)
    assert c.kv_len == 33 and [src for src, _ in c.prefix_copies] == list(range(1, kept_blocks + 1))
    assert eng.kv.peak_used_blocks == 9 + kept_blocks  # 9 blocks of the prompt and the copies, for a step
    eng.run_until_done()
    assert eng.kv.pool.num_free() == 64
    eng.add_request(req("b", 33, 2))  # the same prompt: 8 full blocks (32 tokens), the last token computed
    eng.run_until_done()  # (SlotExecutor checks that b's slot i holds position i)
    assert eng.records[1].prefix_hit_tokens == 32 and eng.kv.pool.num_free() == 64


def test_a_prefix_hit_is_cut_to_what_fits_the_pool_beside_a_chunk():
    """7 blocks of 4 slots admit a 40-token prompt under a budget of 4 (4 + 3 + a 16-token chunk = 6 blocks).
    A first request with the same first 16 tokens leaves its first chunk cached (4 blocks); the 40-token
    prompt would hold those 4 and 4 more for its next chunk, 8 > 7, and could never be admitted: it takes
    3 of them."""
    eng, ex = make_engine(num_blocks=7, **tova(4, **{"eviction.sink_tokens": 1, "eviction.recent_window": 2}),
                          **{"batching.chunk_size": 16, "batching.max_num_batched_tokens": 16})
    eng.add_request(req("a", 17, 1))
    eng.run_until_done()
    eng.add_request(req("b", 40, 3))
    eng.run_until_done()
    assert eng.records[1].prefix_hit_tokens == 12 and len(eng.records[1].output_token_ids) == 3
    assert eng.kv.pool.num_free() == 7


def test_without_free_blocks_for_the_copies_the_prefix_is_not_cached():
    eng, ex = make_engine(num_blocks=9, **tova(16), **{"batching.chunk_size": 64})  # the prompt fills the pool
    eng.add_request(req("a", 33, 3))
    eng.run_until_done()
    assert ex.compactions[0].prefix_copies == () and eng.kv.pool.num_free() == 9
    eng.add_request(req("b", 33, 2))
    eng.run_until_done()
    assert eng.records[1].prefix_hit_tokens == 0


def test_preemption_drops_the_evicted_state_and_recomputes_from_scratch():
    # prompts of 20 are compacted to 14 slots at once, then hold 4 or 5 blocks: three do not fit in 13
    eng, ex = make_engine(num_blocks=13, **h2o(14), **{"prefix_reuse.enabled": False})
    preempted_after_compaction = []
    original = eng.scheduler._preempt

    def preempt(seq, out):
        if seq.seq_id in eng.kv.num_evicted:
            preempted_after_compaction.append(seq.seq_id)
        return original(seq, out)

    eng.scheduler._preempt = preempt
    for i in range(3):
        eng.add_request(req(f"r{i}", 20, 30, base=100 * i))
    eng.run_until_done()
    assert preempted_after_compaction and eng.kv.pool.num_free() == 13 and eng.kv.num_evicted == {}
    # readmitted, a sequence recomputes all its tokens from slot 0 (SlotExecutor checked that slot i holds
    # position i), is compacted again at once, and goes on from the budget's slots
    again = preempted_after_compaction[0]
    steps = [(start, n, kv_start) for step in ex.steps for sid, start, n, kv_start in step if sid == again]
    restart = max(i for i, (start, _, _) in enumerate(steps) if start == 0)
    assert restart > 0 and steps[restart][0] == steps[restart][2] == 0 and steps[restart][1] > 20
    assert steps[restart + 1] == (steps[restart][1], 1, 14)
    assert all(len(r.output_token_ids) == 30 for r in eng.records)


def test_finished_sequences_are_reported_to_the_executor_once():
    eng, _ = make_engine(**h2o(16))
    eng.add_request(req("a", 8, 1))
    eng.add_request(req("b", 8, 3, base=100))
    outs = []
    while eng.scheduler.has_work():
        out = eng.scheduler.schedule()
        outs.append(out)
        eng.scheduler.update(out, eng.executor.execute(out, eng.kv), eng.clock.now())
    assert [o.finished_seq_ids for o in outs] == [[], ["a"], []]


# ---- block manager pieces -----------------------------------------------------------------------------
class Seq(TokenList):
    def __init__(self, seq_id, n):
        self.seq_id, self.token_ids, self.num_computed_tokens = seq_id, list(range(n)), 0


def computed(kv, seq, hits=()):
    kv.allocate_slots(seq, len(seq.token_ids) - len(hits) * kv.block_size, hits)
    seq.num_computed_tokens = len(seq.token_ids)
    kv.cache_full_blocks(seq)


def test_shared_blocks_wait_for_free_blocks_and_cached_ones_leave_the_cache_in_place():
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_prefix_reuse=True)
    a, b = Seq("a", 9), Seq("b", 9)
    computed(kv, a)  # blocks 1, 2, 3 (1 and 2 full and cached)
    computed(kv, b, kv.get_computed_blocks(b))  # shares 1, 2; gets 4
    assert kv.block_table("b") == [1, 2, 4] and kv.pool.num_free() == 1
    assert kv.prepare_compaction(b, 8) is None  # two shared blocks to copy, one free block: wait
    assert kv.block_table("b") == [1, 2, 4] and kv.pool.num_free() == 1  # nothing changed
    kv.free(a)  # a's blocks 1, 2 are now b's alone (and still cached); 2 blocks free
    assert kv.pool.num_free() == 2
    c = Seq("c", 5)
    computed(kv, c)  # takes 3 and 5: none free
    assert kv.prepare_compaction(b, 8) == []  # no room to copy: blocks 1 and 2 leave the cache instead
    assert kv.pool.lookup(kv.hashes["b"][0]) is None and kv.block_table("b") == [1, 2, 4]
    kv.truncate(b, 6)
    assert kv.block_table("b") == [1, 2] and kv.num_kv_tokens(b) == 6 and kv.pool.num_free() == 1
    b.token_ids.extend([7, 7, 7])
    kv.allocate_slots(b, 3)
    b.num_computed_tokens = 12
    kv.cache_full_blocks(b)  # compacted: never cached again
    assert kv.block_table("b") == [1, 2, 4] and kv.pool.block_hash[4] is None
    kv.free(b)
    kv.free(c)
    assert kv.pool.num_free() == 5 and kv.num_evicted == {}


# ---- the simulator ------------------------------------------------------------------------------------
SPEC = PRESETS["smollm2-135m"]


def sim_run(knobs, reqs, ff, compaction_coef=(3e-3, 2e-6)):
    """The simulator with the step costs of tests/simulator's fast-forward test, and compactions that cost
    (per compaction and per slot: a fast-forwarded run must charge them to the steps they follow)."""
    coef = dict(fixed=2e-3, seqs=1e-4, tokens=2e-5, tokens_past_knee=0.0, multi_token=0.0, decode_kv_bytes=1e-12,
                prefill_kv_bytes=0.0, prefill_pairs=0.0, samples=1e-5)
    cost = StepCostModel(tuple(coef[f] for f in FEATURES), 512, evict_coef=compaction_coef)
    target = SimTarget(SPEC, cost, kv_itemsize=2, device_free_bytes=512 << 20)
    engine, executor = build_engine(KVConfig().with_knobs(knobs), target, fast_forward=ff)
    return engine.replay(reqs), engine, executor


def azure(n):
    w = load_workload(str(AZURE_CONV), first=n, rate_scale=4.0)
    return to_requests(w, vocab_size=SPEC.vocab_size)


@pytest.mark.parametrize("knobs", [
    {"eviction.policy": "h2o", "eviction.budget_tokens": 64},
    {"eviction.policy": "snapkv", "eviction.budget_fraction": 0.3, "eviction.layer_schedule": "pyramid"},
    {"eviction.policy": "tova", "eviction.budget_tokens": 100, "prefix_reuse.enabled": False},
    {"eviction.policy": "streaming", "eviction.budget_tokens": 40, "offload.device_kv_bytes": 16 << 20},
], ids=["h2o", "snapkv-pyramid-fraction", "tova-no-prefix", "streaming-small-pool"])
def test_simulator_fast_forward_with_eviction_equals_stepping(knobs):
    reqs = azure(300)
    fast, eng_fast, ex_fast = sim_run(knobs, reqs, ff=True)
    slow, eng_slow, ex_slow = sim_run(knobs, reqs, ff=False)
    assert ex_fast.num_steps == ex_slow.num_steps and ex_fast.num_fast_forwards > 0
    for a, b in zip(eng_fast.records, eng_slow.records):
        np.testing.assert_allclose(a.token_times_s, b.token_times_s, rtol=1e-9, atol=1e-9)
        assert a.preemptions == b.preemptions and a.prefix_hit_tokens == b.prefix_hit_tokens
        assert a.output_token_ids == b.output_token_ids
    assert fast.kv_peak_bytes == slow.kv_peak_bytes and fast.preemptions == slow.preemptions
    assert eng_fast.kv.pool.num_free() == eng_fast.kv.pool.num_blocks


def test_simulator_sees_the_memory_and_the_kv_read_fall():
    reqs = [Request("long", list(range(2000)), 200)]
    full, eng_full, _ = sim_run({}, reqs, ff=True)
    # (compactions free here: this checks the KV read alone, which these step costs price very low)
    evict, eng_evict, _ = sim_run({"eviction.policy": "streaming", "eviction.budget_tokens": 256}, reqs, ff=True,
                                  compaction_coef=(0.0, 0.0))
    block_bytes = full.kv_peak_bytes // eng_full.kv.peak_used_blocks
    assert full.kv_peak_bytes == eng_full.kv.blocks_for(2199) * block_bytes
    assert evict.kv_peak_bytes == eng_evict.kv.blocks_for(256 + 512) * block_bytes  # the budget and a prefill chunk
    assert evict.e2e_s.max < full.e2e_s.max  # decode steps read 256..271 KV tokens instead of 2000..2199


def test_step_shape_reads_kv_slots_not_positions():
    eng, _ = make_engine(**h2o(16))
    eng.add_request(req("a", 10, 30, base=500))
    shapes = []
    while eng.scheduler.has_work():
        out = eng.scheduler.schedule()
        shapes.append((out.scheduled[0].start, step_shape(out, 1).decode_kv_bytes))
        eng.scheduler.update(out, eng.executor.execute(out, eng.kv), eng.clock.now())
    assert shapes[-1] == (38, 16 + 2 + 1)  # position 38 reads 19 slots
    assert max(b for _, b in shapes) == 20


@pytest.mark.parametrize("ff", [True, False])
def test_simulated_compactions_cost_what_the_profile_says_each_one_does(ff):
    """Each compaction adds the profile's per-compaction cost to its step (stepped, or inside a run)."""
    reqs = [Request("long", list(range(600)), 120)]
    knobs = {"eviction.policy": "h2o", "eviction.budget_tokens": 128}
    free, _, _ = sim_run(knobs, reqs, ff=ff, compaction_coef=(0.0, 0.0))
    costly, engine, _ = sim_run(knobs, reqs, ff=ff, compaction_coef=(0.01, 0.0))
    compactions = (costly.e2e_s.max - free.e2e_s.max) / 0.01
    # the prompt is compacted at its end, then once a block (16 tokens) of the 120 decoded ones
    assert round(compactions) == pytest.approx(compactions, abs=1e-6) and 6 <= round(compactions) <= 9
