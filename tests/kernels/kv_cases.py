"""Random paged KV for kernel tests: a one-layer store at given bits, filled through the runtime's own
write path (prefill then decode steps), and a float64 reference that reads back what was stored."""
from __future__ import annotations


import torch

from skistune.config import KVConfig
from skistune.kernels.attention import RingInfo, build_attention_metadata, write_kv
from skistune.kernels.quant import dequantize_keys, dequantize_values
from skistune.runtime.kv_store import PagedKVStore
from skistune.runtime.presets import ModelSpec

SPEC = ModelSpec("test", n_layers=1, hidden=0, n_heads=6, n_kv_heads=2, head_dim=32, ffn_hidden=0,
                 vocab_size=0, rope_theta=1e4, max_context=4096)
BLOCK = 16


def make_store(bits: tuple[int, int], slots: int, window: int = 0, dtype=torch.float32, device="cpu",
               num_blocks: int = 64, group: int = 16, spec: ModelSpec = SPEC) -> PagedKVStore:
    cfg = KVConfig().with_knobs({"bitwidth.key_bits": bits[0], "bitwidth.value_bits": bits[1],
                                 "bitwidth.full_precision_window": window, "bitwidth.group_size": group,
                                 "batching.max_num_seqs": slots, "prefix_reuse.block_size": BLOCK})
    return PagedKVStore(spec, num_blocks, BLOCK, dtype, device, cfg)


def scattered_tables(contexts: list[int], num_blocks: int, gen: torch.Generator) -> list[list[int]]:
    """Block tables with holes: each sequence's blocks are random, non-adjacent ids."""
    ids = (torch.randperm(num_blocks, generator=gen) + 1).tolist()
    tables, at = [], 0
    for ctx in contexts:
        n = -(-ctx // BLOCK)
        tables.append(ids[at:at + n])
        at += n
    return tables


def ring(store: PagedKVStore, n: int) -> RingInfo | None:
    return RingInfo(list(range(n)), [0] * n, store.ring_tokens, store.window) if store.quantized else None


def fill(store: PagedKVStore, tables, contexts, gen, dtype=torch.float32, device="cpu", decode_steps: int = 3):
    """Write every sequence's KV: a prefill of all but the last ``decode_steps`` tokens, then decodes.
    Returns the full-precision K, V written per sequence (``[ctx, n_kv, D]`` each)."""
    key, value = store.layer(0)
    spec_kv = key.data.shape[-2]
    d = key.ring.shape[-1] if key.quantized else key.data.shape[-1]
    written = [(torch.randn(c, spec_kv, d, generator=gen, dtype=torch.float64).to(dtype).to(device),
                torch.randn(c, spec_kv, d, generator=gen, dtype=torch.float64).to(dtype).to(device)) for c in contexts]
    first = [max(1, c - decode_steps) for c in contexts]
    steps = [(first, [0] * len(contexts))] + [([1] * len(contexts), [f + i for f in first]) for i in range(decode_steps)]
    for qlens, starts in steps:
        live = [i for i, (c, s) in enumerate(zip(contexts, starts)) if s < c]
        if not live:
            continue
        q = [min(qlens[i], contexts[i] - starts[i]) for i in live]
        r = ring(store, len(contexts))
        if r is not None:
            r = RingInfo([r.slots[i] for i in live], [0] * len(live), r.ring_tokens, r.window)
        meta = build_attention_metadata([tables[i] for i in live], q, [starts[i] + n for i, n in zip(live, q)],
                                        BLOCK, r, device)
        k = torch.cat([written[i][0][starts[i]:starts[i] + n] for i, n in zip(live, q)])
        v = torch.cat([written[i][1][starts[i]:starts[i] + n] for i, n in zip(live, q)])
        write_kv(key, value, k, v, meta, store.value_group)
    return written


def stored_kv(store: PagedKVStore, table: list[int], ctx: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the cache holds for one sequence, in float64 ``[ctx, n_kv, D]``: dequantized blocks, with the
    ring's full-precision tokens from the first position the ring covers."""
    out = []
    for side in store.layers[0]:
        ids = torch.tensor(table)
        if not side.quantized:
            x = side.data[ids].double().flatten(0, 1)
        elif side.is_key:
            x = dequantize_keys(side.data[ids], side.scale[ids], side.zero[ids], side.bits).double().flatten(0, 1)
        else:
            x = dequantize_values(side.data[ids], side.scale[ids], side.zero[ids], side.bits).double().flatten(0, 1)
        if side.quantized:
            for p in range(store.full_precision_start(ctx, 0), ctx):
                x[p] = side.ring[slot, p % store.ring_tokens].double()
        out.append(x[:ctx])
    return out[0], out[1]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int | None = None):
    """float64 attention of ``q [Q, H, D]`` over ``k, v [L, KVH, D]`` (GQA by repetition)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if causal_offset is not None:
        qpos = torch.arange(q.shape[0]).unsqueeze(1) + causal_offset
        s = s.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
