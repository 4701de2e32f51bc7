"""A cached prefix must not change what an eviction policy keeps, hence what the model generates: the same
prompt served after itself (its prefix cached) gives the tokens it gave first. H2O takes no prefix hit (its
scores sum every prompt query's attention, which a hit skips); SnapKV takes hits that leave its observation
window to compute; StreamingLLM and TOVA take every hit. The scheduler decides it, so the simulator, which
shares it, predicts the same hits."""
import pytest

from skistune.runtime.eviction_budget import SNAPKV_WINDOW, EvictionBudget
from skistune.runtime.request import Request

from test_eviction_runtime import evicting, prompts


def twice(policy, prompt, **more):
    """Serve ``prompt`` alone, then again on the same engine: (first output, second output, second's hits)."""
    rt = evicting(policy, budget=16, **{"batching.chunk_size": 64, "batching.max_num_batched_tokens": 64,
                                        "offload.device_kv_bytes": 256 * 1024, **more})
    eng = rt.new_engine()
    first = eng.add_request(Request("a", prompt, 12))
    eng.run_until_done()
    second = eng.add_request(Request("b", prompt, 12))
    eng.run_until_done()
    return first.output_token_ids, second.output_token_ids, second.prefix_hit_tokens


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "tova", "streaming"])
def test_a_prompt_served_after_itself_generates_the_same_tokens(policy):
    prompt = prompts(1, [60], seed=4)[0]
    first, second, hits = twice(policy, prompt)
    assert second == first
    expected_hits = {"h2o": 0, "snapkv": (60 - SNAPKV_WINDOW) // 4 * 4}.get(policy, (60 - 1) // 4 * 4)
    assert hits == expected_hits


def test_a_hit_limit_per_policy():
    from skistune.config import EvictionConfig

    def limit(policy):
        return EvictionBudget(EvictionConfig(policy=policy, budget_tokens=64), n_layers=2, block_size=16)
    assert limit("h2o").max_hit_tokens(1000) == 0
    assert limit("snapkv").max_hit_tokens(1000) == 1000 - SNAPKV_WINDOW and limit("snapkv").max_hit_tokens(20) == 0
    assert limit("tova").max_hit_tokens(1000) is None and limit("streaming").max_hit_tokens(1000) is None
