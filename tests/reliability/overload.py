"""The runtime under pressure: every request arrives at once and together they need ``factor`` times the
KV blocks the cache holds. The runtime copes by recompute preemption, or with the tiers by swap
preemption, host and disk offload of cached prefix blocks and prefetch. Shared by test_overload.py and
benchmarks/reliability.py.

Both the real runtime (the tiny random Llama of tests/runtime/tiny.py, real kernels) and the simulator
(the runtime's scheduler and block accounting with profile step costs) are measured the same way.
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from reliability_helpers import REPO
from skistune.runtime.block_manager import chain_hashes
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
    the block accounting balanced: every block back in the free queue, no references, no block tables (and
    with tiers, no swapped sequence and no host or disk slot held by anything but a cached block)."""
    records = engine.records
    wanted = {r.request_id: r.max_new_tokens for r in requests}
    done = {r.request_id for r in records if r.finish_s is not None and len(r.output_token_ids) == wanted.get(
        r.request_id)}
    pool, tiers = engine.kv.pool, engine.kv.tiers
    balanced = (pool.num_free() == pool.num_blocks and not any(pool.ref_cnt[1:])
                and not any(engine.kv.tables.values()))
    if tiers is not None:  # no swapped sequence left; every host or disk slot in use holds a cached block
        balanced = balanced and not tiers.swapped and all(p.num_used() == len(p.cached) for p in tiers.levels)
    return {"requests": len(requests), "pool_blocks": pool.num_blocks,
            "overload": blocks_needed(requests, engine.kv.block_size) / pool.num_blocks,
            "finished": len(done), "lost": len(set(wanted) - done),
            "duplicated": len(records) - len({r.request_id for r in records}),
            "rejected": sum(r.rejected_reason is not None for r in records),
            "preemptions": engine.scheduler.num_preemptions, "blocks_balanced": balanced}


def overload_requests(n: int, prompt: int, output: int, vocab_size: int, prefix: str = "r") -> list[Request]:
    """``n`` requests of random (seeded, so always the same) ``prompt`` tokens and ``output`` new tokens."""
    rng = np.random.default_rng(0)
    return [Request(f"{prefix}{i}", [int(t) for t in rng.integers(3, vocab_size, prompt)], output)
            for i in range(n)]


def runtime_overload(factor: int = FACTOR, n: int = 12, prompt: int = 16, output: int = 16) -> dict[str, Any]:
    """The tiny model serving ``n`` requests at once in a cache ``factor`` times too small for them, with
    recompute preemption; the greedy tokens must equal those of a run with room for all."""
    tiny = load_tiny()
    roomy = tiny.tiny_runtime()
    requests = overload_requests(n, prompt, output, tiny.TINY.vocab_size)
    pool_blocks = blocks_needed(requests, roomy.config.prefix_reuse.block_size) // factor
    tight = roomy.with_config(roomy.config.with_knobs({"offload.device_kv_bytes": pool_blocks * roomy.store.block_bytes}))
    engine = tight.new_engine()
    engine.replay(requests)
    reference = roomy.new_engine()
    reference.replay(requests)
    figures = accounting(engine, requests)
    tokens = {r.request_id: r.output_token_ids for r in engine.records}
    figures["tokens_as_without_pressure"] = all(tokens.get(r.request_id) == r.output_token_ids
                                                for r in reference.records)
    return figures


# swap preemption, the host and disk tiers and prefetch; at most 5 running sequences (their 40 blocks at
# their longest are more than the 32 of the cache: preemption) so that admissions wait and free blocks
# are left for prefetch, 4 blocks deep: a prompt's 3 cached blocks at once (prefetch promotes whole chains)
TIERED = {"batching.preemption": "swap", "batching.max_num_seqs": 5, "prefetch.depth": 4}


def corrupt_disk_block(disk, slot: int) -> None:
    """Flip one byte of a disk-tier block in its file (its CRC32 no longer matches)."""
    offset = slot * disk.block_bytes + 7
    byte = os.pread(disk.fd, 1, offset)
    os.pwrite(disk.fd, bytes([byte[0] ^ 0xFF]), offset)


