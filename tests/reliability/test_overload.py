"""The runtime under 3x overload: every request arrives at once and together they need three times the
KV blocks the cache holds. Recompute preemption serves all of them, none is lost, duplicated or rejected,
the block accounting balances at the end, and the tokens equal those of a run with room for all. The same
with swap preemption, a host tier and a disk tier (two waves of the same prompts: the second reads the
first's prefix blocks back from the tiers, one of them corrupted on purpose on the disk), without and
with prefetch."""
import pytest
from overload import FACTOR, runtime_overload, simulator_overload, tiered_overload

EVERY_REQUEST = {"lost": 0, "duplicated": 0, "rejected": 0, "blocks_balanced": True}


@pytest.mark.slow
def test_real_runtime_at_3x_its_kv_capacity_loses_no_request():
    figures = runtime_overload()
    assert figures["overload"] >= FACTOR and figures["preemptions"] > 0
    assert {k: figures[k] for k in EVERY_REQUEST} == EVERY_REQUEST, figures
    assert figures["finished"] == figures["requests"] and figures["tokens_as_without_pressure"]


@pytest.fixture(scope="module")
def tiered():
    return tiered_overload(prefetch=False)


def assert_every_request_served_through_the_tiers(figures):
    assert figures["error"] is None, figures["error"]
    assert figures["overload"] >= FACTOR and figures["preemptions"] > 0
    assert {k: figures[k] for k in EVERY_REQUEST} == EVERY_REQUEST, figures
    assert figures["finished"] == figures["requests"] == 24 and figures["tokens_as_without_pressure"]
    assert figures["swapped_out"] > 0 and figures["swapped_in"] == figures["swapped_out"]
    moved = figures["blocks_moved_by_link"]
    assert moved["host->disk"] > 0 and moved["disk->device"] > 0 and moved["host->device"] > 0, moved
    assert figures["disk_blocks_corrupted"] == 1 and figures["corrupted_block_detected"]


@pytest.mark.slow
def test_real_runtime_at_3x_with_swap_host_and_disk_loses_no_request(tiered):
    assert not tiered["prefetch"]
    assert_every_request_served_through_the_tiers(tiered)


@pytest.mark.slow
def test_no_checksum_failure_but_the_corrupted_block(tiered):
    assert tiered["checksum_failures_not_corrupted"] == 0, tiered


@pytest.fixture(scope="module")
def tiered_prefetch():
    return tiered_overload(prefetch=True)


@pytest.mark.slow
def test_real_runtime_at_3x_with_swap_host_disk_and_prefetch_loses_no_request(tiered_prefetch):
    assert_every_request_served_through_the_tiers(tiered_prefetch)
    assert tiered_prefetch["blocks_prefetched"] > 0


@pytest.mark.slow
def test_no_checksum_failure_but_the_corrupted_block_with_prefetch(tiered_prefetch):
    assert tiered_prefetch["checksum_failures_not_corrupted"] == 0, tiered_prefetch


def test_simulated_runtime_at_3x_its_kv_capacity_loses_no_request(profile):
    figures = simulator_overload(profile)
    assert figures["overload"] >= FACTOR and figures["preemptions"] > 0
    assert {k: figures[k] for k in EVERY_REQUEST} == EVERY_REQUEST, figures
    assert figures["finished"] == figures["requests"] == 200
