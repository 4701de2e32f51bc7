"""The simulator drives the runtime's engine with a clock: exact arithmetic on hand-set step costs,
fast-forward identical to stepping, determinism."""
import numpy as np
import pytest

from skistune.config import KVConfig
from skistune.profile.cost import FEATURES, StepCostModel
from skistune.runtime.presets import PRESETS
from skistune.runtime.request import Request
from skistune.simulator import SimTarget, build_engine, highest_feasible, simulate
from skistune.workloads import load_workload, to_requests

SPEC = PRESETS["smollm2-135m"]


def cost(fixed=0.0, seqs=0.0, tokens=0.0, kv=0.0, pairs=0.0, samples=0.0, knee=512):
    c = dict(fixed=fixed, seqs=seqs, tokens=tokens, tokens_past_knee=0.0, multi_token=0.0, decode_kv_bytes=kv,
             prefill_kv_bytes=0.0, prefill_pairs=pairs, samples=samples)
    return StepCostModel(tuple(c[f] for f in FEATURES), knee)


def target(step_cost, device_bytes=1 << 30):
    return SimTarget(SPEC, step_cost, kv_itemsize=2, device_free_bytes=device_bytes)


def test_fixed_step_cost_gives_exact_latencies():
    reqs = [Request("a", list(range(100)), 5, arrival_s=0.0), Request("b", list(range(200, 240)), 3, arrival_s=0.5)]
    m = simulate(KVConfig(), reqs, target(cost(fixed=0.01)))
    # a: one prefill step then 4 decodes, 10 ms each; b arrives when the engine is idle
    assert m.ttft_s.max == pytest.approx(0.01) and m.tbt_s.p50 == pytest.approx(0.01)
    assert m.e2e_s.max == pytest.approx(0.05)
    assert m.duration_s == pytest.approx(0.53) and m.output_tokens == 8


def test_step_time_follows_the_cost_features():
    reqs = [Request("a", list(range(64)), 3)]
    m = simulate(KVConfig(), reqs, target(cost(tokens=1e-3, kv=1e-9)))
    kv_per_token = SPEC.kv_bytes_per_token(16, 16)  # 2-byte elements
    prefill = 64 * 1e-3
    decode1 = 1e-3 + 65 * kv_per_token * 1e-9
    decode2 = 1e-3 + 66 * kv_per_token * 1e-9
    assert m.ttft_s.max == pytest.approx(prefill)
    assert m.e2e_s.max == pytest.approx(prefill + decode1 + decode2)


def azure_requests(n=300):
    w = load_workload("../shared/traces/azure_llm_2023_conv/AzureLLMInferenceTrace_conv.csv", first=n,
                      rate_scale=4.0)
    return to_requests(w, vocab_size=SPEC.vocab_size)


def run(config, reqs, ff):
    engine, executor = build_engine(config, target(cost(fixed=2e-3, seqs=1e-4, tokens=2e-5, kv=1e-12, samples=1e-5),
                                                   device_bytes=512 << 20), fast_forward=ff)
    return engine.replay(reqs), engine, executor


@pytest.mark.parametrize("knobs", [{}, {"batching.max_num_seqs": 8}, {"prefix_reuse.enabled": False},
                                   {"offload.device_kv_bytes": 64 << 20}])
def test_fast_forward_equals_stepping_one_step_at_a_time(knobs):
    cfg = KVConfig().with_knobs(knobs)
    reqs = azure_requests()
    fast, eng_fast, ex_fast = run(cfg, reqs, ff=True)
    slow, eng_slow, ex_slow = run(cfg, reqs, ff=False)
    assert ex_fast.num_steps == ex_slow.num_steps
    assert ex_fast.num_fast_forwards > 0 and ex_slow.num_fast_forwards == 0
    for a, b in zip(eng_fast.records, eng_slow.records):
        np.testing.assert_allclose(a.token_times_s, b.token_times_s, rtol=1e-9, atol=1e-9)
        assert a.preemptions == b.preemptions and a.prefix_hit_tokens == b.prefix_hit_tokens
        assert a.output_token_ids == b.output_token_ids  # a run draws its tokens as its steps would
        assert (a.finish_s is None) == (b.finish_s is None)  # unfinished (rejected) in both, or finished in both
        assert a.finish_s is None or a.finish_s == pytest.approx(b.finish_s, rel=1e-9)
    assert fast.kv_peak_bytes == slow.kv_peak_bytes and fast.preemptions == slow.preemptions
    assert eng_fast.kv.pool.num_free() == eng_fast.kv.pool.num_blocks


