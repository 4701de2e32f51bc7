"""`compute_metrics` gives each latency its definition, request by request (the whole-run arrays it uses
must not mix two requests' tokens), and keeps the figures of unfinished and rejected requests apart."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from skistune.runtime.metrics import Percentiles, compute_metrics
from skistune.runtime.request import RequestRecord


def _records(n: int, seed: int = 0) -> list[RequestRecord]:
    rng, records = random.Random(seed), []
    for i in range(n):
        arrival = rng.uniform(0, 100)
        r = RequestRecord(f"r{i}", arrival, prompt_len=rng.randint(1, 500), prefix_hit_tokens=rng.choice((0, 16)))
        kind = rng.random()
        if kind < 0.1:
            r.rejected_reason = "too long"
            records.append(r)
            continue
        t = arrival + rng.uniform(0.01, 2)
        for _ in range(1 if kind < 0.3 else rng.randint(2, 40)):  # single-token requests have no gap
            r.token_times_s.append(t)
            t += rng.expovariate(30)
        if kind < 0.9:  # the others are still running
            r.finish_s = r.token_times_s[-1]
        records.append(r)
    return records


def _by_definition(records: list[RequestRecord]) -> dict[str, list[float]]:
    done = [r for r in records if r.finish_s is not None]
    return {"ttft": [r.token_times_s[0] - r.arrival_s for r in done],
            "tbt": [b - a for r in done for a, b in zip(r.token_times_s, r.token_times_s[1:])],
            "e2e": [r.finish_s - r.arrival_s for r in done],
            "tpot": [(r.finish_s - r.token_times_s[0]) / (len(r.token_times_s) - 1) for r in done
                     if len(r.token_times_s) > 1]}


def _metrics(records):
    return compute_metrics(records, duration_s=120.0, kv_peak_bytes=10, kv_capacity_bytes=20, preemptions=3)


def test_latencies_are_their_definitions_request_by_request():
    records = _records(500)
    m = _metrics(records)
    for name, values in _by_definition(records).items():
        assert m.latency(name) == Percentiles.of(values), name  # the same values: the same percentiles
    done = [r for r in records if r.finish_s is not None]
    assert m.num_finished == len(done) and m.num_rejected == sum(r.rejected_reason is not None for r in records)
    assert m.output_tokens == sum(len(r.token_times_s) for r in done) and type(m.output_tokens) is int
    assert m.throughput_tok_per_s == m.output_tokens / 120.0
    assert m.rejections == {r.request_id: "too long" for r in records if r.rejected_reason is not None}
    assert m.prefix_hit_tokens == sum(r.prefix_hit_tokens for r in records)


def test_no_gap_spans_two_requests():
    a, b = RequestRecord("a", 0.0, 4, [1.0, 1.5, 2.5], finish_s=2.5), RequestRecord("b", 0.0, 4, [9.0], finish_s=9.0)
    c = RequestRecord("c", 1.0, 4, [10.0, 10.25], finish_s=10.25)
    m = _metrics([a, b, c])
    assert (m.tbt_s.count, m.tbt_s.max, m.tbt_s.mean) == (3, 1.0, pytest.approx(1.75 / 3))
    assert (m.tpot_s.count, m.tpot_s.max) == (2, 0.75) and m.ttft_s.max == 9.0  # a: 1.5 s over 2 gaps


def test_no_finished_request_gives_empty_percentiles():
    m = _metrics([RequestRecord("a", 0.0, 4, [1.0]), RequestRecord("b", 0.0, 4, rejected_reason="too long")])
    for name in ("ttft", "tbt", "e2e", "tpot"):
        p = m.latency(name)
        assert p.count == 0 and math.isnan(p.p50) and math.isnan(p.mean)
    assert (m.num_finished, m.num_rejected, m.output_tokens) == (0, 1, 0)
    assert _metrics([]).tbt_s.count == 0


def test_a_finished_request_without_a_token_is_an_error():
    with pytest.raises(ValueError, match="without a token"):
        _metrics([RequestRecord("a", 0.0, 4, [1.0], finish_s=1.0), RequestRecord("b", 0.0, 4, finish_s=2.0)])


def test_percentiles_interpolate_like_numpy():
    values = np.random.default_rng(1).exponential(size=1001)
    p = Percentiles.of(values)
    assert (p.p50, p.p90, p.p99) == tuple(np.percentile(values, (50, 90, 99)))
    assert (p.max, p.count) == (values.max(), 1001)


def test_the_tier_figures_have_no_prefetch_hit_rate_without_prefetches_and_count_refused_disk_writes():
    """Blocks promoted on demand only: the table said "n/a (nothing prefetched)" and --json 0.0 (every
    promotion counts as a prefetch miss). A full disk's refused writes were in no figure."""
    from skistune.runtime.metrics import tier_metrics
    from skistune.runtime.tiers import TierManager

    tiers = TierManager(4, 4)
    tiers.stats.promotions = tiers.stats.prefetch_misses = 3
    tiers.stats.disk_write_errors = 2
    figures = tier_metrics(tiers, block_bytes=16, device_peak_blocks=1)
    assert figures.prefetch_hit_rate is None and figures.disk_write_errors == 2
    tiers.stats.prefetched = tiers.stats.prefetch_hits = 1
    assert tier_metrics(tiers, block_bytes=16, device_peak_blocks=1).prefetch_hit_rate == 0.25
    assert tier_metrics(TierManager(4, 0), 16, 1).prefetch_hit_rate is None  # (nothing promoted: as before)


def test_request_throughput_counts_finished_requests_only():
    """Guards against counting rejected (or still running) requests in the requests served per second."""
    done = RequestRecord("a", 0.0, 4, [1.0, 2.0], finish_s=2.0)
    rejected = RequestRecord("b", 0.0, 4, rejected_reason="too long")
    m = compute_metrics([done, rejected], duration_s=4.0, kv_peak_bytes=10, kv_capacity_bytes=20, preemptions=0)
    assert m.throughput_req_per_s == 0.25 and m.num_requests == 2


def test_the_host_tiers_peak_bytes_are_the_blocks_it_held_not_its_capacity():
    """Guards against reporting the host pool's capacity as its peak use when fewer blocks were ever demoted."""
    from skistune.runtime.metrics import tier_metrics
    from skistune.runtime.tiers import TierManager

    tiers = TierManager(host_blocks=8, disk_blocks=0)
    for block in range(3):  # three cached device blocks demoted: three of the eight host slots taken
        tiers.demote_all([(block, 100 + block)])
    figures = tier_metrics(tiers, block_bytes=16, device_peak_blocks=5)
    assert figures.peak_bytes == {"device": 5 * 16, "host": 3 * 16, "disk": 0}
    assert figures.capacity_bytes["host"] == 8 * 16 and figures.demotions == 3


def test_scratch_percentiles_equal_a_copys_and_only_they_reorder_the_values():
    values = np.random.default_rng(3).exponential(0.05, 10_001)
    kept = values.copy()
    assert Percentiles.of(values) == Percentiles.of(kept.copy(), scratch=True)
    np.testing.assert_array_equal(values, kept)  # (the default leaves the caller's array as it was)
    scratch = kept.copy()
    Percentiles.of(scratch, scratch=True)
    assert not np.array_equal(scratch, kept)  # partitioned in place: no copy taken
