"""Prompt tokens: deterministic, equal prefix blocks give equal tokens, everything else is unique."""
from __future__ import annotations

import numpy as np
import pytest

from skistune.runtime.request import Request
from skistune.workloads import Workload, first_n, read_trace, synthesize, to_requests
from workload_paths import AZURE_CONV, MOONCAKE_CONV


@pytest.fixture(scope="module")
def mooncake_head() -> Workload:
    return first_n(read_trace(MOONCAKE_CONV), 60)


def _tiny(block_ids: list[list[int]], input_tokens: list[int], block_tokens: int = 4) -> Workload:
    offsets = np.cumsum([0] + [len(ids) for ids in block_ids])
    n = len(input_tokens)
    return Workload(name="tiny", arrival_s=np.arange(n, dtype=float), input_tokens=input_tokens,
                    output_tokens=[2] * n, block_offsets=offsets,
                    block_ids=[i for ids in block_ids for i in ids], session_ids=np.arange(n),
                    request_ids=np.arange(n), block_tokens=block_tokens)


def test_requests_carry_lengths_arrivals_and_ids(mooncake_head):
    requests = to_requests(mooncake_head, vocab_size=49152)
    assert all(isinstance(r, Request) for r in requests)
    assert [r.prompt_len for r in requests] == mooncake_head.input_tokens.tolist()
    assert [r.max_new_tokens for r in requests] == mooncake_head.output_tokens.tolist()
    assert [r.arrival_s for r in requests] == mooncake_head.arrival_s.tolist()
    assert [r.request_id for r in requests] == [str(i) for i in range(60)]
    prompt = requests[0].prompt_token_ids
    assert prompt.dtype == np.int32 and prompt.min() >= 0 and prompt.max() < 49152


def test_equal_hash_ids_give_equal_token_blocks(mooncake_head):
    requests = to_requests(mooncake_head, vocab_size=49152, seed=3)
    block = mooncake_head.block_tokens
    pairs = 0
    for i in range(len(mooncake_head)):
        for j in range(i):
            a, b = mooncake_head.blocks(i), mooncake_head.blocks(j)
            common = int(np.argmin(np.append(a[:len(b)] == b[:len(a)], False)))  # leading equal ids
            prompt_a, prompt_b = requests[i].prompt_token_ids, requests[j].prompt_token_ids
            shared = min(common * block, len(prompt_a), len(prompt_b))
            assert np.array_equal(prompt_a[:shared], prompt_b[:shared])
            if common < min(len(a), len(b)):  # the first differing block differs in its tokens
                assert not np.array_equal(prompt_a[shared:shared + block], prompt_b[shared:shared + block])
            pairs += common > 0
    assert pairs > 100  # the sample's requests share a system-prompt block and longer prefixes


def test_partial_last_block_and_unique_tail():
    workload = _tiny([[7, 8], [7, 8], [7], []], [6, 8, 9, 4])
    a, b, c, d = (r.prompt_token_ids for r in to_requests(workload, vocab_size=1000))
    assert np.array_equal(a, b[:6])  # same ids: a's partial block is the start of b's full one
    assert np.array_equal(a[:4], c[:4]) and not np.array_equal(a[4:6], c[4:6])  # c's own tokens after block 7
    assert not np.array_equal(d, a[:4])


def test_prompts_without_blocks_are_all_different():
    requests = to_requests(first_n(read_trace(AZURE_CONV), 200), vocab_size=32000)
    starts = {tuple(r.prompt_token_ids[:8].tolist()) for r in requests}
    assert len(starts) == 200


def test_tokens_are_deterministic_by_seed(mooncake_head):
    one = to_requests(mooncake_head, vocab_size=1000, seed=1)
    again = to_requests(mooncake_head, vocab_size=1000, seed=1)
    other = to_requests(mooncake_head, vocab_size=1000, seed=2)
    assert all(np.array_equal(x.prompt_token_ids, y.prompt_token_ids) for x, y in zip(one, again))
    assert not np.array_equal(one[0].prompt_token_ids, other[0].prompt_token_ids)


def test_tokens_follow_requests_through_sampling():
    workload = synthesize("chat", requests=200, seed=0)
    later = workload.take(np.arange(100, 200))
    full = to_requests(workload, vocab_size=5000)
    part = to_requests(later, vocab_size=5000)
    assert all(np.array_equal(x.prompt_token_ids, y.prompt_token_ids) for x, y in zip(full[100:], part))


def test_sessions_extend_previous_turns_in_tokens():
    workload = synthesize("chat", requests=400, seed=2)
    requests = to_requests(workload, vocab_size=49152)
    checked = 0
    for session in np.unique(workload.session_ids):
        turns = np.flatnonzero(workload.session_ids == session)
        for earlier, later in zip(turns[:-1], turns[1:]):
            full = workload.input_tokens[earlier] // workload.block_tokens * workload.block_tokens
            assert np.array_equal(requests[earlier].prompt_token_ids[:full], requests[later].prompt_token_ids[:full])
            checked += 1
    assert checked > 50


def test_real_text_tokens_come_from_the_encoded_text():
    text = "the quick brown fox jumps over the lazy dog " * 40

    def encode(s: str) -> list[int]:
        return list(s.encode())

    workload = _tiny([[1, 2], [1, 3]], [8, 8])
    a, b = (r.prompt_token_ids for r in to_requests(workload, vocab_size=256, text=text, encode=encode))
    assert np.array_equal(a[:4], b[:4]) and not np.array_equal(a[4:], b[4:])
    doubled = text + text
    for block in (a[:4], a[4:], b[4:]):
        assert bytes(block.astype(np.uint8)).decode() in doubled  # a window of the text
    with pytest.raises(ValueError, match="both text and encode"):
        to_requests(workload, vocab_size=256, text=text)
    with pytest.raises(ValueError, match=r"ids in \[0, 100\)"):
        to_requests(workload, vocab_size=100, text=text, encode=encode)


def test_first_token_deadline():
    workload = _tiny([[], []], [3, 3])
    requests = to_requests(workload, vocab_size=10, first_token_deadline_s=0.5)
    assert [r.deadline_s for r in requests] == [0.5, 1.5]


def test_blocks_far_longer_than_the_prompt_build_only_the_prompt():
    """A --length-scale of 1e9 scales the block size with the lengths (16 -> 1.6e10 tokens) while the prompt is
    cut to the context: the prompt's blocks had been built whole (numpy: "Unable to allocate 119. GiB")."""
    huge = _tiny([[1, 2], [1, 3]], [8, 5], block_tokens=16 * 10**9)
    small = _tiny([[1, 2], [1, 3]], [8, 5], block_tokens=16)
    a, b = to_requests(huge, vocab_size=1000), to_requests(small, vocab_size=1000)
    assert [len(r.prompt_token_ids) for r in a] == [8, 5]
    assert all(np.array_equal(x.prompt_token_ids, y.prompt_token_ids) for x, y in zip(a, b))  # first tokens of block 1
