"""Prompt token ids for the runtime: deterministic, with the workload's prefix structure made real.

Each prefix block id names a token stream; a request's prompt is its blocks' streams (the last one cut at
the prompt's length) followed by a stream of its own. So requests listing equal block ids get equal token
blocks (and the runtime's prefix cache can share their KV), a multi-turn session's prompts extend one
another, and everything else is unique. Tokens are pseudo-random ids by default, or windows of a real
text's tokens (for quality runs) when ``text`` and ``encode`` are given.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from skistune.runtime.request import Request
from skistune.workloads.model import Workload

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_BLOCK_DOMAIN = np.uint64(0x5EED_B10C_0000_0001)
_TAIL_DOMAIN = np.uint64(0x5EED_7A11_0000_0002)
_CHAIN_ROOT = np.uint64(0x5EED_C4A1_0000_0003)
_OWN_BLOCK_DOMAIN = np.uint64(0x5EED_0B10_0000_0004)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection on uint64 whose outputs look independent for nearby inputs."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


_MASK = 2**64 - 1


def _mix_int(x: int) -> int:
    """`_mix` of one value as a Python int (a few array operations cost 10x more than its arithmetic)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


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

    def tokens_at(self, keys: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Token ``offsets`` of the streams ``keys`` (uint64 arrays of one shape): pseudo-random ids, or the
        text read from a place each key names."""
        if self.corpus is None:
            return (_mix(keys + offsets * _GOLDEN) % np.uint64(self.vocab_size)).astype(np.int32)
        n = np.uint64(len(self.corpus))
        return self.corpus[((keys % n + offsets) % n).astype(np.int64)].astype(np.int32)


class StreamPrompt:
    """Request ``i``'s prompt with its tokens computed when read, never stored (`prompt_token_ids` is its
    array): 60,000 trace requests of 8,000-token prompts took 2 GB as int32 arrays, and the simulator reads
    few tokens of each (where outputs share a block with the prompt). Its prefix cache reads `block_hashes`,
    computed from the prompt's structure without a token. Slices and ``np.asarray`` give int32 arrays."""

    dtype = np.dtype(np.int32)
    ndim = 1
    # (no __dict__: a trace holds one per request; the weak reference: `PROMPT_HASHES`)
    __slots__ = ("source", "block_tokens", "from_blocks", "length", "block_keys", "block_chain", "own_key",
                 "_tail", "__weakref__")
    TAIL_MEMO_TOKENS = 256  # the longest tail kept (`_tail`): the largest KV block a config may have

    def __init__(self, source: TokenSource, block_keys: np.ndarray, block_chain: np.ndarray, block_tokens: int,
                 from_blocks: int, own_key: np.uint64, length: int) -> None:
        self.source, self.block_tokens, self.from_blocks, self.length = source, block_tokens, from_blocks, length
        self.block_keys, self.block_chain, self.own_key = block_keys, block_chain, own_key  # [blocks it reaches]
        # (start, tokens start..length) of the last short tail read: the tokens a prompt's last partial KV block
        # holds, read by every replay of the request when its first output block is hashed (a search replays the
        # same prompts at many rates; computing the span cost ~10 array operations)
        self._tail: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.length

    def _span(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``start..stop`` (0 <= start <= stop <= len): the blocks' streams, then the prompt's own."""
        if start >= self.from_blocks:  # (the prompt's own tokens only: the span a replay reads most)
            own = np.arange(start - self.from_blocks, stop - self.from_blocks, dtype=np.uint64)
            return self.source.tokens_at(self.own_key, own)
        positions = np.arange(start, stop, dtype=np.int64)
        in_blocks = positions < self.from_blocks
        keys = np.full(len(positions), self.own_key, dtype=np.uint64)
        keys[in_blocks] = self.block_keys[positions[in_blocks] // self.block_tokens]
        offsets = np.where(in_blocks, positions % self.block_tokens, positions - self.from_blocks)
        return self.source.tokens_at(keys, offsets.astype(np.uint64))

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self.length)
            if step != 1:
                return self._span(0, self.length)[index]
            if stop < self.length or self.length - start > self.TAIL_MEMO_TOKENS:
                return self._span(start, max(start, stop))
            tail = self._tail
            if tail is None or tail[0] != start:
                tail = self._tail = (start, self._span(start, self.length))
            return tail[1].copy()  # (a copy: the caller may write to it)
        i = index.__index__()
        if not -self.length <= i < self.length:
            raise IndexError(f"prompt index {index} out of range for {self.length} tokens")
        i %= self.length
        return int(self._span(i, i + 1)[0])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        tokens = self._span(0, self.length)
        return tokens if dtype is None else tokens.astype(dtype)

    def __iter__(self):
        return iter(self.tolist())

    def tolist(self) -> list[int]:
        return self._span(0, self.length).tolist()

    def min(self) -> int:
        return int(self._span(0, self.length).min())

    def max(self) -> int:
        return int(self._span(0, self.length).max())

    def __repr__(self) -> str:
        return f"StreamPrompt({self.length} tokens, {len(self.block_keys)} workload blocks)"

    def block_hashes(self, block_size: int, count: int | None = None) -> np.ndarray | None:
        """A hash per full block of ``block_size`` tokens (int64), equal for two prompts exactly when their
        tokens up to the end of that block are (up to 64-bit collisions), as chained hashes of the tokens are
        (`runtime.block_manager.chain_hashes`). A block that ends inside the workload blocks' streams hashes
        the chain of those blocks' keys and where it ends; a block that reaches the prompt's own tokens is
        this prompt's alone: it hashes the prompt's own key and where it ends. None (hash the tokens) where
        equal tokens under unequal structure are not as rare as a 64-bit collision: a prompt of real text,
        whose windows may repeat, or blocks so short that two streams' blocks match by chance (one token of a
        49,152-token vocabulary: once in 49,152 pairs; five tokens: 2^-78). ``count``: the first blocks only."""
        if self.source.corpus is not None or block_size * math.log2(self.source.vocab_size) < 64:
            return None
        full = self.length // block_size
        if count == 1 and full:  # (a replay's census reads every prompt's first block: no array operations)
            owner = self.block_chain[(block_size - 1) // self.block_tokens] if block_size <= self.from_blocks \
                else self.own_key ^ _OWN_BLOCK_DOMAIN
            return np.array([_mix_int(int(owner) ^ (block_size * int(_GOLDEN) & _MASK))], dtype=np.uint64).view(np.int64)
        ends = np.arange(1, full + 1 if count is None else min(full, count) + 1, dtype=np.int64) * block_size
        owners = np.full(len(ends), self.own_key ^ _OWN_BLOCK_DOMAIN, dtype=np.uint64)
        shared = ends <= self.from_blocks
        owners[shared] = self.block_chain[(ends[shared] - 1) // self.block_tokens]
        return _mix(owners ^ (ends.astype(np.uint64) * _GOLDEN)).view(np.int64)


def _chain_keys(keys: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per block of concatenated block lists (request r's at ``starts[r]``, ``lengths[r]`` long), a key of
    that block and every block before it in its list: like a workload's block ids, but for any ids."""
    chain = np.empty(len(keys), dtype=np.uint64)
    for k in range(int(lengths.max(initial=0))):  # (vectorised over the requests: a list is a few dozen long)
        at = starts[lengths > k] + k
        parent = chain[at - 1] if k else np.full(len(at), _CHAIN_ROOT, dtype=np.uint64)
        chain[at] = _mix((parent ^ keys[at]) * _GOLDEN)
    return chain


