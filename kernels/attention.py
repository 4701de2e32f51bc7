"""Paged attention over block tables, and writing new KV into the paged store.

One entry point per op, two implementations: PyTorch (CPUs, and the reference) and Triton (CUDA,
`kernels.triton_attention`), chosen by the device of the query. On a CPU the decode rows go to a compiled
C kernel (`kernels.cpu_native`, built on first use) that reads each row's own blocks and dequantizes packed
KV in registers: the PyTorch path below, which dequantizes into a full-precision copy, made 8/4/2-bit KV
slower than 16-bit, and it stays the fallback where no C compiler exists (and for prefill chunks).

A layer's KV is two `KVSide`s (keys, values; see `skistune.runtime.kv_store`), each at 16 bits or
packed 8/4/2 bits with a full-precision ring of each running sequence's newest tokens. A step's queries
are flattened over the batch: ``q: [T, n_heads, head_dim]`` with sequence i owning ``query_lens[i]``
consecutive rows whose KV positions are the last ``query_lens[i]`` of its ``context_lens[i]`` (whose
KV is already written). Decode rows (one query) are attended in one batched call; prefill chunks one
by one with a causal mask offset by the cached context.

PyTorch path: the blocks are gathered whole (``index_select``) and handed to
``scaled_dot_product_attention`` as a transposed view, with GQA left to the kernel (``enable_gqa``) and an
additive mask built once per step: no copy of the context but the gather. It replaced two grouped matmuls
on contiguous copies gathered by advanced indexing (`benchmarks/kernels.py --device cpu --model
smollm2-135m --shapes 8x2048 --bits 16`: 7.7 -> 4.4 ms per layer; decode steps of the runtime at batch 32,
SmolLM2: 183 -> 150 ms). The grouped matmuls stay for steps that need the attention probabilities
(eviction statistics). Quantized sides are dequantized after the gather, then the ring's full-precision
tokens are laid over the positions they cover. A batched call pads every decode row to the batch's longest
context, so the decode rows are attended in groups of similar length (`decode_groups`): one long sequence
among short ones made every row pay for its length (a decode step of 7 x 40 + 1 x 840 context tokens
took 265 ms against 155 ms for 8 x 160).

Eviction. Context positions here are KV slots: after an eviction compaction a sequence's slots are fewer
than its tokens (the runner passes ``context_lens = kv_start + query_len``; RoPE positions are the model's
business). A layer that keeps fewer tokens than the largest leaves its first slots empty: the metadata then
carries each sequence's first slot per layer (``first_slots``) and attention masks the slots before it.
Policies that score tokens by attention ask for statistics (``scored_queries``): the softmax probabilities
the attention computes anyway are summed per KV head and kept in ``meta.stats`` (the PyTorch path and the
compiled CPU kernel need no second pass for them). The compiled CPU decode kernel and the Triton decode
kernel do both: Triton masks the first slots in its split loop and writes the statistics by a second small
kernel that recomputes the scores from the keys (`kernels.triton_attention`); its decode rows take them
on CUDA. Prefill chunks that need either still take the PyTorch path (`_prefill_torch`) on CUDA too: the
Triton prefill kernel has neither.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..runtime.kv_layout import full_precision_start
from . import cpu_native
from .quant import dequantize_keys, dequantize_values, quantize_keys, quantize_values


@dataclass
class RingOverlay:
    """Positions of a gathered context read from the full-precision ring instead of packed blocks."""

    rows: torch.Tensor  # [n] which sequence of the batch (decode) or zeros (one prefill chunk)
    positions: torch.Tensor  # [n] KV position in that sequence's context
    sources: torch.Tensor  # [n] flat ring row: slot * ring_tokens + position % ring_tokens


DECODE_GROUP_RATIO = 2  # a decode group's rows read more than 1/ratio of its longest row's blocks ...
DECODE_GROUP_MIN_SAVING_BLOCKS = 8  # ... unless a row is fewer blocks short than this (another call per layer
# costs about what attending 8 blocks of padding does)


def decode_groups(blocks: list[int]) -> list[list[int]]:
    """Decode rows (their contexts in blocks) in the groups the PyTorch path attends together, longest
    first: a row joins the current group unless padding it to the group's width would more than double its
    reads and cost at least `DECODE_GROUP_MIN_SAVING_BLOCKS` blocks."""
    groups: list[list[int]] = []
    width = 0
    for i in sorted(range(len(blocks)), key=lambda r: -blocks[r]):
        if groups and (blocks[i] * DECODE_GROUP_RATIO > width or width - blocks[i] < DECODE_GROUP_MIN_SAVING_BLOCKS):
            groups[-1].append(i)
        else:
            groups.append([i])
            width = blocks[i]
    return groups


@dataclass
class DecodeGroup:
    """Decode rows attended in one call, with the slices of the step's decode metadata they need."""

    rows: torch.Tensor | None  # [g] decode rows of the group; None: all of them, in order
    block_tables: torch.Tensor  # [g, width]
    mask: torch.Tensor  # [g, 1, 1, width * block_size]
    overlay: RingOverlay | None
    first_slots: torch.Tensor | None  # [n_layers, g]
    seqs: list[int]  # index in the batch of each row
    context_lens: list[int]