def test_a_run_of_decodes_ends_with_the_finish_and_the_rest_runs_on():
    reqs = [Request("a", list(range(100)), 10), Request("b", list(range(200, 240)), 30)]
    m, engine, executor = run(KVConfig(), reqs, ff=True)
    # one step prefills both (each samples its first token); a run takes both to a's last token and
    # finishes it, the next run takes b alone to its own
    assert executor.num_fast_forwards == 2 and executor.num_steps == 30
    assert m.num_finished == 2 and engine.kv.pool.num_free() == engine.kv.pool.num_blocks
    assert [len(r.token_times_s) for r in engine.records] == [10, 30]
    assert engine.records[0].finish_s == engine.records[0].token_times_s[-1]


def test_simulation_is_deterministic():
    reqs = azure_requests(200)
    a, _, _ = run(KVConfig(), reqs, ff=True)
    b, _, _ = run(KVConfig(), reqs, ff=True)
    assert a == b


def test_capacity_is_the_highest_rate_scale_meeting_the_slo():
    from skistune.simulator import capacity, with_rate_scale
    from skistune.slo import parse_slo

    reqs = azure_requests(120)
    t = target(cost(fixed=2e-3, seqs=1e-4, tokens=2e-5, kv=1e-12, samples=1e-5), device_bytes=256 << 20)
    slo = parse_slo("ttft:p99<=500ms")
    cap = capacity(KVConfig(), reqs, t, [slo])
    assert cap.rate_scale > 0 and slo.met(cap.metrics)
    above = simulate(KVConfig(), with_rate_scale(reqs, cap.rate_scale * 1.05), t)
    assert not slo.met(above)  # 2% precision: 5% faster arrivals break it
    looser = capacity(KVConfig(), reqs, t, [parse_slo("ttft:p99<=2s")])
    assert looser.rate_scale > cap.rate_scale
    assert cap.rate_rps == pytest.approx(cap.rate_scale * len(reqs) / max(r.arrival_s for r in reqs))


def test_capacity_is_zero_when_most_requests_can_never_be_served():
    """Guards against a capacity that checks the SLOs on the few requests served and ignores those rejected,
    so a config that refuses 10 of 12 requests at every rate reads as meeting the SLO at the top rate."""
    from skistune.simulator import capacity
    from skistune.slo import parse_slo

    knobs = {"batching.chunked_prefill": False, "batching.max_num_batched_tokens": 64}
    # requests 0 and 6 fit the 64-token step; the other ten have 100-token prompts, refused with chunking off
    reqs = [Request(f"r{i}", list(range(8 if i % 6 == 0 else 100)), 4, arrival_s=float(i)) for i in range(12)]
    t = target(cost(fixed=1e-3))
    served = simulate(KVConfig().with_knobs(knobs), reqs, t)
    assert (served.num_finished, served.num_rejected) == (2, 10) and parse_slo("ttft:p99<=10s").met(served)
    cap = capacity(KVConfig().with_knobs(knobs), reqs, t, ["ttft:p99<=10s"], precision=0.1, max_queue=None)
    assert (cap.rate_scale, cap.rate_rps, cap.metrics) == (0.0, 0.0, None)


def test_capacity_is_the_same_from_any_start_and_a_good_guess_saves_simulations():
    from skistune.simulator import capacity, lattice_step, with_rate_scale
    from skistune.slo import parse_slo

    reqs = azure_requests(120)
    t = target(cost(fixed=2e-3, seqs=1e-4, tokens=2e-5, kv=1e-12, samples=1e-5), device_bytes=256 << 20)
    slos = [parse_slo("ttft:p99<=500ms")]
    cold = capacity(KVConfig(), reqs, t, slos, precision=0.10)
    assert lattice_step(0.10) == 1 / 8 and lattice_step(0.02) == 1 / 64
    # the next lattice point up breaks the SLO: the answer is the highest feasible one
    assert not slos[0].met(simulate(KVConfig(), with_rate_scale(reqs, cold.rate_scale * 2 ** (1 / 8)), t))
    for start in (1 / 1000, cold.rate_scale / 3, cold.rate_scale, cold.rate_scale * 1.3, 500.0):
        warm = capacity(KVConfig(), reqs, t, slos, precision=0.10, start=start)
        assert warm.rate_scale == cold.rate_scale, start
    guessed = capacity(KVConfig(), reqs, t, slos, precision=0.10, start=cold.rate_scale)
    assert guessed.evaluations <= 3 < cold.evaluations  # the guess and the lattice point above it (+ a bisection)
    finer = capacity(KVConfig(), reqs, t, slos, precision=0.02, start=cold.rate_scale)
    assert cold.rate_scale <= finer.rate_scale < cold.rate_scale * 2 ** (1 / 8)
    assert finer.rate_scale == capacity(KVConfig(), reqs, t, slos, precision=0.02).rate_scale
    # the lattice's ends: nothing feasible gives 0, everything feasible gives the top scale
    assert capacity(KVConfig(), reqs, t, [parse_slo("ttft:p99<=1us")], start=2.0).rate_scale == 0.0
    top = capacity(KVConfig(), reqs, t, [parse_slo("ttft:p99<=1000s")], max_scale=4.0, start=0.5, max_queue=None)
    assert top.rate_scale == 4.0


