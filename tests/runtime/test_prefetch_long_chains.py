"""Block prefetch takes a cached prefix longer than its depth over several steps, from the chain's start:
it had taken whole chains only, so with the default depth (2 blocks, 32 tokens) no real system prompt was
ever prefetched, nor anything queued behind one."""
from skistune.runtime.request import Request

from test_eviction_runtime import prompts
from tiny import tiny_runtime

BLOCK = 4  # tiny_runtime's block size (tokens)


def serve_behind(depth):
    """A's 40-token prompt pushed to the host tier by fillers, then B (the same prompt) waiting behind a long
    request while prefetch runs: (B's prefix hit tokens, tier metrics)."""
    rt = tiny_runtime(**{"offload.device_kv_bytes": 48 * 1024, "offload.host_kv_bytes": 128 * 1024,
                         "prefetch.enabled": True, "prefetch.unit": "blocks", "prefetch.depth": depth,
                         "batching.max_num_seqs": 1})
    eng = rt.new_engine()
    prompt, *fillers = prompts(5, [40, 44, 44, 44, 44], seed=7)
    for rid, ids in [("A", prompt), *((f"F{i}", f) for i, f in enumerate(fillers[:3]))]:
        eng.add_request(Request(rid, ids, 2))
        eng.run_until_done()
    eng.add_request(Request("F3", fillers[3], 12))
    b = eng.add_request(Request("B", prompt, 2))
    eng.run_until_done()
    return b.prefix_hit_tokens, eng.metrics(1.0).tiers


def test_a_chain_longer_than_the_depth_is_prefetched_a_depth_a_step():
    hits, tiers = serve_behind(depth=2)
    chain = (40 - 1) // BLOCK  # the blocks of A's prompt a hit can take
    assert hits == chain * BLOCK
    assert tiers.prefetched == chain and tiers.promotions == chain  # every block came up ahead of use
    assert tiers.prefetch_hit_rate == 1.0
