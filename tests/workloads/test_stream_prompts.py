"""`StreamPrompt`: a workload's prompt whose tokens are computed when read. It must read as the array it
stands for, and its block hashes (from the prompt's structure, no token read) must say "equal" exactly where
hashes chained over the tokens do: the prefix cache finds the same blocks either way."""
from __future__ import annotations

import tracemalloc
import warnings

import numpy as np
import pytest

from skistune.config import KVConfig
from skistune.evaluate import sim_target
from skistune.profile import FingerprintWarning
from skistune.runtime.block_manager import PROMPT_HASHES, chain_hashes
from skistune.simulator import build_engine, with_rate_scale
from skistune.workloads import Workload, first_n, read_trace, to_requests
from skistune.workloads.tokens import StreamPrompt
from workload_paths import MOONCAKE_CONV
from test_workload_tokens import _tiny

PROFILE = "profiles/cpu-smollm2-135m.json"


def test_tokens_are_those_skistune_has_always_built():
    """Pinned ids: a run replays the same prompts. (On a trace, whose lengths and shared blocks stay as they are:
    the pins of a preset's draw had to move when its lengths were refitted; these were built by the code before.)"""
    requests = to_requests(first_n(read_trace(MOONCAKE_CONV), 5), vocab_size=49152, seed=7)
    got = [(len(r.prompt_token_ids), r.prompt_token_ids[:4].tolist(), r.prompt_token_ids[-3:].tolist())
           for r in requests[:3]]
    assert got == [(6758, [14150, 16275, 29089, 20272], [27070, 44030, 713]),  # (a shared first block)
                   (7322, [14150, 16275, 29089, 20272], [15498, 9660, 48696]),
                   (7236, [14150, 16275, 29089, 20272], [47227, 8832, 31368])]


def test_reads_as_the_array_it_stands_for():
    workload = first_n(read_trace(MOONCAKE_CONV), 20)
    lazy = to_requests(workload, vocab_size=49152, seed=1)
    arrays = to_requests(workload, vocab_size=49152, seed=1, arrays=True)
    for x, y in zip(lazy, arrays):
        prompt, array = x.prompt_token_ids, y.prompt_token_ids
        assert isinstance(prompt, StreamPrompt) and isinstance(array, np.ndarray) and array.dtype == np.int32
        assert len(prompt) == len(array) and np.array_equal(np.asarray(prompt), array)
        n = len(array)
        for index in (slice(None), slice(0, 5), slice(n - 7, None), slice(-600, -3), slice(511, 1025),
                      slice(5, 2), slice(n + 5, n + 9), slice(3, 40, 7), slice(None, None, -1)):
            assert np.array_equal(prompt[index], array[index]), index
        for i in (0, 511, 512, n - 1, -1, -n):
            assert prompt[i] == array[i]
        with pytest.raises(IndexError):
            prompt[n]
        assert prompt.tolist() == array.tolist() == list(prompt)
        assert (prompt.min(), prompt.max()) == (array.min(), array.max())


def test_a_tail_read_again_is_the_same_and_a_write_to_it_stays_the_callers():
    """The last short tail read is kept (each replay hashes a prompt's last partial block with its first outputs):
    reading it again, or another tail after it, gives the array's tokens, whatever the caller did to a copy."""
    workload = first_n(read_trace(MOONCAKE_CONV), 3)
    lazy = to_requests(workload, vocab_size=49152, seed=1)
    arrays = to_requests(workload, vocab_size=49152, seed=1, arrays=True)
    for x, y in zip(lazy, arrays):
        prompt, array = x.prompt_token_ids, y.prompt_token_ids
        n = len(array)
        for start in (n - 5, n - 5, n - 12, n - 5, n - StreamPrompt.TAIL_MEMO_TOKENS - 1, n - 5):
            first = prompt[start:]
            assert np.array_equal(first, array[start:]), start
            first[:] = -1
            assert np.array_equal(prompt[start:n + 3], array[start:]), start
        assert np.array_equal(prompt[n - 12:n - 1], array[n - 12:n - 1])  # (not a tail: read as it is)

def _prefix_pairs(prompts, block_size):
    """For every pair of prompts and every block both have in full: whether the chained token hashes and
    the structural hashes call it equal."""
    by_tokens = [chain_hashes(np.asarray(p).tolist(), block_size, []) for p in prompts]
    by_structure = [PROMPT_HASHES.array(p, block_size).tolist() for p in prompts]
    for a, b in zip(by_tokens, by_structure):
        assert len(a) == len(b)
        assert len(set(b)) == len(b)  # a prompt's blocks never hash alike (each covers a longer prefix)
    pairs = []
    for i in range(len(prompts)):
        for j in range(i):
            n = min(len(by_tokens[i]), len(by_tokens[j]))
            pairs += [(by_tokens[i][k] == by_tokens[j][k], by_structure[i][k] == by_structure[j][k]) for k in range(n)]
    return pairs


