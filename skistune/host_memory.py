"""What memory this process can use, read from the system (Linux's /proc/meminfo and cgroups, else the C
library): how many requests can be simulated (`workloads.synthetic.check_request_count`), whether a model fits
before it is built for profiling (`profile.measure`). Standard library only: the workload layer imports it."""
from __future__ import annotations

import os


def available_memory_bytes() -> int | None:
    """The memory this process can still take: Linux's MemAvailable (free memory and what the kernel can
    reclaim), within a cgroup's limit (a container's, a systemd unit's), else the free or total physical memory
    the C library reports; None where none is known (then nothing is refused)."""
    known = [b for b in (_meminfo_available(), _cgroup_room()) if b is not None]
    if known:
        return min(known)
    for pages in ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES"):  # (macOS has only the total)
        try:
            return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            continue
    return None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # (kB)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The least room (limit - usage) in this process's memory cgroup and the cgroups above it (v2, or v1's
    memory controller); None where none has a limit. A container's MemAvailable is its host's, far above what
    the container may use."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    places = []  # (folder, limit file, usage file)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2 (at the root, or beside v1 controllers under unified/)
            places += [(folder, "memory.max", "memory.current")
                       for base in (root, os.path.join(root, "unified")) for folder in _upwards(base, path)]
        elif "memory" in controllers.split(","):
            places += [(folder, "memory.limit_in_bytes", "memory.usage_in_bytes")
                       for folder in _upwards(os.path.join(root, "memory"), path)]
    rooms = []
    for folder, limit_name, usage_name in places:
        try:
            with open(os.path.join(folder, limit_name)) as f:
                limit = f.read().strip()
            with open(os.path.join(folder, usage_name)) as f:
                usage = int(f.read().strip())
            # (v2 writes "max" for no limit; v1 a number near 2**63)
            if limit != "max" and int(limit) < 2**60:
                rooms.append(max(int(limit) - usage, 0))
        except (OSError, ValueError):
            continue
    return min(rooms) if rooms else None


def _upwards(base: str, path: str) -> list[str]:
    """The folder of cgroup ``path`` under ``base`` and each one above it, up to ``base``."""
    folder, base = os.path.normpath(base + "/" + path), os.path.normpath(base)
    folders = []
    while folder == base or folder.startswith(base + os.sep):
        folders.append(folder)
        if folder == base:
            break
        folder = os.path.dirname(folder)
    return folders
