"""What a client sends (`Request`) and what the runtime records about it (`RequestRecord`). Torch-free."""
from __future__ import annotations

import math
import numbers
from array import array
from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class Request:
    """One generation request as a workload describes it.

    ``prompt_token_ids`` may be any integer sequence (list, tuple or a numpy int array: workloads of
    many thousand requests keep prompts as arrays). Generation is greedy and stops after exactly
    ``max_new_tokens`` tokens unless ``stop_at_eos`` is set. ``deadline_s`` is the absolute time by
    which the first token is due; the ``edf`` scheduling policy orders by it (default: the arrival).
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    max_new_tokens: int
    arrival_s: float = 0.0
    deadline_s: float | None = None
    stop_at_eos: bool = False

    def __post_init__(self) -> None:
        if len(self.prompt_token_ids) == 0:
            raise ValueError(f"request {self.request_id}: empty prompt")
        _check_token_ids(self.request_id, self.prompt_token_ids)
        # bool is an Integral too, but True new tokens is a caller's bug, not 1
        if not isinstance(self.max_new_tokens, numbers.Integral) or isinstance(self.max_new_tokens, bool):
            raise ValueError(f"request {self.request_id}: max_new_tokens must be an integer, "
                             f"got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        # a NaN or infinite time is never reached by a clock: replay would wait for it forever
        for name, t in (("arrival_s", self.arrival_s), ("deadline_s", self.deadline_s)):
            if t is not None and not (isinstance(t, numbers.Real) and math.isfinite(t)):
                raise ValueError(f"request {self.request_id}: {name} must be a finite number of seconds, got {t!r}")
        if self.arrival_s < 0:
            raise ValueError(f"request {self.request_id}: negative arrival time {self.arrival_s}")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def priority_deadline_s(self) -> float:
        return self.arrival_s if self.deadline_s is None else self.deadline_s


@dataclass
class RequestRecord:
    """Timestamps (seconds since the start of the run) and outcome of one request."""

    request_id: str
    arrival_s: float
    prompt_len: int
    # a float64 array, not a list: 8 bytes a token instead of 32 (a simulated trace holds millions of them)
    token_times_s: array = field(default_factory=lambda: array("d"))
    output_token_ids: list[int] = field(default_factory=list)
    finish_s: float | None = None
    rejected_reason: str | None = None
    prefix_hit_tokens: int = 0  # at every admission, re-admissions after a preemption included
    readmission_hit_tokens: int = 0  # ... of them, at re-admissions (mostly the request's own blocks, still cached)
    preemptions: int = 0

    @property
    def first_token_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None


def _check_token_ids(request_id: str, ids) -> None:
    """Token ids must be integers in one dimension: a float list had been truncated (2.9 served as 2) and a
    float or 2-D array failed inside a step, taking every request batched with it down (a tester's finding).
    Range is checked against the model's vocabulary when the engine queues the request."""
    dtype = getattr(ids, "dtype", None)
    if dtype is not None:  # a numpy array (workloads keep prompts so): checked without a loop
        if getattr(ids, "ndim", 1) != 1 or dtype.kind not in "iu":
            raise ValueError(f"request {request_id}: prompt token ids must be a 1-D array of integers, got "
                             f"{getattr(ids, 'ndim', 1)}-D {dtype}")
        return
    if all(type(t) is int for t in ids):  # (the common case, fast)
        return
    for i, t in enumerate(ids):
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise ValueError(f"request {request_id}: prompt token {i} is {t!r}, not an integer token id")
