"""The summary figures of a workload (what `skistune workload show` prints and presets are checked against).

Percentiles use numpy's linear interpolation, as the traces' SOURCE.md statistics do.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from skistune.workloads.model import Workload


@dataclass(frozen=True)
class WorkloadStats:
    name: str
    digest: str
    requests: int
    duration_s: float
    rate_rps: float | None  # requests / duration; None for a single request
    burstiness: float | None  # CV of inter-arrival times (1 for Poisson); None below MIN_BURSTINESS_GAPS gaps
    input_mean: float
    input_p50: float
    input_p99: float
    output_mean: float
    output_p50: float
    output_p99: float
    prefix_reuse_ratio: float  # fraction of prompt blocks already seen earlier (unbounded cache)
    block_tokens: int
    sessions: int  # distinct session ids: a lone request, with or without a session id in its source, counts
    multi_turn_sessions: int  # sessions of two or more requests (requests without a session id are never one)
    multi_turn_requests: int = 0  # requests in those sessions

    def as_dict(self) -> dict:
        return asdict(self)


# Fewer gaps than this and the CV says nothing: k gaps cannot reach a CV above sqrt(k - 1) (one gap: always 0,
# which read as "perfectly regular" for 2 requests of a bursty preset), and 10 Poisson gaps already read
# anywhere from 0.6 to 1.2 (10th-90th percentile), so fewer cannot tell Poisson from bursty traffic.
MIN_BURSTINESS_GAPS = 10


def burstiness(arrival_s: np.ndarray) -> float | None:
    """Coefficient of variation of the inter-arrival times: 1 for Poisson, above 1 for bursty traffic. None
    with fewer than `MIN_BURSTINESS_GAPS` gaps, or when every request arrives at once."""
    gaps_s = np.diff(arrival_s)
    if len(gaps_s) < MIN_BURSTINESS_GAPS or gaps_s.mean() == 0:
        return None
    return float(gaps_s.std() / gaps_s.mean())


def prefix_reuse_ratio(workload: Workload) -> float:
    """Fraction of all prompt blocks (``ceil(input / block_tokens)`` per request) whose id appeared earlier
    in arrival order: the prefix-cache hit ratio with an unbounded cache. Unlisted blocks are unique."""
    total_blocks = int(np.sum(-(-workload.input_tokens // workload.block_tokens)))
    if len(workload.block_ids) == 0:
        return 0.0
    first_seen = _distinct(workload.block_ids)  # every other reference is a repeat of an earlier one
    return float((len(workload.block_ids) - first_seen) / total_blocks)


def _distinct(ids: np.ndarray) -> int:
    """Number of distinct ids; a presence mask when ids are dense (generated ones are), else a sort (not
    np.unique, whose hashing took 14 s on the 6.2M ids of Mooncake at 16-token blocks where a sort takes 0.4)."""
    if ids.max() < 4 * len(ids) + 1024:
        seen = np.zeros(int(ids.max()) + 1, dtype=bool)
        seen[ids] = True
        return int(np.count_nonzero(seen))
    ordered = np.sort(ids)
    return 1 + int(np.count_nonzero(ordered[1:] != ordered[:-1]))


def _session_counts(session_ids: np.ndarray) -> tuple[int, int, int]:
    """Distinct ids, ids shared by two or more requests, and the requests with those. Readers give a request
    without a session id (BurstGPT's API-log rows) an id of its own, so it is never in a multi-turn session."""
    _, turns = np.unique(session_ids, return_counts=True)
    multi = turns > 1
    return len(turns), int(np.sum(multi)), int(np.sum(turns[multi]))


def workload_stats(workload: Workload) -> WorkloadStats:
    n = len(workload)
    duration_s = workload.duration_s
    input_p50, input_p99 = np.percentile(workload.input_tokens, [50, 99])
    output_p50, output_p99 = np.percentile(workload.output_tokens, [50, 99])
    sessions, multi_turn, multi_turn_requests = _session_counts(workload.session_ids)
    return WorkloadStats(
        name=workload.name, digest=workload.digest(), requests=n, duration_s=duration_s,
        rate_rps=n / duration_s if duration_s > 0 else None, burstiness=burstiness(workload.arrival_s),
        input_mean=float(workload.input_tokens.mean()), input_p50=float(input_p50), input_p99=float(input_p99),
        output_mean=float(workload.output_tokens.mean()), output_p50=float(output_p50), output_p99=float(output_p99),
        prefix_reuse_ratio=prefix_reuse_ratio(workload), block_tokens=workload.block_tokens,
        sessions=sessions, multi_turn_sessions=multi_turn, multi_turn_requests=multi_turn_requests)


def ks_distance(a: np.ndarray, b: np.ndarray) -> float:
    """The largest gap between two samples' empirical CDFs (Kolmogorov-Smirnov): how far a preset's lengths are
    from its trace's, whatever their shape."""
    points = np.union1d(a, b)
    return float(np.max(np.abs(np.searchsorted(np.sort(a), points, "right") / len(a)
                               - np.searchsorted(np.sort(b), points, "right") / len(b))))


def rate_swings(arrival_s: np.ndarray, window_s: float = 60.0) -> dict[str, float] | None:
    """How the arrival rate moves over windows of ``window_s``: the CV of the requests per window, the correlation
    of neighbouring windows' counts, and the busiest window over the mean (None under four whole windows)."""
    counts = np.histogram(arrival_s, np.arange(0.0, float(arrival_s[-1]), window_s))[0].astype(float)
    if len(counts) < 4 or counts.mean() == 0:
        return None
    centred = counts - counts.mean()
    spread = float((centred * centred).sum())
    return {"rate_cv": float(counts.std() / counts.mean()),
            "lag1": float((centred[1:] * centred[:-1]).sum() / spread) if spread > 0 else 0.0,
            "peak_over_mean": float(counts.max() / counts.mean())}
