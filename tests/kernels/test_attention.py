"""PyTorch paged attention (the CPU path and the reference for the Triton kernels) against float64
attention over what the cache holds: 16-bit and packed KV, decode and prefill, block tables with holes,
one-token contexts, contexts that are not a multiple of the block size."""
import pytest
import torch

from skistune.kernels.attention import build_attention_metadata, paged_attention

from kv_cases import BLOCK, SPEC, fill, make_store, reference_attention, ring, scattered_tables, stored_kv

CONTEXTS = [1, 17, 40, 5, 32]
BITS = [(16, 16), (8, 8), (4, 4), (2, 2), (4, 16), (16, 8)]
SCALE = SPEC.head_dim ** -0.5


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("window", [0, 20])
def test_decode_equals_float64_attention_over_stored_kv(bits, window):
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


def test_fewer_bits_lose_more():
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
