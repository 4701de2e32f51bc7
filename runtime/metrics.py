"""One `Metrics` type for a served (or simulated) workload, computed from per-request records.

TTFT = first token - arrival; TBT = gap between consecutive tokens of a request; E2E = finish - arrival;
TPOT = (E2E - TTFT) / (output tokens - 1) per request. Percentiles interpolate linearly (numpy default).
Torch-free: the simulator fills the same type.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from array import array
from typing import Sequence

import numpy as np

from .request import RequestRecord
from .tiers import TierManager

PERCENTILES = (50, 90, 95, 99, 99.9)
# the names `Percentiles.at` reads (and SLOs are written with): p99.9 is the field p999
PERCENTILE_NAMES = ("p50", "p90", "p95", "p99", "p99.9", "max", "mean")


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float
    max: float
    mean: float
    count: int
    p95: float = float("nan")  # (after the others: figures stored before they existed read as unknown)
    p999: float = float("nan")

    @classmethod
    def of(cls, values: "Sequence[float] | np.ndarray", scratch: bool = False) -> "Percentiles":
        """``scratch``: ``values`` is a float64 array of the caller's that may be reordered (a replay's millions
        of token gaps: no copy of them to partition, whose fresh pages had cost tens of milliseconds)."""
        arr = np.asarray(values, dtype=np.float64)
        if arr.size == 0:
            nan = float("nan")
            return cls(nan, nan, nan, nan, nan, 0)
        top, mean = float(arr.max()), float(arr.mean())  # (before a reordering: the sum's rounding follows the order)
        p50, p90, p95, p99, p999 = (float(x) for x in np.percentile(arr, PERCENTILES, overwrite_input=scratch))
        return cls(p50, p90, p99, top, mean, int(arr.size), p95, p999)

    def at(self, percentile: str) -> float:
        """Value by name: one of `PERCENTILE_NAMES`."""
        if percentile not in PERCENTILE_NAMES:
            raise ValueError(f"percentile {percentile!r}: use {', '.join(PERCENTILE_NAMES)}")
        return getattr(self, "p999" if percentile == "p99.9" else percentile)


@dataclass(frozen=True)
class TierMetrics:
    """What the KV tiers did (see `tiers`): bytes per tier and per move, and the time moves took."""

    peak_bytes: dict[str, int]  # tier -> most bytes held at once (device: blocks in use)
    capacity_bytes: dict[str, int]  # host and disk pools
    moved_bytes: dict[str, int]  # "src->dst" -> bytes copied (to disk: written; see disk_write_errors)
    transfer_s: float  # time spent copying (runtime: measured; simulator: the profile's transfer fits)
    stall_s: float  # time steps waited for KV transfers (on-demand copies and late prefetches)
    promotions: int  # blocks brought up on a prefix hit
    demotions: int  # cached blocks moved down instead of dropped
    swapped_out: int  # preempted sequences whose KV went to the host
    swapped_in: int
    swap_fallbacks: int  # swap preemptions that recomputed for want of host room
    prefetched: int  # blocks promoted ahead of use
    # of the promoted blocks sequences used, the share prefetched (None: none used, or none prefetched)
    prefetch_hit_rate: float | None
    corrupt_blocks: int  # disk blocks that failed their checksum when read back: recomputed
    # blocks the disk refused to write (full, over quota, an I/O error): lost, recomputed when needed, not in
    # moved_bytes; the disk's peak still counts the slots they were given (after the others: figures stored
    # before it existed read as none)
    disk_write_errors: int = 0


def tier_metrics(tiers: TierManager, block_bytes: int, device_peak_blocks: int) -> TierMetrics:
    st = tiers.stats
    # (nothing prefetched: no rate, not 0%, as the table says; every promotion on demand counts as a miss)
    used = st.prefetch_hits + st.prefetch_misses if st.prefetched else 0
    return TierMetrics(
        peak_bytes={"device": device_peak_blocks * block_bytes, "host": tiers.host.peak_used * block_bytes,
                    "disk": tiers.disk.peak_used * block_bytes},
        capacity_bytes={"host": tiers.host.capacity * block_bytes, "disk": tiers.disk.capacity * block_bytes},
        moved_bytes={link: n * block_bytes for link, n in sorted(st.blocks_moved.items())},
        transfer_s=st.transfer_s, stall_s=st.stall_s, promotions=st.promotions, demotions=st.demotions,
        swapped_out=st.swapped_out, swapped_in=st.swapped_in, swap_fallbacks=st.swap_fallbacks,
        prefetched=st.prefetched, prefetch_hit_rate=st.prefetch_hits / used if used else None,
        corrupt_blocks=st.corrupt_blocks, disk_write_errors=st.disk_write_errors)


@dataclass(frozen=True)
class Metrics:
    """What a run of a workload achieved. Times in seconds, memory in bytes."""

    ttft_s: Percentiles
    tbt_s: Percentiles
    e2e_s: Percentiles
    tpot_s: Percentiles
    duration_s: float
    num_requests: int
    num_finished: int
    num_rejected: int
    output_tokens: int
    throughput_tok_per_s: float
    throughput_req_per_s: float
    kv_peak_bytes: int
    kv_capacity_bytes: int
    preemptions: int
    prefix_hit_tokens: int
    prompt_tokens: int  # of the requests admitted: a rejected one's prompt could get no prefix hit
    busy_s: float  # time spent computing steps (duration minus idle waits for arrivals)
    rejections: dict[str, str] = field(default_factory=dict)  # request id -> reason
    evicted_tokens: int = 0  # KV slots eviction compactions dropped, over all sequences (0: no eviction)
    # of ``prefix_hit_tokens``, those at re-admissions after a preemption: a preempted request finds its own
    # blocks still cached (vLLM counts these as prefix hits too), on a trace that shares no prefix as well
    readmission_hit_tokens: int = 0
    notes: tuple[str, ...] = ()  # e.g. "random weights: timing only"
    tiers: TierMetrics | None = None  # None: no host or disk tier

    def latency(self, metric: str) -> Percentiles:
        """Percentiles of ``ttft``, ``tbt``, ``e2e`` or ``tpot``."""
        if metric not in ("ttft", "tbt", "e2e", "tpot"):
            raise ValueError(f"metric {metric!r}: use ttft, tbt, e2e or tpot")
        return getattr(self, f"{metric}_s")

    def to_dict(self) -> dict:
        return asdict(self)


def compute_metrics(records: list[RequestRecord], *, duration_s: float, kv_peak_bytes: int,
                    kv_capacity_bytes: int, preemptions: int, busy_s: float = 0.0,
                    notes: tuple[str, ...] = (), tiers: TierMetrics | None = None, evicted_tokens: int = 0) -> Metrics:
    done = [r for r in records if r.finish_s is not None]
    # Whole-run arrays rather than a numpy call per request: a simulated replay ends with tens of thousands
    # of requests and millions of tokens.
    counts = np.fromiter((len(r.token_times_s) for r in done), np.int64, count=len(done))
    if done and counts.min() < 1:
        raise ValueError("a request finished without a token: its records are inconsistent")
    output_tokens = int(counts.sum())
    joined = array("d")
    for r in done:  # (the records' float64 arrays copy in whole: 4 M floats read one by one had taken 0.2 s)
        joined.extend(r.token_times_s)
    times = np.frombuffer(joined, dtype=np.float64) if output_tokens else np.zeros(0)
    starts = np.cumsum(counts) - counts  # each request's first token in ``times``
    first = times[starts]
    arrival = np.fromiter((r.arrival_s for r in done), np.float64, count=len(done))
    finish = np.fromiter((r.finish_s for r in done), np.float64, count=len(done))
    ttft, e2e = first - arrival, finish - arrival
    gap_within = np.ones(max(times.size - 1, 0), dtype=bool)  # gaps between consecutive tokens of one request
    gap_within[starts[1:] - 1] = False  # ... not from one request's last token to the next one's first
    tbt = np.diff(times)[gap_within]
    several = counts > 1
    tpot = (finish - first)[several] / (counts[several] - 1)
    rate = (lambda x: x / duration_s if duration_s > 0 else 0.0)
    return Metrics(
        ttft_s=Percentiles.of(ttft, scratch=True), tbt_s=Percentiles.of(tbt, scratch=True),
        e2e_s=Percentiles.of(e2e, scratch=True), tpot_s=Percentiles.of(tpot, scratch=True), duration_s=duration_s,
        num_requests=len(records),
        num_finished=len(done), num_rejected=sum(r.rejected_reason is not None for r in records),
        output_tokens=output_tokens, throughput_tok_per_s=rate(output_tokens),
        throughput_req_per_s=rate(len(done)), kv_peak_bytes=kv_peak_bytes, kv_capacity_bytes=kv_capacity_bytes,
        preemptions=preemptions, prefix_hit_tokens=sum(r.prefix_hit_tokens for r in records),
        readmission_hit_tokens=sum(r.readmission_hit_tokens for r in records),
        prompt_tokens=sum(r.prompt_len for r in records if r.rejected_reason is None), busy_s=busy_s,
        rejections={r.request_id: r.rejected_reason for r in records if r.rejected_reason is not None},
        notes=notes, tiers=tiers, evicted_tokens=evicted_tokens)