def test_slos_take_tail_percentiles_and_name_a_wrong_one():
    """p95 and p99.9 are common SLO percentiles; a percentile outside the list is named in the error."""
    from skistune.runtime.metrics import Percentiles
    from skistune.slo import parse_slo

    slo = parse_slo("ttft:p99.9<=2s")
    assert (slo.metric, slo.percentile, slo.limit_s, str(slo)) == ("ttft", "p99.9", 2.0, "ttft:p99.9<=2000ms")
    assert parse_slo("p95=150ms").percentile == "p95"
    p = Percentiles.of(np.arange(1001, dtype=np.float64))
    assert (p.at("p95"), p.at("p99.9"), p.at("p99")) == pytest.approx((950.0, 999.0, 990.0))
    for text, message in (("ttft:p101<=1s", "percentile p101 is not one of p50, p90, p95, p99, p99.9"),
                          ("p0=1s", "percentile p0 is not one of"), ("ttft:p99<1s", "write METRIC:pXX<=VALUE")):
        with pytest.raises(ValueError, match=message):
            parse_slo(text)


def test_a_lone_prefill_runs_on_in_one_event_as_its_steps_would():
    # a 100-token prompt in chunks of 32: the first chunk is a step (the admission), the other three one
    # event, then the decodes one run; an arrival in the middle of the prefill cuts the event there
    cfg = KVConfig().with_knobs({"batching.chunk_size": 32})
    events = []
    for later in (10.0, 0.0025):
        reqs = [Request("a", list(range(100)), 5), Request("b", list(range(300, 340)), 3, arrival_s=later)]
        engine_fast, ex_fast = build_engine(cfg, target(cost(fixed=1e-3, tokens=1e-5)), fast_forward=True)
        engine_slow, ex_slow = build_engine(cfg, target(cost(fixed=1e-3, tokens=1e-5)), fast_forward=False)
        fast, slow = engine_fast.replay(reqs), engine_slow.replay(reqs)
        assert ex_fast.num_steps == ex_slow.num_steps and fast.kv_peak_bytes == slow.kv_peak_bytes
        for a, b in zip(engine_fast.records, engine_slow.records):
            assert a.token_times_s[0] == b.token_times_s[0]  # the prefill's times add up as its steps' do
            np.testing.assert_allclose(a.token_times_s, b.token_times_s, rtol=1e-12)  # (decode runs: cumsum)
            assert a.output_token_ids == b.output_token_ids
        events.append(ex_fast.num_fast_forwards)
    # alone: the rest of a's prefill, a's decodes, b's second chunk, b's decodes; with b arriving during
    # a's second chunk: that chunk, then steps of both, a run of both to b's end, a run of a alone
    assert events == [4, 3]


def test_a_sequence_whose_recompute_can_never_fit_the_pool_is_dropped_with_its_reason():
    """A tester's config that passes validation crashed `evaluate` ("scheduler made no progress with work
    pending"): under H2O a sequence holds its budget, not its context, so it was admitted; preempted with
    recompute and chunked prefill off, its prompt and 493 outputs came back as one 749-token step needing 24
    blocks of a pool of 18 (most of the memory went to the full-precision rings of 799 sequences)."""
    config = KVConfig().with_knobs({"eviction.policy": "h2o", "eviction.budget_fraction": 0.32,
                                    "bitwidth.key_bits": 8, "bitwidth.full_precision_window": 128,
                                    "offload.device_memory_fraction": 0.69, "batching.max_num_seqs": 799,
                                    "batching.chunked_prefill": False, "prefix_reuse.block_size": 32})
    # (requests of their own, not a preset's draw: the chat preset's refitted lengths no longer met the case; a
    # sequence preempted late, re-admitted last and preempted again, comes back with its outputs)
    rng = np.random.default_rng(0)
    reqs = [Request(f"r{i}", rng.integers(0, SPEC.vocab_size, 256).tolist(), 600, arrival_s=2.0 * i) for i in range(30)]
    m = simulate(config, reqs, target(cost(fixed=5e-2, seqs=1e-4, tokens=2e-4, kv=1e-11, samples=1e-5),
                                      device_bytes=2050 << 20))  # (a pool of 18 blocks, as the tester's)
    assert m.num_finished + m.num_rejected == 30 and m.num_finished > 25
    dropped = [why for why in m.rejections.values() if "recomputed in one step" in why]
    assert dropped and all(why.endswith("; dropped") and "the cache holds" in why for why in dropped)


