"""Scheduler and engine with a fake executor on a virtual clock (no model, exact assertions)."""
import pytest

from skistune.config import KVConfig
from skistune.runtime.engine import Engine, VirtualClock
from skistune.runtime.request import Request

STEP_S = 0.01


class CountingExecutor:
    """Samples token (last token + 1) % 1000 and advances the virtual clock by one fixed step."""

    def __init__(self, clock):
        self.clock = clock
        self.steps = []

    def execute(self, out, kv):
        self.steps.append([(s.seq.seq_id, s.start, s.num_new_tokens) for s in out.scheduled])
        self.clock.advance(STEP_S)
        return {s.seq.seq_id: (s.seq.token_ids[-1] + 1) % 1000 for s in out.scheduled if s.samples}


def make_engine(num_blocks=64, max_context=4096, **knobs):
    cfg = KVConfig().with_knobs({"prefix_reuse.block_size": 4, **knobs})
    clock = VirtualClock()
    ex = CountingExecutor(clock)
    return Engine(cfg, num_blocks=num_blocks, block_bytes=100, max_context=max_context, executor=ex,
                  clock=clock), ex


def req(rid, prompt_len, out_len, arrival=0.0, base=0, deadline=None):
    return Request(rid, list(range(base, base + prompt_len)), out_len, arrival_s=arrival, deadline_s=deadline)


def test_token_budget_chunks_prefill_and_decodes_first():
    eng, ex = make_engine(**{"batching.max_num_batched_tokens": 16, "batching.chunk_size": 8})
    for r in (req("a", 10, 3), req("b", 10, 3, base=100), req("c", 10, 3, base=200)):
        eng.add_request(r)
    eng.run_until_done()
    assert ex.steps[0] == [("a", 0, 8), ("b", 0, 8)]
    assert ex.steps[1] == [("a", 8, 2), ("b", 8, 2), ("c", 0, 8)]  # running first, then admission
    assert ex.steps[2] == [("a", 10, 1), ("b", 10, 1), ("c", 8, 2)]
    assert all(sum(n for _, _, n in s) <= 16 for s in ex.steps)
    assert eng.kv.pool.num_free() == 64


@pytest.mark.parametrize("b_prompt", [10, 15])
def test_without_chunking_a_prompt_waits_for_a_step_with_room(b_prompt):
    """b waits while a's prompt takes the step; then it is admitted beside a's decode, also when its prompt fills
    the budget left exactly (15 + 1 = 16: an off-by-one had admitted only prompts strictly smaller)."""
    eng, ex = make_engine(**{"batching.max_num_batched_tokens": 16, "batching.chunk_size": 16,
                             "batching.chunked_prefill": False})
    eng.add_request(req("a", 10, 3))
    eng.add_request(req("b", b_prompt, 1, base=50))
    eng.run_until_done()
    assert ex.steps[0] == [("a", 0, 10)]
    assert ex.steps[1] == [("a", 10, 1), ("b", 0, b_prompt)]


def test_without_chunking_a_request_longer_than_the_budget_with_its_output_is_rejected():
    """Its recompute after a preemption would be its prompt and outputs in one step, over the budget: it had
    waited for ever ("scheduler made no progress with work pending", a search's config that crashed)."""
    eng, _ = make_engine(**{"batching.max_num_batched_tokens": 16, "batching.chunk_size": 16,
                            "batching.chunked_prefill": False})
    fits, too_long = eng.add_request(req("a", 10, 6)), eng.add_request(req("b", 10, 7, base=50))
    eng.run_until_done()
    assert fits.rejected_reason is None and len(fits.output_token_ids) == 6
    assert too_long.rejected_reason == "prompt + output = 17 tokens exceeds max_num_batched_tokens 16 with chunked prefill off"


def test_max_num_seqs_caps_the_running_set():
    eng, ex = make_engine(**{"batching.max_num_seqs": 2})
    for i in range(3):
        eng.add_request(req(f"r{i}", 4, 2, base=10 * i))
    eng.step()
    assert [s[0] for s in ex.steps[0]] == ["r0", "r1"]


def test_preemption_by_recompute_completes_everything_and_frees_all_blocks():
    # 6 blocks of 4 tokens: two sequences of 8 + 10 tokens cannot both finish without preemption
    eng, ex = make_engine(num_blocks=6, **{"prefix_reuse.enabled": False})
    eng.add_request(req("a", 8, 10))
    eng.add_request(req("b", 8, 10, base=100))
    eng.run_until_done()
    recs = {r.request_id: r for r in eng.records}
    assert eng.scheduler.num_preemptions >= 1
    assert recs["b"].preemptions >= 1 and recs["a"].preemptions == 0  # the newest is the victim
    assert [len(r.output_token_ids) for r in eng.records] == [10, 10]
    # outputs are what a lone run gives: recompute loses no token
    assert recs["b"].output_token_ids == [(107 + i) % 1000 + 1 for i in range(10)]
    assert eng.kv.pool.num_free() == 6


