"""The paged model equals a plain dense forward; chunking, batching, prefix reuse and preemption
change no logit and no greedy token (tiny random model, fp32)."""
import torch

from skistune.kernels.attention import build_attention_metadata
from skistune.runtime.request import Request

from tiny import TINY, dense_logits, tiny_runtime, tiny_weights

TOL = 1e-4


def run_chunks(rt, chunks_per_seq):
    """Run one model step over [(block_table, tokens_so_far, start, n)] and return all logits rows."""
    ids, pos, tables, qlens, ctxs = [], [], [], [], []
    for table, tokens, start, n in chunks_per_seq:
        ids += tokens[start:start + n]
        pos += range(start, start + n)
        tables.append(table)
        qlens.append(n)
        ctxs.append(start + n)
    meta = build_attention_metadata(tables, qlens, ctxs, rt.store.block_size)
    with torch.inference_mode():
        return rt.model.forward(torch.tensor(ids), torch.tensor(pos), rt.store, meta, torch.arange(len(ids)))


def test_paged_prefill_and_decode_equal_dense_forward():
    rt = tiny_runtime()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, TINY.vocab_size, (23,), generator=g).tolist()
    ref = dense_logits(TINY, tiny_weights(), tokens)
    table = [3, 1, 7, 2, 5, 9]  # scattered blocks, 4 tokens each
    got = run_chunks(rt, [(table, tokens, 0, 15)])
    torch.testing.assert_close(got, ref[:15], atol=TOL, rtol=0)
    for p in range(15, 23):  # decode one token at a time
        got = run_chunks(rt, [(table, tokens, p, 1)])
        torch.testing.assert_close(got, ref[p:p + 1], atol=TOL, rtol=0)


def test_chunked_prefill_equals_unchunked():
    rt = tiny_runtime()
    tokens = list(range(5, 35))
    ref = dense_logits(TINY, tiny_weights(), tokens)
    table = list(range(1, 9))
    rows = [run_chunks(rt, [(table, tokens, s, min(7, 30 - s))]) for s in range(0, 30, 7)]
    torch.testing.assert_close(torch.cat(rows), ref, atol=TOL, rtol=0)


def test_mixed_batch_equals_each_sequence_alone():
    rt = tiny_runtime()
    a, b, c = list(range(1, 12)), list(range(40, 49)), list(range(60, 80))
    ta, tb, tc = [1, 2, 3], [4, 5, 6], [7, 8, 9, 10, 11]
    run_chunks(rt, [(tb, b, 0, 8)])  # b's first 8 tokens cached: it decodes token 8 below
    run_chunks(rt, [(tc, c, 0, 6)])  # c's first 6 cached: a chunk of 9 follows
    batch = run_chunks(rt, [(ta, a, 0, 11), (tb, b, 8, 1), (tc, c, 6, 9)])
    torch.testing.assert_close(batch[:11], dense_logits(TINY, tiny_weights(), a), atol=TOL, rtol=0)
    torch.testing.assert_close(batch[11:12], dense_logits(TINY, tiny_weights(), b)[8:9], atol=TOL, rtol=0)
    torch.testing.assert_close(batch[12:], dense_logits(TINY, tiny_weights(), c)[6:15], atol=TOL, rtol=0)


def greedy(rt, requests):
    eng = rt.new_engine()
    for r in requests:
        eng.add_request(r)
    eng.run_until_done()
    return eng, {r.request_id: r.output_token_ids for r in eng.records}


def mixed_requests():
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(0, 101, (12,), generator=g).tolist()
    return [Request(f"r{i}", shared + torch.randint(0, 101, (n,), generator=g).tolist(), 12)
            for i, n in enumerate([1, 9, 4, 17, 6])]


def test_batched_greedy_equals_each_request_alone():
    rt = tiny_runtime(**{"batching.chunk_size": 8, "batching.max_num_batched_tokens": 16})
    reqs = mixed_requests()
    _, together = greedy(rt, reqs)
    alone = {r.request_id: greedy(rt, [r])[1][r.request_id] for r in reqs}
    assert together == alone


def test_prefix_reuse_gives_identical_tokens_and_counts_saved_tokens():
    reqs = mixed_requests()
    eng_on, on = greedy(tiny_runtime(**{"prefix_reuse.enabled": True, "batching.max_num_seqs": 1}), reqs)
    eng_off, off = greedy(tiny_runtime(**{"prefix_reuse.enabled": False, "batching.max_num_seqs": 1}), reqs)
    assert on == off
    # one at a time: every request after the first finds the 12 shared tokens (3 blocks of 4) cached
    assert [r.prefix_hit_tokens for r in eng_on.records] == [0, 12, 12, 12, 12]
    assert all(r.prefix_hit_tokens == 0 for r in eng_off.records)


def test_greedy_tokens_identical_with_and_without_preemption():
    reqs = mixed_requests()
    _, roomy = greedy(tiny_runtime(), reqs)
    # 16 blocks of 4 tokens = 64 slots for five sequences of up to 41 tokens: preemption is forced
    block_bytes = tiny_runtime().store.block_bytes
    eng, tight = greedy(tiny_runtime(**{"offload.device_kv_bytes": 16 * block_bytes}), reqs)
    assert eng.scheduler.num_preemptions > 0
    assert tight == roomy
    assert eng.kv.pool.num_free() == 16
