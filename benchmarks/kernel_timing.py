"""Paged decode attention and quantize-on-append against the memory-bandwidth limit, side by side.

For one attention layer of a model preset (default Llama-3-8B's: 32 query heads, 8 KV heads, head dim
128) over a paged KV cache in randomly placed blocks, at 16/8/4/2 bits, prints per shape: the time
(median), the bytes the kernel must read (KV codes, scales and zero points; queries and outputs are
negligible), the achieved bytes/s and that as a fraction of this machine's copy bandwidth measured in
the same run (a large device-to-device copy, bytes read plus bytes written), and the time of
``torch.nn.functional.scaled_dot_product_attention`` on the same KV stored contiguously at 16 bits
(the best library alternative; FlashAttention's kernel on CUDA). Before timing, each bitwidth's
output is checked against the PyTorch path in float32 (and, at 16 bits, a float64 reference).

On CUDA the Triton kernels run. On a CPU the compiled kernel (`kernels/paged_decode_cpu.c`, the runtime's
CPU decode path) runs, and the PyTorch path it replaced is timed beside it on the same KV (``vs torch``).
A CPU run evicts the caches before every timed call (it writes a buffer of twice the last-level cache):
in a real step the KV of 30-odd layers and the weights stream between two reads of one layer's KV, so a
layer timed in a loop from a warm cache would read it at cache speed, not memory speed (16-bit 1 x 8192
of Llama-3-8B is 67 MB). ``--warm`` times it in a loop instead.

    python benchmarks/kernel_timing.py [--device cpu|cuda] [--shapes 8x2048 ...] [--bits 16 8 4 2] [--sweep]
                                      [--warm] [--json]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

from bench_args import add_json, check_device, description, fail, positive_int, print_json

import torch
import torch.nn.functional as F

from skistune.config import KVConfig
from skistune.kernels import cpu_native
from skistune.kernels.attention import _decode_torch, build_attention_metadata, paged_attention, quantize_blocks
from skistune.runtime.kv_layout import side_block_bytes
from skistune.runtime.kv_store import PagedKVStore
from skistune.runtime.presets import PRESETS, get_preset

DEFAULT_SHAPES = {"cuda": ["1x65536", "32x8192", "128x4096", "64x16384"], "cpu": ["1x8192", "8x2048", "16x4096"]}
DTYPES = {"cuda": torch.bfloat16, "cpu": torch.float32}


def last_level_cache_bytes() -> int:
    """The largest CPU cache this machine reports (sysfs), 64 MiB where it says nothing."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=64 << 20)


class CacheFlush:
    """Evicts the CPU caches by writing over a buffer twice the size of the last-level cache."""

    def __init__(self):
        self.buffer = torch.empty(2 * last_level_cache_bytes() // 4)
        self.value = 0.0

    def __call__(self) -> None:
        self.value += 1.0
        self.buffer.fill_(self.value)


def bench(fn, device: torch.device, repeats: int, before=None) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, the performance counter on a CPU); ``before()``
    runs untimed ahead of each call."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        if before is not None:
            before()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes/s of a large copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 4, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2 * nbytes / bench(lambda: dst.copy_(src), device, repeats)


