"""The runtime: a paged KV cache that serves requests with a real model (`llm.Runtime`), and the torch-free
block accounting and scheduler that the simulator drives too. ``from skistune.runtime import Runtime`` works;
it is imported on first use, so that the simulator's imports of this package load no torch."""


def __getattr__(name: str):
    if name == "Runtime":
        from .llm import Runtime

        return Runtime
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