def _reach(workload: Workload, i: int) -> tuple[int, int, int]:
    """(tokens of request ``i``'s prompt, how many of them are its blocks', how many of its blocks they
    reach): only the blocks the prompt reaches are read (a --length-scale of 1e9 had built whole
    1.6e10-token blocks for an 8,192-token prompt)."""
    input_tokens = int(workload.input_tokens[i])
    from_blocks = min(input_tokens, len(workload.blocks(i)) * workload.block_tokens)
    return input_tokens, from_blocks, -(-from_blocks // workload.block_tokens)


def stream_prompts(workload: Workload, source: TokenSource) -> list[StreamPrompt]:
    """Every request's prompt as a `StreamPrompt`."""
    offsets = workload.block_offsets
    keys = source.keys(workload.block_ids, _BLOCK_DOMAIN)
    chain = _chain_keys(keys, offsets[:-1], np.diff(offsets))
    own_keys = source.keys(workload.request_ids, _TAIL_DOMAIN)
    prompts = []
    for i in range(len(workload)):
        input_tokens, from_blocks, reached = _reach(workload, i)
        at = slice(offsets[i], offsets[i] + reached)
        prompts.append(StreamPrompt(source, keys[at], chain[at], workload.block_tokens, from_blocks, own_keys[i],
                                    input_tokens))
    return prompts


def prompt_token_ids(workload: Workload, i: int, source: TokenSource) -> np.ndarray:
    """Request ``i``'s prompt: its prefix blocks' token streams, then its own tokens. [input_tokens[i]] int32"""
    return np.asarray(stream_prompts(workload.take(np.array([i])), source)[0])


def to_requests(workload: Workload, *, vocab_size: int, seed: int = 0, text: str | None = None,
                encode: Callable[[str], Sequence[int]] | None = None,
                first_token_deadline_s: float | None = None, arrays: bool = False) -> list[Request]:
    """The workload as runtime requests. Prompts are `StreamPrompt` sequences, whose tokens are computed when
    read (``arrays``: int32 arrays instead). ``text`` and ``encode`` (both or neither) make prompts from
    windows of real text tokens instead of random ids, as int32 arrays; ``first_token_deadline_s`` sets each
    request's deadline that long after its arrival (for the ``edf`` scheduling policy)."""
    if (text is None) != (encode is None):
        raise ValueError("real-text prompts need both text and encode (a tokenizer's encode function)")
    corpus = None if text is None else np.asarray(encode(text), dtype=np.int64)
    source = TokenSource(vocab_size, seed, corpus)
    prompts = stream_prompts(workload, source)
    requests = []
    for i, prompt in enumerate(prompts):
        arrival_s = float(workload.arrival_s[i])
        deadline_s = None if first_token_deadline_s is None else arrival_s + first_token_deadline_s
        requests.append(Request(request_id=str(workload.request_ids[i]),
                                prompt_token_ids=np.asarray(prompt) if arrays or corpus is not None else prompt,
                                max_new_tokens=int(workload.output_tokens[i]), arrival_s=arrival_s,
                                deadline_s=deadline_s))
    return requests