@dataclass
class AppendPlan:
    """Quantized stores only: the blocks this step completes (quantized from the ring's older tokens and
    the step's new ones), and the ring rows the new tokens go to."""

    block_ids: torch.Tensor  # [n] physical blocks completed this step
    from_ring_dst: torch.Tensor  # rows of the [n * block_size] staging buffer filled from the ring
    from_ring_src: torch.Tensor  # flat ring rows they come from
    from_new_dst: torch.Tensor  # rows of the staging buffer filled from the step's new tokens
    from_new_src: torch.Tensor  # rows of k/v
    ring_dst: torch.Tensor  # flat ring rows written with new tokens
    ring_src: torch.Tensor  # rows of k/v


@dataclass
class PrefillChunk:
    rows: slice  # rows of q
    block_ids: torch.Tensor  # [n_blocks] covering the context
    context_len: int
    overlay: RingOverlay | None = None
    seq: int = 0  # index of the sequence in the step's batch
    first_slots: tuple[int, ...] = ()  # per layer, the first slot holding a token (empty: no slot is empty)
    fp_start: int | None = None  # quantized stores: first position read from the ring (slot `ring_slot`)
    ring_slot: int = 0
    _mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def mask(self) -> torch.Tensor:
        """``[q_len, context_len]`` additive: 0 where a query sees the key, -inf elsewhere. The PyTorch path's
        alone, so built at its first use (on a GPU a 512-token chunk after 4,096 cached tokens would build
        and copy 9 MB a step that the Triton kernel never reads)."""
        if self._mask is None:
            q_len, ctx = self.rows.stop - self.rows.start, self.context_len
            visible = torch.arange(ctx).unsqueeze(0) <= torch.arange(ctx - q_len, ctx).unsqueeze(1)
            self._mask = _additive(visible).to(self.block_ids.device)
        return self._mask


@dataclass
class SeqStats:
    """One sequence's attention probabilities at one layer over its slots ``[0, context_len)``, summed over
    the query heads of each KV head (zero in masked slots): ``probs_sum`` also over the step's last
    ``scored_queries`` queries, ``probs_last`` the newest query's alone. Both ``[n_kv_heads, context_len]``."""

    probs_sum: torch.Tensor
    probs_last: torch.Tensor


