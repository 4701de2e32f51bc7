"""The shape of one engine step and the cost model that turns it into seconds. Torch-free: the
simulator computes a `StepShape` from each `SchedulerOutput` and asks the hardware profile's fitted
`StepCostModel` for the step's duration; the profiler measures real steps of known shapes to fit it.

The model is linear in features that follow the step's work (a roofline split into its parts):

    step_s = c_fixed                      per-step overhead (Python scheduling, kernel launches)
           + c_seq     * num_seqs         per-sequence bookkeeping (metadata, sampling)
           + c_token   * num_tokens       projections and MLP (weights streamed once, work per token)
           + c_knee    * max(0, num_tokens - knee)   the compute-bound slope past the knee
           + c_multi   * [num_tokens > 1] matrix-matrix instead of matrix-vector products (on CPUs a
                                          one-token step is markedly cheaper per token than two)
           + c_kv      * decode_kv_bytes  decode attention reads each cached KV byte once
           + c_pkv     * prefill_kv_bytes a prefill chunk reads its whole cached context's KV once
           + c_pair    * prefill_pairs    prefill attention does work per query-key pair
           + c_sample  * num_samples      LM head over the vocabulary for each sampled row

Coefficients are fitted with non-negative least squares (a cost cannot be negative).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from skistune.runtime.scheduler import SchedulerOutput

FEATURES = ("fixed", "seqs", "tokens", "tokens_past_knee", "multi_token", "decode_kv_bytes", "prefill_kv_bytes",
            "prefill_pairs", "samples")


@dataclass(frozen=True)
class StepShape:
    """What one step computes: enough to predict its time, nothing about which tokens."""

    num_tokens: int  # tokens computed (prefill chunk tokens + one per decode)
    num_seqs: int
    decode_kv_bytes: int  # KV bytes the decode sequences read (context tokens x bytes per token)
    prefill_pairs: int  # sum over prefill chunks of chunk tokens x context tokens
    num_samples: int  # sequences that sample a token this step
    prefill_kv_bytes: int = 0  # KV bytes the prefill chunks read (their contexts x bytes per token)

    def features(self, knee: int) -> np.ndarray:
        return np.array([1.0, self.num_seqs, self.num_tokens, max(0, self.num_tokens - knee),
                         float(self.num_tokens > 1), self.decode_kv_bytes, self.prefill_kv_bytes,
                         self.prefill_pairs, self.num_samples], dtype=np.float64)


@dataclass(frozen=True)
class StepCostModel:
    """Fitted coefficients (seconds per unit of each feature) and the knee in tokens."""

    coef: tuple[float, ...]
    knee: int

    def predict_s(self, shape: StepShape) -> float:
        return float(shape.features(self.knee) @ np.asarray(self.coef))

    def to_dict(self) -> dict:
        return {"features": list(FEATURES), "coef": list(self.coef), "knee_tokens": self.knee}

    @classmethod
    def from_dict(cls, data: dict) -> "StepCostModel":
        if list(data.get("features", [])) != list(FEATURES):
            raise ValueError(f"step cost model: features {data.get('features')} are not {list(FEATURES)}")
        coef = tuple(float(c) for c in data["coef"])
        if len(coef) != len(FEATURES) or any(c < 0 or c != c for c in coef):
            raise ValueError("step cost model: needs one finite, non-negative coefficient per feature")
        return cls(coef, int(data["knee_tokens"]))


def design_matrix(shapes: Sequence[StepShape], knee: int) -> np.ndarray:
    return np.stack([s.features(knee) for s in shapes])


def step_shape(out: "SchedulerOutput", kv_bytes_per_token: int) -> StepShape:
    """The shape of a scheduled step (``kv_bytes_per_token`` over all layers at the stored precision)."""
    decode_tokens = prefill_tokens = pairs = samples = 0
    for s in out.scheduled:
        context = s.kv_start + s.num_new_tokens  # KV slots read: fewer than the positions after an eviction
        if s.num_new_tokens == 1:
            decode_tokens += context
        else:
            prefill_tokens += context
            pairs += s.num_new_tokens * context
        samples += s.samples
    return StepShape(num_tokens=out.num_batched_tokens, num_seqs=len(out.scheduled),
                     decode_kv_bytes=decode_tokens * kv_bytes_per_token, prefill_pairs=pairs, num_samples=samples,
                     prefill_kv_bytes=prefill_tokens * kv_bytes_per_token)
