"""`Workload`: the requests a tuning run serves, as columns of numpy arrays.

Prefix structure uses block hash ids, the convention of Mooncake's traces and of vLLM's prefix cache: a
prompt is cut into blocks of ``block_tokens`` tokens and each block has an id that names the whole
prefix up to the end of that block (a chained hash). Equal ids mean equal tokens, so two requests that
list the same leading ids share that prompt prefix and its KV. A request lists ids for a leading part of
its prompt (its last listed block may be partial); the tokens after the listed blocks are its own.
Requests with nothing to share list no blocks at all, which keeps million-row traces small.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import numpy as np

# No model takes a context past 10M tokens (the longest advertised, Llama 4 Scout's, is 10M): a longer prompt or
# output is a typo or a corrupt row (2^63-1 read as a length wrapped to negative counts downstream). Readers
# refuse such a row, `--length-scale` such a scale, and a `Workload` such a request.
MAX_TOKENS = 10_000_000
CHAIN_CHUNK_BLOCKS = 1 << 24  # about the blocks whose new ids `chain_blocks` numbers in one step (16 M: 150 MB)


def _as_array(values: object, dtype: type) -> np.ndarray:
    """A read-only view: transformed copies share arrays, so none may be written in place."""
    view = np.ascontiguousarray(values, dtype=dtype).view()
    view.flags.writeable = False
    return view


@dataclass(frozen=True, eq=False)
class Workload:
    """N requests in arrival order. Lengths are in tokens, times in seconds (readers and presets start the
    clock at the first arrival)."""

    name: str
    arrival_s: np.ndarray  # [N] float64, non-decreasing, >= 0
    input_tokens: np.ndarray  # [N] int64 >= 1, prompt lengths
    output_tokens: np.ndarray  # [N] int64 >= 1, tokens to generate
    block_offsets: np.ndarray  # [N+1] int64: request i lists block_ids[block_offsets[i]:block_offsets[i+1]]
    block_ids: np.ndarray  # [M] int64 >= 0, prefix block hash ids of all requests, concatenated
    session_ids: np.ndarray  # [N] int64: turns of one conversation share an id; a lone request has its own
    request_ids: np.ndarray  # [N] int64, unique: a request's identity in its source, kept by every transform
    block_tokens: int = 512
    source: str = ""  # file path, or "preset:NAME" with the generator's parameters
    generated_arrivals: bool = False  # arrivals drawn by a generator (presets, length-only traces), not recorded
    # the inter-arrival CV the generator was asked for; the arrivals' own (`stats.burstiness`) differs by chance
    # and after transforms. None for recorded arrivals.
    requested_burstiness: float | None = None
    transforms: tuple[str, ...] = ()  # what was applied after reading, in order
    notes: tuple[str, ...] = ()  # what the reader changed or noticed (rows dropped, timestamps sorted)
    # `load_workload`'s arguments that built it (those not at their defaults; ``spec`` a preset's name or a file's
    # path), so that a tuned file made from it in Python can say how to build it again; None when built otherwise.
    # A transform applied afterwards keeps them: whoever reads them rebuilds and checks the digest.
    loaded_with: dict | None = None

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        for name, dtype in (("arrival_s", np.float64), ("input_tokens", np.int64), ("output_tokens", np.int64),
                            ("block_offsets", np.int64), ("block_ids", np.int64), ("session_ids", np.int64),
                            ("request_ids", np.int64)):
            object.__setattr__(self, name, _as_array(getattr(self, name), dtype))
        self._check(n)

    def _check(self, n: int) -> None:
        if n == 0:
            raise ValueError(f"workload {self.name!r}: no requests")
        for name in ("input_tokens", "output_tokens", "session_ids", "request_ids"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"workload {self.name!r}: {name} has {len(getattr(self, name))} entries, expected {n}")
        offsets = self.block_offsets
        if len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != len(self.block_ids):
            raise ValueError(f"workload {self.name!r}: block_offsets must run from 0 to len(block_ids) in N+1 entries")
        if np.any(np.diff(self.block_offsets) < 0):
            raise ValueError(f"workload {self.name!r}: block_offsets must be non-decreasing")
        if not np.all(np.isfinite(self.arrival_s)) or self.arrival_s[0] < 0 or np.any(np.diff(self.arrival_s) < 0):
            raise ValueError(f"workload {self.name!r}: arrival_s must be finite, >= 0 and sorted")
        if self.input_tokens.min() < 1 or self.output_tokens.min() < 1:
            raise ValueError(f"workload {self.name!r}: every request needs >= 1 input and >= 1 output token")
        longest = int(max(self.input_tokens.max(), self.output_tokens.max()))
        if longest > MAX_TOKENS:
            raise ValueError(f"workload {self.name!r}: a request of {longest:,} tokens is above {MAX_TOKENS:,}, "
                             "which no model's context holds")
        if self.block_tokens < 1:
            raise ValueError(f"workload {self.name!r}: block_tokens must be >= 1, got {self.block_tokens}")
        if len(self.block_ids) and self.block_ids.min() < 0:
            raise ValueError(f"workload {self.name!r}: block ids must be >= 0")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @classmethod
    def from_lengths(cls, name: str, arrival_s: np.ndarray, input_tokens: np.ndarray, output_tokens: np.ndarray,
                     **kwargs: object) -> "Workload":
        """A workload without prefix sharing (every prompt is its own) and without sessions."""
        n = len(arrival_s)
        ids = np.arange(n, dtype=np.int64)
        return cls(name=name, arrival_s=arrival_s, input_tokens=input_tokens, output_tokens=output_tokens,
                   block_offsets=np.zeros(n + 1, dtype=np.int64), block_ids=np.zeros(0, dtype=np.int64),
                   session_ids=ids, request_ids=ids, **kwargs)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1] - self.arrival_s[0])

    def blocks(self, i: int) -> np.ndarray:
        """Prefix block ids of request ``i`` (leading blocks of its prompt; may be empty)."""
        return self.block_ids[self.block_offsets[i]:self.block_offsets[i + 1]]

    def take(self, index: np.ndarray, arrival_s: np.ndarray | None = None) -> "Workload":
        """The requests at ``index`` (in that order), block lists and identities kept. ``arrival_s``: their new
        arrival times, in that order, for a transform that re-sorts requests by new times (their old times,
        in the new order, would not be sorted)."""
        index = np.asarray(index, dtype=np.int64)
        block_offsets, block_ids = gather_blocks(self.block_offsets, self.block_ids, index)
        arrival_s = self.arrival_s[index] if arrival_s is None else arrival_s
        return replace(self, arrival_s=arrival_s, input_tokens=self.input_tokens[index],
                       output_tokens=self.output_tokens[index], block_offsets=block_offsets, block_ids=block_ids,
                       session_ids=self.session_ids[index], request_ids=self.request_ids[index])

    def digest(self) -> str:
        """Stable content hash (arrivals, lengths, prefix and session structure); not the name or notes."""
        h = hashlib.sha256(f"skistune-workload-v1 block_tokens={self.block_tokens}".encode())
        for array in (self.arrival_s, self.input_tokens, self.output_tokens, self.block_offsets, self.block_ids,
                      self.session_ids):
            h.update(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
        return h.hexdigest()[:16]

    def label(self) -> str:
        """The source and what was applied to it, for titles: ``preset:chat ... | first 8, rate x0.1``."""
        return " | ".join([self.source or self.name] + ([", ".join(self.transforms)] if self.transforms else []))

    def with_note(self, note: str) -> "Workload":
        return replace(self, notes=self.notes + (note,))

    def with_transform(self, description: str, **changes: object) -> "Workload":
        return replace(self, transforms=self.transforms + (description,), **changes)


def gather_blocks(block_offsets: np.ndarray, block_ids: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR gather: the block lists of requests ``index``, concatenated, with their new offsets."""
    return _leading_slices(block_ids, block_offsets[index], np.diff(block_offsets)[index])


