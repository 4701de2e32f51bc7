"""Where skistune keeps what it builds or measures once per machine (the compiled CPU kernel, the
projection rule, quick hardware profiles), what identifies the machine for it, and the lock that lets
one process build or measure an entry while others wait for it instead of doing the same work."""
from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Callable, Iterator

try:
    import fcntl
except ImportError:  # (not POSIX: no lock, each process builds or measures for itself, as before locks)
    fcntl = None  # type: ignore[assignment]


def user_cache_dir(kind: str) -> Path:
    """``$XDG_CACHE_HOME/skistune/<kind>`` (``~/.cache`` when XDG_CACHE_HOME is not set, or is relative: the
    XDG spec says such a path is ignored, and one taken from the working directory put a new cache in every
    folder a command ran from)."""
    root = os.environ.get("XDG_CACHE_HOME") or ""
    if not os.path.isabs(root):
        root = str(Path.home() / ".cache")
    return Path(root) / "skistune" / kind


def cpu_identity() -> str:
    """The CPU's model name and feature flags from /proc/cpuinfo (what ``-march=native`` compiles for and
    what a BLAS dispatches on), or the platform's processor string where there is no /proc/cpuinfo."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    seen: dict[str, str] = {}
    for line in lines:
        name = line.split(":", 1)[0].strip()
        if name in wanted and name not in seen:
            seen[name] = line
    return "\n".join([platform.machine(), *seen.values()])


def lock_path(entry: Path) -> Path:
    """The lock file beside a cache entry (hidden; kept: removing it would let a third process lock a new
    file while a second still waits on the old one)."""
    return entry.with_name(f".{entry.name}.lock")


def _holder(fd: int) -> int | None:
    """The pid the lock's holder wrote into the lock file, if it has yet."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


@contextlib.contextmanager
def exclusive(entry: Path, waiting: Callable[[int | None], None] | None = None) -> Iterator[bool]:
    """Hold an exclusive lock on the lock file beside ``entry`` (created, with its folder) while the block
    builds or measures the entry; yields whether another process held it first (then the entry is likely
    there now: read it before doing the work again). ``waiting(pid)`` is called before blocking on another
    holder (pid None where it cannot be told). An ``OSError`` where the folder or the lock file cannot be
    created (an unwritable cache: the caller goes on without caching). The lock is ``flock``'s: the kernel
    drops it when its holder exits, however it dies, so a killed process leaves nobody waiting."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path(entry), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        waited = False
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if waiting is not None:
                    waiting(_holder(fd))
                fcntl.flock(fd, fcntl.LOCK_EX)
                waited = True
            except OSError:  # a file system without flock (some NFS mounts): unlocked, as before locks existed
                pass
        with contextlib.suppress(OSError):  # (the pid is for the waiters' message only)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield waited
        finally:
            with contextlib.suppress(OSError):  # emptied while still held: a later waiter reads no stale pid
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # (releases the lock)
