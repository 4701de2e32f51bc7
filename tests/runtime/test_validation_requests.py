"""Bad requests fail at once with one line naming the request, never hang or fail deep in a step."""
import math

import numpy as np
import pytest

from skistune.config import KVConfig
from skistune.runtime.engine import Engine, VirtualClock
from skistune.runtime.request import Request


class CountingExecutor:
    """Samples (last token + 1) % 100 and advances the virtual clock by 10 ms a step."""

    def __init__(self, clock):
        self.clock = clock
        self.steps = 0

    def execute(self, out, kv):
        self.steps += 1
        self.clock.advance(0.01)
        return {s.seq.seq_id: (s.seq.token_ids[-1] + 1) % 100 for s in out.scheduled if s.samples}


def make_engine(vocab_size=None):
    clock = VirtualClock()
    ex = CountingExecutor(clock)
    cfg = KVConfig().with_knobs({"prefix_reuse.block_size": 4})
    return Engine(cfg, num_blocks=64, block_bytes=100, max_context=4096, executor=ex, clock=clock,
                  vocab_size=vocab_size), ex


# ---- Request --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"arrival_s": math.nan}, "request r: arrival_s must be a finite number of seconds, got nan"),
    ({"arrival_s": math.inf}, "request r: arrival_s must be a finite number of seconds, got inf"),
    ({"deadline_s": math.nan}, "request r: deadline_s must be a finite number of seconds, got nan"),
    ({"deadline_s": -math.inf}, "request r: deadline_s must be a finite number of seconds, got -inf"),
    ({"max_new_tokens": 2.5}, "request r: max_new_tokens must be an integer, got 2.5"),
    ({"max_new_tokens": True}, "request r: max_new_tokens must be an integer, got True"),
    ({"max_new_tokens": 4.0}, "request r: max_new_tokens must be an integer, got 4.0"),
])
def test_request_rejects_non_finite_times_and_non_integer_lengths(kwargs, message):
    with pytest.raises(ValueError) as err:
        Request("r", [5, 6, 7], **{"max_new_tokens": 2, **kwargs})
    assert str(err.value) == message


def test_request_takes_numpy_integers_and_finite_times():
    r = Request("r", np.array([5, 6, 7]), np.int64(3), arrival_s=np.float64(0.5), deadline_s=2.0)
    assert r.max_new_tokens == 3 and r.priority_deadline_s == 2.0


# ---- duplicate ids --------------------------------------------------------------------------------------
def test_replay_rejects_duplicate_ids_before_serving_anything():
    eng, ex = make_engine()
    # the duplicate arrives late: the whole list is checked first, not when it arrives
    with pytest.raises(ValueError, match=r"^request d: duplicate request id"):
        eng.replay([Request("d", [5, 6, 7], 4), Request("e", [1, 2], 2, arrival_s=0.5),
                    Request("d", [5, 6, 8], 4, arrival_s=1.0)])
    assert ex.steps == 0 and eng.records == []


def test_add_request_rejects_an_id_queued_running_or_finished():
    eng, _ = make_engine()
    eng.add_request(Request("a", [5, 6, 7], 4))
    with pytest.raises(ValueError, match="request a: duplicate request id"):  # queued
        eng.add_request(Request("a", [5, 6, 8], 4))
    eng.step()
    with pytest.raises(ValueError, match="request a: duplicate request id"):  # running
        eng.add_request(Request("a", [5, 6, 8], 4))
    eng.run_until_done()
    with pytest.raises(ValueError, match="request a: duplicate request id"):  # finished: ids key the records
        eng.add_request(Request("a", [5, 6, 8], 4))
    eng.add_request(Request("b", [5, 6, 8], 4))
    eng.run_until_done()
    assert [(r.request_id, len(r.output_token_ids)) for r in eng.records] == [("a", 4), ("b", 4)]


