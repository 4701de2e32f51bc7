"""Paged attention over block tables (PyTorch implementation, used on CPUs).

The KV store of one layer is ``k_cache, v_cache: [num_blocks + 1, block_size, n_kv_heads, head_dim]``
(block 0 is the zeroed null block that pads block tables). A step's queries are flattened over the
batch: ``q: [T, n_heads, head_dim]`` with sequence i owning ``query_lens[i]`` consecutive rows whose
positions are the last ``query_lens[i]`` of its ``context_lens[i]`` tokens (whose KV is already
written). Decode rows (one query) are attended in one batched call; prefill chunks one by one with a
causal mask offset by the cached context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    rows: slice  # rows of q
    block_ids: torch.Tensor  # [n_blocks] covering the context
    context_len: int
    mask: torch.Tensor | None  # [q_len, context_len] bool, None when the chunk is the whole context


@dataclass
class AttentionMetadata:
    """Everything about a step's batch layout that is the same for every layer (built once per step)."""

    slot_mapping: torch.Tensor  # [T] flat KV slot of each new token
    decode_rows: torch.Tensor  # [Bd] rows of q that are single-token decodes
    decode_block_tables: torch.Tensor  # [Bd, n_blocks]
    decode_mask: torch.Tensor  # [Bd, 1, 1, n_blocks * block_size] bool: key position < context length
    prefills: list[PrefillChunk]


def build_attention_metadata(block_tables: list[list[int]], query_lens: list[int], context_lens: list[int],
                             block_size: int) -> AttentionMetadata:
    """Batch layout of one step; ``block_tables[i]`` covers at least ``context_lens[i]`` tokens."""
    slots, decode_rows, decode_tables, decode_ctx, prefills = [], [], [], [], []
    row = 0
    for table, q_len, ctx in zip(block_tables, query_lens, context_lens):
        for pos in range(ctx - q_len, ctx):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        n_blocks = -(-ctx // block_size)
        if q_len == 1:
            decode_rows.append(row)
            decode_tables.append(table[:n_blocks])
            decode_ctx.append(ctx)
        else:
            mask = None
            if q_len != ctx:
                q_pos = torch.arange(ctx - q_len, ctx).unsqueeze(1)
                mask = torch.arange(ctx).unsqueeze(0) <= q_pos
            prefills.append(PrefillChunk(slice(row, row + q_len), torch.tensor(table[:n_blocks]), ctx, mask))
        row += q_len
    width = max((len(t) for t in decode_tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in decode_tables]
    decode_mask = torch.arange(width * block_size).unsqueeze(0) < torch.tensor(decode_ctx).unsqueeze(1)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        decode_rows=torch.tensor(decode_rows, dtype=torch.long),
        decode_block_tables=torch.tensor(padded, dtype=torch.long).reshape(len(padded), width),
        decode_mask=decode_mask.reshape(len(decode_ctx), 1, 1, width * block_size),
        prefills=prefills)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values ``[T, n_kv_heads, head_dim]`` at their flat slots."""
    n_kv, d = k_cache.shape[-2:]
    k_cache.view(-1, n_kv, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, n_kv, d).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[..., n_blocks] block ids -> [..., n_kv_heads, n_blocks * block_size, head_dim]."""
    blocks = cache[block_ids]  # [..., n_blocks, block_size, n_kv, d]
    flat = blocks.flatten(-4, -3)  # [..., L, n_kv, d]
    return flat.transpose(-3, -2)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Attention of the step's queries ``[T, n_heads, head_dim]`` over their paged context."""
    out = torch.empty_like(q)
    if meta.decode_rows.numel():
        qd = q[meta.decode_rows].unsqueeze(2)  # [Bd, H, 1, D]
        k = _gather(k_cache, meta.decode_block_tables)  # [Bd, KVH, L, D]
        v = _gather(v_cache, meta.decode_block_tables)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
        out[meta.decode_rows] = o.squeeze(2)
    for chunk in meta.prefills:
        qp = q[chunk.rows].transpose(0, 1)  # [H, q_len, D]
        k = _gather(k_cache, chunk.block_ids)[:, :chunk.context_len]  # [KVH, ctx, D]
        v = _gather(v_cache, chunk.block_ids)[:, :chunk.context_len]
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                           scale=scale, enable_gqa=True)
        out[chunk.rows] = o.transpose(0, 1)
    return out
