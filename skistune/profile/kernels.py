"""The kernels one by one, outside the model: paged attention of one layer over random paged KV, timed
for decode batches and prefill chunks on the same grid as the steps (``write_kv`` and the projections
are the rest of the step, in the step fit)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..kernels.attention import build_attention_metadata, paged_attention
from ..runtime.kv_store import KVSide
from ..runtime.presets import ModelSpec
from .harness import time_fn
from .records import GridPoint

ATTENTION_FEATURES = ("fixed", "seqs", "decode_kv_bytes", "prefill_pairs")


def _attention_inputs(spec: ModelSpec, block_size: int, dtype: torch.dtype, device: torch.device,
                      query_lens: list[int], context_lens: list[int], rng: np.random.Generator):
    """Random queries and one layer's paged KV in randomly placed blocks (block 0 stays the zero pad)."""
    blocks_per_seq = [-(-ctx // block_size) for ctx in context_lens]
    ids = (rng.permutation(sum(blocks_per_seq)) + 1).tolist()
    tables, start = [], 0
    for n in blocks_per_seq:
        tables.append(ids[start:start + n])
        start += n
    shape = (sum(blocks_per_seq) + 1, block_size, spec.n_kv_heads, spec.head_dim)  # [N + 1, bs, KVH, D]
    k_cache = torch.empty(shape, dtype=dtype, device=device).uniform_(-1, 1)
    v_cache = torch.empty(shape, dtype=dtype, device=device).uniform_(-1, 1)
    k_cache[0] = v_cache[0] = 0
    q = torch.randn(sum(query_lens), spec.n_heads, spec.head_dim, dtype=dtype, device=device)  # [T, H, D]
    meta = build_attention_metadata(tables, query_lens, context_lens, block_size, device=device)
    return q, KVSide(16, True, k_cache), KVSide(16, False, v_cache), meta


def attention_timings(spec: ModelSpec, block_size: int, dtype: torch.dtype, device: torch.device, *,
                      decode: Sequence[tuple[int, int]], prefill: Sequence[tuple[int, int]],
                      warmup: int, repeats: int, min_time_s: float = 0.0,
                      tick=lambda label: None) -> list[GridPoint]:
    """One layer's ``paged_attention``: decode (batch, context) and prefill (chunk, cached) points."""
    rng = np.random.default_rng()
    scale = spec.head_dim ** -0.5
    cases = [("decode", {"batch": b, "context": c}, [1] * b, [c] * b) for b, c in decode]
    cases += [("prefill", {"chunk": n, "cached": k}, [n], [k + n]) for n, k in prefill]
    points = []
    for kind, grid, query_lens, context_lens in cases:
        def fresh_inputs(query_lens: list[int] = query_lens, context_lens: list[int] = context_lens):
            return _attention_inputs(spec, block_size, dtype, device, query_lens, context_lens, rng)

        timing = time_fn(lambda inputs: paged_attention(*inputs, scale), fresh_inputs,
                         warmup=warmup, repeats=repeats, device=device, max_repeats=10 * repeats,
                         min_time_s=min_time_s)
        points.append(GridPoint(kind, grid, timing))
        tick(f"attention {kind} {grid}")
    return points


def attention_features(point: GridPoint, kv_bytes_per_token_layer: int) -> list[float]:
    """Features of `ATTENTION_FEATURES` for one point: decode reads every context byte once per sequence,
    prefill does work per query-key pair."""
    g = point.grid
    if point.kind == "decode":
        return [1.0, g["batch"], g["batch"] * g["context"] * kv_bytes_per_token_layer, 0.0]
    return [1.0, 1.0, 0.0, g["chunk"] * (g["cached"] + g["chunk"])]
