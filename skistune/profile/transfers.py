"""Transfers between KV tiers: batched copies of KV blocks between the device pool and a host pool, and
real file I/O between host memory and a directory on disk (``os.pwrite`` + ``fsync``, ``os.pread`` with
the file's page cache dropped first, so reads come from the disk)."""
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


def _pools(device: torch.device, block_bytes: int, max_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks = max(2 * max_blocks, MIN_POOL_BYTES // block_bytes)
    elems = block_bytes // 4  # float32 elements per block
    pin = device.type == "cuda"  # page-locked host memory: what a real offload tier copies to and from
    device_pool = torch.empty(num_blocks, elems, device=device).uniform_(-1, 1)
    host_pool = torch.empty(num_blocks, elems, pin_memory=pin).uniform_(-1, 1)
    return device_pool, host_pool


def block_copy_timings(device: torch.device, block_bytes: int, block_counts: Sequence[int], *,
                       warmup: int, repeats: int) -> list[GridPoint]:
    """Timings per block count of device->host and host->device block copies."""
    device_pool, host_pool = _pools(device, block_bytes, max(block_counts))
    out = []
    directions = {"device_to_host": (device_pool, host_pool), "host_to_device": (host_pool, device_pool)}
    for link, (src, dst) in directions.items():
        for n in block_counts:
            def fresh_ids(n: int = n, src: torch.Tensor = src, dst: torch.Tensor = dst):
                return (torch.randperm(src.shape[0])[:n].to(src.device),
                        torch.randperm(dst.shape[0])[:n].to(dst.device))

            timing = time_fn(lambda ids, src=src, dst=dst: copy_blocks(src, dst, *ids), fresh_ids,
                             warmup=warmup, repeats=repeats, device=device)
            out.append(GridPoint(link, {"bytes": n * block_bytes, "blocks": n}, timing))
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