def first_disk_prefix_block(kv, requests: Sequence[Request]) -> int | None:
    """The disk slot of the first prompt block (requests in order) that the disk holds and whose earlier
    blocks are cached in some tier: the next prefix lookup of that prompt reads it. None: no such block."""
    tiers = kv.tiers
    for r in requests:
        for h in chain_hashes(r.prompt_token_ids, kv.block_size, [])[:(r.prompt_len - 1) // kv.block_size]:
            if h in tiers.disk.cached:
                return tiers.disk.cached[h]
            if kv.pool.lookup(h) is None and tiers.lookup(h) is None:
                break
    return None


def tiered_overload(factor: int = FACTOR, n: int = 12, prompt: int = 16, output: int = 16,
                    corrupt: bool = True, prefetch: bool = True) -> dict[str, Any]:
    """The tiny model at ``factor`` times its KV capacity with swap preemption, a host tier and a disk tier
    each as large as the device pool, and ``prefetch`` (`TIERED`): ``n`` requests at once, then the same
    ``n`` prompts again at once, whose prefix blocks wave 1 left on the host and the disk. With ``corrupt``,
    one byte of the disk block that wave 2 reads first is flipped in between: the first check of that block
    must fail (CRC32; the block is recomputed, never used). Every request's greedy tokens must equal those
    of a run with room for all. Checksum failures of blocks nobody corrupted are counted apart. A runtime
    error is a figure too (``error``; the requests not finished by then are lost)."""
    tiny = load_tiny()
    roomy = tiny.tiny_runtime()
    waves = [overload_requests(n, prompt, output, tiny.TINY.vocab_size, prefix=f"w{w}r") for w in (1, 2)]
    block_size = roomy.config.prefix_reuse.block_size
    pool_bytes = blocks_needed(waves[0], block_size) // factor * roomy.store.block_bytes
    knobs = {**TIERED, "prefetch.enabled": prefetch, "offload.device_kv_bytes": pool_bytes,
             "offload.host_kv_bytes": pool_bytes, "offload.disk_kv_bytes": pool_bytes}
    engine = roomy.with_config(roomy.config.with_knobs(knobs)).new_engine()
    corrupted, checks, error = None, [], None  # checks: whether each check of the corrupted slot passed
    try:
        for wave in waves:
            if wave is waves[1] and corrupt:
                corrupted = first_disk_prefix_block(engine.kv, wave)
                if corrupted is not None:
                    corrupt_disk_block(engine.executor.tier_store.disk, corrupted)
                    verify = engine.kv.tiers.verify_disk

                    def observed(slot: int) -> bool:
                        ok = verify(slot)
                        if slot == corrupted:
                            checks.append(ok)
                        return ok

                    engine.kv.tiers.verify_disk = observed
            for r in wave:
                engine.add_request(r)
            engine.run_until_done()
    except RuntimeError as exc:
        error = f"{type(exc).__name__}: {str(exc).split('.')[0][:200]}"  # its first sentence
    reference = roomy.new_engine()
    reference.replay(waves[0])
    want = {r.request_id[len("w1r"):]: r.output_token_ids for r in reference.records}
    requests = waves[0] + waves[1]
    figures = accounting(engine, requests)
    figures["overload"] = blocks_needed(waves[0], block_size) / engine.kv.pool.num_blocks  # each wave's
    figures["tokens_as_without_pressure"] = (error is None and len(engine.records) == len(requests) and all(
        r.output_token_ids == want[r.request_id[len("w1r"):]] for r in engine.records))
    tiers, block_bytes = engine.tier_metrics(), engine.block_bytes
    moved = {link: b // block_bytes for link, b in tiers.moved_bytes.items()}
    figures.update({
        "host_blocks": tiers.capacity_bytes["host"] // block_bytes,
        "disk_blocks": tiers.capacity_bytes["disk"] // block_bytes,
        "swapped_out": tiers.swapped_out, "swapped_in": tiers.swapped_in, "swap_fallbacks": tiers.swap_fallbacks,
        "blocks_offloaded": tiers.demotions, "blocks_promoted": tiers.promotions, "blocks_prefetched": tiers.prefetched,
        "blocks_moved": sum(moved.values()), "blocks_moved_by_link": moved,
        "prefetch": prefetch, "disk_blocks_corrupted": int(corrupted is not None),
        "corrupted_block_detected": bool(checks) and not checks[0],  # its first check after the flip failed
        "corrupt_blocks_detected": tiers.corrupt_blocks,
        "checksum_failures_not_corrupted": tiers.corrupt_blocks - (bool(checks) and not checks[0]),
        "error": error})
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
