"""The runtime under 3x overload: every request arrives at once and together they need three times the
KV blocks the cache holds. Recompute preemption serves all of them, none is lost, duplicated or rejected,
the block accounting balances at the end, and the tokens equal those of a run with room for all.
Swap and host/disk offload are not implemented yet, so preemption is the only relief measured here."""
import pytest
from overload import FACTOR, runtime_overload, simulator_overload

EVERY_REQUEST = {"lost": 0, "duplicated": 0, "rejected": 0, "blocks_balanced": True}


@pytest.mark.slow
def test_real_runtime_at_3x_its_kv_capacity_loses_no_request():
    figures = runtime_overload()
    assert figures["overload"] >= FACTOR and figures["preemptions"] > 0
    assert {k: figures[k] for k in EVERY_REQUEST} == EVERY_REQUEST, figures
    assert figures["finished"] == figures["requests"] and figures["tokens_as_without_pressure"]


def test_simulated_runtime_at_3x_its_kv_capacity_loses_no_request(profile):
    figures = simulator_overload(profile)
    assert figures["overload"] >= FACTOR and figures["preemptions"] > 0
    assert {k: figures[k] for k in EVERY_REQUEST} == EVERY_REQUEST, figures
    assert figures["finished"] == figures["requests"] == 200
