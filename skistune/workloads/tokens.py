"""Prompt token ids for the runtime: deterministic, with the workload's prefix structure made real.

Each prefix block id names a token stream; a request's prompt is its blocks' streams (the last one cut at
the prompt's length) followed by a stream of its own. So requests listing equal block ids get equal token
blocks (and the runtime's prefix cache can share their KV), a multi-turn session's prompts extend one
another, and everything else is unique. Tokens are pseudo-random ids by default, or windows of a real
text's tokens (for quality runs) when ``text`` and ``encode`` are given.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from skistune.runtime.request import Request
from skistune.workloads.model import Workload

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_BLOCK_DOMAIN = np.uint64(0x5EED_B10C_0000_0001)
_TAIL_DOMAIN = np.uint64(0x5EED_7A11_0000_0002)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection on uint64 whose outputs look independent for nearby inputs."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class TokenSource:
    """Token streams keyed by uint64: pseudo-random ids below ``vocab_size``, or windows of ``corpus``."""

    def __init__(self, vocab_size: int, seed: int, corpus: np.ndarray | None = None) -> None:
        if not 1 <= vocab_size < 2**31:
            raise ValueError(f"vocab_size must be in [1, 2**31), got {vocab_size}")
        if corpus is not None and (len(corpus) == 0 or corpus.min() < 0 or corpus.max() >= vocab_size):
            raise ValueError(f"text tokens must be a non-empty sequence of ids in [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.seed_key = _mix(np.array([seed % 2**64], dtype=np.uint64) * _GOLDEN)
        self.corpus = corpus

    def keys(self, ids: np.ndarray, domain: np.uint64) -> np.ndarray:
        return _mix(self.seed_key ^ domain ^ (ids.astype(np.uint64) * _GOLDEN))  # [K]

    def streams(self, keys: np.ndarray, length: int) -> np.ndarray:
        """The first ``length`` tokens of each key's stream: [K, length] int32."""
        positions = np.arange(length, dtype=np.uint64)
        if self.corpus is None:
            hashed = _mix(keys[:, None] + positions[None, :] * _GOLDEN)  # [K, length]
            return (hashed % np.uint64(self.vocab_size)).astype(np.int32)
        start = keys % np.uint64(len(self.corpus))  # each stream reads the text from its own place
        return self.corpus[((start[:, None] + positions[None, :]) % np.uint64(len(self.corpus))).astype(np.int64)]


def prompt_token_ids(workload: Workload, i: int, source: TokenSource) -> np.ndarray:
    """Request ``i``'s prompt: its prefix blocks' token streams, then its own tokens. [input_tokens[i]] int32"""
    input_tokens = int(workload.input_tokens[i])
    blocks = workload.blocks(i)
    from_blocks = min(input_tokens, len(blocks) * workload.block_tokens)
    # only the blocks the prompt reaches, each only as long as the prompt: a stream's first tokens do not depend
    # on its length, and a --length-scale of 1e9 had built whole 1.6e10-token blocks for an 8,192-token prompt
    used = blocks[:-(-from_blocks // workload.block_tokens)]
    length = min(workload.block_tokens, from_blocks)
    head = source.streams(source.keys(used, _BLOCK_DOMAIN), length).reshape(-1)[:from_blocks]
    own_key = source.keys(workload.request_ids[i:i + 1], _TAIL_DOMAIN)
    tail = source.streams(own_key, input_tokens - from_blocks).reshape(-1)
    return np.concatenate([head, tail]).astype(np.int32, copy=False)


def to_requests(workload: Workload, *, vocab_size: int, seed: int = 0, text: str | None = None,
                encode: Callable[[str], Sequence[int]] | None = None,
                first_token_deadline_s: float | None = None) -> list[Request]:
    """The workload as runtime requests (prompts as int32 arrays). ``text`` and ``encode`` (both or neither)
    make prompts from windows of real text tokens instead of random ids; ``first_token_deadline_s`` sets
    each request's deadline that long after its arrival (for the ``edf`` scheduling policy)."""
    if (text is None) != (encode is None):
        raise ValueError("real-text prompts need both text and encode (a tokenizer's encode function)")
    corpus = None if text is None else np.asarray(encode(text), dtype=np.int64)
    source = TokenSource(vocab_size, seed, corpus)
    requests = []
    for i in range(len(workload)):
        arrival_s = float(workload.arrival_s[i])
        deadline_s = None if first_token_deadline_s is None else arrival_s + first_token_deadline_s
        requests.append(Request(request_id=str(workload.request_ids[i]),
                                prompt_token_ids=prompt_token_ids(workload, i, source),
                                max_new_tokens=int(workload.output_tokens[i]), arrival_s=arrival_s,
                                deadline_s=deadline_s))
    return requests
