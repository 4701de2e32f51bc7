"""PyTorch paged attention (the CPU path and the reference for the Triton kernels) against float64
attention over what the cache holds: 16-bit and packed KV, decode and prefill, block tables with holes,
one-token contexts, contexts that are not a multiple of the block size. Decode runs with each CPU
implementation (the compiled kernel and the PyTorch path: `cpu_decode`)."""
import pytest
import torch

from skistune.kernels import attention
from skistune.kernels.attention import (DECODE_GROUP_MIN_SAVING_BLOCKS, DECODE_GROUP_RATIO, build_attention_metadata,
                                          decode_groups, paged_attention)

from kv_cases import BLOCK, SPEC, fill, make_store, reference_attention, ring, scattered_tables, stored_kv

CONTEXTS = [1, 17, 40, 5, 32]
BITS = [(16, 16), (8, 8), (4, 4), (2, 2), (4, 16), (16, 8)]
SCALE = SPEC.head_dim ** -0.5


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("window", [0, 20])
def test_decode_equals_float64_attention_over_stored_kv(bits, window, cpu_decode):
    gen = torch.Generator().manual_seed(hash((bits, window)) % 1000)
    store = make_store(bits, slots=len(CONTEXTS), window=window)
    tables = scattered_tables(CONTEXTS, store.num_blocks, gen)
    written = fill(store, tables, CONTEXTS, gen)
    q = torch.randn(len(CONTEXTS), SPEC.n_heads, SPEC.head_dim, generator=gen)
    meta = build_attention_metadata(tables, [1] * len(CONTEXTS), CONTEXTS, BLOCK, ring(store, len(CONTEXTS)))
    out = paged_attention(q, *store.layer(0), meta, SCALE)
    for i, ctx in enumerate(CONTEXTS):
        k, v = stored_kv(store, tables[i], ctx, slot=i)
        ref = reference_attention(q[i:i + 1], k, v, SCALE)
        torch.testing.assert_close(out[i:i + 1].double(), ref, rtol=0, atol=1e-5)
        if bits == (16, 16):  # nothing lost: the stored KV is what was written
            torch.testing.assert_close(k, written[i][0].double(), rtol=0, atol=0)


@pytest.mark.parametrize("bits", BITS)
def test_prefill_chunk_over_cached_context(bits):
    gen = torch.Generator().manual_seed(7)
    contexts = [37]
    store = make_store(bits, slots=1, window=0)
    tables = scattered_tables(contexts, store.num_blocks, gen)
    fill(store, tables, contexts, gen, decode_steps=0)
    q_len = 12  # the chunk's queries: the last 12 positions of the 37, attending causally
    q = torch.randn(q_len, SPEC.n_heads, SPEC.head_dim, generator=gen)
    meta = build_attention_metadata(tables, [q_len], contexts, BLOCK, ring(store, 1))
    out = paged_attention(q, *store.layer(0), meta, SCALE)
    k, v = stored_kv(store, tables[0], 37, slot=0)
    ref = reference_attention(q, k, v, SCALE, causal_offset=37 - q_len)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)


def test_fewer_bits_lose_more(cpu_decode):
    """Against attention over the full-precision KV that was written, the error grows as bits fall."""
    errors = []
    for b in (8, 4, 2):
        gen = torch.Generator().manual_seed(3)
        store = make_store((b, b), slots=len(CONTEXTS))
        tables = scattered_tables(CONTEXTS, store.num_blocks, gen)
        written = fill(store, tables, CONTEXTS, gen)
        q = torch.randn(len(CONTEXTS), SPEC.n_heads, SPEC.head_dim, generator=gen)
        meta = build_attention_metadata(tables, [1] * len(CONTEXTS), CONTEXTS, BLOCK, ring(store, len(CONTEXTS)))
        out = paged_attention(q, *store.layer(0), meta, SCALE).double()
        ref = torch.cat([reference_attention(q[i:i + 1], *(x.double() for x in written[i]), SCALE)
                         for i in range(len(CONTEXTS))])
        errors.append(((out - ref).norm() / ref.norm()).item())
    assert errors[0] < 0.02 and errors[0] < errors[1] < errors[2]


