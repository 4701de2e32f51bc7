"""Triton kernels (CUDA; on a CPU they run under ``TRITON_INTERPRET=1`` for tests): paged decode attention
over packed 16/8/4/2-bit KV, and quantize-on-append.

Paged decode (flash-decoding): one program per (sequence, KV head, split of the context). A program
loads the query heads of its KV group once, then walks its split's blocks: each block's keys and
values are loaded from the packed codes and dequantized in registers (never written back in full
precision), or read from the sequence's full-precision ring for the positions the ring holds, and
folded into an online softmax. Splits write partial (max, sum, output) that a small reduction
combines, so that one long sequence can use the whole GPU.

Eviction. A row's slots before its first slot at this layer (``meta.decode_first_slots[layer]``) are empty:
the split kernel starts at the tile holding the first slot and masks the positions before it (a constexpr
switch: steps without first slots run the same code as before). Eviction policies that score tokens ask
for the attention statistics (per row, its query heads' softmax probabilities summed per KV head); a second
kernel, after the reduction that gives each row and head its final max and sum, recomputes the scores
from the keys alone (dequantized in registers by the same tile loader, the query scaled the same way) and
writes ``exp(s - max) / sum`` summed over each KV head's query heads, zero before the first slot and past
the context. It reads the keys a second time: only steps that ask for statistics pay that.

Memory layout and quantization scheme: see `skistune.runtime.kv_store` and `skistune.kernels.quant`.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from .quant import stored_scale_floor



@dataclass
class DecodeSetting:
    """How the decode kernel runs. ``tile``: tokens per loop iteration (tiles span several KV blocks,
    each row finds its block in the table, so that an iteration has enough bytes in flight whatever the
    block size); ``warps``/``stages``: Triton's launch options. Quantized sides only: ``unpack`` 0 loads
    contiguous bytes and interleaves the codes with joins, 1 loads each channel's byte and shifts;
    ``scales`` 0 loads one scale row per block (keys) or group (values) and broadcasts by reshapes, 1
    loads a scale per element from the (cached) scale tensors. ``benchmarks/kernels.py --sweep`` times
    the choices on the GPU at hand and keeps the fastest."""

    tile: int = 64
    warps: int = 4
    stages: int = 2
    unpack: int = 0
    scales: int = 0


# measured on an H200 (benchmarks/kernels.py --sweep; BENCHMARKS.md)
DECODE_FULL = DecodeSetting(tile=64, warps=4, stages=3)
DECODE_QUANTIZED = DecodeSetting(tile=128, warps=4, stages=3)


# How the prefill kernel unpacks 4- and 2-bit codes (`DecodeSetting.unpack`). Compiled on an H200 the joins
# (0) gave wrong results in the prefill, which feeds the tile to `tl.dot`, while the decode kernel passed with
# them; the per-channel byte loads (1) avoid joins. Not yet compiled on a GPU: until the prefill tests pass
# there, `attention.TRITON_PREFILL_BITS` keeps 4- and 2-bit chunks on the PyTorch path.
PREFILL_UNPACK = 1


def _jit_unspecialized(*names: str):
    """``triton.jit``, not specialized on the integer arguments ``names``, which change from step to step
    (tiles per split, the block tables' width, a chunk's length and context). Triton compiles a kernel again
    for each such argument that is 1, a multiple of 16, or neither: a serving run meets those classes one by
    one, each costing a compile (about a second) inside the step that first meets it, where it lands in a
    request's latency. Unspecialized, a kernel compiles once per setting of its constexprs."""
    def jit(fn):
        unknown = set(names) - set(inspect.signature(fn).parameters)
        if unknown:  # (Triton ignores a name that is no parameter: the specialization would stay, silently)
            raise TypeError(f"{fn.__name__}: no parameter {', '.join(sorted(unknown))}")
        return triton.jit(do_not_specialize=names, do_not_specialize_on_alignment=names)(fn)
    return jit