@pytest.mark.parametrize("block_size", [1, 4, 5, 16, 48, 512])
def test_structural_hashes_agree_with_token_hashes_on_a_trace(block_size):
    workload = first_n(read_trace(MOONCAKE_CONV), 40)
    workload = Workload(**{**workload.__dict__, "input_tokens": np.minimum(workload.input_tokens, 3000)})
    prompts = [r.prompt_token_ids for r in to_requests(workload, vocab_size=49152)]
    pairs = _prefix_pairs(prompts, block_size)
    assert all(tokens == structure for tokens, structure in pairs)
    assert sum(tokens for tokens, _ in pairs) > 100  # the sample's prompts do share blocks


@pytest.mark.parametrize("block_size", [5, 6, 8, 12, 16])
def test_structural_hashes_agree_on_partial_blocks_and_diverging_lists(block_size):
    # workload blocks of 8 tokens: equal lists, a list cut short by the prompt, lists that part at their second
    # block, equal later ids under unequal earlier ones, a prompt with no list, and ones longer than their list
    workload = _tiny([[7, 8], [7, 8], [7], [7, 9], [6, 8], [], [7, 8], [7, 8, 5]], [16, 13, 19, 16, 16, 9, 27, 25],
                     block_tokens=8)
    prompts = [r.prompt_token_ids for r in to_requests(workload, vocab_size=49152)]
    assert all(p.block_hashes(block_size) is not None for p in prompts)
    pairs = _prefix_pairs(prompts, block_size)
    assert all(tokens == structure for tokens, structure in pairs)
    assert any(tokens for tokens, _ in pairs) and not all(tokens for tokens, _ in pairs)


def test_short_blocks_of_a_small_vocabulary_are_hashed_from_their_tokens():
    """Two 1-token blocks of different streams match once in a vocabulary's size: the prefix cache shares them
    (a content hash), so structure cannot stand in for the tokens there."""
    prompts = [r.prompt_token_ids for r in to_requests(_tiny([[1], [2], [3]], [4, 4, 4]), vocab_size=49152)]
    assert prompts[0].block_hashes(4) is None and prompts[0].block_hashes(5) is not None
    small = to_requests(_tiny([[1]], [40]), vocab_size=50)[0].prompt_token_ids
    assert small.block_hashes(11) is None and small.block_hashes(12) is not None


def test_prompts_of_real_text_are_arrays_hashed_from_their_tokens():
    text = "the quick brown fox jumps over the lazy dog " * 40
    requests = to_requests(_tiny([[1, 2], [1, 3]], [8, 8]), vocab_size=256, text=text, encode=lambda s: list(s.encode()))
    assert all(isinstance(r.prompt_token_ids, np.ndarray) for r in requests)
    assert StreamPrompt.block_hashes(_text_prompt(text), 4) is None  # (windows of a text may repeat)


def _text_prompt(text: str) -> StreamPrompt:
    from skistune.workloads.tokens import TokenSource
    source = TokenSource(256, 0, np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64))
    return StreamPrompt(source, np.zeros(0, np.uint64), np.zeros(0, np.uint64), 4, 0, np.uint64(5), 8)


def test_the_simulator_serves_them_as_it_serves_arrays():
    """Same prefix hits, same metrics: prompts from structure or from tokens, a replay cannot tell."""
    workload = first_n(read_trace(MOONCAKE_CONV), 150)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FingerprintWarning)  # (the shipped profile's machine is not this one)
        target = sim_target("smollm2-135m", PROFILE)
    results = []
    for arrays in (False, True):
        requests = with_rate_scale(to_requests(workload, vocab_size=49152, arrays=arrays), 0.05)
        engine, _ = build_engine(KVConfig(), target)
        results.append(engine.replay(requests).to_dict())
    assert results[0] == results[1]
    assert results[0]["prefix_hit_tokens"] > 0.1 * results[0]["prompt_tokens"]  # prefix reuse was exercised


def test_building_requests_stores_no_tokens():
    """200 requests of 50,000 tokens: 40 MB as int32 arrays; their `StreamPrompt`s take a few hundred bytes each,
    and the memoized block hashes 8 bytes per block."""
    n, length = 200, 50_000
    workload = _tiny([[1, 2]] * n, [length] * n, block_tokens=512)
    tracemalloc.start()
    requests = to_requests(workload, vocab_size=49152)
    built = tracemalloc.get_traced_memory()[1]
    hashes = [PROMPT_HASHES.array(r.prompt_token_ids, 16) for r in requests]
    tracemalloc.stop()
    assert built < 2_000_000, built
    assert sum(h.nbytes for h in hashes) == n * (length // 16) * 8


def test_one_value_mixes_as_arrays_do():
    from skistune.workloads.tokens import _mix, _mix_int
    values = np.random.default_rng(0).integers(0, 2**63, 1000, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    assert [_mix_int(int(v)) for v in values] == _mix(values).tolist()


def test_the_first_block_alone_hashes_as_among_all():
    prompts = [r.prompt_token_ids for r in to_requests(first_n(read_trace(MOONCAKE_CONV), 30), vocab_size=49152)]
    for block_size in (16, 512, 700):
        for p in prompts:
            assert p.block_hashes(block_size, 1).tolist() == p.block_hashes(block_size)[:1].tolist()
            assert p.block_hashes(block_size, 3).tolist() == p.block_hashes(block_size)[:3].tolist()
