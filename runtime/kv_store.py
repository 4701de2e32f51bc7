"""Where KV tensors live: per layer, one `KVSide` for keys and one for values, each at its own bits.

Every tensor is indexed by physical block ``[num_blocks + 1, ...]``; block 0 is the null block that
pads block tables (see `block_manager`); it stays zero so that padded reads are harmless.

- 16 bits: ``data [num_blocks + 1, block_size, n_kv_heads, head_dim]`` in the model's dtype.
- 8/4/2 bits: packed codes ``data [num_blocks + 1, block_size, n_kv_heads, head_dim * bits / 8]`` (uint8),
  ``scale``/``zero`` per group (keys ``[num_blocks + 1, n_kv_heads, head_dim]``, values
  ``[num_blocks + 1, block_size, n_kv_heads, head_dim / group]``), and a full-precision ``ring
  [slots, ring_tokens, n_kv_heads, head_dim]``: position ``p`` of the sequence in slot ``s`` is at
  ``ring[s, p % ring_tokens]`` (see `kv_layout` for why the ring exists and what it costs).

`TierStore` holds the host and disk pools below it and executes the scheduler's tier transfers.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..config import KVConfig
from ..profile.transfers import block_to_bytes, bytes_to_block, copy_blocks
from .disk_pool import DiskPool
from .host_allocator import zeros_lazy
from .tiers import DISK, HOST, Transfer
from .kv_layout import (FULL_PRECISION_BITS, full_precision_ring_tokens, full_precision_start, kv_block_bytes,
                        layer_bits, value_group)
from .presets import ModelSpec


@dataclass
class KVSide:
    """One layer's keys or values."""

    bits: int
    is_key: bool
    data: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    ring: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.bits != FULL_PRECISION_BITS


