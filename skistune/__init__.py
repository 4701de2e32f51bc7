"""skistune: find the best KV-cache settings for serving an LLM under latency, energy and quality constraints.

The public API is loaded on first use, so that ``import skistune`` stays light:

    skistune.optimize(workload, slo=..., objective=..., constraints=..., n_trials=..., storage=...)
    skistune.OptimizeResult
"""
from __future__ import annotations

from typing import Any

_LAZY = {"optimize": "skistune.optimize", "OptimizeResult": "skistune.optimize"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # importing the submodule bound the name to it; the function wins
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
