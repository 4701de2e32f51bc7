"""The kernels one by one, outside the model: paged attention of one layer over random paged KV, timed
for decode batches and prefill chunks on the same grid as the steps, at 16 bits and at each quantized
bitwidth (a one-layer `PagedKVStore` at those bits: packed codes, scales, zero points and the
full-precision rings); and quantize-on-append of full blocks, one layer's keys and values. ``write_kv``
and the projections are the rest of the step, in the step fit."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch

from ..config import KVConfig
from ..kernels.attention import RingInfo, build_attention_metadata, paged_attention, quantize_blocks
from ..runtime.kv_layout import KVTraffic, kv_traffic
from ..runtime.kv_store import PagedKVStore
from ..runtime.presets import ModelSpec
from .harness import time_fn
from .records import GridPoint, kv_bits

ATTENTION_FEATURES = ("fixed", "seqs", "decode_kv_bytes", "prefill_pairs", "decode_dequant_elements",
                      "prefill_kv_bytes", "prefill_dequant_elements")
QUANTIZE_FEATURES = ("fixed", "elements")


def layer_config(bits: int, block_size: int, seqs: int) -> KVConfig:
    """Keys and values at ``bits``, one full-precision ring slot per sequence of the call."""
    return KVConfig().with_knobs({"bitwidth.key_bits": bits, "bitwidth.value_bits": bits,
                                  "batching.max_num_seqs": max(1, seqs), "prefix_reuse.block_size": block_size})


def one_layer(spec: ModelSpec) -> ModelSpec:
    return dataclasses.replace(spec, n_layers=1)


def layer_traffic(spec: ModelSpec, bits: int, block_size: int, itemsize: int) -> KVTraffic:
    """What one layer's attention reads and converts per token at ``bits`` (the runtime's own layout)."""
    return kv_traffic(layer_config(bits, block_size, 1), one_layer(spec), itemsize)


def _attention_inputs(spec: ModelSpec, block_size: int, dtype: torch.dtype, device: torch.device, bits: int,
                      query_lens: list[int], context_lens: list[int], rng: np.random.Generator):
    """Random queries and one layer's paged KV at ``bits`` in randomly placed blocks (block 0 stays the zero
    pad); each sequence owns a ring slot and wrote every position itself (ring start 0)."""
    blocks_per_seq = [-(-ctx // block_size) for ctx in context_lens]
    ids = (rng.permutation(sum(blocks_per_seq)) + 1).tolist()
    tables, start = [], 0
    for n in blocks_per_seq:
        tables.append(ids[start:start + n])
        start += n
    store = PagedKVStore(one_layer(spec), sum(blocks_per_seq), block_size, dtype, device,
                         layer_config(bits, block_size, len(query_lens)))
    store.fill_random_()  # the timing does not depend on the values, only on none being zero pages
    n = len(query_lens)
    ring = RingInfo(list(range(n)), [0] * n, store.ring_tokens, store.window) if store.quantized else None
    q = torch.randn(sum(query_lens), spec.n_heads, spec.head_dim, dtype=dtype, device=device)  # [T, H, D]
    meta = build_attention_metadata(tables, query_lens, context_lens, block_size, ring, device=device)
    return (q, *store.layer(0), meta)


def attention_timings(spec: ModelSpec, block_size: int, dtype: torch.dtype, device: torch.device, *,
                      decode: Sequence[tuple[int, int]], prefill: Sequence[tuple[int, int]],
                      warmup: int, repeats: int, min_time_s: float = 0.0, bits: Sequence[int] = (16,),
                      tick=lambda label: None) -> list[GridPoint]:
    """One layer's ``paged_attention``: decode (batch, context) and prefill (chunk, cached) points, each at
    every bitwidth of ``bits`` (KV bits for keys and values alike)."""
    rng = np.random.default_rng()
    scale = spec.head_dim ** -0.5
    cases = [("decode", {"batch": b, "context": c}, [1] * b, [c] * b) for b, c in decode]
    cases += [("prefill", {"chunk": n, "cached": k}, [n], [k + n]) for n, k in prefill]
    points = []
    for b in bits:
        for kind, grid, query_lens, context_lens in cases:
            def fresh_inputs(query_lens: list[int] = query_lens, context_lens: list[int] = context_lens, b: int = b):
                return _attention_inputs(spec, block_size, dtype, device, b, query_lens, context_lens, rng)

            timing = time_fn(lambda inputs: paged_attention(*inputs, scale), fresh_inputs,
                             warmup=warmup, repeats=repeats, device=device, max_repeats=10 * repeats,
                             min_time_s=min_time_s)
            points.append(GridPoint(kind, {**grid, "bits": b}, timing))
            tick(f"attention {kind} {grid}, {b}-bit KV")
    return points


def attention_features(point: GridPoint, spec: ModelSpec, block_size: int, itemsize: int) -> list[float]:
    """Features of `ATTENTION_FEATURES` for one point: decode reads every context byte once per sequence
    (at the point's bits, with its ring) and converts every quantized element; prefill does work per
    query-key pair on top of reading and converting its context once."""
    g = point.grid
    kv = layer_traffic(spec, kv_bits(g), block_size, itemsize)
    q = kv.quantized_elements_per_token
    if point.kind == "decode":
        tokens = g["batch"] * g["context"]
        return [1.0, g["batch"], tokens * kv.bytes_per_token + g["batch"] * kv.ring_bytes_per_seq, 0.0,
                tokens * q, 0.0, 0.0]
    context = g["cached"] + g["chunk"]
    return [1.0, 1.0, 0.0, g["chunk"] * context, 0.0, context * kv.bytes_per_token + kv.ring_bytes_per_seq,
            context * q]


def quantize_timings(spec: ModelSpec, block_size: int, dtype: torch.dtype, device: torch.device, *,
                     blocks: Sequence[int], bits: Sequence[int], warmup: int, repeats: int,
                     min_time_s: float = 0.0, tick=lambda label: None) -> list[GridPoint]:
    """Quantize-on-append of ``blocks`` full blocks into one layer's keys and values, at each of ``bits``."""
    n_kv, d = spec.n_kv_heads, spec.head_dim
    points = []
    for b in bits:
        for n in blocks:
            def fresh_inputs(n: int = n, b: int = b):
                store = PagedKVStore(one_layer(spec), n, block_size, dtype, device, layer_config(b, block_size, 1))
                staging = torch.empty(n * block_size, n_kv, d, dtype=dtype, device=device).uniform_(-1, 1)
                return store, staging, torch.arange(1, n + 1, device=device)

            def append(inputs) -> None:
                store, staging, ids = inputs
                for side in store.layer(0):
                    quantize_blocks(side, staging, ids, store.value_group)

            timing = time_fn(append, fresh_inputs, warmup=warmup, repeats=repeats, device=device,
                             max_repeats=10 * repeats, min_time_s=min_time_s)
            points.append(GridPoint("quantize", {"blocks": n, "bits": b}, timing))
            tick(f"quantize-on-append: {n} blocks, {b}-bit KV")
    return points


def quantize_features(point: GridPoint, spec: ModelSpec, block_size: int) -> list[float]:
    """Features of `QUANTIZE_FEATURES`: the keys' and values' elements of the blocks."""
    return [1.0, point.grid["blocks"] * block_size * 2 * spec.n_kv_heads * spec.head_dim]