@dataclass
class AttentionMetadata:
    """Everything about a step's batch layout that is the same for every layer (built once per step)."""

    slot_mapping: torch.Tensor  # [T] flat KV slot of each new token
    decode_rows: torch.Tensor  # [Bd] rows of q that are single-token decodes
    decode_block_tables: torch.Tensor  # [Bd, n_blocks]
    decode_context_lens: torch.Tensor  # [Bd]
    prefills: list[PrefillChunk]
    block_size: int
    # quantized stores only
    decode_fp_start: torch.Tensor | None = None  # [Bd] first position read from the ring
    decode_slots: torch.Tensor | None = None  # [Bd] ring slot of each decode row
    decode_overlay: RingOverlay | None = None
    append: AppendPlan | None = None
    ring_tokens: int = 0
    # eviction only
    decode_seqs: list[int] = field(default_factory=list)  # [Bd] index in the batch of each decode row
    decode_first_slots: torch.Tensor | None = None  # [n_layers, Bd] first slot each layer reads; None: all 0
    decode_lens: list[int] = field(default_factory=list)  # decode_context_lens on the host (read every layer:
    # no device sync for them)
    scored_queries: list[int] | None = None  # per sequence of the batch; set: record `stats`
    stats: list[list[SeqStats]] = field(default_factory=list)  # [layer][sequence of the batch]
    # the model calls paged_attention once per layer in layer order: this counts the calls made, so that
    # each call finds its layer's first slots and files its statistics under its layer
    layers_attended: int = 0
    decode_groups: list[DecodeGroup] | None = None  # the PyTorch path's, built at its first layer
    _decode_mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def want_stats(self) -> bool:
        return self.scored_queries is not None

    @property
    def decode_mask(self) -> torch.Tensor:
        """``[Bd, 1, 1, n_blocks * block_size]`` additive: 0 where the key's position is below the context. The
        PyTorch path's alone (the kernels read the context lengths), so built at its first use: under
        torch.profiler on the H200 its four host operations took 3.8 ms a step of 64 sequences at 1,024 tokens
        (`benchmarks/step_trace.py`), and 0.25 ms of 0.83 for the step's metadata on a 2-core CPU."""
        if self._decode_mask is None:
            bd, width = len(self.decode_lens), self.decode_block_tables.shape[1] * self.block_size
            visible = torch.arange(width).unsqueeze(0) < torch.tensor(self.decode_lens, dtype=torch.long).unsqueeze(1)
            self._decode_mask = _additive(visible).reshape(bd, 1, 1, width).to(self.decode_block_tables.device)
        return self._decode_mask


@dataclass(frozen=True)
class RingInfo:
    """Per sequence of the step: its ring slot and the first position it wrote itself (before that, its
    blocks came from the prefix cache and exist only packed); plus the store's ring geometry."""

    slots: list[int]
    ring_starts: list[int]
    ring_tokens: int
    window: int


def _overlay(row: int, slot: int, first: int, ctx: int, ring_tokens: int, out: tuple[list, list, list]) -> None:
    for p in range(first, ctx):
        out[0].append(row)
        out[1].append(p)
        out[2].append(slot * ring_tokens + p % ring_tokens)


def _to_overlay(lists: tuple[list, list, list], device) -> RingOverlay:
    rows, pos, src = (torch.tensor(x, dtype=torch.long, device=device) for x in lists)
    return RingOverlay(rows, pos, src)


