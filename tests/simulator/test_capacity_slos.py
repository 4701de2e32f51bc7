"""`simulator.capacity` takes SLOs as `skistune optimize` does: strings parsed by `slo.parse_slo`, SLO
objects, or anything with ``met``; anything else is a clear TypeError before any simulation."""
from __future__ import annotations


import pytest

from skistune.config import KVConfig
from skistune.evaluate import workload_requests
from skistune.simulator import capacity
from skistune.slo import parse_slo
from skistune.workloads import load_workload

@pytest.fixture(scope="module")
def setup(shipped_target):
    target = shipped_target
    requests = workload_requests(load_workload("chat", requests=6, max_input=64, max_output=8, seed=0), "smollm2-135m")
    return requests, target


def test_slo_strings_are_parsed_as_optimize_parses_them(setup):
    requests, target = setup
    parsed = capacity(KVConfig(), requests, target, [parse_slo("p99=40ms")], precision=0.1)
    for slos in (["p99=40ms"], "p99=40ms", ("tbt:p99<=40ms",), parse_slo("p99=40ms")):
        c = capacity(KVConfig(), requests, target, slos, precision=0.1)
        assert (c.rate_scale, c.evaluations) == (parsed.rate_scale, parsed.evaluations)


@pytest.mark.parametrize("slos, error, message", [
    ([3], TypeError, "slos: 3 is not an SLO: write 'p99=200ms'"),
    (5, TypeError, "slos: expected SLO strings such as 'p99=200ms'"),
    (["p99<200ms"], ValueError, "SLO 'p99<200ms'"),
])
def test_anything_else_is_a_clear_error_before_any_simulation(setup, monkeypatch, slos, error, message):
    import skistune.simulator as simulator

    requests, target = setup
    monkeypatch.setattr(simulator, "simulate", lambda *a, **k: pytest.fail("simulated before checking the SLOs"))
    with pytest.raises(error, match=message):
        capacity(KVConfig(), requests, target, slos)
    with pytest.raises(ValueError, match="capacity: no requests"):
        capacity(KVConfig(), [], target, ["p99=200ms"])


def test_the_queueing_guard_keeps_a_starved_pool_from_any_rate(shipped_target):
    # a pool of ~1,200 tokens serves the chat prompts about one at a time: TBT stays low at any rate while the
    # queue grows without end, so a TBT SLO alone gives the top of the lattice (a tester's finding)
    requests = workload_requests(load_workload("chat", requests=40, max_input=1024, max_output=64, seed=0),
                                 "smollm2-135m")
    starved = KVConfig().with_knobs({"offload.device_kv_bytes": 1200 * 46080})  # (fp32 KV on the CPU profile)
    unguarded = capacity(starved, requests, shipped_target, "p99=300ms", precision=0.1, max_queue=None)
    assert unguarded.rate_scale == 1024
    guarded = capacity(starved, requests, shipped_target, "p99=300ms", precision=0.1)  # 5 s, as the CLI's default
    assert 0 < guarded.rate_scale < 1 and guarded.metrics.ttft_s.p99 < unguarded.metrics.ttft_s.p99
    assert capacity(starved, requests, shipped_target, "p99=300ms", precision=0.1, max_queue=5.0) == guarded
    looser = capacity(starved, requests, shipped_target, "p99=300ms", precision=0.1, max_queue="60s")
    assert guarded.rate_scale <= looser.rate_scale < 1024


@pytest.mark.parametrize("max_queue, message", [
    ("5", "max_queue '5': the limit needs a unit"), ("soon", "max_queue 'soon'"), (-1, "max_queue -1"),
    (True, "max_queue True"), ("0s", "positive, finite"),
])
def test_a_bad_queueing_guard_is_a_clear_error_before_any_simulation(setup, monkeypatch, max_queue, message):
    import skistune.simulator as simulator

    requests, target = setup
    monkeypatch.setattr(simulator, "simulate", lambda *a, **k: pytest.fail("simulated before checking max_queue"))
    with pytest.raises(ValueError, match=message):
        capacity(KVConfig(), requests, target, "p99=200ms", max_queue=max_queue)


CUT_CASES = [  # (workload, config knobs, SLOs): configs that preempt, quantize, evict and refuse requests; SLOs
    # `CertainMiss` watches (TTFT, E2E, the queueing guard) and others
    ("chat", {}, ["p99=200ms"]),
    ("chat", {"batching.max_num_seqs": 8}, ["ttft:p90<=10s"]),
    ("azure", {"offload.device_kv_bytes": 6000 * 46080}, ["e2e:mean<=40s", "ttft:max<=20s"]),  # (preempts)
    ("azure", {"bitwidth.key_bits": 8, "bitwidth.value_bits": 8}, ["e2e:p50<=30s", "p99=300ms"]),
    ("azure", {"eviction.policy": "h2o", "eviction.budget_fraction": 0.5}, ["ttft:p99<=10s"]),
    ("chat", {}, ["tbt:max<=3s", "tbt:mean<=70ms"]),
    ("chat", {"batching.chunk_size": 256}, ["tbt:p50<=60ms", "tbt:p99.9<=500ms"]),
    ("azure", {"offload.device_kv_bytes": 3000 * 46080}, ["p99=300ms"]),  # refuses its longest requests: 0
]


@pytest.mark.parametrize("case", range(len(CUT_CASES)))
def test_cutting_replays_certain_to_miss_changes_no_capacity(shipped_target, monkeypatch, case):
    import skistune.simulator as simulator

    name, knobs, slos = CUT_CASES[case]
    spec = dict(spec="../shared/traces/azure_llm_2023_conv/AzureLLMInferenceTrace_conv.csv", first=150) \
        if name == "azure" else dict(spec="chat", requests=150, seed=0)
    requests = workload_requests(load_workload(**spec), "smollm2-135m")
    config = KVConfig().with_knobs(knobs)
    cuts = []
    certain = simulator.CertainMiss.__call__
    monkeypatch.setattr(simulator.CertainMiss, "__call__", lambda self, e: cuts.append(certain(self, e)) or cuts[-1])
    cut = capacity(config, requests, shipped_target, slos, precision=0.1)
    whole = capacity(config, requests, shipped_target, slos, precision=0.1, stop_early=False)
    assert cut == whole  # the same scale, evaluations and metrics there
    assert any(cuts)  # (replays were cut)
    assert cut.rate_scale == 0 if case == len(CUT_CASES) - 1 else 0 < cut.rate_scale < 1024


def test_a_replay_asked_to_stop_ends_there_and_says_so(shipped_target):
    from skistune.simulator import build_engine

    target = shipped_target
    requests = workload_requests(load_workload("chat", requests=150, seed=0), "smollm2-135m")
    asked = []
    engine, _ = build_engine(KVConfig(), target)
    m = engine.replay(requests, stop=lambda e: asked.append(e.clock.now()) or True)
    assert engine.stopped and len(asked) == 1 and m.num_finished < len(requests)
    engine, _ = build_engine(KVConfig(), target)
    assert engine.replay(requests, stop=lambda e: False).num_finished == len(requests) and not engine.stopped
    with pytest.raises(TypeError, match="stop_early: expected True or False"):
        capacity(KVConfig(), requests, target, "p99=200ms", stop_early="no")
