"""The disk tier's storage: one file per pool, a block per ``block_bytes`` at offset ``slot * block_bytes``,
written with ``os.pwrite`` and read with ``os.pread``, and a CRC32 per block kept in memory.

A block whose bytes no longer match their checksum is never used: `verify` reads and checks it when the
scheduler is about to promote it (the block manager then treats it as a cache miss and the KV is
recomputed); the checked bytes are kept for the copy that follows, so the block is read once.

The file is sparse: its size is the tier's capacity, its blocks take disk space as they are written. A
write the disk cannot take (full, over quota, an I/O error) loses that block only: it has no checksum,
it is recomputed when next needed, and serving goes on (`write` says so, `write_errors` counts them, and
the first one warns). Its bytes stay in memory until the tiers have seen the loss (`verify` drops them):
a promotion decided before the write ran copies them up from there (`take`).

The file is unlinked as soon as it is open: the descriptor keeps it alive for positional I/O, and no way
of ending the process (SIGTERM, SIGKILL, a crash) leaves it behind. ``path`` names it in messages only."""
from __future__ import annotations

import errno
import os
import tempfile
import warnings
import weakref
import zlib

from ..config import format_bytes

# errors of a write that the disk, not the program, causes: the block is lost, serving goes on
DISK_WRITE_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG})
# where the disk tier's file lives: a deployment's choice (the drive), not a knob the search tunes; the
# profiler times the same folder by default (`skistune profile --disk-dir` overrides it)
DISK_DIR_ENV = "SKISTUNE_DISK_DIR"


def default_disk_dir() -> str | None:
    """The folder named by ``$SKISTUNE_DISK_DIR``, checked (None when unset: the system's temporary
    directory). A folder that is missing is an error, not a silent fall back to another drive."""
    folder = os.environ.get(DISK_DIR_ENV)
    if not folder:
        return None
    if not os.path.isdir(folder):
        raise ValueError(f"{DISK_DIR_ENV}={folder}: not a directory (it names where the disk tier's file lives)")
    return folder


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class DiskPool:
    def __init__(self, num_blocks: int, block_bytes: int, directory: str | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        directory = directory if directory is not None else default_disk_dir()
        size, where = num_blocks * block_bytes, directory or tempfile.gettempdir()
        try:
            self.fd, self.path = tempfile.mkstemp(prefix="skistune-kv-", suffix=".bin", dir=directory)
        except OSError as exc:
            raise ValueError(f"offload.disk_kv_bytes: cannot create the disk tier's file on {where} "
                             f"({exc.strerror})") from None
        # unlinked now: a process that ends without running finalizers (SIGTERM, SIGKILL) had left GB-sized files
        # in the folder; the descriptor keeps the file until it is closed (with the pool)
        _unlink(self.path)
        self._finalizer = weakref.finalize(self, os.close, self.fd)
        try:
            os.ftruncate(self.fd, size)
        except OSError as exc:  # e.g. EFBIG: past the filesystem's largest file
            # closed now, not when the pool is collected: the half-built pool lives on in the traceback
            self._finalizer()
            raise ValueError(f"offload.disk_kv_bytes: a {format_bytes(size)} disk tier does not fit in a file "
                             f"on {where} ({exc.strerror})") from None
        self.crc: dict[int, int] = {}  # slot -> CRC32 of the bytes written there
        self._checked: dict[int, bytes] = {}  # slot -> bytes verified and not yet copied up
        # slot -> bytes of a block whose write the disk refused, until the tiers drop them (`verify`) or a
        # promotion decided before the write ran copies them up (`take`)
        self._unwritten: dict[int, bytes] = {}
        self.write_errors = 0  # blocks lost to `DISK_WRITE_ERRORS`

    def close(self) -> None:
        self._finalizer()

    def write(self, slot: int, data: bytes) -> bool:
        """Write a block; False when the disk refused it (`DISK_WRITE_ERRORS`: the block is lost)."""
        if len(data) != self.block_bytes:
            raise ValueError(f"disk pool: block of {len(data)} bytes, the pool's are {self.block_bytes}")
        self._checked.pop(slot, None)
        self._unwritten.pop(slot, None)
        self.crc.pop(slot, None)  # until the whole block is written, the slot holds nothing usable
        view, offset = memoryview(data), slot * self.block_bytes
        try:
            while view:  # pwrite may write less than asked
                n = os.pwrite(self.fd, view, offset)
                view, offset = view[n:], offset + n
        except OSError as exc:
            if exc.errno not in DISK_WRITE_ERRORS:
                raise
            self.write_errors += 1
            if self.write_errors == 1:
                warnings.warn(f"KV disk tier ({self.path}): {os.strerror(exc.errno)}; blocks that cannot be "
                              "written are recomputed when next needed", RuntimeWarning, stacklevel=2)
            self._unwritten[slot] = bytes(data)
            return False
        self.crc[slot] = zlib.crc32(data)
        return True

    def read(self, slot: int) -> bytes | None:
        """The block's bytes, or None when they fail their checksum (or were never written)."""
        data = os.pread(self.fd, self.block_bytes, slot * self.block_bytes)
        if len(data) != self.block_bytes or self.crc.get(slot) != zlib.crc32(data):
            return None
        return data

    def verify(self, slot: int) -> bool:
        """Read and check a block about to be promoted; keep its bytes for `take`. A block whose write was
        refused fails without a read (and the bytes kept of it are dropped)."""
        self._unwritten.pop(slot, None)
        data = self.read(slot) if slot in self.crc else None
        if data is None:
            self.crc.pop(slot, None)
            return False
        self._checked[slot] = data
        return True

    def take(self, slot: int) -> bytes:
        """The bytes of a block being copied up (checked by `verify`, or read and checked now; or those of a
        write the disk refused after the promotion was decided)."""
        data = self._checked.pop(slot, None) or self._unwritten.pop(slot, None) or self.read(slot)
        if data is None:
            raise RuntimeError(f"disk pool: block in slot {slot} failed its checksum after it was promoted")
        return data