def layer_store(spec, bits: int, batch: int, context: int, dtype, device) -> tuple[PagedKVStore, list[list[int]]]:
    """One layer's paged KV at ``bits`` for ``batch`` sequences of ``context`` tokens, blocks shuffled."""
    bs = 16
    config = KVConfig().with_knobs({"bitwidth.key_bits": bits, "bitwidth.value_bits": bits,
                                    "batching.max_num_seqs": batch, "prefix_reuse.block_size": bs})
    blocks = batch * -(-context // bs)
    store = PagedKVStore(dataclasses.replace(spec, n_layers=1), blocks, bs, dtype, device, config)
    perm = (torch.randperm(blocks) + 1).tolist()
    per_seq = blocks // batch
    return store, [perm[i * per_seq:(i + 1) * per_seq] for i in range(batch)]


def fill(store: PagedKVStore, tables, device) -> None:
    """Real quantized content: random full-precision KV quantized block by block (16 bits: stored as is)."""
    key, value = store.layer(0)
    n_kv, d = key.ring.shape[-2:] if key.quantized else key.data.shape[-2:]
    ids = torch.tensor([b for t in tables for b in t], device=device)
    for side in (key, value):
        for chunk in ids.split(4096):
            x = torch.randn(chunk.numel() * store.block_size, n_kv, d, device=device, dtype=store.dtype)
            if side.quantized:
                quantize_blocks(side, x, chunk, store.value_group)
            else:
                side.data[chunk] = x.view(-1, store.block_size, n_kv, d)


def read_bytes(spec, bits: int, batch: int, context: int, itemsize: int) -> int:
    per_block = sum(side_block_bytes(spec, 16, itemsize, bits, is_key, min(32, spec.head_dim))
                    for is_key in (True, False))
    return batch * -(-context // 16) * per_block


def check(q, key, value, meta, scale, spec) -> float:
    """Relative error of the device kernel against the PyTorch path in float32 (same stored KV)."""
    out = paged_attention(q, key, value, meta, scale).float()
    ref = _decode_torch(q.float(), key, value, meta, scale, spec.n_kv_heads, spec.n_heads // spec.n_kv_heads)
    return ((out - ref).norm() / ref.norm()).item()


def sdpa_time(spec, batch: int, context: int, dtype, device, repeats: int, flush=None) -> float:
    q = torch.randn(batch, spec.n_heads, 1, spec.head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, spec.n_kv_heads, context, spec.head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    return bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), device, repeats, flush)


def torch_path_time(q, key, value, meta, scale, spec, device, repeats: int, flush) -> float | None:
    """The PyTorch decode path on the same KV (CPU: what the compiled kernel replaced); None on CUDA."""
    if device.type != "cpu":
        return None
    group = spec.n_heads // spec.n_kv_heads
    return bench(lambda: _decode_torch(q, key, value, meta, scale, spec.n_kv_heads, group), device, repeats, flush)


def run_shape(spec, batch: int, context: int, bits_list, dtype, device, copy_bps: float, repeats: int,
              flush=None) -> list[dict]:
    scale = spec.head_dim ** -0.5
    sdpa_s = sdpa_time(spec, batch, context, dtype, device, repeats, flush)
    rows = []
    for bits in bits_list:
        store, tables = layer_store(spec, bits, batch, context, dtype, device)
        fill(store, tables, device)
        key, value = store.layer(0)
        meta = build_attention_metadata(tables, [1] * batch, [context] * batch, 16, _ring(store, batch), device)
        q = torch.randn(batch, spec.n_heads, spec.head_dim, dtype=dtype, device=device)
        err = check(q, key, value, meta, scale, spec) if batch * context <= 1 << 20 else None
        t = bench(lambda: paged_attention(q, key, value, meta, scale), device, repeats, flush)
        torch_s = torch_path_time(q, key, value, meta, scale, spec, device, repeats, flush)
        nbytes = read_bytes(spec, bits, batch, context, dtype.itemsize)
        rows.append({"batch": batch, "context": context, "bits": bits, "time_s": t, "bytes": nbytes,
                     "bytes_per_s": nbytes / t, "fraction_of_copy": nbytes / t / copy_bps,
                     "vs_sdpa": t / sdpa_s, "sdpa_s": sdpa_s, "rel_err_vs_torch": err, "torch_path_s": torch_s,
                     "vs_torch_path": None if torch_s is None else t / torch_s})
        store = meta = None  # (freed before the next size; the lambdas above read them only within this pass)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def sweep(spec, batch: int, context: int, dtype, device, repeats: int) -> list[dict]:
    """Time the Triton decode kernel's settings (`DecodeSetting`: tile, warps, stages; for packed KV also
    the unpack and scale strategies) at one shape, 16- and 4-bit, and keep the fastest of each."""
    from skistune.kernels import triton_attention as ta
    full = [ta.DecodeSetting(t, w, st) for t in (32, 64, 128) for w in (4, 8) for st in (2, 3)]
    packed = [ta.DecodeSetting(t, w, 3, u, sc) for t in (32, 64, 128) for w in (4, 8) for u in (0, 1) for sc in (0, 1)]
    rows = []
    for bits, settings, name in ((16, full, "DECODE_FULL"), (4, packed, "DECODE_QUANTIZED")):
        store, tables = layer_store(spec, bits, batch, context, dtype, device)
        fill(store, tables, device)
        meta = build_attention_metadata(tables, [1] * batch, [context] * batch, 16, _ring(store, batch), device)
        q = torch.randn(batch, spec.n_heads, spec.head_dim, dtype=dtype, device=device)
        timed = []
        for setting in settings:
            setattr(ta, name, setting)
            t = bench(lambda: paged_attention(q, *store.layer(0), meta, spec.head_dim ** -0.5), device, repeats)
            timed.append((t, setting))
            rows.append({"bits": bits, **dataclasses.asdict(setting), "time_s": t})
        setattr(ta, name, min(timed, key=lambda x: x[0])[1])
        store = meta = None
    return rows


def _settings() -> dict:
    try:
        from skistune.kernels import triton_attention as ta
    except ImportError:
        return {}
    return {"full": dataclasses.asdict(ta.DECODE_FULL), "quantized": dataclasses.asdict(ta.DECODE_QUANTIZED)}


def _ring(store, batch: int):
    from skistune.kernels.attention import RingInfo
    return RingInfo(list(range(batch)), [0] * batch, store.ring_tokens, store.window) if store.quantized else None


def prefill_rows(spec, dtype, device, repeats: int) -> list[dict]:
    """One prefill chunk over its cached context: the Triton kernel (CUDA) on paged KV at 16 and 4 bits
    against SDPA with the same causal mask on contiguous 16-bit KV; TFLOP/s counts the unmasked pairs."""
    if device.type != "cuda":
        return []
    from skistune.kernels.triton_attention import paged_prefill
    rows = []
    for chunk, cached in ((512, 4096), (2048, 0), (512, 16384)):
        ctx = chunk + cached
        q = torch.randn(chunk, spec.n_heads, spec.head_dim, dtype=dtype, device=device)
        qs = q.transpose(0, 1).unsqueeze(0)  # [1, H, chunk, D]
        k = torch.randn(1, spec.n_kv_heads, ctx, spec.head_dim, dtype=dtype, device=device)
        v = torch.randn_like(k)
        mask = torch.arange(ctx, device=device)[None, :] <= torch.arange(cached, ctx, device=device)[:, None]
        sdpa_s = bench(lambda: F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True),
                       device, repeats)
        flops = 4 * spec.n_heads * spec.head_dim * chunk * (cached + (chunk + 1) / 2)
        for bits in (16, 4):
            store, tables = layer_store(spec, bits, 1, ctx, dtype, device)
            fill(store, tables, device)
            ids = torch.tensor(tables[0], device=device)
            t = bench(lambda: paged_prefill(q, *store.layer(0), ids, ctx, spec.head_dim ** -0.5,
                                            fp_start=store.full_precision_start(ctx, 0),
                                            ring_tokens=store.ring_tokens, block_size=16), device, repeats)
            rows.append({"chunk": chunk, "cached": cached, "bits": bits, "time_s": t, "tflop_per_s": flops / t / 1e12,
                         "vs_sdpa": t / sdpa_s, "sdpa_s": sdpa_s})
            store = None
    return rows


def quantize_rows(spec, dtype, device, repeats: int) -> list[dict]:
    """Quantize-on-append of 4096 full blocks (a large prefill's worth) at each bitwidth."""
    rows = []
    for bits in (8, 4, 2):
        store, tables = layer_store(spec, bits, 1, 4096 * 16, dtype, device)
        key, _ = store.layer(0)
        x = torch.randn(4096 * 16, spec.n_kv_heads, spec.head_dim, dtype=dtype, device=device)
        ids = torch.tensor(tables[0], device=device)
        t = bench(lambda: quantize_blocks(key, x, ids, store.value_group), device, repeats)
        nbytes = x.numel() * x.element_size() + 4096 * side_block_bytes(spec, 16, dtype.itemsize, bits, True, 32)
        rows.append({"bits": bits, "blocks": 4096, "time_s": t, "bytes": nbytes, "bytes_per_s": nbytes / t})
    return rows


def gbps(bytes_per_s: float) -> str:
    """GB/s to three significant digits, without an exponent from 100 up: a CPU's quantize-on-append runs
    below 1 GB/s, which a whole number printed as 0."""
    x = bytes_per_s / 1e9
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def shape(text: str) -> tuple[int, int]:
    """``--shapes``: BATCHxCONTEXT, both positive integers."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: not BATCHxCONTEXT (two positive integers, e.g. 8x2048)")
    return int(parts[0]), int(parts[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default="llama-3-8b", choices=list(PRESETS))
    ap.add_argument("--shapes", nargs="+", type=shape, metavar="BATCHxCONTEXT",
                    help="BATCHxCONTEXT, e.g. 8x2048 (default depends on the device)")
    ap.add_argument("--bits", nargs="+", type=int, choices=(16, 8, 4, 2), default=[16, 8, 4, 2])
    ap.add_argument("--repeats", type=positive_int, default=None, help="timed repeats (default 20 on CUDA, 5 on CPU)")
    ap.add_argument("--sweep", action="store_true",
                    help="CUDA: first time the decode kernel's tile/warps/stages choices and use the fastest")
    ap.add_argument("--warm", action="store_true",
                    help="CPU: time each call from a warm cache (default: caches evicted before every call)")
    add_json(ap)
    args = ap.parse_args()
    check_device(args.device)
    # each of these times one device's code only: on the other, taken silently, it changed nothing
    if args.sweep and args.device != "cuda":
        fail(f"--sweep: times the Triton decode kernel's settings, on CUDA only (not --device {args.device})")
    if args.warm and args.device != "cpu":
        fail(f"--warm: times the CPU kernel from a warm cache, on a CPU only (not --device {args.device})")
    device = torch.device(args.device)
    dtype = DTYPES[device.type]
    repeats = args.repeats or (20 if device.type == "cuda" else 5)
    spec = get_preset(args.model)
    torch.manual_seed(0)
    copy_bps = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (256 << 20), repeats)
    flush = CacheFlush() if device.type == "cpu" and not args.warm else None
    impl = "triton" if device.type == "cuda" else ("compiled C" if cpu_native.available() else "pytorch")
    print(f"{device.type} ({impl} decode kernel): copy bandwidth {gbps(copy_bps)} GB/s (read + write); "
          f"{spec.name} layer, {dtype}"
          + (f"; caches evicted before each call ({len(flush.buffer) * 4 >> 20} MiB written)" if flush else ""))
    sweep_rows = []
    if args.sweep:
        from skistune.kernels import triton_attention as ta
        sweep_rows = sweep(spec, 64, 8192, dtype, device, repeats)
        for r in sweep_rows:
            print(f"sweep {r['bits']:>2}-bit tile {r['tile']:>3} warps {r['warps']} stages {r['stages']} "
                  f"unpack {r['unpack']} scales {r['scales']}: {r['time_s'] * 1e3:.3f} ms")
        print(f"decode kernel settings: 16-bit {ta.DECODE_FULL}, packed {ta.DECODE_QUANTIZED}")
    rows = []
    for batch, context in args.shapes or [shape(s) for s in DEFAULT_SHAPES[device.type]]:
        for r in run_shape(spec, batch, context, args.bits, dtype, device, copy_bps, repeats, flush):
            rows.append(r)
            err = "" if r["rel_err_vs_torch"] is None else f"  err {r['rel_err_vs_torch']:.1e}"
            vs_torch = "" if r["vs_torch_path"] is None else f"  {r['vs_torch_path']:5.2f}x torch path"
            print(f"decode B={batch:<4} L={context:<6} {r['bits']:>2}-bit  {r['time_s'] * 1e3:8.3f} ms  "
                  f"{r['bytes'] / 1e9:7.3f} GB  {gbps(r['bytes_per_s']):>7} GB/s  "
                  f"{r['fraction_of_copy']:5.1%} of copy  {r['vs_sdpa']:5.2f}x SDPA{vs_torch}{err}")
    prefill = prefill_rows(spec, dtype, device, repeats)
    for r in prefill:
        print(f"prefill chunk {r['chunk']:<5} cached {r['cached']:<6} {r['bits']:>2}-bit  {r['time_s'] * 1e3:8.3f} ms  "
              f"{r['tflop_per_s']:6.1f} TFLOP/s  {r['vs_sdpa']:5.2f}x SDPA")
    quant = quantize_rows(spec, dtype, device, repeats)
    for r in quant:
        print(f"quantize-on-append {r['bits']}-bit, {r['blocks']} blocks: {r['time_s'] * 1e3:.3f} ms, "
              f"{gbps(r['bytes_per_s'])} GB/s")
    if args.json:
        print_json({"benchmark": "kernel_timing", "device": device.type, "implementation": impl,
                    "model": spec.name, "dtype": str(dtype).removeprefix("torch."),
                    "copy_bytes_per_s": copy_bps, "decode": rows, "prefill": prefill, "quantize": quant,
                    "sweep": sweep_rows, "settings": _settings(), "caches_evicted": flush is not None})


if __name__ == "__main__":
    main()
