"""The runtime under pressure: every request arrives at once and together they need ``factor`` times the
KV blocks the cache holds. What exists today copes by recompute preemption (swap and host/disk offload
are in the schema but not implemented yet). Shared by test_overload.py and benchmarks/reliability.py.

Both the real runtime (the tiny random Llama of tests/runtime/tiny.py, real kernels) and the simulator
(the runtime's scheduler and block accounting with profile step costs) are measured the same way.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import numpy as np
from reliability_helpers import REPO
from skistune.runtime.request import Request

FACTOR = 3


def load_tiny():
    """tests/runtime/tiny.py as a module (by path: test folders are not packages)."""
    spec = importlib.util.spec_from_file_location("skistune_tests_tiny", REPO / "tests" / "runtime" / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def blocks_needed(requests: Sequence[Request], block_size: int) -> int:
    """KV blocks the requests need at their longest (prompt + every output token), all at once."""
    return sum(-(-(r.prompt_len + r.max_new_tokens) // block_size) for r in requests)


def accounting(engine, requests: Sequence[Request]) -> dict[str, Any]:
    """Requests lost (not finished with every token), duplicated (recorded twice) or rejected, and whether
    the block accounting balanced: every block back in the free queue, no references, no block tables."""
    records = engine.records
    wanted = {r.request_id: r.max_new_tokens for r in requests}
    done = {r.request_id for r in records if r.finish_s is not None and len(r.output_token_ids) == wanted.get(
        r.request_id)}
    pool = engine.kv.pool
    balanced = (pool.num_free() == pool.num_blocks and not any(pool.ref_cnt[1:])
                and not any(engine.kv.tables.values()))
    return {"requests": len(requests), "pool_blocks": pool.num_blocks,
            "overload": blocks_needed(requests, engine.kv.block_size) / pool.num_blocks,
            "finished": len(done), "lost": len(set(wanted) - done),
            "duplicated": len(records) - len({r.request_id for r in records}),
            "rejected": sum(r.rejected_reason is not None for r in records),
            "preemptions": engine.scheduler.num_preemptions, "blocks_balanced": balanced}


def runtime_overload(factor: int = FACTOR, n: int = 12, prompt: int = 16, output: int = 16,
                     tiers: bool = False) -> dict[str, Any]:
    """The tiny model serving ``n`` requests at once in a cache ``factor`` times too small for them; the
    greedy tokens must equal those of a run with room for all (recompute loses nothing). ``tiers``: with
    swap preemption, a host tier and a disk tier as large as the device pool, and prefetch."""
    tiny = load_tiny()
    roomy = tiny.tiny_runtime()
    rng = np.random.default_rng(0)
    requests = [Request(f"r{i}", [int(t) for t in rng.integers(3, tiny.TINY.vocab_size, prompt)], output)
                for i in range(n)]
    pool_blocks = blocks_needed(requests, roomy.config.prefix_reuse.block_size) // factor
    pool_bytes = pool_blocks * roomy.store.block_bytes
    knobs = {"offload.device_kv_bytes": pool_bytes}
    if tiers:
        knobs.update({"batching.preemption": "swap", "offload.host_kv_bytes": pool_bytes,
                      "offload.disk_kv_bytes": pool_bytes, "prefetch.enabled": True})
    tight = roomy.with_config(roomy.config.with_knobs(knobs))
    engine = tight.new_engine()
    engine.replay(requests)
    reference = roomy.new_engine()
    reference.replay(requests)
    figures = accounting(engine, requests)
    tokens = {r.request_id: r.output_token_ids for r in engine.records}
    figures["tokens_as_without_pressure"] = all(tokens.get(r.request_id) == r.output_token_ids
                                                for r in reference.records)
    return figures


def simulator_overload(profile, factor: int = FACTOR, n: int = 200) -> dict[str, Any]:
    """``n`` chat requests arriving at once on SmolLM2's simulated CPU cache sized to 1/``factor`` of their
    needs (never below the longest request's own need: that one would be rejected, not preempted)."""
    from skistune.evaluate import workload_requests
    from skistune.optimize import baseline_config
    from skistune.simulator import build_engine, target_from_profile
    from skistune.workloads import load_workload

    model = "smollm2-135m"
    requests = [Request(r.request_id, r.prompt_token_ids, r.max_new_tokens) for r in
                workload_requests(load_workload("chat", requests=n), model)]  # every arrival at 0
    config = baseline_config()
    target = target_from_profile(profile, model)
    block_size = config.prefix_reuse.block_size
    longest = max(blocks_needed([r], block_size) for r in requests)
    pool_blocks = max(blocks_needed(requests, block_size) // factor, longest)
    engine, _ = build_engine(config, target)
    tight = config.with_knobs({"offload.device_kv_bytes": pool_blocks * engine.block_bytes})
    engine, _ = build_engine(tight, target)
    engine.replay(requests)
    return accounting(engine, requests)
