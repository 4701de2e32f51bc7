"""Timing harness: warm-up, fresh inputs for every repeat, device synchronisation before each clock read,
and the median (with the 10th/90th percentiles to show the spread) over repeats."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from .records import Timing


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work, so that a clock read after it counts the work (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def enough(samples_s: list[float], repeats: int, max_repeats: int, min_time_s: float) -> bool:
    """At least ``repeats`` samples and ``min_time_s`` of them (a fast call is repeated more, so that a
    few slow calls, e.g. when another process takes a core, cannot move the median), at most ``max_repeats``."""
    return len(samples_s) >= max_repeats or (len(samples_s) >= repeats and sum(samples_s) >= min_time_s)


def time_fn(fn: Callable[[Any], Any], make_inputs: Callable[[], Any], *, warmup: int, repeats: int,
            device: torch.device | str, max_repeats: int | None = None, min_time_s: float = 0.0) -> Timing:
    """Median time of ``fn(inputs)`` with new inputs each call (built outside the timed region, so
    caches never hold a previous call's data and no input is all zeros)."""
    for _ in range(warmup):
        fn(make_inputs())
    samples_s: list[float] = []
    while not enough(samples_s, repeats, max_repeats or repeats, min_time_s):
        inputs = make_inputs()
        synchronize(device)
        t0 = time.perf_counter()
        fn(inputs)
        synchronize(device)
        samples_s.append(time.perf_counter() - t0)
    return Timing.of(samples_s)
