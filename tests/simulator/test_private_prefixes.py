"""A replay in the simulator caches only the blocks another sequence could find (`private_prefixes`); the rest
are cached when their sequence is preempted. Nothing a replay measures may change."""
import numpy as np
import pytest

from skistune.config import KVConfig
from skistune.runtime.block_manager import _private_depths, private_prefixes
from skistune.runtime.request import Request
from skistune.simulator import build_engine

from test_simulator import cost, target


def test_a_prompt_is_private_from_its_first_block_no_other_prompt_has():
    system = list(range(100, 108))  # two blocks of 4 shared by b, c and g
    prompts = [list(range(12)),                       # a: unique from its first block
               system + [1, 2, 3, 4, 9],              # b: shares two blocks with c
               system + [5, 6, 7, 8],                 # c
               [7, 7, 7, 7, 8, 8, 8, 8],              # d and e: the same prompt, every block shared
               [7, 7, 7, 7, 8, 8, 8, 8],
               [1, 2, 3],                             # f: no full block (its first will hold outputs)
               system[:4] + [0, 0, 0, 0]]             # g: shares the first block only
    assert _private_depths([np.array(p) for p in prompts], 4) == [0, 2, 2, -1, -1, -1, 1]
    assert _private_depths(prompts, 4) == [0, 2, 2, -1, -1, -1, 1]  # lists hash as arrays do
    # blocks of 8: b and c have one full block, which they share; g's first block is its own now
    assert private_prefixes(list(zip("abcdefg", prompts)), 8) == {"a": 0, "g": 0}


def shared_prefix_requests(n=60, seed=0):
    """Requests whose prompts start with one of three system prompts (or none), at a rate that queues."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(10, 40_000, size=int(k)) for k in (96, 200, 37)]
    reqs = []
    for i in range(n):
        tail = rng.integers(10, 40_000, size=int(rng.integers(20, 300)))
        which = i % 4
        prompt = tail if which == 3 else np.concatenate([systems[which], tail])
        reqs.append(Request(f"r{i}", prompt, int(rng.integers(5, 120)), arrival_s=i * 0.02))
    return reqs


@pytest.mark.parametrize("knobs", [{}, {"batching.chunked_prefill": False, "batching.max_num_batched_tokens": 4096},
                                   {"batching.max_num_seqs": 4}, {"prefix_reuse.block_size": 32}])
def test_caching_only_shared_blocks_changes_nothing_a_replay_measures(knobs):
    # a pool of ~40 blocks of 16 tokens: sequences are preempted (recompute) and come back to their own blocks
    cfg = KVConfig().with_knobs({"offload.device_kv_bytes": 40 * 16 * 23040, **knobs})
    reqs = shared_prefix_requests()
    results = []
    for unique_outputs in (True, False):
        engine, executor = build_engine(cfg, target(cost(fixed=2e-3, seqs=1e-4, tokens=2e-5, kv=1e-12)))
        engine.unique_outputs = unique_outputs  # False: every full block cached as it fills, as the runtime does
        metrics = engine.replay(reqs)
        results.append((metrics, engine, executor))
    (lazy, lazy_engine, lazy_ex), (eager, eager_engine, eager_ex) = results
    assert lazy == eager and lazy_ex.num_steps == eager_ex.num_steps
    for a, b in zip(lazy_engine.records, eager_engine.records):
        assert (a.token_times_s, a.prefix_hit_tokens, a.preemptions) == (b.token_times_s, b.prefix_hit_tokens,
                                                                         b.preemptions)
    assert lazy.preemptions > 0 and sum(r.prefix_hit_tokens for r in lazy_engine.records) > 0
    # preempted sequences found their own blocks when they came back: the blocks cached at their preemption
    assert sum(r.prefix_hit_tokens for r in lazy_engine.records if r.preemptions) > 0
    assert lazy_engine.kv.private_from == {} and len(lazy_engine.kv.pool.cached) < len(eager_engine.kv.pool.cached)


def test_the_runtime_and_configs_whose_cached_blocks_move_cache_every_block(shipped_target):
    reqs = shared_prefix_requests(8)
    for knobs in ({"offload.host_kv_bytes": 64 << 20}, {"eviction.policy": "streaming", "eviction.budget_tokens": 256}):
        engine, _ = build_engine(KVConfig().with_knobs(knobs), shipped_target)
        engine._private_prefixes(reqs)  # tiers write or demote cached blocks; a compaction copies them
        assert engine.kv.private_from == {}
    engine, _ = build_engine(KVConfig(), target(cost(fixed=1e-3)))
    engine.unique_outputs = False  # the runtime's engine: a real model's output may continue another prompt
    engine._private_prefixes(reqs)
    assert engine.kv.private_from == {}
    engine.unique_outputs = True
    engine._private_prefixes(reqs)
    # system prompts of 96, 200 and 37 tokens: 6, 12 and 2 full blocks shared; r3 and r7 share none
    assert engine.kv.private_from == {"r0": 6, "r4": 6, "r1": 12, "r5": 12, "r2": 2, "r6": 2, "r3": 0, "r7": 0}