def _side(bits: int, is_key: bool, shape: tuple[int, int, int, int], group: int, slots: int, ring_tokens: int,
          dtype: torch.dtype, device: torch.device | str) -> KVSide:
    # zeros_lazy: on a CPU the pool's pages are zeroed on first use, not all up front (most are unused)
    blocks, bs, n_kv, d = shape
    if bits == FULL_PRECISION_BITS:
        return KVSide(bits, is_key, zeros_lazy(shape, dtype, device))
    scale_shape = (blocks, n_kv, d) if is_key else (blocks, bs, n_kv, d // group)
    return KVSide(bits, is_key,
                  data=zeros_lazy((blocks, bs, n_kv, d * bits // 8), torch.uint8, device),
                  scale=zeros_lazy(scale_shape, dtype, device),
                  zero=zeros_lazy(scale_shape, dtype, device),
                  ring=zeros_lazy((slots, ring_tokens, n_kv, d), dtype, device))


class PagedKVStore:
    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", config: KVConfig | None = None) -> None:
        config = config or KVConfig()
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.block_bytes = kv_block_bytes(spec, block_size, dtype.itemsize, config)
        self.value_group = value_group(config, spec)
        self.window = config.bitwidth.full_precision_window
        self.ring_tokens = full_precision_ring_tokens(config)
        self.slots = config.batching.max_num_seqs
        shape = (num_blocks + 1, block_size, spec.n_kv_heads, spec.head_dim)
        if torch.device(device).type == "cpu":  # the "device" pool is host memory here
            check_fits_memory(num_blocks * self.block_bytes, "offload.device_kv_bytes", "KV pool")
        self.layers = [
            (_side(kb, True, shape, self.value_group, self.slots, self.ring_tokens, dtype, device),
             _side(vb, False, shape, self.value_group, self.slots, self.ring_tokens, dtype, device))
            for kb, vb in layer_bits(config, spec)]
        self.quantized = any(k.quantized or v.quantized for k, v in self.layers)

    def layer(self, i: int) -> tuple[KVSide, KVSide]:
        return self.layers[i]

    def full_precision_start(self, context_len: int, ring_start: int) -> int:
        """`kv_layout.full_precision_start` at this store's window and block size."""
        return full_precision_start(context_len, ring_start, self.window, self.block_size)

    def fill_random_(self) -> None:
        """Random contents in every block but the null block 0 (which must stay zero), for timing: values
        in [-1, 1), random codes, and scales that keep dequantized values in about the same range."""
        for side in (s for pair in self.layers for s in pair):
            if side.quantized:
                side.data[1:].random_(0, 256)
                side.scale[1:].fill_(2.0 / ((1 << side.bits) - 1))
                side.zero[1:].fill_(-1.0)
                side.ring.uniform_(-1.0, 1.0)
            else:
                side.data[1:].uniform_(-1.0, 1.0)


class TierStore:
    """The host and disk pools of a `PagedKVStore` and the copies of the scheduler's tier transfers
    (`tiers.Transfer`). A block of a lower tier holds every layer's packed codes, scales and zeros (or
    16-bit data) of one device block; the full-precision rings stay on the device (they belong to
    running sequences). The host pool is pinned memory on CUDA; on a CPU it is host memory like the
    device pool, but the copies are real and its capacity is enforced."""

    def __init__(self, store: PagedKVStore, host_blocks: int, disk_blocks: int) -> None:
        self.parts = [t for pair in store.layers for side in pair for t in (side.data, side.scale, side.zero)
                      if t is not None]  # device tensors indexed by block
        # which of them belong to each layer (layer-wise loading copies one layer's at a time)
        self.layer_parts, first = [], 0
        for pair in store.layers:
            n = sum(t is not None for side in pair for t in (side.data, side.scale, side.zero))
            self.layer_parts.append(range(first, first + n))
            first += n
        pin = self.parts[0].device.type == "cuda"
        check_fits_memory(host_blocks * store.block_bytes, "offload.host_kv_bytes", "host tier")
        # page-locked for the GPU's copies (allocated now); on a CPU zeroed by the kernel as blocks are first
        # written (`zeros_lazy`), as the device pool is: zero-filling a 2 GiB host tier took about a second
        self.host = [torch.zeros((host_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=True) if pin
                     else zeros_lazy((host_blocks, *t.shape[1:]), t.dtype) for t in self.parts]
        self.part_bytes = [t[0].numel() * t.element_size() for t in self.parts]
        if sum(self.part_bytes) != store.block_bytes:
            raise RuntimeError(f"KV tiers: a block is {sum(self.part_bytes)} bytes, the layout says {store.block_bytes}")
        self.disk = DiskPool(disk_blocks, store.block_bytes) if disk_blocks else None

    def run(self, transfers: list[Transfer], layer: int | None = None) -> float:
        """Execute transfers in order, every layer's KV or only ``layer``'s (host <-> device copies only:
        a disk block holds every layer); returns the seconds they took."""
        t0 = time.perf_counter()
        parts = range(len(self.parts)) if layer is None else self.layer_parts[layer]
        for t in transfers:
            if DISK not in (t.src_tier, t.dst_tier):
                self._copy(parts, t.src_tier == HOST, t.src_blocks, t.dst_blocks)
            elif layer is None:
                getattr(self, f"_{t.src_tier}_to_{t.dst_tier}")(t)
            else:
                raise ValueError("disk transfers move whole blocks, not one layer's KV")
        if transfers and self.parts[0].device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        return time.perf_counter() - t0

    def _copy(self, parts, from_host: bool, src: list[int], dst: list[int]) -> None:
        """Copy blocks of the chosen parts between the device tensors and their host pools."""
        srcs, dsts = (self.host, self.parts) if from_host else (self.parts, self.host)
        src_ids = torch.tensor(src, device=srcs[0].device)
        dst_ids = torch.tensor(dst, device=dsts[0].device)
        for i in parts:
            copy_blocks(srcs[i], dsts[i], src_ids, dst_ids)

    def _host_to_disk(self, t: Transfer) -> None:
        self._to_disk(t, self.host)

    def _device_to_disk(self, t: Transfer) -> None:
        self._to_disk(t, self.parts)

    def _to_disk(self, t: Transfer, tensors: list[torch.Tensor]) -> None:
        """Write the blocks; those the disk refuses (full, ...) are marked lost on the transfer, for the tiers'
        accounting (`TierManager.ran`)."""
        for s, d in zip(t.src_blocks, t.dst_blocks):
            if not self.disk.write(d, block_to_bytes(tensors, s)):
                t.lost.append(d)

    def _disk_to_device(self, t: Transfer) -> None:
        for s, d in zip(t.src_blocks, t.dst_blocks):  # (the profiler times these same conversions: `block_io`)
            bytes_to_block(self.disk.take(s), self.parts, d, self.part_bytes)


def check_fits_memory(nbytes: int, knob: str, what: str) -> None:
    """KV in host memory larger than this machine's memory cannot be served: say so before allocating it
    (the pools are zeroed lazily, so filling them would end in the kernel's out-of-memory kill, with no
    message)."""
    from ..profile.fingerprint import host_memory_bytes

    memory = host_memory_bytes()
    if memory is not None and nbytes > memory:
        gib = 2 ** 30
        raise ValueError(f"{knob}: a {nbytes / gib:.1f} GiB {what} in host memory is more than this machine's "
                         f"{memory / gib:.1f} GiB")
