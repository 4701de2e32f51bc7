"""With quantized KV and a full-precision window, a prefix hit must not change what the model reads: a hit
exists only packed, so the window's tokens are computed into the sequence's own ring (the scheduler caps the
hit, `Scheduler._max_hit_tokens`), and a prompt served after itself generates the tokens it generated first."""
import pytest

from skistune.runtime.request import Request

from test_eviction_runtime import prompts
from tiny import tiny_runtime

BLOCK = 4  # tiny_runtime's block size


def twice(window, cap=True, prompt_len=50, **more):
    rt = tiny_runtime(**{"bitwidth.key_bits": 4, "bitwidth.value_bits": 2, "bitwidth.group_size": 16,
                         "bitwidth.full_precision_window": window, "batching.max_num_seqs": 1, **more})
    prompt = prompts(1, [prompt_len], seed=7)[0]
    eng = rt.new_engine()
    if not cap:
        eng.scheduler.full_precision_window = 0  # the scheduler before the cap: every hit taken
    first = eng.add_request(Request("a", prompt, 30))
    eng.run_until_done()
    second = eng.add_request(Request("b", prompt, 30))
    eng.run_until_done()
    return first.output_token_ids, second.output_token_ids, second.prefix_hit_tokens


@pytest.mark.parametrize("window", [0, 8, 13, 32])
def test_a_prompt_served_after_itself_generates_the_same_tokens(window):
    first, second, hits = twice(window)
    assert second == first
    # every full block before the window's first token, or before the last token without a window
    assert hits == (50 - window if window else 49) // BLOCK * BLOCK


def test_taking_the_windows_tokens_from_the_cache_reads_them_dequantized():
    first, second, hits = twice(32, cap=False)
    assert hits == 48 and second != first  # (what the cap prevents: the tester's finding, on the tiny model)


def test_sixteen_bit_kv_takes_every_hit_whatever_the_window():
    rt = tiny_runtime(**{"bitwidth.full_precision_window": 32})
    assert rt.new_engine().scheduler.full_precision_window == 0
