"""Where skistune keeps what it builds or measures once per machine (the compiled CPU kernel, the
projection rule, quick hardware profiles), and what identifies the machine for it."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def user_cache_dir(kind: str) -> Path:
    """``$XDG_CACHE_HOME/skistune/<kind>`` (``~/.cache`` when XDG_CACHE_HOME is not set)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
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
