"""Transfers between KV tiers: batched copies of KV blocks between the device pool and a host pool, and
real file I/O between host memory and a directory on disk (``os.pwrite`` + ``fsync``, ``os.pread`` with
the file's page cache dropped first, so reads come from the disk).

The runtime's pools hold a block as several part tensors (per layer, keys and values: 16-bit data, or packed
codes, scales and zero points: `kv_layout.part_tensors`) and its tier copies make one call per part: the
copies are timed both as one tensor and split as the 16-bit layout splits them, so that the fit tells the
per-call latency from the bandwidth. The disk tier moves a block at a time, converting its parts to and from
the bytes of one write or read (`block_to_bytes`, `bytes_to_block`): those conversions are timed too."""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from .harness import time_fn
from .records import GridPoint

# Random block ids over a pool this large rarely hit the CPU's caches, as a real tier's blocks would not.
MIN_POOL_BYTES = 256 << 20
STAGING_BYTES = 8 << 20


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """``dst[dst_ids] = src[src_ids]`` across devices (ids live on their pool's device): gather where the
    source lives, one copy across, scatter where the destination lives, `STAGING_BYTES` at a time.

    Bounded batches keep the temporaries small enough for the allocator to reuse: one 47 MB temporary
    is a fresh mapping whose page faults cost more than the copy (measured: 0.5 GB/s instead of 8)."""
    per_batch = max(1, STAGING_BYTES // (src[0].numel() * src.element_size()))
    for i in range(0, len(src_ids), per_batch):
        batch = src.index_select(0, src_ids[i:i + per_batch]).to(dst.device)
        dst.index_copy_(0, dst_ids[i:i + per_batch], batch)


def copy_parts(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], src_ids: torch.Tensor,
               dst_ids: torch.Tensor) -> None:
    """The same blocks of every part tensor, one `copy_blocks` call per part (as `TierStore` copies them)."""
    for src, dst in zip(srcs, dsts):
        copy_blocks(src, dst, src_ids, dst_ids)


def block_to_bytes(tensors: Sequence[torch.Tensor], block: int) -> bytes:
    """One block of every tensor, as raw bytes in tensor order (what the disk tier writes)."""
    return b"".join(t[block].contiguous().view(torch.uint8).cpu().numpy().tobytes() for t in tensors)


def bytes_to_block(data: bytes, tensors: Sequence[torch.Tensor], block: int, part_bytes: Sequence[int]) -> None:
    """`block_to_bytes`'s bytes (``part_bytes`` of each tensor, in order) back into block ``block`` of each."""
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    for t, piece in zip(tensors, buf.split(list(part_bytes))):
        t[block].copy_(piece.view(t.dtype).view(t.shape[1:]))