def test_a_rejected_requests_id_is_taken_too():
    eng, _ = make_engine()
    rec = eng.add_request(Request("big", [1] * 5000, 4))  # longer than the context: rejected, recorded
    assert rec.rejected_reason is not None
    with pytest.raises(ValueError, match="request big: duplicate request id"):
        eng.add_request(Request("big", [1, 2], 4))


# ---- token ids outside the vocabulary -------------------------------------------------------------------
@pytest.mark.parametrize("prompt, bad", [([10**6, 5], 10**6), ([5, -1], -1), (np.array([3, 100, 7]), 100),
                                         (np.array([-2, 7]), -2)])
def test_an_engine_with_a_vocabulary_rejects_token_ids_outside_it(prompt, bad):
    eng, _ = make_engine(vocab_size=100)
    with pytest.raises(ValueError) as err:
        eng.add_request(Request("v", prompt, 4))
    assert str(err.value) == f"request v: token id {bad} is outside the model's vocabulary of 100 (0..99)"
    assert eng.records == []


def test_token_ids_at_the_vocabulary_edges_are_served_and_no_vocabulary_means_no_check():
    eng, _ = make_engine(vocab_size=100)
    eng.add_request(Request("edge", np.array([0, 99]), 2))
    eng.run_until_done()
    assert len(eng.records[0].output_token_ids) == 2
    eng, _ = make_engine()  # the simulator's engine: its executor never embeds tokens
    assert eng.add_request(Request("big", [10**6, 5], 2)).rejected_reason is None


torch = pytest.importorskip("torch")
from tiny import TINY, tiny_runtime, tiny_weights  # noqa: E402


def test_the_runtime_rejects_out_of_vocabulary_tokens_naming_the_request():
    rt = tiny_runtime()  # a real model: vocabulary of 101
    for prompt, bad in (([10**6, 5], 10**6), ([5, -3], -3)):
        with pytest.raises(ValueError) as err:
            rt.replay([Request("v", prompt, 4)])
        assert str(err.value) == f"request v: token id {bad} is outside the model's vocabulary of 101 (0..100)"


def test_the_runtime_rejects_duplicate_ids():
    with pytest.raises(ValueError, match="request d: duplicate request id"):
        tiny_runtime().replay([Request("d", [5, 6, 7], 4), Request("d", [5, 6, 8], 4)])


# ---- generate: a single string is one prompt ------------------------------------------------------------
class CharTokenizer:
    eos_token_id = 0

    def encode(self, text):
        return [1 + ord(c) % 100 for c in text]

    def decode(self, ids):
        return "".join(chr(32 + i % 90) for i in ids)


def test_generate_takes_a_single_string_as_one_prompt():
    from skistune.runtime.llm import Runtime

    rt = Runtime(TINY, tiny_weights(), tiny_runtime().config, tokenizer=CharTokenizer())
    one = rt.generate("Hello", max_new_tokens=2, stop_at_eos=False)
    assert len(one) == 1 and len(one[0]) == 2
    assert one == rt.generate(["Hello"], max_new_tokens=2, stop_at_eos=False)
    assert len(rt.generate(["Hello", "you"], max_new_tokens=2, stop_at_eos=False)) == 2


@pytest.mark.parametrize("ids, message", [
    (np.array([1.5, 2.0]), "must be a 1-D array of integers, got 1-D float64"),  # had failed mid-step, with others
    (np.array([[1, 2], [3, 4]]), "got 2-D int64"),
    ([1.0, 2.9, 3.0], "prompt token 0 is 1.0, not an integer token id"),  # had been served as [1, 2, 3]
    ([5, True], "prompt token 1 is True"),
])
def test_prompt_token_ids_must_be_integers_in_one_dimension(ids, message):
    with pytest.raises(ValueError, match=message):
        Request("r", ids, 3)


def test_integer_prompts_of_any_integer_type_are_taken():
    for ids in ([1, 2, 3], (1, 2, 3), [1, np.int64(2)], np.array([1, 2], dtype=np.int32),
                np.array([1, 2], dtype=np.uint16)):
        assert Request("r", ids, 3).prompt_len == len(ids)