def test_requests_that_can_never_fit_are_rejected_with_a_reason():
    eng, _ = make_engine(num_blocks=4, max_context=20)
    too_long = eng.add_request(req("ctx", 15, 10))
    too_big = eng.add_request(req("blocks", 14, 4))
    ok = eng.add_request(req("ok", 8, 4))
    eng.run_until_done()
    assert "exceeds the model's context of 20" in too_long.rejected_reason
    assert "needs 5 KV blocks, the cache holds 4" in too_big.rejected_reason
    assert ok.rejected_reason is None and len(ok.output_token_ids) == 4
    m = eng.metrics(duration_s=1.0)
    assert m.num_rejected == 2 and m.num_finished == 1 and set(m.rejections) == {"ctx", "blocks"}


def test_edf_admits_earliest_deadline_first():
    eng, ex = make_engine(**{"batching.policy": "edf", "batching.max_num_seqs": 1})
    eng.add_request(req("late", 4, 1, deadline=9.0))
    eng.add_request(req("soon", 4, 1, base=10, deadline=1.0))
    eng.run_until_done()
    assert [s[0][0] for s in ex.steps] == ["soon", "late"]


@pytest.mark.parametrize("deadlines", [(5.0, 5.0), (5.0, 9.0)], ids=["tied", "later-last"])
def test_edf_preempts_the_latest_deadline_and_among_equals_the_newest(deadlines):
    # as the recompute test above: 6 blocks, two sequences that cannot both finish; with equal deadlines
    # the victim was the oldest (the most work done), which livelocked a tight pool on a real trace
    eng, ex = make_engine(num_blocks=6, **{"prefix_reuse.enabled": False, "batching.policy": "edf"})
    eng.add_request(req("a", 8, 10, deadline=deadlines[0]))
    eng.add_request(req("b", 8, 10, base=100, deadline=deadlines[1]))
    eng.run_until_done()
    recs = {r.request_id: r for r in eng.records}
    assert recs["b"].preemptions >= 1 and recs["a"].preemptions == 0
    assert [len(r.output_token_ids) for r in eng.records] == [10, 10] and eng.kv.pool.num_free() == 6


def test_prefix_policy_admits_the_longest_cached_prefix_first():
    eng, ex = make_engine(**{"batching.policy": "prefix", "batching.max_num_seqs": 1})
    eng.add_request(req("warm", 12, 1))
    eng.run_until_done()
    eng.add_request(req("cold", 12, 1, base=500))
    eng.add_request(req("hot", 12, 1))  # same prompt as "warm": 2 cached blocks
    eng.step()
    assert ex.steps[-1] == [("hot", 8, 4)]
    assert eng.records[-1].prefix_hit_tokens == 8


def test_replay_records_times_on_the_clock():
    eng, _ = make_engine()
    m = eng.replay([req("a", 4, 3, arrival=0.0), req("b", 4, 2, base=10, arrival=1.0)])
    # a: steps at 0.01 (prefill+sample), 0.02, 0.03; b arrives at 1.0 after an idle wait
    a, b = eng.records
    assert a.token_times_s == pytest.approx([0.01, 0.02, 0.03])
    assert b.arrival_s == pytest.approx(1.0) and b.token_times_s == pytest.approx([1.01, 1.02])
    assert m.ttft_s.max == pytest.approx(0.01) and m.tbt_s.p50 == pytest.approx(0.01)
    assert m.e2e_s.max == pytest.approx(0.03) and m.output_tokens == 5 and m.num_finished == 2
    assert m.duration_s == pytest.approx(1.02)
    assert m.kv_peak_bytes == 2 * 100


def test_hits_at_a_readmission_after_preemption_are_counted_apart():
    # with prefix reuse, the preempted sequence finds its own full blocks still cached when it comes back
    eng, ex = make_engine(num_blocks=6)
    eng.add_request(req("a", 8, 10))
    eng.add_request(req("b", 8, 10, base=100))
    eng.run_until_done()
    recs = {r.request_id: r for r in eng.records}
    assert recs["b"].preemptions >= 1 and recs["b"].readmission_hit_tokens > 0
    assert recs["b"].readmission_hit_tokens == recs["b"].prefix_hit_tokens  # a shares nothing with b
    assert recs["a"].readmission_hit_tokens == 0
    m = eng.metrics(duration_s=1.0)
    assert m.readmission_hit_tokens == recs["b"].readmission_hit_tokens