def _pools(device: torch.device, block_bytes: int, max_blocks: int, parts: int = 1
           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Device and host pools of ``block_bytes`` blocks, each block split over ``parts`` tensors."""
    if block_bytes % (4 * parts):
        raise ValueError(f"transfer profile: a {block_bytes}-byte block does not split into {parts} float32 parts")
    num_blocks = max(2 * max_blocks, MIN_POOL_BYTES // block_bytes)
    elems = block_bytes // 4 // parts  # float32 elements per block of one part
    pin = device.type == "cuda"  # page-locked host memory: what a real offload tier copies to and from
    device_pool = [torch.empty(num_blocks, elems, device=device).uniform_(-1, 1) for _ in range(parts)]
    host_pool = [torch.empty(num_blocks, elems, pin_memory=pin).uniform_(-1, 1) for _ in range(parts)]
    return device_pool, host_pool


def block_copy_timings(device: torch.device, block_bytes: int, block_counts: Sequence[int], *, parts: int = 1,
                       warmup: int, repeats: int) -> list[GridPoint]:
    """Timings per block count of device->host and host->device block copies, with each block one tensor
    and, where ``parts`` > 1, split over ``parts`` tensors (the runtime's 16-bit layout: one per layer's keys
    and values): the same bytes in ``parts`` calls, which tells the fit the per-call latency. Then the disk
    tier's conversions of single blocks to and from bytes (`block_io_timings`) on the same pools."""
    out = []
    for p in dict.fromkeys((1, parts)):  # (one pool set at a time: each is at least MIN_POOL_BYTES twice)
        device_pool, host_pool = _pools(device, block_bytes, max(block_counts), p)
        out += _copy_timings(device, device_pool, host_pool, block_bytes, block_counts, warmup, repeats)
        out += block_io_timings(device, device_pool, host_pool, block_bytes, warmup=warmup, repeats=repeats)
        del device_pool, host_pool
    return out


def _copy_timings(device: torch.device, device_pool: list[torch.Tensor], host_pool: list[torch.Tensor],
                  block_bytes: int, block_counts: Sequence[int], warmup: int, repeats: int) -> list[GridPoint]:
    out = []
    rows = device_pool[0].shape[0]
    directions = {"device_to_host": (device_pool, host_pool), "host_to_device": (host_pool, device_pool)}
    for link, (src, dst) in directions.items():
        for n in block_counts:
            def fresh_ids(n: int = n, src: list[torch.Tensor] = src, dst: list[torch.Tensor] = dst):
                return torch.randperm(rows)[:n].to(src[0].device), torch.randperm(rows)[:n].to(dst[0].device)

            timing = time_fn(lambda ids, src=src, dst=dst: copy_parts(src, dst, *ids), fresh_ids,
                             warmup=warmup, repeats=repeats, device=device)
            out.append(GridPoint(link, {"bytes": n * block_bytes, "blocks": n, "parts": len(src)}, timing))
    return out


def block_io_timings(device: torch.device, device_pool: list[torch.Tensor], host_pool: list[torch.Tensor],
                     block_bytes: int, *, warmup: int, repeats: int) -> list[GridPoint]:
    """Timings of one block's conversions (`records.BLOCK_IO`) with its parts in the first 1, half and all of
    the pools' tensors: with the one-tensor pools' whole blocks, the parts, the bytes and the call itself
    vary apart, so that a fit tells their costs apart (`records.BLOCK_IO_FEATURES`)."""
    rows = device_pool[0].shape[0]
    out = []
    for k in sorted({1, len(device_pool) // 2, len(device_pool)} - {0}):
        pool, host = device_pool[:k], host_pool[:k]
        sizes = [t[0].numel() * t.element_size() for t in pool]
        data = block_to_bytes(pool, 0)
        kinds = {"device_to_bytes": lambda b, pool=pool: block_to_bytes(pool, b),
                 "host_to_bytes": lambda b, host=host: block_to_bytes(host, b),
                 "bytes_to_device": lambda b, pool=pool, data=data, sizes=sizes: bytes_to_block(data, pool, b, sizes)}
        for kind, fn in kinds.items():
            timing = time_fn(fn, lambda: int(torch.randint(rows, ())), warmup=warmup, repeats=repeats, device=device)
            out.append(GridPoint(kind, {"bytes": sum(sizes), "blocks": 1, "parts": k}, timing))
    return out


@contextmanager
def disk_file(directory: Path | None) -> Iterator[int]:
    """An open scratch file in ``directory`` (a new temp dir when None), removed afterwards."""
    from skistune.runtime.disk_pool import default_disk_dir

    directory = directory if directory is not None else default_disk_dir()  # (where the runtime's tier will be)
    own_dir = directory is None
    folder = Path(tempfile.mkdtemp(prefix="skistune-disk-")) if own_dir else Path(directory)
    if not folder.is_dir():
        raise ValueError(f"--disk-dir {folder}: not a directory")
    path = folder / f"skistune-profile-{os.getpid()}.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        yield fd
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
        if own_dir:
            shutil.rmtree(folder, ignore_errors=True)


def _write_all(fd: int, data: bytes) -> None:
    view, offset = memoryview(data), 0
    while offset < len(view):
        offset += os.pwrite(fd, view[offset:], offset)
    os.fsync(fd)  # the disk, not the page cache, has the data when the clock stops


def _read_all(fd: int, size: int) -> None:
    offset = 0
    while offset < size:
        chunk = os.pread(fd, size - offset, offset)
        if not chunk:
            raise OSError(f"disk profile: short read at byte {offset} of {size}")
        offset += len(chunk)


def _drop_cache(fd: int, size: int) -> None:
    # After fsync the pages are clean, so the kernel can drop them: the next read goes to the disk.
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)


def disk_timings(directory: Path | None, sizes_bytes: Sequence[int], *, warmup: int,
                 repeats: int) -> list[GridPoint]:
    """Timings per size of host->disk writes and disk->host reads of fresh random data."""
    rng = np.random.default_rng()
    out = []
    with disk_file(directory) as fd:
        for size in sizes_bytes:
            write = time_fn(lambda data: _write_all(fd, data), lambda size=size: rng.bytes(size),
                            warmup=warmup, repeats=repeats, device="cpu")

            def written_then_dropped(size: int = size) -> int:
                _write_all(fd, rng.bytes(size))
                _drop_cache(fd, size)
                return size

            read = time_fn(lambda n: _read_all(fd, n), written_then_dropped, warmup=warmup, repeats=repeats,
                           device="cpu")
            out += [GridPoint("host_to_disk", {"bytes": size}, write), GridPoint("disk_to_host", {"bytes": size}, read)]
    return out


def disk_free_bytes(directory: Path | str | None) -> int | None:
    """Free space of the filesystem holding ``directory`` (default: the temporary directory, where the
    runtime's disk tier lives: ``$SKISTUNE_DISK_DIR`` or the temporary directory); None where it cannot be read."""
    from skistune.runtime.disk_pool import default_disk_dir

    try:
        directory = directory if directory is not None else default_disk_dir() or tempfile.gettempdir()
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def page_cache_dropped() -> bool:
    """Whether disk reads bypass the page cache here (posix_fadvise exists: Linux, most Unixes)."""
    return hasattr(os, "posix_fadvise")
