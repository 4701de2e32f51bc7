"""The compiled CPU decode kernel (`kernels/paged_decode_cpu.c`) against float64 attention over what the
cache holds and against the PyTorch path: GQA shapes of real models, every bitwidth and value group,
full-precision windows and prefix hits (rows whose ring starts late), evicted first slots and the
attention statistics, block tables with holes; its build, cache and fallback."""
import dataclasses
import subprocess
import sys

import pytest
import torch

from skistune.kernels import attention, cpu_native
from skistune.kernels.attention import RingInfo, build_attention_metadata, paged_attention

from kv_cases import BLOCK, SPEC, fill, make_store, reference_attention, ring, scattered_tables, stored_kv

CONTEXTS = [1, 16, 17, 95, 300, 33]


def _decode(store, tables, contexts, q, ring_info, **meta_kw):
    meta = build_attention_metadata(tables, [1] * len(contexts), contexts, BLOCK, ring_info, **meta_kw)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    out[:] = paged_attention(q, *store.layer(0), meta, q.shape[-1] ** -0.5)
    return out, meta


@pytest.mark.parametrize("bits", [(16, 16), (8, 8), (4, 4), (2, 2), (16, 4), (2, 16), (8, 2)])
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("heads", [(6, 2, 32), (9, 3, 64), (32, 8, 128)])  # test, SmolLM2, Llama-3-8B
def test_equals_float64_attention_over_stored_kv(bits, group, heads):
    assert cpu_native.available()
    n_heads, n_kv, d = heads
    spec = dataclasses.replace(SPEC, n_heads=n_heads, n_kv_heads=n_kv, head_dim=d)
    gen = torch.Generator().manual_seed(hash((bits, group, heads)) % 10_000)
    store = make_store(bits, slots=len(CONTEXTS), window=24, num_blocks=48, group=group, spec=spec)
    tables = scattered_tables(CONTEXTS, store.num_blocks, gen)
    fill(store, tables, CONTEXTS, gen)
    q = torch.randn(len(CONTEXTS), n_heads, d, generator=gen)
    out, _ = _decode(store, tables, CONTEXTS, q, ring(store, len(CONTEXTS)))
    for i, ctx in enumerate(CONTEXTS):
        k, v = stored_kv(store, tables[i], ctx, slot=i)
        ref = reference_attention(q[i:i + 1], k, v, d ** -0.5)
        torch.testing.assert_close(out[i:i + 1].double(), ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("bits", [(16, 16), (4, 8), (2, 2)])
def test_statistics_and_first_slots_equal_the_pytorch_path(bits, monkeypatch):
    """Eviction's inputs: per-layer first slots mask the slots before them; the probabilities summed per
    KV head come out as the PyTorch path computes them, zero before the first slot."""
    gen = torch.Generator().manual_seed(5)
    store = make_store(bits, slots=len(CONTEXTS), window=16, num_blocks=48)
    tables = scattered_tables(CONTEXTS, store.num_blocks, gen)
    fill(store, tables, CONTEXTS, gen)
    q = torch.randn(len(CONTEXTS), SPEC.n_heads, SPEC.head_dim, generator=gen)
    kw = dict(first_slots=[(0,), (), (5,), (40,), (0,), (32,)], scored_queries=[1, 0, 1, 1, 0, 1])
    native, meta = _decode(store, tables, CONTEXTS, q, ring(store, len(CONTEXTS)), **kw)
    monkeypatch.setattr(attention.cpu_native, "supports", lambda *a: False)
    reference, ref_meta = _decode(store, tables, CONTEXTS, q, ring(store, len(CONTEXTS)), **kw)
    torch.testing.assert_close(native, reference, rtol=0, atol=2e-6)
    for ours, theirs, ctx in zip(meta.stats[0], ref_meta.stats[0], CONTEXTS):
        assert ours.probs_last.shape == (SPEC.n_kv_heads, ctx)
        torch.testing.assert_close(ours.probs_sum, theirs.probs_sum, rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.probs_last, theirs.probs_last, rtol=0, atol=1e-6)
    assert float(meta.stats[0][3].probs_last[:, :40].abs().sum()) == 0.0
    group = SPEC.n_heads // SPEC.n_kv_heads  # each KV head's probabilities sum to its query heads' count
    torch.testing.assert_close(meta.stats[0][4].probs_last.sum(-1), torch.full((SPEC.n_kv_heads,), float(group)))


def test_prefix_hits_read_packed_blocks_before_the_ring_start():
    """A row whose first blocks came from the prefix cache has them only packed: positions before its
    ring start are dequantized even inside the full-precision window."""
    gen = torch.Generator().manual_seed(9)
    contexts = [70, 40]
    store = make_store((4, 4), slots=2, window=64, num_blocks=16)
    tables = scattered_tables(contexts, store.num_blocks, gen)
    fill(store, tables, contexts, gen)
    q = torch.randn(2, SPEC.n_heads, SPEC.head_dim, generator=gen)
    starts = [32, 16]  # the ring holds positions from here on (block-aligned, as prefix hits are)
    out, meta = _decode(store, tables, contexts, q, RingInfo([0, 1], starts, store.ring_tokens, store.window))
    assert meta.decode_fp_start.tolist() == starts
    for i, ctx in enumerate(contexts):
        k, v = stored_kv(store, tables[i], ctx, slot=i)  # ring from the window's start: 6 and 0 ...
        k_expected = k.clone()
        for p in range(store.full_precision_start(ctx, 0), starts[i]):  # ... but packed before the ring start
            k_expected[p] = _dequantized_key(store, tables[i], p)
            v[p] = _dequantized_value(store, tables[i], p)
        ref = reference_attention(q[i:i + 1], k_expected, v, SPEC.head_dim ** -0.5)
        torch.testing.assert_close(out[i:i + 1].double(), ref, rtol=0, atol=2e-5)


def _dequantized_key(store, table, p):
    from skistune.kernels.quant import dequantize_keys
    side = store.layers[0][0]
    b = torch.tensor([table[p // BLOCK]])
    return dequantize_keys(side.data[b], side.scale[b], side.zero[b], side.bits)[0, p % BLOCK].double()


def _dequantized_value(store, table, p):
    from skistune.kernels.quant import dequantize_values
    side = store.layers[0][1]
    b = torch.tensor([table[p // BLOCK]])
    return dequantize_values(side.data[b], side.scale[b], side.zero[b], side.bits)[0, p % BLOCK].double()


def test_unsupported_inputs_take_the_pytorch_path():
    store = make_store((16, 16), slots=1)
    q = torch.randn(1, SPEC.n_heads, SPEC.head_dim)
    assert cpu_native.supports(q, *store.layer(0))
    assert not cpu_native.supports(q.double(), *store.layer(0))
    bf16 = make_store((16, 16), slots=1, dtype=torch.bfloat16)
    assert not cpu_native.supports(q, *bf16.layer(0))


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)


def test_build_is_cached_and_falls_back_with_a_warning(tmp_path):
    import os
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    code = "from skistune.kernels import cpu_native; print(cpu_native.available())"
    first = _run(code, env)
    assert first.stdout.strip() == "True", first.stderr
    built = list((tmp_path / "skistune" / "kernels").glob("paged_decode_cpu-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    assert _run(code, env).stdout.strip() == "True" and built[0].stat().st_mtime_ns == mtime  # reused
    off = _run(code, {**env, "SKISTUNE_CPU_KERNELS": "torch"})
    assert off.stdout.strip() == "False" and "Warning" not in off.stderr  # switched off on purpose: silent
    broken = _run(code, {**env, "XDG_CACHE_HOME": str(tmp_path / "other"), "CC": "false"})
    assert broken.stdout.strip() == "False"
    assert "CPU attention kernel unavailable (false failed to build paged_decode_cpu.c" in broken.stderr


PORTABLE_CHECK = """
import sys
import torch
from skistune.kernels import cpu_native
cpu_native.FLAGS = cpu_native.FLAGS + tuple(sys.argv[1:])  # switch the vector paths off
from kv_cases import BLOCK, SPEC, fill, make_store, ring, scattered_tables, stored_kv, reference_attention
from skistune.kernels.attention import build_attention_metadata, paged_attention
assert cpu_native.available()
contexts = [1, 17, 95, 300]
for bits in ((16, 16), (4, 4), (2, 8)):
    gen = torch.Generator().manual_seed(3)
    store = make_store(bits, slots=len(contexts), window=24, num_blocks=48)
    tables = scattered_tables(contexts, store.num_blocks, gen)
    fill(store, tables, contexts, gen)
    q = torch.randn(len(contexts), SPEC.n_heads, SPEC.head_dim, generator=gen)
    meta = build_attention_metadata(tables, [1] * len(contexts), contexts, BLOCK, ring(store, len(contexts)))
    out = paged_attention(q, *store.layer(0), meta, SPEC.head_dim ** -0.5)
    for i, ctx in enumerate(contexts):
        k, v = stored_kv(store, tables[i], ctx, slot=i)
        torch.testing.assert_close(out[i:i + 1].double(), reference_attention(q[i:i + 1], k, v, SPEC.head_dim ** -0.5),
                                   rtol=0, atol=2e-5)
print("ok")
"""


def test_the_portable_build_without_x86_vector_paths_is_as_exact(tmp_path):
    """Hosts without AVX2 (or not x86 at all) compile the kernel's portable dot product: built here with the
    vector paths switched off, it matches float64 attention like the AVX-512/AVX2 build."""
    import os
    import platform
    off = ["-mno-avx512f", "-mno-avx2", "-mno-fma"] if platform.machine() in ("x86_64", "AMD64") else []
    here = os.path.dirname(__file__)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", PORTABLE_CHECK, *off], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
    assert list((tmp_path / "skistune" / "kernels").glob("paged_decode_cpu-*.so"))