def _append_plan(block_tables, query_lens, context_lens, ring: RingInfo, block_size: int, device) -> AppendPlan:
    """Which blocks complete this step and where their tokens are; which new tokens go to the ring."""
    lists: dict[str, list[int]] = {k: [] for k in ("blocks", "rd", "rs", "nd", "ns", "wd", "ws")}
    row = 0
    R = ring.ring_tokens
    for table, q_len, ctx, slot in zip(block_tables, query_lens, context_lens, ring.slots):
        start = ctx - q_len
        for j in range(start // block_size, ctx // block_size):
            base = len(lists["blocks"]) * block_size
            lists["blocks"].append(table[j])
            for t in range(block_size):
                p = j * block_size + t
                if p < start:
                    lists["rd"].append(base + t)
                    lists["rs"].append(slot * R + p % R)
                else:
                    lists["nd"].append(base + t)
                    lists["ns"].append(row + p - start)
        for p in range(max(start, ctx - R), ctx):  # only the newest R survive in the ring
            lists["wd"].append(slot * R + p % R)
            lists["ws"].append(row + p - start)
        row += q_len
    t = {k: torch.tensor(v, dtype=torch.long, device=device) for k, v in lists.items()}
    return AppendPlan(t["blocks"], t["rd"], t["rs"], t["nd"], t["ns"], t["wd"], t["ws"])


def build_attention_metadata(block_tables: list[list[int]], query_lens: list[int], context_lens: list[int],
                             block_size: int, ring: RingInfo | None = None,
                             device: torch.device | str = "cpu", *,
                             first_slots: list[tuple[int, ...]] | None = None,
                             scored_queries: list[int] | None = None) -> AttentionMetadata:
    """Batch layout of one step; ``block_tables[i]`` covers at least ``context_lens[i]`` KV slots. ``ring``
    is given when the store holds quantized sides. With eviction: ``first_slots[i]`` is sequence i's first
    slot per layer (``()``: none empty), and ``scored_queries`` (one count per sequence) asks
    `paged_attention` for statistics (see `SeqStats`)."""
    first_slots = [tuple(f) if any(f) else () for f in first_slots] if first_slots else [()] * len(block_tables)
    slots, decode_rows, decode_tables, decode_ctx, prefills = [], [], [], [], []
    decode_fp, decode_slot, overlay = [], [], ([], [], [])
    row = 0
    for i, (table, q_len, ctx) in enumerate(zip(block_tables, query_lens, context_lens)):
        for pos in range(ctx - q_len, ctx):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        n_blocks = -(-ctx // block_size)
        fp = full_precision_start(ctx, ring.ring_starts[i], ring.window, block_size) if ring else ctx
        if q_len == 1:
            if ring:
                _overlay(len(decode_rows), ring.slots[i], fp, ctx, ring.ring_tokens, overlay)
                decode_fp.append(fp)
                decode_slot.append(ring.slots[i])
            decode_rows.append(row)
            decode_tables.append(table[:n_blocks])
            decode_ctx.append(ctx)
        else:
            chunk_overlay = None
            if ring:
                lists = ([], [], [])
                _overlay(0, ring.slots[i], fp, ctx, ring.ring_tokens, lists)
                chunk_overlay = _to_overlay(lists, device)
            prefills.append(PrefillChunk(slice(row, row + q_len), torch.tensor(table[:n_blocks], device=device), ctx,
                                         chunk_overlay, i, first_slots[i], fp if ring else None,
                                         ring.slots[i] if ring else 0))
        row += q_len
    width = max((len(t) for t in decode_tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in decode_tables]

    def longs(x):
        return torch.tensor(x, dtype=torch.long, device=device)

    meta = AttentionMetadata(
        slot_mapping=longs(slots), decode_rows=longs(decode_rows),
        decode_block_tables=longs(padded).reshape(len(padded), width),
        decode_context_lens=longs(decode_ctx), prefills=prefills, block_size=block_size,
        decode_seqs=[i for i, q_len in enumerate(query_lens) if q_len == 1], scored_queries=scored_queries,
        decode_lens=list(decode_ctx))
    meta.decode_first_slots = _decode_first_slots([first_slots[i] for i in meta.decode_seqs], device)
    if ring:
        meta.decode_fp_start, meta.decode_slots = longs(decode_fp), longs(decode_slot)
        meta.decode_overlay = _to_overlay(overlay, device)
        meta.append = _append_plan(block_tables, query_lens, context_lens, ring, block_size, device)
        meta.ring_tokens = ring.ring_tokens
    return meta


def _decode_first_slots(first_slots: list[tuple[int, ...]], device) -> torch.Tensor | None:
    """``[n_layers, Bd]`` first slots of the decode rows, or None when no decode row has an empty slot."""
    n_layers = max((len(f) for f in first_slots), default=0)
    if n_layers == 0:
        return None
    rows = [f or (0,) * n_layers for f in first_slots]
    return torch.tensor(rows, dtype=torch.long, device=device).T.contiguous()


def _additive(visible: torch.Tensor) -> torch.Tensor:
    return torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))


# ---- writing ----------------------------------------------------------------------------------------

def quantize_blocks(side, staging: torch.Tensor, block_ids: torch.Tensor, value_group: int) -> None:
    """Quantize-on-append: full blocks ``staging [n * block_size, n_kv, D]`` into ``side`` at ``block_ids``
    (Triton on CUDA, PyTorch elsewhere)."""
    if staging.is_cuda and triton_head_dim(staging.shape[-1]) and _triton_available():
        from .triton_attention import quantize_into
        quantize_into(side, staging, block_ids, value_group)
        return
    n_kv, d = staging.shape[-2:]
    blocks = staging.view(-1, side.data.shape[1], n_kv, d)
    if side.is_key:
        packed, scale, zero = quantize_keys(blocks, side.bits)
    else:
        packed, scale, zero = quantize_values(blocks, side.bits, value_group)
    # (index_copy_, not ``side.data[block_ids] = ...``: advanced-indexing stores cost several times as much
    # on a CPU, where a step packs a block per side and layer)
    side.data.index_copy_(0, block_ids, packed)
    side.scale.index_copy_(0, block_ids, scale)
    side.zero.index_copy_(0, block_ids, zero)


def _append_quantized(side, new: torch.Tensor, plan: AppendPlan, block_size: int, value_group: int) -> None:
    """Quantize the blocks completed this step into ``side`` (before the ring is overwritten: a completed
    block's older tokens are read from the ring), then write the new tokens to the ring."""
    n_kv, d = new.shape[-2:]
    ring = side.ring.view(-1, n_kv, d)
    if plan.block_ids.numel():
        staging = new.new_empty(plan.block_ids.numel() * block_size, n_kv, d)
        if plan.from_ring_dst.numel():  # (none where the step's own tokens fill the block: a prefill's)
            staging.index_copy_(0, plan.from_ring_dst, ring.index_select(0, plan.from_ring_src))
        staging.index_copy_(0, plan.from_new_dst, new.index_select(0, plan.from_new_src))
        quantize_blocks(side, staging, plan.block_ids, value_group)
    ring.index_copy_(0, plan.ring_dst, new.index_select(0, plan.ring_src))


def write_kv(key, value, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, value_group: int = 0) -> None:
    """Store the step's new keys/values ``[T, n_kv_heads, head_dim]`` (16-bit sides at their flat slots,
    quantized sides through their ring and packed blocks)."""
    for side, new in ((key, k), (value, v)):
        if side.quantized:
            _append_quantized(side, new, meta.append, meta.block_size, value_group)
        else:
            n_kv, d = side.data.shape[-2:]
            side.data.view(-1, n_kv, d).index_copy_(0, meta.slot_mapping, new)


# ---- reading ----------------------------------------------------------------------------------------

def _gather(t: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``t[block_ids]`` for block ids of any shape. (index_select copies whole blocks: 6x faster on a CPU
    than advanced indexing, which computes every element's offset.)"""
    return t.index_select(0, block_ids.reshape(-1)).view(*block_ids.shape, *t.shape[1:])


def _context(side, block_ids: torch.Tensor, overlay: RingOverlay | None) -> torch.Tensor:
    """[..., n_blocks] block ids -> [..., n_kv_heads, n_blocks * block_size, head_dim] in full precision
    (a transposed view of the gathered ``[..., L, n_kv_heads, head_dim]``)."""
    if not side.quantized:
        flat = _gather(side.data, block_ids).flatten(-4, -3)  # [..., L, n_kv, d]
        return flat.transpose(-3, -2)
    dequantize = dequantize_keys if side.is_key else dequantize_values
    blocks = dequantize(_gather(side.data, block_ids), _gather(side.scale, block_ids), _gather(side.zero, block_ids),
                        side.bits)
    flat = blocks.flatten(-4, -3)  # [..., L, n_kv, d]
    if overlay is not None and overlay.positions.numel():
        ring = side.ring.view(-1, *side.ring.shape[-2:])
        tokens = ring[overlay.sources].to(flat.dtype)
        if flat.dim() == 3:
            flat[overlay.positions] = tokens
        else:
            flat[overlay.rows, overlay.positions] = tokens
    return flat.transpose(-3, -2)


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[..., n_kv, G*Q, D]`` (G query heads per KV head), k/v ``[..., n_kv, L, D]``, mask broadcastable
    to ``[..., n_kv, G*Q, L]`` -> output ``[..., n_kv, G*Q, D]`` and the probabilities ``[..., n_kv, G*Q, L]``
    (kept for the eviction statistics: they cost nothing more)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).add_(mask)
    probs = scores.softmax(-1)
    return torch.matmul(probs, v), probs


def paged_attention(q: torch.Tensor, key, value, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of the step's queries ``[T, n_heads, head_dim]`` over their paged context (one layer: the
    model calls this once per layer, in order; see `AttentionMetadata.layers_attended`)."""
    layer = meta.layers_attended
    meta.layers_attended += 1
    n_heads = q.shape[1]
    n_kv = key.data.shape[-2]
    group = n_heads // n_kv
    stats: list[SeqStats | None] | None = [None] * len(meta.scored_queries) if meta.want_stats else None
    if meta.decode_rows.numel():
        # a step of decodes only (the common one) needs no scatter of rows
        qd = q if not meta.prefills else q[meta.decode_rows]
        if _use_triton(q):  # first slots and statistics included
            decoded = _decode_triton(qd, key, value, meta, scale, layer, stats)
        elif cpu_native.supports(qd, key, value):
            decoded = _decode_native(qd, key, value, meta, scale, layer, stats)
        else:
            decoded = _decode_torch(qd, key, value, meta, scale, n_kv, group, layer, stats)
        if not meta.prefills:
            if stats is not None:
                meta.stats.append(stats)
            return decoded
    out = torch.empty_like(q)
    if meta.decode_rows.numel():
        out[meta.decode_rows] = decoded
    for chunk in meta.prefills:
        if (_use_triton(q) and stats is None and not any(chunk.first_slots)  # the Triton prefill has neither
                and key.bits in TRITON_PREFILL_BITS and value.bits in TRITON_PREFILL_BITS):
            from .triton_attention import paged_prefill
            out[chunk.rows] = paged_prefill(q[chunk.rows], key, value, chunk.block_ids, chunk.context_len, scale,
                                            fp_start=chunk.fp_start, slot=chunk.ring_slot,
                                            ring_tokens=meta.ring_tokens, block_size=meta.block_size)
        else:
            out[chunk.rows] = _prefill_torch(q, key, value, chunk, scale, group, layer, stats, meta.scored_queries)
    if stats is not None:
        meta.stats.append(stats)
    return out


def _prefill_torch(q, key, value, chunk: PrefillChunk, scale: float, group: int, layer: int,
                   stats: list | None, scored_queries: list[int] | None) -> torch.Tensor:
    """One prefill chunk's attention ``[q_len, n_heads, D]`` over its causal context."""
    n_heads, d = q.shape[1:]
    n_kv = n_heads // group
    q_len = chunk.rows.stop - chunk.rows.start
    # slots before the layer's first one are empty (evicted): not read at all
    first = chunk.first_slots[layer] if chunk.first_slots else 0
    k = _context(key, chunk.block_ids, chunk.overlay)[:, first:chunk.context_len].to(q.dtype)  # [KVH, ctx, D]
    v = _context(value, chunk.block_ids, chunk.overlay)[:, first:chunk.context_len].to(q.dtype)
    mask = chunk.mask[:, first:].to(q.dtype)  # [q_len, ctx]
    if stats is None:
        o = F.scaled_dot_product_attention(q[chunk.rows].transpose(0, 1).unsqueeze(0), k.unsqueeze(0),
                                           v.unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)  # [1, n_heads, q_len, D] -> [q_len, n_heads, D]
    qp = q[chunk.rows].transpose(0, 1).reshape(n_kv, group * q_len, d)  # heads grouped by KV head
    o, probs = _grouped_attention(qp, k, v, mask.repeat(group, 1), scale)  # [KVH, G*q_len, D]
    per_query = probs.view(n_kv, group, q_len, -1).sum(1)  # [KVH, q_len, ctx - first]
    scored = per_query[:, q_len - scored_queries[chunk.seq]:].sum(1)
    stats[chunk.seq] = SeqStats(F.pad(scored, (first, 0)), F.pad(per_query[:, -1], (first, 0)))
    return o.view(n_heads, q_len, d).transpose(0, 1)


def _group_decodes(meta: AttentionMetadata) -> list[DecodeGroup]:
    """`decode_groups` of the step's decode rows, each with its slices of the padded batch's metadata."""
    lens = meta.decode_lens
    bs = meta.block_size
    groups = decode_groups([-(-n // bs) for n in lens])
    if len(groups) == 1:
        return [DecodeGroup(None, meta.decode_block_tables, meta.decode_mask, meta.decode_overlay,
                            meta.decode_first_slots, list(meta.decode_seqs), lens)]
    device = meta.decode_block_tables.device
    local = torch.full((len(lens),), -1, dtype=torch.long, device=device)  # decode row -> row in its group
    out = []
    for members in groups:
        rows = torch.tensor(members, dtype=torch.long, device=device)
        width = -(-max(lens[i] for i in members) // bs)
        overlay = meta.decode_overlay
        if overlay is not None:
            local[rows] = torch.arange(len(members), device=device)
            keep = torch.isin(overlay.rows, rows)
            overlay = RingOverlay(local[overlay.rows[keep]], overlay.positions[keep], overlay.sources[keep])
        first = meta.decode_first_slots
        out.append(DecodeGroup(rows, meta.decode_block_tables[rows, :width], meta.decode_mask[rows][..., :width * bs],
                               overlay, None if first is None else first[:, rows],
                               [meta.decode_seqs[i] for i in members], [lens[i] for i in members]))
    return out


def _decode_torch(qd, key, value, meta: AttentionMetadata, scale: float, n_kv: int, group: int, layer: int = 0,
                  stats: list | None = None) -> torch.Tensor:
    """The decode rows' attention ``[Bd, n_heads, D]`` (their queries ``qd``, in the order of
    ``meta.decode_rows``), one query each over its paged context, a group of similar lengths at a time."""
    if meta.decode_groups is None:
        meta.decode_groups = _group_decodes(meta)
    if len(meta.decode_groups) == 1:
        return _decode_group(qd, key, value, meta.decode_groups[0], scale, n_kv, group, layer, stats,
                             meta.scored_queries)
    out = qd.new_empty(qd.shape)
    for g in meta.decode_groups:
        out[g.rows] = _decode_group(qd[g.rows], key, value, g, scale, n_kv, group, layer, stats, meta.scored_queries)
    return out


def _decode_group(qd, key, value, g: DecodeGroup, scale: float, n_kv: int, group: int, layer: int,
                  stats: list | None, scored_queries: list[int] | None) -> torch.Tensor:
    d = qd.shape[-1]
    k = _context(key, g.block_tables, g.overlay).to(qd.dtype)  # [g, KVH, L, D]
    v = _context(value, g.block_tables, g.overlay).to(qd.dtype)
    mask = g.mask  # [g, 1, 1, L]
    if g.first_slots is not None:  # a layer's slots before its first one are empty (evicted)
        before = torch.arange(mask.shape[-1], device=mask.device) < g.first_slots[layer].unsqueeze(1)
        mask = mask.masked_fill(before.view(mask.shape), float("-inf"))
    mask = mask.to(qd.dtype)
    if stats is None:
        o = F.scaled_dot_product_attention(qd.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=True)  # [g, n_heads, 1, D]
        return o.squeeze(2)
    grouped = qd.reshape(-1, n_kv, group, d)  # [g, KVH, G, D]: query heads grouped by KV head
    o, probs = _grouped_attention(grouped, k, v, mask, scale)
    _file_decode_stats(stats, probs.sum(2), g.seqs, g.context_lens, scored_queries)  # summed over each group
    return o.view(-1, n_kv * group, d)


def _file_decode_stats(stats: list, probs: torch.Tensor, seqs: list[int], context_lens: list[int],
                       scored_queries: list[int]) -> None:
    """File decode rows' probabilities ``[rows, KVH, >= context]`` (one query each, summed over the query
    heads of each KV head) as their sequences' `SeqStats`."""
    for row, (seq, ctx) in enumerate(zip(seqs, context_lens)):
        p = probs[row, :, :ctx]
        stats[seq] = SeqStats(p if scored_queries[seq] else torch.zeros_like(p), p)


def _decode_native(qd, key, value, meta: AttentionMetadata, scale: float, layer: int,
                   stats: list | None) -> torch.Tensor:
    """The decode rows' attention by the compiled CPU kernel (`cpu_native`): every row over its own
    blocks, so no length groups are needed."""
    out, probs = cpu_native.paged_decode(qd, key, value, meta, scale, layer, stats is not None)
    if stats is not None:
        _file_decode_stats(stats, probs, meta.decode_seqs, meta.decode_lens, meta.scored_queries)
    return out


def _decode_triton(qd, key, value, meta: AttentionMetadata, scale: float, layer: int,
                   stats: list | None) -> torch.Tensor:
    """The decode rows' attention by the Triton kernel (`triton_attention.paged_decode`), with the layer's
    first slots and, when the step wants them, the statistics filed as `_decode_native` files them."""
    from .triton_attention import paged_decode
    out, probs = paged_decode(qd, key, value, meta, scale, layer, stats is not None)
    if stats is not None:
        _file_decode_stats(stats, probs, meta.decode_seqs, meta.decode_lens, meta.scored_queries)
    return out


# KV bits at which a prefill chunk runs the Triton kernel on a GPU. Compiled on an H200 (2026-12-04), the
# kernel over 4-bit KV gave a relative error of 0.67 against the PyTorch path (37 tokens of context, a 12-token
# chunk; an illegal memory access when not run under compute-sanitizer) while Triton's interpreter passes the
# same test: 4- and 2-bit codes are unpacked by joins (`triton_attention._unpack`), which 8-bit codes skip.
# Chunks over such KV take the PyTorch path until the kernel passes its tests compiled on a GPU.
TRITON_PREFILL_BITS = (16, 8)


def _use_triton(q: torch.Tensor) -> bool:
    """Whether this step's attention runs the Triton kernels: CUDA queries, Triton installed and a head size
    they take (`triton_head_dim`). (A function, so that tests on a CPU can send a step through them under
    Triton's interpreter.)"""
    return q.is_cuda and triton_head_dim(q.shape[-1]) and _triton_available()


def triton_head_dim(head_dim: int) -> bool:
    """The Triton kernels index a head with ``tl.arange(0, head_dim)``, which takes powers of two only: a model
    with heads of 48 or 80 runs the PyTorch path (a tester's finding: head dim 48 failed in all three)."""
    return head_dim > 0 and head_dim & (head_dim - 1) == 0


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True