def test_a_config_without_chunking_and_a_small_budget_finishes_its_replay():
    """A tester's search crashed on this config ("scheduler made no progress with work pending"): a sequence
    preempted past the step budget could never be recomputed in one step. Such requests are refused now."""
    config = KVConfig().with_knobs({"offload.device_kv_bytes": 77510410, "batching.chunked_prefill": False,
                                    "batching.max_num_batched_tokens": 615, "prefix_reuse.enabled": False})
    reqs = to_requests(load_workload("chat", requests=100, max_input=512, seed=0), vocab_size=SPEC.vocab_size)
    m = simulate(config, reqs, target(cost(fixed=2e-3, seqs=1e-4, tokens=2e-4, kv=1e-11, samples=1e-5)))
    assert m.num_finished + m.num_rejected == 100 and m.num_finished > 0
    assert all("with chunked prefill off" in why for why in m.rejections.values())


@pytest.mark.parametrize("threshold", [-10.0, -3.3, 0.0, 0.126, 2.5, 6.0])
def test_highest_feasible_finds_the_same_lattice_point_from_every_start(threshold):
    step, low, high = 1 / 8, -10.0, 6.0
    tried = []

    def feasible(x):
        tried.append(x)
        return x <= threshold

    answers = set()
    for x, stride in [(0.0, 1.0), (-10.0, step), (6.0, step), (2.5, step), (-3.375, step)]:
        answers.add(highest_feasible(feasible, x, stride, low, high, step))
    assert len(answers) == 1
    (best,) = answers
    assert best <= threshold < best + step or best == high  # the highest multiple of step that holds
    assert all(abs(x / step - round(x / step)) < 1e-9 for x in tried)


def test_highest_feasible_is_none_when_even_the_lowest_point_breaks():
    assert highest_feasible(lambda x: False, 0.0, 1.0, -10.0, 6.0, 1 / 8) is None
    assert highest_feasible(lambda x: True, 0.0, 1.0, -10.0, 6.0, 1 / 8) == 6.0


def test_a_cost_model_predicts_each_step_shape_once_across_replays_and_a_full_memo_starts_again(monkeypatch):
    import dataclasses

    import skistune.simulator as sim

    reqs = azure_requests(120)
    calls = []
    predict = StepCostModel.predict_s
    monkeypatch.setattr(StepCostModel, "predict_s", lambda self, shape: calls.append(shape) or predict(self, shape))
    model = target(cost(fixed=2e-3, seqs=1e-4, tokens=2e-5, kv=1e-12, samples=1e-5))
    engine, _ = build_engine(KVConfig(), model)
    kept = engine.replay(reqs)
    assert calls and len(calls) == len(set(calls))  # (the decode runs' lines too: two shapes per batch size)
    calls.clear()  # the model keeps its predictions: a second replay (a capacity search's next rate) makes none
    engine, _ = build_engine(KVConfig(), model)
    assert engine.replay(reqs) == kept and calls == []
    # a model derived with other coefficients predicts for itself (none of the first model's times)
    slower_cost = dataclasses.replace(model.step_cost, coef=tuple(2 * c for c in model.step_cost.coef))
    slower = dataclasses.replace(model, step_cost=slower_cost)
    assert slower.step_cost.predicted == {}
    engine, _ = build_engine(KVConfig(), slower)
    assert engine.replay(reqs).e2e_s.max > kept.e2e_s.max and calls
    monkeypatch.setattr(sim, "PREDICTED_SHAPES", 2)  # the memo emptied every two shapes: the same replay
    calls.clear()
    model.step_cost.predicted.clear()
    engine, _ = build_engine(KVConfig(), model)
    assert engine.replay(reqs) == kept and len(calls) > len(set(calls))
