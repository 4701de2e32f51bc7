"""skistune: find the best KV-cache settings for serving an LLM under latency, energy and quality constraints.

The public API is loaded on first use, so that ``import skistune`` stays light:

    skistune.optimize(workload, slo=..., objective=..., constraints=..., n_trials=..., storage=...)
    skistune.OptimizeResult
    skistune.evaluate(config, workload_or_requests, mode="simulate" | "run", profile=...) -> Metrics
    skistune.simulate(config, requests, target); skistune.capacity(config, requests, target, ["p99=200ms"])
    skistune.sim_target(model, profile)      the simulation target of a model on a profiled machine
    skistune.KVConfig, skistune.load_config  the knobs (one frozen, validated type) and their files
    skistune.load_workload(spec, ...)        a preset or a trace, transformed
"""
from __future__ import annotations

import os
import sys
from typing import Any

# OpenMP threads that wait for work sleep instead of spinning, unless the user chose (OMP_WAIT_POLICY) or
# SKISTUNE_OMP_WAIT=spin keeps OpenMP's default. Read when torch loads its OpenMP runtime, so set here, before
# any torch import. On a 2-core host a decode step of SmolLM2 took x3.2 its time alone beside a busy process
# (a single-threaded loop, or a second replay) with spinning threads, and x0.9 with sleeping ones; alone,
# sleeping cost x1.09 there and x1.61 on an Intel host (`python benchmarks/contention.py`, BENCHMARKS.md).
# Profiles and validation replays on a shared machine then measure the machine, not its neighbour. A short
# spin before sleeping (GOMP_SPINCOUNT=10000) ran as fast as spinning alone but x3.7 beside a busy process.
TORCH_LOADED_FIRST = "torch" in sys.modules  # its OpenMP runtime read the environment before this could set it
if (not TORCH_LOADED_FIRST and "OMP_WAIT_POLICY" not in os.environ
        and os.environ.get("SKISTUNE_OMP_WAIT", "passive") != "spin"):
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def openmp_wait() -> str:
    """How torch's OpenMP threads wait for work in this process, as profiles record it (their timings hold
    under it only: sleeping threads ran a decode step x1.6 slower than spinning ones alone on an Intel host):
    ``passive``, ``active`` or ``default`` (spinning), and a spin count where GOMP_SPINCOUNT sets one."""
    policy = os.environ.get("OMP_WAIT_POLICY", "default").strip().lower() or "default"
    spin = os.environ.get("GOMP_SPINCOUNT")
    return f"{policy}, spin count {spin}" if spin else policy


_LAZY = {"optimize": "skistune.optimize", "OptimizeResult": "skistune.optimize",
         "evaluate": "skistune.evaluate", "sim_target": "skistune.evaluate",
         "simulate": "skistune.simulator", "capacity": "skistune.simulator",
         "KVConfig": "skistune.config", "load_config": "skistune.config",
         "load_workload": "skistune.workloads"}

__all__ = sorted(_LAZY)


def callable_module(module_name: str, function: Any) -> None:
    """Make the module ``module_name`` callable as ``function``: `skistune.optimize` and `skistune.evaluate` name
    both a module and its main function, and importing the module (``from skistune.optimize import ...``)
    binds the package attribute to the module, so ``skistune.optimize(...)`` must work on the module too."""
    import inspect
    import types

    class CallableModule(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs)

    module = sys.modules[module_name]
    module.__class__ = CallableModule
    module.__signature__ = inspect.signature(function)  # what inspect and help() show for the module
    # help(skistune.optimize) shows the module's page: the function's signature and text first (a reader had found
    # them 587 lines down, under FUNCTIONS), then the module's own text
    call = f"{module_name}{module.__signature__}"
    module.__doc__ = f"{call}\n\n{inspect.getdoc(function) or ''}\n\nThe module:\n\n{module.__doc__ or ''}"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module = importlib.import_module(_LAZY[name])
        if module.__name__ == f"{__name__}.{name}":
            # skistune.optimize, skistune.evaluate: a module and its main function share the name. Importing the
            # module bound the name to the module, which is callable (runs the function, shows its signature):
            # kept, so that `import skistune.optimize as opt` gets the module whatever was reached first
            return module
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
