"""Triton kernels against the PyTorch implementation on the same stored KV (compiled on a GPU, under
``TRITON_INTERPRET=1`` on a CPU): fp16 inputs, fresh random data per case, scratch poisoned with NaN,
block tables with holes, one-token contexts, contexts not a multiple of the block size, 1 to many
splits of the context; with eviction, per-layer first slots and the attention statistics."""
import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton")

from skistune.kernels import triton_attention as ta  # noqa: E402
from skistune.kernels.attention import _decode_torch, build_attention_metadata, quantize_blocks  # noqa: E402
from skistune.kernels.quant import unpack  # noqa: E402

from kv_cases import BLOCK, SPEC, fill, make_store, ring, scattered_tables  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONTEXTS = [1, 17, 48, 5, 33]


@pytest.fixture(autouse=True)
def poisoned_scratch(monkeypatch):
    monkeypatch.setattr(ta, "_scratch", lambda *shape, device: torch.full(shape, float("nan"), device=device))


@pytest.mark.parametrize("bits", [(16, 16), (8, 8), (4, 4), (2, 2), (4, 16), (16, 2)])
@pytest.mark.parametrize("window,splits", [(0, 1), (16, 3), (0, None)])
def test_decode_matches_pytorch(bits, window, splits):
    gen = torch.Generator().manual_seed(hash((bits, window)) % 997)
    store = make_store(bits, slots=len(CONTEXTS), window=window, dtype=torch.float16, device=DEVICE)
    tables = scattered_tables(CONTEXTS, store.num_blocks, gen)
    fill(store, tables, CONTEXTS, gen, dtype=torch.float16, device=DEVICE)
    q = torch.randn(len(CONTEXTS), SPEC.n_heads, SPEC.head_dim, generator=gen).half().to(DEVICE)
    meta = build_attention_metadata(tables, [1] * len(CONTEXTS), CONTEXTS, BLOCK, ring(store, len(CONTEXTS)), DEVICE)
    key, value = store.layer(0)
    out, none = ta.paged_decode(q, key, value, meta, 0.17, num_splits=splits)
    assert none is None
    ref = _decode_torch(q.float(), key, value, meta, 0.17, SPEC.n_kv_heads, SPEC.n_heads // SPEC.n_kv_heads)
    assert not out.isnan().any()
    assert ((out.float() - ref).norm() / ref.norm()).item() <= 1e-3


@pytest.mark.parametrize("setting", [ta.DecodeSetting(tile=16, unpack=1, scales=1),
                                     ta.DecodeSetting(tile=32, unpack=0, scales=1),
                                     ta.DecodeSetting(tile=128, unpack=1, scales=0)])
@pytest.mark.parametrize("bits", [(8, 8), (4, 4), (2, 16)])
def test_decode_settings_compute_the_same(setting, bits, monkeypatch):
    """Every tile size and unpack/scale strategy the benchmark may pick gives the PyTorch result."""
    monkeypatch.setattr(ta, "DECODE_QUANTIZED", setting)
    monkeypatch.setattr(ta, "DECODE_FULL", setting)
    test_decode_matches_pytorch(bits, 16, 2)


# Eviction: each row's first slot per layer (two layers; () is none empty) and the queries it scores.
FIRSTS = [(), (0, 3), (20, 37), (1, 4), (16, 16)]  # ctx 17 from 3, ctx 48 from 37, ctx 33 from a tile's start
SCORED = [1, 0, 1, 1, 0]
SCALE = 0.17
# (tile, splits): one tile per split; 16-token tiles in one split (tiles before the first slot skipped);
# one 16-token tile per split (whole splits before the first slot, or past a short row's context)
SPLITS = [(None, 1), (16, 1), (16, 3)]


def _eviction_case(bits, window, seed):
    gen = torch.Generator().manual_seed(seed)
    store = make_store(bits, slots=len(CONTEXTS), window=window, dtype=torch.float16, device=DEVICE)
    tables = scattered_tables(CONTEXTS, store.num_blocks, gen)
    fill(store, tables, CONTEXTS, gen, dtype=torch.float16, device=DEVICE)
    q = torch.randn(len(CONTEXTS), SPEC.n_heads, SPEC.head_dim, generator=gen).half().to(DEVICE)
    return store, tables, q


def _eviction_meta(store, tables, query_lens=None, firsts=FIRSTS):
    return build_attention_metadata(tables, query_lens or [1] * len(CONTEXTS), CONTEXTS, BLOCK,
                                    ring(store, len(CONTEXTS)), DEVICE, first_slots=firsts, scored_queries=SCORED)


def _tile(monkeypatch, tile):
    if tile is not None:
        for name in ("DECODE_QUANTIZED", "DECODE_FULL"):
            monkeypatch.setattr(ta, name, dataclasses.replace(getattr(ta, name), tile=tile))


@pytest.mark.parametrize("bits", [(16, 16), (8, 8), (4, 4), (2, 16)])
@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("tile,splits", SPLITS)
def test_decode_with_first_slots_and_statistics_matches_pytorch(bits, window, tile, splits, monkeypatch):
    """Per-layer first slots mask the slots before them; the statistics (probabilities of each row's query
    heads summed per KV head) come out as the PyTorch path computes them, everywhere written (the scratch is
    NaN), zero before the first slot and past the context."""
    _tile(monkeypatch, tile)
    store, tables, q = _eviction_case(bits, window, hash((bits, window, tile, splits)) % 997)
    key, value = store.layer(0)
    layer = 1 if splits == 3 else 0  # the first slots of the layer asked for
    meta = _eviction_meta(store, tables)
    out, probs = ta.paged_decode(q, key, value, meta, SCALE, layer, True, num_splits=splits)
    stats = [None] * len(CONTEXTS)
    ref = _decode_torch(q.float(), key, value, meta, SCALE, SPEC.n_kv_heads, SPEC.n_heads // SPEC.n_kv_heads, layer,
                        stats)
    assert not out.isnan().any() and not probs.isnan().any()
    assert ((out.float() - ref).norm() / ref.norm()).item() <= 1e-3
    assert probs.shape == (len(CONTEXTS), SPEC.n_kv_heads, meta.decode_block_tables.shape[1] * BLOCK)
    group = SPEC.n_heads // SPEC.n_kv_heads
    for i, (ctx, first) in enumerate(zip(CONTEXTS, FIRSTS)):
        theirs = stats[i].probs_last
        ours = probs[i, :, :ctx]
        assert ((ours - theirs).norm() / theirs.norm()).item() <= 1e-3
        assert (ours - theirs).abs().max().item() <= 1e-3
        lo = first[layer] if first else 0
        assert float(probs[i, :, :lo].abs().sum()) == 0.0 and float(probs[i, :, ctx:].abs().sum()) == 0.0
        torch.testing.assert_close(ours.sum(-1), torch.full((SPEC.n_kv_heads,), float(group), device=DEVICE),
                                   rtol=0, atol=1e-3)


def test_decode_without_first_slots_is_unchanged_by_them():
    """First slots all zero (a layer that kept everything) give the output of a step without first slots."""
    store, tables, q = _eviction_case((4, 4), 16, 5)
    key, value = store.layer(0)
    plain = build_attention_metadata(tables, [1] * len(CONTEXTS), CONTEXTS, BLOCK, ring(store, len(CONTEXTS)), DEVICE)
    zeros = build_attention_metadata(tables, [1] * len(CONTEXTS), CONTEXTS, BLOCK, ring(store, len(CONTEXTS)), DEVICE,
                                     first_slots=[(0, 0)] * 4 + [(0, 1)])
    assert zeros.decode_first_slots is not None
    a, _ = ta.paged_decode(q, key, value, plain, SCALE)
    b, _ = ta.paged_decode(q, key, value, zeros, SCALE)
    assert torch.equal(a, b)


@pytest.mark.parametrize("bits,window", [((16, 16), 0), ((4, 4), 16)])
def test_paged_attention_sends_eviction_decodes_to_triton_and_files_statistics(bits, window, monkeypatch):
    """`paged_attention` on the Triton path (forced on a CPU: the interpreter) with statistics and first
    slots: the decode rows' output and `meta.stats` equal the PyTorch path's; a prefill chunk in the same
    step (statistics wanted, no first slots of its own) still takes the PyTorch path and files its own."""
    from skistune.kernels import attention

    _tile(monkeypatch, 16)
    store, tables, q = _eviction_case(bits, window, 17 + window)
    key, value = store.layer(0)
    query_lens = [1, 1, 12, 1, 1]  # the third sequence's last 12 tokens are a prefill chunk ...
    firsts = FIRSTS[:2] + [()] + FIRSTS[3:]  # ... without empty slots: only the statistics keep it off Triton
    gen = torch.Generator().manual_seed(3)
    qs = torch.randn(sum(query_lens), SPEC.n_heads, SPEC.head_dim, generator=gen).half().to(DEVICE)

    def attend(triton_on):
        monkeypatch.setattr(attention, "_use_triton", lambda q: triton_on)
        monkeypatch.setattr(attention.cpu_native, "supports", lambda *a: False)
        meta = _eviction_meta(store, tables, query_lens, firsts)
        for layer in range(2):
            out = attention.paged_attention(qs if triton_on else qs.float(), key, value, meta, SCALE)
        return out.float(), meta

    ours, meta = attend(True)
    theirs, ref = attend(False)
    assert ((ours - theirs).norm() / theirs.norm()).item() <= 1e-3
    assert len(meta.stats) == 2
    for layer in range(2):
        for i, (a, b) in enumerate(zip(meta.stats[layer], ref.stats[layer])):
            assert a.probs_last.shape == b.probs_last.shape == (SPEC.n_kv_heads, CONTEXTS[i])
            for x, y in ((a.probs_last, b.probs_last), (a.probs_sum, b.probs_sum)):
                assert (x.float() - y).abs().max().item() <= 1e-3
            if not SCORED[i]:
                assert float(a.probs_sum.abs().sum()) == 0.0


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("is_key", [True, False])
def test_quantize_kernel_writes_the_same_bytes_as_pytorch(bits, is_key):
    gen = torch.Generator().manual_seed(bits * 2 + is_key)
    stores = [make_store((bits, bits), slots=1, dtype=torch.float16, device=DEVICE, num_blocks=8) for _ in range(2)]
    x = (torch.randn(3 * BLOCK, SPEC.n_kv_heads, SPEC.head_dim, generator=gen) * 4).half().to(DEVICE)
    ids = torch.tensor([6, 2, 5], device=DEVICE)
    side = 0 if is_key else 1
    ta.quantize_into(stores[0].layers[0][side], x, ids, stores[0].value_group)
    if DEVICE == "cuda":  # quantize_blocks would take the Triton path too: compare with the CPU's
        cpu = make_store((bits, bits), slots=1, dtype=torch.float16, num_blocks=8)
        quantize_blocks(cpu.layers[0][side], x.cpu(), ids.cpu(), cpu.value_group)
        ref = cpu.layers[0][side]
    else:
        quantize_blocks(stores[1].layers[0][side], x, ids, stores[1].value_group)
        ref = stores[1].layers[0][side]
    got = stores[0].layers[0][side]
    if DEVICE == "cuda":  # the GPU's float division may round a code that sits on a .5 boundary the other way
        diff = (unpack(got.data.cpu(), bits).int() - unpack(ref.data.cpu(), bits).int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
    else:
        assert torch.equal(got.data.cpu(), ref.data.cpu())
    torch.testing.assert_close(got.scale.cpu(), ref.scale.cpu(), rtol=1e-3, atol=0)
    torch.testing.assert_close(got.zero.cpu(), ref.zero.cpu(), rtol=1e-3, atol=0)


@pytest.mark.parametrize("bits", [(16, 16), (8, 8), (4, 4), (2, 16)])
@pytest.mark.parametrize("context,q_len,window", [(37, 12, 0), (37, 37, 16), (70, 1, 0), (5, 5, 0)])
def test_prefill_matches_pytorch(bits, context, q_len, window):
    """A prefill chunk's causal attention over its cached context (and itself)."""
    from skistune.kernels.attention import paged_attention

    gen = torch.Generator().manual_seed(context * 31 + q_len + bits[0])
    store = make_store(bits, slots=1, window=window, dtype=torch.float16, device=DEVICE)
    tables = scattered_tables([context], store.num_blocks, gen)
    fill(store, tables, [context], gen, dtype=torch.float16, device=DEVICE, decode_steps=0)
    q = torch.randn(q_len, SPEC.n_heads, SPEC.head_dim, generator=gen).half().to(DEVICE)
    meta = build_attention_metadata(tables, [q_len], [context], BLOCK, ring(store, 1), DEVICE)
    key, value = store.layer(0)
    out = ta.paged_prefill(q, key, value, meta.prefills[0].block_ids if q_len > 1 else meta.decode_block_tables[0],
                           context, 0.17, fp_start=store.full_precision_start(context, 0), slot=0,
                           ring_tokens=store.ring_tokens, block_size=BLOCK)
    # the reference: the PyTorch path on the CPU (on CUDA, paged_attention would dispatch to Triton)
    cpu_meta = build_attention_metadata(tables, [q_len], [context], BLOCK, ring(store, 1), "cpu")
    ref = paged_attention(q.float().cpu(), _to_cpu(key), _to_cpu(value), cpu_meta, 0.17)
    assert not out.isnan().any()
    assert ((out.float().cpu() - ref.cpu()).norm() / ref.norm()).item() <= 1e-3


def _to_cpu(side):
    return dataclasses.replace(side, **{f: getattr(side, f).cpu() for f in ("data", "scale", "zero", "ring")
                                        if getattr(side, f) is not None})


@pytest.mark.parametrize("bits,triton_runs", [((16, 16), True), ((8, 8), True), ((4, 4), False), ((2, 16), False)])
def test_prefill_takes_the_triton_kernel_only_at_the_bits_it_passed_compiled(monkeypatch, bits, triton_runs):
    """Compiled on an H200, the Triton prefill over 4-bit KV gave wrong results (the interpreter passes):
    chunks over 4- or 2-bit keys or values take the PyTorch path, with the same output."""
    from skistune.kernels import attention

    gen = torch.Generator().manual_seed(7)
    store = make_store(bits, slots=1, dtype=torch.float16, device=DEVICE)
    tables = scattered_tables([37], store.num_blocks, gen)
    fill(store, tables, [37], gen, dtype=torch.float16, device=DEVICE, decode_steps=0)
    q = torch.randn(12, SPEC.n_heads, SPEC.head_dim, generator=gen).half().to(DEVICE)
    key, value = store.layer(0)
    calls = []
    kernel = ta.paged_prefill
    monkeypatch.setattr(ta, "paged_prefill", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    monkeypatch.setattr(attention, "_use_triton", lambda q: True)
    meta = build_attention_metadata(tables, [12], [37], BLOCK, ring(store, 1), DEVICE)
    out = attention.paged_attention(q, key, value, meta, 0.17)
    assert bool(calls) is triton_runs
    cpu_meta = build_attention_metadata(tables, [12], [37], BLOCK, ring(store, 1), "cpu")
    ref = attention.paged_attention(q.float().cpu(), _to_cpu(key), _to_cpu(value), cpu_meta, 0.17)
    assert ((out.float().cpu() - ref).norm() / ref.norm()).item() <= 1e-3


def test_a_kernel_left_unspecialized_on_a_name_it_lacks_is_an_error():
    """Triton ignores a do_not_specialize name that is no parameter; the decorator does not."""
    def kernel(X, n):
        pass

    with pytest.raises(TypeError, match="kernel: no parameter width"):
        ta._jit_unspecialized("n", "width")(kernel)


def test_heads_that_are_not_a_power_of_two_take_the_pytorch_path():
    """The Triton kernels index a head with tl.arange(0, head_dim): 48 failed in decode, prefill and quantize."""
    from types import SimpleNamespace

    from skistune.kernels.attention import _use_triton, triton_head_dim

    assert [d for d in (32, 48, 64, 80, 96, 128, 256) if triton_head_dim(d)] == [32, 64, 128, 256]
    assert not _use_triton(SimpleNamespace(is_cuda=True, shape=(3, 9, 48)))