def truncate_blocks(block_offsets: np.ndarray, block_ids: np.ndarray,
                    keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keep at most ``keep[i]`` leading blocks of each request (a shorter prompt keeps its prefix)."""
    return _leading_slices(block_ids, block_offsets[:-1], np.minimum(np.diff(block_offsets), keep))


def _leading_slices(block_ids: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """block_ids[starts[k]:starts[k] + counts[k]] for every k, concatenated (vectorised), and their offsets."""
    new_offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=new_offsets[1:])
    # each output position = its request's old start + its rank inside the request's list
    shift = np.repeat(starts - new_offsets[:-1], counts)
    positions = np.arange(new_offsets[-1], dtype=np.int64) + shift
    return new_offsets, block_ids[positions]


def recut_blocks(block_offsets: np.ndarray, block_ids: np.ndarray, input_tokens: np.ndarray, from_tokens: int,
                 to_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Block lists at ``to_tokens`` tokens a block from lists at ``from_tokens`` (Mooncake's 512-token hash ids
    as 16-token blocks: each id becomes 32). A block id names the whole prefix up to its block's end, so the
    prefix up to any token is named by the id of the block holding that token plus the offset in it: a new
    block ending at token e gets the id (old id holding token e-1, e's offset in that block), the old ids
    numbered densely first so that the pair fits in an int64. Equal new ids are then equal prefixes, exactly
    where the old ids were. New blocks cover what the old lists covered (a prompt's partial last block only
    at the prompt's end); a new block reaching past an old list that stops short of the prompt is left out."""
    counts = np.diff(block_offsets)
    covered = np.minimum(counts * from_tokens, input_tokens)  # tokens the old lists name
    at_end = covered == input_tokens  # the last new block may be partial only at the prompt's end
    new_counts = np.where(at_end, -(-covered // to_tokens), covered // to_tokens)
    new_offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(new_counts, out=new_offsets[1:])
    rank = np.arange(new_offsets[-1], dtype=np.int64) - np.repeat(new_offsets[:-1], new_counts)
    end = np.minimum((rank + 1) * to_tokens, np.repeat(covered, new_counts))  # [M'] last token + 1
    old_rank = (end - 1) // from_tokens
    _, dense = np.unique(block_ids, return_inverse=True)
    old_id = dense.reshape(-1)[np.repeat(block_offsets[:-1], new_counts) + old_rank]
    return new_offsets, old_id * from_tokens + (end - old_rank * from_tokens - 1)


def chain_blocks(input_tokens: np.ndarray, prev_turn: list[int | None],
                 block_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Block lists for multi-turn sessions: a turn whose prompt is longer than its previous turn's re-sends
    that prompt, so it lists the previous turn's full blocks and then new ids (a partial last block holds
    different tokens once the prompt grows). Turns that extend or are extended get blocks covering their
    whole prompt; other requests list none (their prompt is their own). New ids are numbered in request
    order, then block order."""
    n = len(input_tokens)
    tokens = np.asarray(input_tokens, dtype=np.int64)
    prev = np.fromiter((-1 if p is None else p for p in prev_turn), dtype=np.int64, count=n)
    prev_tokens = tokens[np.maximum(prev, 0)]
    extends = (prev >= 0) & (tokens > prev_tokens)
    extended = np.zeros(n, dtype=bool)
    extended[prev[extends]] = True
    counts = np.where(extends | extended, -(-tokens // block_tokens), 0)
    shared = np.where(extends, prev_tokens // block_tokens, 0)  # the previous turn's full blocks
    block_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=block_offsets[1:])
    # Every list written in place of one array (a list per request, then joined, had taken 3.4 s and twice the
    # ids' memory for 1e6 chat requests; 0.6 s now, and 6-13 s -> 3-4 s for agent's 845 M ids). First the new
    # ids, consecutive in request order: each request's run of them starts after its shared blocks ...
    fresh = counts - shared
    first_fresh = np.cumsum(fresh) - fresh
    fresh_from = block_offsets[:-1] + shared
    total = int(block_offsets[-1])
    block_ids = np.empty(total, dtype=np.int64)
    # (in chunks of whole requests about `CHAIN_CHUNK_BLOCKS` blocks long: no temporary as long as the ids)
    at = np.searchsorted(block_offsets, np.arange(0, total, CHAIN_CHUNK_BLOCKS), side="right") - 1
    bounds = np.unique(np.concatenate([[0], at, [n]])).tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        lo, hi = int(block_offsets[a]), int(block_offsets[b])
        # the positions of new ids: +1 where a request's run starts, -1 where its list ends, summed (only the
        # new ids are written: shared blocks, 70% of long-context's, were written twice, 5.3 s -> 1.3 s there)
        edges = np.zeros(hi - lo + 1, dtype=np.int8)
        np.add.at(edges, fresh_from[a:b] - lo, 1)
        np.add.at(edges, block_offsets[a + 1:b + 1] - lo, -1)
        new = np.cumsum(edges[:-1], dtype=np.int8).view(bool)
        block_ids[lo:hi][new] = np.arange(first_fresh[a], first_fresh[a] + fresh[a:b].sum(), dtype=np.int64)
    # ... then the shared blocks copied from the previous turn's list, in request order: a previous turn comes
    # earlier, so its own list is whole by then
    turns = np.flatnonzero(extends)
    for start, source, k in zip(block_offsets[turns].tolist(), block_offsets[prev[turns]].tolist(),
                                shared[turns].tolist()):
        block_ids[start:start + k] = block_ids[source:source + k]
    return block_offsets, block_ids