def _scratch(*shape: int, device) -> torch.Tensor:
    """Partial-result buffers (a function, so that tests can poison them to prove every element is written)."""
    return torch.empty(*shape, device=device, dtype=torch.float32)


@triton.jit
def _unpack(codes, T: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Bytes ``[T, D * BITS / 8]`` (int32) -> codes ``[T, D]`` (float32) in channel order: channel
    ``PACK * j + r`` is bits ``[r * BITS, (r + 1) * BITS)`` of byte ``j``; unpacked by shifts, interleaved by
    joins (contiguous byte loads, no per-element gathers)."""
    if BITS == 8:
        x = codes
    elif BITS == 4:
        x = tl.reshape(tl.join(codes & 15, codes >> 4), [T, D])
    else:  # join(join(c0, c2), join(c1, c3)) flattens to c0 c1 c2 c3
        x = tl.reshape(tl.join(tl.join(codes & 3, (codes >> 4) & 3), tl.join((codes >> 2) & 3, codes >> 6)), [T, D])
    return x.to(tl.float32)


@triton.jit
def _load_tile(DATA, SCALE, ZERO, RING, blk, blk_rows, row, h, pos, valid, fp_start, tile_end, ring_tokens, offs_d,
               s_db, s_dt, s_dh, s_sb, s_st, s_sh, s_rt, s_rh,
               T: tl.constexpr, NB: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, IS_KEY: tl.constexpr,
               GROUP: tl.constexpr, OUT_TY: tl.constexpr, UNPACK: tl.constexpr, SCALES: tl.constexpr):
    """One tile of keys or values of one KV head, ``[T, D]`` in ``OUT_TY``: tokens ``pos`` (in blocks
    ``blk`` at rows ``row``; ``blk_rows [NB]`` the tile's distinct blocks), dequantized in registers;
    positions from ``fp_start`` on come from the ring."""
    base = blk * s_db + row * s_dt + h * s_dh  # [T]
    if BITS == 16:
        x = tl.load(DATA + base[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0).to(OUT_TY)
    else:
        PACK: tl.constexpr = 8 // BITS
        packed = valid & (pos < fp_start)
        if UNPACK == 0:
            offs_p = tl.arange(0, D // PACK)
            codes = tl.load(DATA + base[:, None] + offs_p[None, :], mask=packed[:, None], other=0).to(tl.int32)
            q = _unpack(codes, T, D, BITS)
        else:
            byte = tl.load(DATA + base[:, None] + (offs_d // PACK)[None, :], mask=packed[:, None], other=0)
            q = ((byte.to(tl.int32) >> ((offs_d % PACK) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
        if IS_KEY:  # one (scale, zero) per channel and block
            if SCALES == 0:  # one row per block of the tile, broadcast
                s_off = (blk_rows * s_sb + h * s_sh)[:, None] + offs_d[None, :]  # [NB, D]
                sc = tl.load(SCALE + s_off).to(tl.float32)
                zp = tl.load(ZERO + s_off).to(tl.float32)
                deq = tl.reshape(tl.reshape(q, [NB, T // NB, D]) * sc[:, None, :] + zp[:, None, :], [T, D])
            else:
                s_off = (blk * s_sb + h * s_sh)[:, None] + offs_d[None, :]  # [T, D]
                sc = tl.load(SCALE + s_off, mask=packed[:, None], other=0.0).to(tl.float32)
                zp = tl.load(ZERO + s_off, mask=packed[:, None], other=0.0).to(tl.float32)
                deq = q * sc + zp
        else:  # one (scale, zero) per token and group of channels
            if SCALES == 0:
                offs_g = tl.arange(0, D // GROUP)
                s_off = (blk * s_sb + row * s_st + h * s_sh)[:, None] + offs_g[None, :]  # [T, D / GROUP]
                sc = tl.load(SCALE + s_off, mask=packed[:, None], other=0.0).to(tl.float32)
                zp = tl.load(ZERO + s_off, mask=packed[:, None], other=0.0).to(tl.float32)
                deq = tl.reshape(tl.reshape(q, [T, D // GROUP, GROUP]) * sc[:, :, None] + zp[:, :, None], [T, D])
            else:
                s_off = (blk * s_sb + row * s_st + h * s_sh)[:, None] + (offs_d // GROUP)[None, :]  # [T, D]
                sc = tl.load(SCALE + s_off, mask=packed[:, None], other=0.0).to(tl.float32)
                zp = tl.load(ZERO + s_off, mask=packed[:, None], other=0.0).to(tl.float32)
                deq = q * sc + zp
        if tile_end > fp_start:  # only tiles that reach the ring read it
            in_ring = valid & (pos >= fp_start)
            ring = tl.load(RING + ((pos % ring_tokens) * s_rt + h * s_rh)[:, None] + offs_d[None, :],
                           mask=in_ring[:, None], other=0.0).to(tl.float32)
            deq = tl.where(in_ring[:, None], ring, deq)
        x = deq.to(OUT_TY)
    return x


@triton.jit
def _split_start(CTX, FIRSTS, tiles_per_split, T: tl.constexpr, HAS_FIRST: tl.constexpr):
    """This program's row context, the first position of its split, and the row's first slot at this layer
    (0 without eviction); the split starts no earlier than the tile holding that slot (slots before it are
    empty)."""
    b = tl.program_id(0)
    ctx = tl.load(CTX + b)
    begin = tl.program_id(2) * tiles_per_split * T
    lo = 0
    if HAS_FIRST:
        lo = tl.load(FIRSTS + b)
    return ctx, begin, lo, tl.maximum(begin, (lo // T) * T)


@triton.jit
def _scaled_query(Q, s_qb, s_qh, scale, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr):
    """The query heads of this program's KV group ``[GP, D]`` (rows past G are zero) and the same scaled by
    ``scale`` in their dtype: both kernels score with it, so the statistics match the attention exactly."""
    offs_g = tl.arange(0, GP)
    q = tl.load(Q + tl.program_id(0) * s_qb + (tl.program_id(1) * G + offs_g)[:, None] * s_qh
                + tl.arange(0, D)[None, :], mask=(offs_g < G)[:, None], other=0.0)
    return q, (q.to(tl.float32) * scale).to(q.dtype)


@_jit_unspecialized("tiles_per_split", "n_splits", "s_tb")
def _decode_split_kernel(Q, K, KS, KZ, KR, V, VS, VZ, VR, TABLES, CTX, FPS, SLOTS, FIRSTS, ACC, ML,
                         scale, ring_tokens, tiles_per_split, n_splits,
                         s_qb, s_qh, s_tb,
                         s_kb, s_kt, s_kh, s_ksb, s_kst, s_ksh, s_krs, s_krt, s_krh,
                         s_vb, s_vt, s_vh, s_vsb, s_vst, s_vsh, s_vrs, s_vrt, s_vrh,
                         G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, T: tl.constexpr,
                         NB: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, VGROUP: tl.constexpr,
                         UNPACK: tl.constexpr, SCALES: tl.constexpr, HAS_FIRST: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    n_kv = tl.num_programs(1)
    ctx, split_begin, lo, begin = _split_start(CTX, FIRSTS, tiles_per_split, T, HAS_FIRST)
    last = tl.minimum(split_begin + tiles_per_split * T, ctx)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, T)
    q, qf = _scaled_query(Q, s_qb, s_qh, scale, G, GP, D)  # [GP, D]
    fp_start = ctx
    slot = 0
    if KBITS != 16 or VBITS != 16:
        fp_start = tl.load(FPS + b)
        slot = tl.load(SLOTS + b)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for start in range(begin, last, T):
        pos = start + offs_t
        valid = pos < last
        if HAS_FIRST:
            valid = valid & (pos >= lo)
        blk = tl.load(TABLES + b * s_tb + pos // BS, mask=valid, other=0)  # [T]: tiles may span blocks
        row = pos % BS
        row_pos = start + tl.arange(0, NB) * (T // NB)
        blk_rows = tl.load(TABLES + b * s_tb + row_pos // BS, mask=row_pos < last, other=0)  # [NB]
        k = _load_tile(K, KS, KZ, KR + slot * s_krs, blk, blk_rows, row, h, pos, valid, fp_start, start + T, ring_tokens,
                       offs_d, s_kb, s_kt, s_kh, s_ksb, s_kst, s_ksh, s_krt, s_krh, T, NB, D, KBITS, True, VGROUP,
                       q.dtype, UNPACK, SCALES)
        s = tl.dot(qf, tl.trans(k))  # [GP, T], fp32 accumulate
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = _load_tile(V, VS, VZ, VR + slot * s_vrs, blk, blk_rows, row, h, pos, valid, fp_start, start + T, ring_tokens,
                       offs_d, s_vb, s_vt, s_vh, s_vsb, s_vst, s_vsh, s_vrt, s_vrh, T, NB, D, VBITS, False, VGROUP,
                       q.dtype, UNPACK, SCALES)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m = m_new
    part = (b * n_kv + h) * n_splits + sp
    tl.store(ACC + part * GP * D + offs_g[:, None] * D + offs_d[None, :], acc)
    tl.store(ML + part * 2 * GP + offs_g, m)
    tl.store(ML + part * 2 * GP + GP + offs_g, l)


@_jit_unspecialized("tiles_per_split", "stats_len", "s_tb")
def _decode_stats_kernel(Q, K, KS, KZ, KR, TABLES, CTX, FPS, SLOTS, FIRSTS, MAXS, SUMS, PROBS,
                         scale, ring_tokens, tiles_per_split, stats_len,
                         s_qb, s_qh, s_tb, s_kb, s_kt, s_kh, s_ksb, s_kst, s_ksh, s_krs, s_krt, s_krh,
                         G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, T: tl.constexpr,
                         NB: tl.constexpr, KBITS: tl.constexpr, QUANTIZED: tl.constexpr, UNPACK: tl.constexpr,
                         SCALES: tl.constexpr, HAS_FIRST: tl.constexpr):
    """One (row, KV head, split): the probabilities of the row's query heads of this KV head, summed over
    them, at every position of the split's tiles ``[begin, end)`` of ``PROBS [Bd, n_kv, stats_len]``:
    ``exp(s - m) / l`` with the row's final max ``m`` and sum ``l`` (``MAXS``/``SUMS [Bd, n_kv, GP]``), zero
    before the row's first slot and from its context on. Scores as `_decode_split_kernel` computes them."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    n_kv = tl.num_programs(1)
    ctx, begin, lo, kept = _split_start(CTX, FIRSTS, tiles_per_split, T, HAS_FIRST)  # kept: first tile with a slot
    end = tl.minimum(begin + tiles_per_split * T, stats_len)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, T)
    out = PROBS + (b * n_kv + h) * stats_len
    zeros = tl.zeros([T], tl.float32)
    for start in range(begin, tl.minimum(kept, end), T):  # tiles wholly before the first slot
        pos = start + offs_t
        tl.store(out + pos, zeros, mask=pos < end)
    q, qf = _scaled_query(Q, s_qb, s_qh, scale, G, GP, D)  # exactly as the split kernel scales it
    row_ml = (b * n_kv + h) * GP + offs_g
    m = tl.load(MAXS + row_ml)
    inv_l = 1.0 / tl.load(SUMS + row_ml)
    fp_start = ctx
    slot = 0
    if QUANTIZED:
        fp_start = tl.load(FPS + b)
        slot = tl.load(SLOTS + b)
    for start in range(kept, tl.minimum(end, ctx), T):
        pos = start + offs_t
        valid = pos < ctx
        if HAS_FIRST:
            valid = valid & (pos >= lo)
        blk = tl.load(TABLES + b * s_tb + pos // BS, mask=valid, other=0)
        row = pos % BS
        row_pos = start + tl.arange(0, NB) * (T // NB)
        blk_rows = tl.load(TABLES + b * s_tb + row_pos // BS, mask=row_pos < ctx, other=0)
        k = _load_tile(K, KS, KZ, KR + slot * s_krs, blk, blk_rows, row, h, pos, valid, fp_start, start + T, ring_tokens,
                       offs_d, s_kb, s_kt, s_kh, s_ksb, s_kst, s_ksh, s_krt, s_krh, T, NB, D, KBITS, True, 1,
                       q.dtype, UNPACK, SCALES)
        s = tl.dot(qf, tl.trans(k))  # [GP, T]
        keep = valid[None, :] & (offs_g < G)[:, None]
        s = tl.where(keep, s, float("-inf"))
        p = tl.where(keep, tl.exp(s - m[:, None]) * inv_l[:, None], 0.0)
        tl.store(out + pos, tl.sum(p, 0), mask=pos < end)
    ctx_end = ((ctx + T - 1) // T) * T  # tiles wholly past the context
    for start in range(tl.maximum(kept, ctx_end), end, T):
        pos = start + offs_t
        tl.store(out + pos, zeros, mask=pos < end)


@functools.cache
def _dummy(device: torch.device) -> torch.Tensor:
    """Stands in for absent scale/ring tensors (never read): one per device, not one per layer and step."""
    return torch.zeros(1, 1, 1, 1, device=device)


def _side_args(side, device) -> tuple[list, list[int]]:
    """Tensors and strides of one side; absent scale/ring tensors are replaced by a dummy (never read)."""
    dummy = _dummy(torch.device(device))
    data = side.data
    scale = side.scale if side.quantized else dummy
    zero = side.zero if side.quantized else dummy
    ring = side.ring if side.quantized else dummy
    sc = scale.stride()
    scale_strides = [sc[0], 0, sc[1]] if side.is_key and side.quantized else [sc[0], sc[1], sc[2]]
    strides = [data.stride(0), data.stride(1), data.stride(2), *scale_strides,
               ring.stride(0), ring.stride(1), ring.stride(2)]
    return [data, scale, zero, ring], strides


def _num_splits(batch: int, n_kv: int, n_tiles: int, device: torch.device) -> int:
    """Enough programs to fill the GPU about four times over, never more splits than tiles."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    want = -(-4 * sms // max(1, batch * n_kv))
    return max(1, min(want, n_tiles))


def paged_decode(q: torch.Tensor, key, value, meta, scale: float, layer: int = 0, want_stats: bool = False,
                 num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode attention of ``q [Bd, n_heads, D]`` (one query per sequence) over paged, possibly packed
    KV; ``meta`` is the step's `AttentionMetadata`, ``layer`` picks the row's first slots
    (``meta.decode_first_slots[layer]``, when there are any). Returns ``[Bd, n_heads, D]`` in q's dtype
    and, with ``want_stats``, the probabilities summed per KV head ``[Bd, n_kv, width * block_size]``
    float32 (zero before a row's first slot and past its context; else None)."""
    bd, n_heads, d = q.shape
    n_kv = key.data.shape[-2]
    group = n_heads // n_kv
    gp = max(16, triton.next_power_of_2(group))  # tl.dot needs at least 16 rows
    tables = meta.decode_block_tables
    quantized = key.quantized or value.quantized
    setting = DECODE_QUANTIZED if quantized else DECODE_FULL
    tile = setting.tile
    stats_len = tables.shape[1] * meta.block_size
    n_tiles = -(-stats_len // tile)
    splits = num_splits or _num_splits(bd, n_kv, n_tiles, q.device)
    per_split = -(-n_tiles // splits)
    splits = -(-n_tiles // per_split)
    acc = _scratch(bd, n_kv, splits, gp, d, device=q.device)
    ml = _scratch(bd, n_kv, splits, 2, gp, device=q.device)
    k_args, k_strides = _side_args(key, q.device)
    v_args, v_strides = _side_args(value, q.device)
    fps = meta.decode_fp_start if quantized else meta.decode_context_lens
    slots = meta.decode_slots if quantized else meta.decode_context_lens
    firsts = None if meta.decode_first_slots is None else meta.decode_first_slots[layer].contiguous()
    has_first = firsts is not None
    if firsts is None:
        firsts = meta.decode_context_lens  # never read
    qc = q.contiguous()
    nb = max(1, tile // meta.block_size)
    _decode_split_kernel[(bd, n_kv, splits)](
        qc, *k_args, *v_args, tables, meta.decode_context_lens, fps, slots, firsts, acc, ml,
        scale, max(1, meta.ring_tokens), per_split, splits,
        qc.stride(0), qc.stride(1), tables.stride(0), *k_strides, *v_strides,
        G=group, GP=gp, D=d, BS=meta.block_size, T=tile, NB=nb, KBITS=key.bits, VBITS=value.bits,
        VGROUP=d // value.scale.shape[-1] if value.quantized else 1, UNPACK=setting.unpack, SCALES=setting.scales,
        HAS_FIRST=has_first, num_warps=setting.warps, num_stages=setting.stages)
    m, l = ml[:, :, :, 0], ml[:, :, :, 1]  # [Bd, KVH, S, GP]
    m_max = m.amax(2, keepdim=True)
    w = torch.exp(m - m_max)  # splits past the context (or before the first slot) have m = -inf and weigh 0
    total = (l * w).sum(2)  # [Bd, KVH, GP]
    out = (acc * w.unsqueeze(-1)).sum(2) / total.unsqueeze(-1)  # [Bd, KVH, GP, D]
    out = out[:, :, :group].reshape(bd, n_heads, d).to(q.dtype)
    if not want_stats:
        return out, None
    probs = _scratch(bd, n_kv, stats_len, device=q.device)
    _decode_stats_kernel[(bd, n_kv, splits)](
        qc, *k_args, tables, meta.decode_context_lens, fps, slots, firsts, m_max.squeeze(2).contiguous(),
        total.contiguous(), probs, scale, max(1, meta.ring_tokens), per_split, stats_len,
        qc.stride(0), qc.stride(1), tables.stride(0), *k_strides,
        G=group, GP=gp, D=d, BS=meta.block_size, T=tile, NB=nb, KBITS=key.bits, QUANTIZED=quantized,
        UNPACK=setting.unpack, SCALES=setting.scales, HAS_FIRST=has_first,
        num_warps=setting.warps, num_stages=setting.stages)
    return out, probs


@_jit_unspecialized("q_len", "ctx", "fp_start")
def _prefill_kernel(Q, K, KS, KZ, KR, V, VS, VZ, VR, TABLE, OUT,
                    scale, ring_tokens, q_len, ctx, fp_start,
                    s_qt, s_qh, s_ot, s_oh,
                    s_kb, s_kt, s_kh, s_ksb, s_kst, s_ksh, s_krt, s_krh,
                    s_vb, s_vt, s_vh, s_vsb, s_vst, s_vsh, s_vrt, s_vrh,
                    G: tl.constexpr, GP: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                    T: tl.constexpr, NB: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
                    VGROUP: tl.constexpr):
    """One (tile of BM queries, KV head): its G query heads' rows ``[BM * GP, D]`` attend causally over
    the paged context (the chunk's own KV is already written)."""
    qt = tl.program_id(0)
    h = tl.program_id(1)
    offs_r = tl.arange(0, BM * GP)
    qi = qt * BM + offs_r // GP  # query index in the chunk
    g = offs_r % GP
    row_ok = (qi < q_len) & (g < G)
    q_pos = ctx - q_len + qi  # its position: it sees keys at positions <= q_pos
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, T)
    q = tl.load(Q + qi[:, None] * s_qt + (h * G + g)[:, None] * s_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    qf = (q.to(tl.float32) * scale).to(q.dtype)
    m = tl.full([BM * GP], float("-inf"), tl.float32)
    l = tl.zeros([BM * GP], tl.float32)
    acc = tl.zeros([BM * GP, D], tl.float32)
    last = tl.minimum(ctx, ctx - q_len + (qt + 1) * BM)  # keys past the tile's last query are masked anyway
    for start in range(0, last, T):
        pos = start + offs_t
        valid = pos < last
        blk = tl.load(TABLE + pos // BS, mask=valid, other=0)
        row = pos % BS
        row_pos = start + tl.arange(0, NB) * (T // NB)
        blk_rows = tl.load(TABLE + row_pos // BS, mask=row_pos < last, other=0)
        k = _load_tile(K, KS, KZ, KR, blk, blk_rows, row, h, pos, valid, fp_start, start + T, ring_tokens, offs_d,
                       s_kb, s_kt, s_kh, s_ksb, s_kst, s_ksh, s_krt, s_krh, T, NB, D, KBITS, True, VGROUP,
                       q.dtype, PREFILL_UNPACK, 0)
        s = tl.dot(qf, tl.trans(k))  # [BM * GP, T]
        s = tl.where((pos[None, :] <= q_pos[:, None]) & valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded rows see no key
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = _load_tile(V, VS, VZ, VR, blk, blk_rows, row, h, pos, valid, fp_start, start + T, ring_tokens, offs_d,
                       s_vb, s_vt, s_vh, s_vsb, s_vst, s_vsh, s_vrt, s_vrh, T, NB, D, VBITS, False, VGROUP,
                       q.dtype, PREFILL_UNPACK, 0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m = m_new
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(OUT + qi[:, None] * s_ot + (h * G + g)[:, None] * s_oh + offs_d[None, :], out.to(q.dtype),
             mask=row_ok[:, None])


def paged_prefill(q: torch.Tensor, key, value, block_ids: torch.Tensor, context_len: int, scale: float, *,
                  fp_start: int | None = None, slot: int = 0, ring_tokens: int = 0, block_size: int) -> torch.Tensor:
    """Causal attention of one prefill chunk ``q [q_len, n_heads, D]`` (the last q_len positions of a
    context of ``context_len`` tokens whose KV is written) over its paged, possibly packed KV in
    ``block_ids``; positions from ``fp_start`` on are read from ring ``slot``. Returns ``[q_len, n_heads, D]``."""
    q_len, n_heads, d = q.shape
    n_kv = key.data.shape[-2]
    group = n_heads // n_kv
    gp = triton.next_power_of_2(group)
    bm = max(1, 64 // gp)  # 64 query rows (queries x heads of the group) per program
    tile = 64
    out = torch.empty_like(q)
    k_args, k_strides = _side_args(key, q.device)
    v_args, v_strides = _side_args(value, q.device)
    if key.quantized:
        k_args[3] = key.ring[slot]
    if value.quantized:
        v_args[3] = value.ring[slot]
    k_strides = k_strides[:6] + k_strides[7:]  # one ring: no slot stride
    v_strides = v_strides[:6] + v_strides[7:]
    qc = q.contiguous()
    _prefill_kernel[(triton.cdiv(q_len, bm), n_kv)](
        qc, *k_args, *v_args, block_ids, out, scale, max(1, ring_tokens), q_len, context_len,
        context_len if fp_start is None else fp_start,
        qc.stride(0), qc.stride(1), out.stride(0), out.stride(1), *k_strides, *v_strides,
        G=group, GP=gp, BM=bm, D=d, BS=block_size, T=tile, NB=max(1, tile // block_size),
        KBITS=key.bits, VBITS=value.bits, VGROUP=d // value.scale.shape[-1] if value.quantized else 1,
        num_warps=4, num_stages=2)
    return out


@triton.jit
def _quantize_kernel(X, BLOCK_IDS, DATA, SCALE, ZERO, FLOOR, s_xt, s_xh, s_db, s_dt, s_dh, s_sb, s_st, s_sh,
                     BS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, IS_KEY: tl.constexpr,
                     GROUP: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.load(BLOCK_IDS + i)
    offs_t = tl.arange(0, BS)
    offs_d = tl.arange(0, D)
    QMAX: tl.constexpr = (1 << BITS) - 1
    PACK: tl.constexpr = 8 // BITS
    x = tl.load(X + (i * BS + offs_t)[:, None] * s_xt + h * s_xh + offs_d[None, :]).to(tl.float32)  # [BS, D]
    if IS_KEY:  # per channel over the block's tokens
        lo = tl.min(x, 0)
        sc = tl.maximum((tl.max(x, 0) - lo) / QMAX, 1e-8)
        sc = tl.maximum(sc.to(SCALE.dtype.element_ty).to(tl.float32), FLOOR)  # (codes against the stored scale
        lo = lo.to(ZERO.dtype.element_ty).to(tl.float32)                        # and zero: `quant._quantize`)
        codes = tl.floor((x - lo[None, :]) / sc[None, :] + 0.5)
        tl.store(SCALE + blk * s_sb + h * s_sh + offs_d, sc.to(SCALE.dtype.element_ty))
        tl.store(ZERO + blk * s_sb + h * s_sh + offs_d, lo.to(ZERO.dtype.element_ty))
    else:  # per token over groups of channels
        xg = tl.reshape(x, [BS, D // GROUP, GROUP])
        lo = tl.min(xg, 2)
        sc = tl.maximum((tl.max(xg, 2) - lo) / QMAX, 1e-8)
        sc = tl.maximum(sc.to(SCALE.dtype.element_ty).to(tl.float32), FLOOR)
        lo = lo.to(ZERO.dtype.element_ty).to(tl.float32)
        codes = tl.reshape(tl.floor((xg - lo[:, :, None]) / sc[:, :, None] + 0.5), [BS, D])
        offs_gr = tl.arange(0, D // GROUP)
        g_off = blk * s_sb + offs_t[:, None] * s_st + h * s_sh + offs_gr[None, :]
        tl.store(SCALE + g_off, sc.to(SCALE.dtype.element_ty))
        tl.store(ZERO + g_off, lo.to(ZERO.dtype.element_ty))
    codes = tl.minimum(tl.maximum(codes, 0.0), QMAX).to(tl.int32)
    shifts = tl.arange(0, PACK) * BITS
    packed = tl.sum(tl.reshape(codes, [BS, D // PACK, PACK]) << shifts[None, None, :], 2)
    offs_p = tl.arange(0, D // PACK)
    tl.store(DATA + blk * s_db + offs_t[:, None] * s_dt + h * s_dh + offs_p[None, :], packed.to(tl.uint8))


def quantize_into(side, staging: torch.Tensor, block_ids: torch.Tensor, group: int) -> None:
    """Quantize full blocks ``staging [n * block_size, n_kv, D]`` into ``side`` at ``block_ids``."""
    n = block_ids.numel()
    bs, n_kv, d = side.data.shape[1], staging.shape[1], staging.shape[2]
    s = side.scale
    scale_strides = (s.stride(0), 0, s.stride(1)) if side.is_key else (s.stride(0), s.stride(1), s.stride(2))
    _quantize_kernel[(n, n_kv)](
        staging, block_ids, side.data, side.scale, side.zero, stored_scale_floor(side.scale.dtype),
        staging.stride(0), staging.stride(1),
        side.data.stride(0), side.data.stride(1), side.data.stride(2), *scale_strides,
        BS=bs, D=d, BITS=side.bits, IS_KEY=side.is_key, GROUP=min(group, d))