# Decode rows of very different lengths: attended in groups (`decode_groups`), not all padded to the longest.
MIXED_CONTEXTS = [300, 20, 700, 1, 150, 45]  # 19, 2, 44, 1, 10 and 3 blocks


def test_decode_groups_bound_the_padding():
    assert decode_groups([19, 2, 44, 1, 10, 3]) == [[2], [0, 4], [5, 1, 3]]
    assert decode_groups([4, 1, 2]) == [[0, 2, 1]]  # short rows: padding costs less than another call
    assert decode_groups([]) == [] and decode_groups([5]) == [[0]]
    for blocks in ([3, 90, 45, 46, 8, 200, 17], [1] * 5 + [64]):
        groups = decode_groups(blocks)
        assert sorted(i for g in groups for i in g) == list(range(len(blocks)))
        for g in groups:
            width = max(blocks[i] for i in g)
            assert all(blocks[i] * DECODE_GROUP_RATIO > width or width - blocks[i] < DECODE_GROUP_MIN_SAVING_BLOCKS
                       for i in g)


@pytest.mark.parametrize("bits,window", [((16, 16), 0), ((4, 4), 20), ((2, 8), 40)])
def test_grouped_decode_equals_float64_attention(bits, window, torch_decode):
    gen = torch.Generator().manual_seed(11)
    store = make_store(bits, slots=len(MIXED_CONTEXTS), window=window, num_blocks=96)
    tables = scattered_tables(MIXED_CONTEXTS, store.num_blocks, gen)
    fill(store, tables, MIXED_CONTEXTS, gen)
    q = torch.randn(len(MIXED_CONTEXTS), SPEC.n_heads, SPEC.head_dim, generator=gen)
    meta = build_attention_metadata(tables, [1] * len(MIXED_CONTEXTS), MIXED_CONTEXTS, BLOCK,
                                    ring(store, len(MIXED_CONTEXTS)))
    out = paged_attention(q, *store.layer(0), meta, SCALE)
    assert len(meta.decode_groups) == 3
    for i, ctx in enumerate(MIXED_CONTEXTS):
        k, v = stored_kv(store, tables[i], ctx, slot=i)
        torch.testing.assert_close(out[i:i + 1].double(), reference_attention(q[i:i + 1], k, v, SCALE), rtol=0, atol=1e-5)


def test_grouped_decode_statistics_and_first_slots_match_one_padded_batch(monkeypatch, torch_decode):
    """With eviction: the statistics and the masked first slots come out the same grouped or padded."""
    gen = torch.Generator().manual_seed(12)
    store = make_store((16, 16), slots=len(MIXED_CONTEXTS), num_blocks=96)
    tables = scattered_tables(MIXED_CONTEXTS, store.num_blocks, gen)
    fill(store, tables, MIXED_CONTEXTS, gen)
    q = torch.randn(len(MIXED_CONTEXTS), SPEC.n_heads, SPEC.head_dim, generator=gen)
    firsts = [(0,), (3,), (100,), (), (7,), (0,)]  # one layer; the fourth sequence has no empty slot

    def attend():
        meta = build_attention_metadata(tables, [1] * len(MIXED_CONTEXTS), MIXED_CONTEXTS, BLOCK,
                                        first_slots=firsts, scored_queries=[1, 0, 1, 1, 0, 1])
        return paged_attention(q, *store.layer(0), meta, SCALE), meta

    grouped, meta = attend()
    assert len(meta.decode_groups) == 3
    monkeypatch.setattr(attention, "DECODE_GROUP_RATIO", 10 ** 6)  # everything in one group
    padded, one = attend()
    assert len(one.decode_groups) == 1
    torch.testing.assert_close(grouped, padded, rtol=0, atol=1e-6)
    for a, b in zip(meta.stats[0], one.stats[0]):
        torch.testing.assert_close(a.probs_sum, b.probs_sum, rtol=0, atol=1e-6)
        torch.testing.assert_close(a.probs_last, b.probs_last, rtol=0, atol=1e-6)
    assert float(meta.stats[0][2].probs_last[:, :100].abs().sum()) == 0.0  # slots before the first are masked
