"""Eviction in the real runtime (tiny random model): memory capped per sequence, statistics taken from the
attention itself, compactions that move exactly the kept tokens' KV (16-bit and quantized, ring included),
per-layer first-slot masking, and eviction together with prefix reuse and preemption."""
import pytest
import torch
import torch.nn.functional as F

from skistune.config import KVConfig
from skistune.kernels.attention import build_attention_metadata, paged_attention, write_kv
from skistune.runtime.engine import Engine, VirtualClock
from skistune.runtime.eviction import kept_slots
from skistune.runtime.kv_store import PagedKVStore
from skistune.runtime.model import apply_rope, rms_norm, rope_tables
from skistune.runtime.model_runner import read_slots
from skistune.runtime.request import Request

from tiny import TINY, dense_logits, tiny_runtime, tiny_weights

BLOCK = 4  # tiny_runtime's block size
GROUP = TINY.n_heads // TINY.n_kv_heads


def evicting(policy="h2o", budget=12, bits=16, **more):
    knobs = {"eviction.policy": policy, "eviction.budget_tokens": budget, "eviction.sink_tokens": 2,
             "eviction.recent_window": 3, "batching.chunk_size": 8, "batching.max_num_batched_tokens": 16,
             "batching.max_num_seqs": 4, "bitwidth.key_bits": bits, "bitwidth.value_bits": bits,
             "bitwidth.group_size": 16, **more}
    return tiny_runtime(**knobs)


def prompts(n, lengths, seed=0, shared=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, TINY.vocab_size, (shared,), generator=g).tolist()
    return [head + torch.randint(0, TINY.vocab_size, (lengths[i % len(lengths)],), generator=g).tolist()
            for i in range(n)]


def serve(rt, token_lists, max_new_tokens):
    """Serve all at once; returns the engine, the outputs and each sequence's most KV blocks in a step."""
    eng = rt.new_engine()
    runner, peak = eng.executor, {}
    execute = runner.execute

    def recording(out, kv):
        for s in out.scheduled:
            peak[s.seq.seq_id] = max(peak.get(s.seq.seq_id, 0), len(kv.block_table(s.seq.seq_id)))
        return execute(out, kv)

    runner.execute = recording
    for i, ids in enumerate(token_lists):
        eng.add_request(Request(f"r{i}", ids, max_new_tokens))
    eng.run_until_done()
    return eng, [r.output_token_ids for r in eng.records], peak


def assert_nothing_leaked(eng):
    assert eng.kv.pool.num_free() == eng.kv.pool.num_blocks
    slots = eng.executor.ring_slots
    if slots is not None:  # released at the next step's look at the block tables
        slots.release_finished(eng.kv)
        assert not slots.assigned and sorted(slots.free) == list(range(eng.executor.store.slots))


@pytest.mark.parametrize("policy,bits,more", [
    ("streaming", 16, {}), ("h2o", 16, {}), ("tova", 16, {}), ("snapkv", 16, {}),
    ("h2o", 16, {"eviction.layer_schedule": "pyramid"}),
    ("h2o", 8, {}), ("snapkv", 4, {"bitwidth.full_precision_window": 5})])
def test_every_policy_caps_each_sequences_blocks_and_completes(policy, bits, more):
    rt = evicting(policy, bits=bits, **more)
    token_lists = prompts(6, [9, 20, 14])
    eng, outs, peak = serve(rt, token_lists, 24)
    assert [len(o) for o in outs] == [24] * 6
    assert_nothing_leaked(eng)
    budget = eng.scheduler.eviction
    for i, ids in enumerate(token_lists):
        total = len(ids) + 24
        assert peak[f"r{i}"] <= eng.kv.blocks_for(budget.peak_slots(len(ids), total, 8)) < eng.kv.blocks_for(total)


def test_without_eviction_or_under_the_budget_tokens_are_unchanged():
    token_lists = prompts(3, [7, 11, 5])
    _, plain, _ = serve(tiny_runtime(), token_lists, 8)
    _, roomy, _ = serve(evicting("h2o", budget=400), token_lists, 8)  # never due: statistics only
    assert plain == roomy
    for ids, out in zip(token_lists, plain):  # and both are the dense model's greedy tokens
        seq = list(ids)
        for _ in range(8):
            seq.append(int(dense_logits(TINY, tiny_weights(), seq)[-1].argmax()))
        assert out == seq[len(ids):]


