"""skistune: find the best KV-cache settings for serving an LLM under latency, energy and quality constraints.

The public API is loaded on first use, so that ``import skistune`` stays light:

    skistune.optimize(workload, slo=..., objective=..., constraints=..., n_trials=..., storage=...)
    skistune.OptimizeResult
"""
from __future__ import annotations

import os
from typing import Any

# OpenMP threads that wait for work sleep instead of spinning, unless the user chose (OMP_WAIT_POLICY) or
# SKISTUNE_OMP_WAIT=spin keeps OpenMP's default. Read when torch loads its OpenMP runtime, so set here, before
# any torch import. On a 2-core host a decode step of SmolLM2 took x3.2 its time alone beside a busy process
# (a single-threaded loop, or a second replay) with spinning threads, and x0.9 with sleeping ones; alone,
# sleeping cost x1.09 (`python benchmarks/contention.py`, BENCHMARKS.md). Profiles and validation replays on
# a shared machine then measure the machine, not its neighbour.
if "OMP_WAIT_POLICY" not in os.environ and os.environ.get("SKISTUNE_OMP_WAIT", "passive") != "spin":
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

_LAZY = {"optimize": "skistune.optimize", "OptimizeResult": "skistune.optimize"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # importing the submodule bound the name to it; the function wins
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