# ---- statistics from the attention itself --------------------------------------------------------------
def dense_probs(token_ids):
    """Per layer, the dense causal attention probabilities ``[n_heads, S, S]`` of the tiny model."""
    s, w = TINY, tiny_weights()
    x = F.embedding(torch.tensor(token_ids), w["embed_tokens"])
    cos, sin = (t[:len(token_ids)].unsqueeze(1) for t in rope_tables(s, x.dtype, x.device))
    out = []
    for i in range(s.n_layers):
        h = rms_norm(x, w[f"layers.{i}.input_norm"], s.rms_eps)
        q = apply_rope((h @ w[f"layers.{i}.q_proj"].T).view(-1, s.n_heads, s.head_dim), cos, sin)
        k = apply_rope((h @ w[f"layers.{i}.k_proj"].T).view(-1, s.n_kv_heads, s.head_dim), cos, sin)
        v = (h @ w[f"layers.{i}.v_proj"].T).view(-1, s.n_kv_heads, s.head_dim)
        k, v = k.repeat_interleave(GROUP, dim=1), v.repeat_interleave(GROUP, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / s.head_dim ** 0.5
        causal = torch.ones(len(token_ids), len(token_ids), dtype=torch.bool).tril()
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out.append(att)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(len(token_ids), -1) @ w[f"layers.{i}.o_proj"].T
        h = rms_norm(x, w[f"layers.{i}.post_attn_norm"], s.rms_eps)
        x = x + (F.silu(h @ w[f"layers.{i}.gate_proj"].T) * (h @ w[f"layers.{i}.up_proj"].T)) @ w[
            f"layers.{i}.down_proj"].T
    return out


@pytest.mark.parametrize("policy", ["h2o", "tova"])
def test_statistics_are_the_attention_probabilities(policy):
    rt = evicting(policy, budget=400, **{"batching.chunk_size": 4})
    eng = rt.new_engine()
    eng.add_request(Request("a", prompts(1, [10])[0], 20))
    for _ in range(6):  # prefill chunks of 4, 4, 2, then 3 decodes: 13 tokens computed, none evicted
        eng.step()
    seq = eng.scheduler.running[0]
    assert seq.num_computed_tokens == 13
    probs = dense_probs(seq.token_ids[:13])
    for layer in range(TINY.n_layers):
        per_kv_head = probs[layer].view(TINY.n_kv_heads, GROUP, 13, 13).sum(1)  # [KVH, queries, keys]
        expected = per_kv_head.sum(1) if policy == "h2o" else per_kv_head[:, -1]  # every query / the newest
        got = eng.executor.stats.scores("a", layer, 13, TINY.n_kv_heads)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_first_slot_masking_and_statistics_in_the_attention_kernel():
    """A decode row and a prefill chunk whose layers start at different slots, against dense attention
    over each layer's slots ``[first, ctx)``."""
    store = PagedKVStore(TINY, 16, BLOCK, torch.float32, "cpu", KVConfig().with_knobs({"prefix_reuse.block_size": BLOCK}))
    g = torch.Generator().manual_seed(3)
    tables, ctxs, qlens, firsts = [[3, 1, 7], [2, 5, 9, 4]], [10, 15], [1, 6], [(0, 5), (3, 9)]
    kv = [(torch.randn(c, TINY.n_kv_heads, TINY.head_dim, generator=g),
           torch.randn(c, TINY.n_kv_heads, TINY.head_dim, generator=g)) for c in ctxs]
    for layer in range(TINY.n_layers):
        meta = build_attention_metadata(tables, ctxs, ctxs, BLOCK)  # write every slot
        write_kv(*store.layer(layer), torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv]), meta)
    q = torch.randn(sum(qlens), TINY.n_heads, TINY.head_dim, generator=g)
    meta = build_attention_metadata(tables, qlens, ctxs, BLOCK, first_slots=firsts, scored_queries=[1, 4])
    outs = [paged_attention(q, *store.layer(layer), meta, 0.25) for layer in range(TINY.n_layers)]
    rows = [slice(0, 1), slice(1, 7)]
    for layer in range(TINY.n_layers):
        for i, (ctx, q_len) in enumerate(zip(ctxs, qlens)):
            first = firsts[i][layer]
            k, v = (x[first:].repeat_interleave(GROUP, 1) for x in kv[i])
            scores = torch.einsum("qhd,khd->hqk", q[rows[i]], k) * 0.25
            causal = torch.arange(first, ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
            att = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # [H, q_len, ctx - first]
            torch.testing.assert_close(outs[layer][rows[i]], torch.einsum("hqk,khd->qhd", att, v), atol=1e-5, rtol=0)
            grouped = F.pad(att, (first, 0)).view(TINY.n_kv_heads, GROUP, q_len, ctx).sum(1)
            st = meta.stats[layer][i]
            torch.testing.assert_close(st.probs_last, grouped[:, -1], atol=1e-6, rtol=0)
            torch.testing.assert_close(st.probs_sum, grouped[:, q_len - [1, 4][i]:].sum(1), atol=1e-6, rtol=0)


# ---- compactions move exactly the kept KV ---------------------------------------------------------------
def stored(runner, kv, seq_id, num_slots):
    """Every layer's (keys, values) of a sequence's slots, in full precision."""
    blocks = torch.tensor(kv.block_table(seq_id)[:kv.blocks_for(num_slots)])
    ring = runner.ring_slots.assigned[seq_id] if runner.ring_slots is not None else None
    return [[read_slots(side, runner.store, blocks, num_slots, ring) for side in sides] for sides in runner.store.layers]


@pytest.mark.parametrize("bits,window,tol", [(16, 0, 0.0), (8, 0, 0.02), (8, 6, 0.02), (4, 0, 0.35)])
def test_compaction_keeps_exactly_the_kept_tokens_kv(bits, window, tol):
    rt = evicting("h2o", budget=10, bits=bits, **{"bitwidth.full_precision_window": window,
                                                  "eviction.layer_schedule": "pyramid"})
    eng = rt.new_engine()
    runner = eng.executor
    compact, seen = runner._compact, []

    def checked(c, kv):
        before = stored(runner, kv, c.seq_id, c.kv_len)
        kept = [kept_slots(runner.policy, runner.stats, c, layer, TINY.n_kv_heads, 2, 3)
                for layer in range(TINY.n_layers)]
        compact(c, kv)
        after = stored(runner, kv, c.seq_id, c.new_num_kv_tokens)
        for layer, (sides_before, sides_after) in enumerate(zip(before, after)):
            first = c.dst_first_slot[layer]
            for old, new in zip(sides_before, sides_after):
                expected = old.gather(0, kept[layer].T.unsqueeze(-1).expand(-1, -1, old.shape[-1]))
                span = (old.max() - old.min()).item()
                torch.testing.assert_close(new[first:], expected, atol=tol * span, rtol=0)
        seen.append((c, after))

    runner._compact = checked
    eng.add_request(Request("a", prompts(1, [23])[0], 20))
    eng.run_until_done()
    assert len(seen) >= 3 and any(min(c.dst_first_slot) < max(c.dst_first_slot) for c, _ in seen)
    assert len(eng.records[0].output_token_ids) == 20


@pytest.mark.parametrize("window", [0, 6])
def test_quantized_kv_written_by_a_compaction_reads_back_after_later_appends(window):
    """The ring keeps following KV slots after a compaction: what was compacted reads the same a few
    steps later, after the blocks it left partial were completed and quantized by ordinary appends."""
    rt = evicting("h2o", budget=10, bits=8, **{"bitwidth.full_precision_window": window})
    eng = rt.new_engine()
    eng.add_request(Request("a", prompts(1, [23])[0], 12))
    eng.step()  # 8 of the prompt
    eng.step()  # 16: due (10 + 4), compacted to 10 slots
    eng.step()  # 23: due again, compacted to 10
    runner, kv = eng.executor, eng.kv
    assert kv.num_kv_tokens(eng.scheduler.running[0]) == 10
    just_after = stored(runner, kv, "a", 10)
    for _ in range(3):  # slots 10..12: the block of slots 8..11 completes and is quantized
        eng.step()
    later = stored(runner, kv, "a", 13)  # (read as 13 slots: the ring has moved on)
    for sides_a, sides_b in zip(just_after, later):
        for a, b in zip(sides_a, sides_b):
            torch.testing.assert_close(b[:10], a, atol=0.02 * (a.max() - a.min()).item(), rtol=0)


# ---- together with prefix reuse and preemption ---------------------------------------------------------
@pytest.mark.parametrize("bits", [16, 8])
def test_eviction_prefix_reuse_and_preemption_on_a_tiny_pool(bits):
    rt = evicting("tova", budget=10, bits=bits)  # (H2O takes no prefix hit: `EvictionBudget.max_hit_tokens`)
    rt = rt.with_config(rt.config.with_knobs({"offload.device_kv_bytes": rt.store.block_bytes * 14 + ring_bytes(rt)}))
    token_lists = prompts(8, [3, 14, 9], shared=8)
    eng, outs, _ = serve(rt, token_lists, 20)
    assert [len(o) for o in outs] == [20] * 8
    assert eng.scheduler.num_preemptions > 0 and sum(r.prefix_hit_tokens for r in eng.records) > 0
    assert_nothing_leaked(eng)


def ring_bytes(rt):
    from skistune.runtime.kv_layout import ring_bytes as rb
    return rb(rt.config, TINY, 4)


def test_requests_longer_than_the_pool_are_served_within_the_budget():
    rt = evicting("streaming", budget=8)
    rt = rt.with_config(rt.config.with_knobs({"offload.device_kv_bytes": rt.store.block_bytes * 8}))
    eng, outs, peak = serve(rt, prompts(2, [30]), 40)  # 70 tokens each, 18 blocks without eviction
    assert [len(o) for o in outs] == [40, 40] and max(peak.values()) <= 8
    plain = tiny_runtime(**{"offload.device_kv_bytes": rt.store.block_bytes * 8})
    assert "KV blocks" in plain.new_engine().add_request(Request("x", list(range(30)), 40)).rejected_reason


def test_an_evicting_engine_needs_the_layer_count():
    cfg = evicting().config
    with pytest.raises(ValueError, match="n_layers"):
        Engine(cfg, num_blocks=8, block_bytes=1, max_context=64, executor=None, clock=VirtualClock())


def test_keep_logits_gives_every_computed_positions_logits():
    """Teacher-forced scoring (benchmarks/quality_kv.py): each step's logits of every computed token."""
    rt = tiny_runtime(**{"batching.chunk_size": 4})
    eng = rt.new_engine()
    eng.executor.keep_logits = True
    ids = prompts(1, [10])[0]
    eng.add_request(Request("a", ids, 3))
    rows = []
    while eng.scheduler.has_work():
        eng.step()
        rows.append(eng.executor.step_logits["a"])
    tokens = ids + eng.records[0].output_token_ids
    torch.testing.assert_close(torch.cat(rows), dense_logits(TINY, tiny_weights(), tokens[:-1]), atol=1e-4, rtol=0)


def cached_prefix_kv(eng, token_ids):
    """Every layer's stored keys and values of the cached blocks that hold ``token_ids``' full blocks."""
    from skistune.runtime.block_manager import chain_hashes

    blocks = [eng.kv.pool.lookup(h) for h in chain_hashes(token_ids, eng.kv.block_size, [])]
    assert None not in blocks, blocks
    return [[side.data[blocks].clone() for side in sides] for sides in eng.executor.store.layers]


def test_a_prompt_compacted_at_the_end_of_its_prefill_stays_cached_with_its_own_kv():
    """A prompt of one chunk is compacted right after it: the blocks the compaction rewrites are copied
    between the forward pass and the compaction. The cache then holds the same KV as without eviction, and
    the same prompt again hits all of its full blocks."""
    prompt = prompts(1, [21])[0]  # 5 full blocks of 4
    evict = evicting("tova", budget=10, **{"batching.chunk_size": 32, "batching.max_num_batched_tokens": 32})
    eng = evict.new_engine()
    eng.add_request(Request("a", prompt, 4))
    eng.run_until_done()
    plain = evict.with_config(evict.config.with_knobs({"eviction.policy": "none", "eviction.budget_tokens": None}))
    ref = plain.new_engine()
    ref.add_request(Request("a", prompt, 4))
    ref.run_until_done()
    for sides, ref_sides in zip(cached_prefix_kv(eng, prompt), cached_prefix_kv(ref, prompt)):
        for got, want in zip(sides, ref_sides):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    eng.add_request(Request("b", prompt, 4))
    eng.run_until_done()
    # (H2O, whose scores of hit tokens would lack the prompt's queries, takes no hit: test_eviction_prefix_hits)
    assert eng.records[1].prefix_hit_tokens == 20 and len(eng.records[1].output_token_ids) == 4
    assert_nothing_leaked(eng)
