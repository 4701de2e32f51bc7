"""Paged KV-cache accounting: a pool of fixed-size blocks, block tables per sequence, reference counts
and prefix reuse by chained block hashes (vLLM v1 semantics). Pure Python, no torch: the simulator
drives this same code.

Block 0 is the null block: never allocated, it pads block tables (the KV store keeps it zeroed).
A freed block keeps its hash and stays findable until it is reused ("free but cached"); the free
queue is least-recently-freed first, and a sequence frees its blocks tail first so that shared
prefix blocks outlive the tails that nobody else has.

Blocks hold KV slots. Without eviction a sequence's slots are its computed tokens; after an eviction
compaction (`prepare_compaction`, then `truncate`) it has fewer slots than tokens (`num_kv_tokens`), its
blocks no longer hold the KV of a token prefix and are never cached again, and the blocks the compaction
rewrites are first made its own (copy-on-write) so that other sequences and the prefix cache keep theirs.
"""
from __future__ import annotations

import weakref
from collections import Counter
from itertools import islice
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from .tiers import TierManager

NULL_BLOCK = 0
LOOKUP_SLICE = 32  # prefix hashes looked up at once (past the first miss, the rest of a slice is wasted)


class HasTokens(Protocol):
    """What the block manager needs of a sequence (`scheduler.Sequence`; `TokenList` for a plain list). A
    sequence that also has a ``prompt`` (a numpy array) gets its prompt's block hashes from `PROMPT_HASHES`."""

    seq_id: str
    num_tokens: int
    num_computed_tokens: int

    def tokens(self, start: int, end: int) -> list[int]: ...


class TokenList:
    """`HasTokens` over a plain ``token_ids`` list that callers append to (a mixin: the subclass, e.g. a
    dataclass, defines ``token_ids``)."""

    token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        return self.token_ids[start:end]


class BlockPool:
    """Blocks ``1..num_blocks``, their reference counts and the prefix-cache index.

    The free queue is a list read from ``head`` on: blocks are taken from its front a slice at a time and
    freed onto its end, so that allocating and freeing move whole slices in C (the simulator allocates and
    frees millions of blocks; an ordered dict cost two hash-table updates per block). A free block that a
    prefix hit takes back (`touch`) stays in the list as a ghost, counted in ``ghosts``, and is skipped when
    the front reaches it: a block's entries leave the list in the order they entered it, so its ghosts
    always come before the entry that is live."""

    COMPACT_AFTER = 4096  # taken entries the queue's front may hold before they are dropped

    def __init__(self, num_blocks: int, on_drop: Callable[[list[tuple[int, int]]], None] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"KV pool: needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * (num_blocks + 1)
        # the hash a block was last cached under: stale once the cache points elsewhere (`is_findable`)
        self.block_hash: list[int | None] = [None] * (num_blocks + 1)
        self._queue: list[int] = list(range(1, num_blocks + 1))  # least recently freed first, from `_head`
        self._head = 0
        self.ghosts: dict[int, int] = {}  # block -> entries of it in the queue that a prefix hit took back
        self._num_ghosts = 0
        self.cached: dict[int, int] = {}  # block hash -> block id
        # called with the (block id, hash) of the findable cached blocks an allocation reuses, in order: the tiers
        # keep their KV below
        self.on_drop = on_drop

    def num_free(self) -> int:
        return len(self._queue) - self._head - self._num_ghosts

    def num_used(self) -> int:
        return self.num_blocks - len(self._queue) + self._head + self._num_ghosts  # (`num_free`, inlined)

    def free_blocks(self) -> list[int]:
        """The free blocks, least recently freed first (the order `allocate` takes them in)."""
        ghosts = dict(self.ghosts)
        out = []
        for b in islice(self._queue, self._head, None):
            if ghosts.get(b):
                ghosts[b] -= 1
            else:
                out.append(b)
        return out

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def num_free_among(self, block_ids: Sequence[int]) -> int:
        """How many of these (cached) blocks sit in the free queue: touching them uses free capacity."""
        ref_cnt = self.ref_cnt
        return [ref_cnt[b] for b in block_ids].count(0)  # (a comprehension: 1.3x faster than a map of __getitem__)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (prefix hits), pulling free ones out of the free queue."""
        ref_cnt, ghosts = self.ref_cnt, self.ghosts
        for b in block_ids:  # (a long prefix hit touches hundreds of blocks)
            if ref_cnt[b] == 0:
                ghosts[b] = ghosts.get(b, 0) + 1
                self._num_ghosts += 1
            ref_cnt[b] += 1

    def _take(self, n: int) -> list[int]:
        """The ``n`` least recently freed blocks, out of the queue (``n`` <= `num_free`)."""
        queue, head = self._queue, self._head
        out = queue[head:head + n]
        head += n
        if self._num_ghosts and not self.ghosts.keys().isdisjoint(out):  # (one C scan: most slices hold none)
            ghosts, live = self.ghosts, []
            while True:
                for b in out:
                    left = ghosts.get(b)
                    if left:  # an entry a prefix hit took back: skip it
                        self._num_ghosts -= 1
                        if left == 1:
                            del ghosts[b]
                        else:
                            ghosts[b] = left - 1
                    else:
                        live.append(b)
                if len(live) == n:
                    break
                out = queue[head:head + n - len(live)]
                head += n - len(live)
            out = live
        if head > self.COMPACT_AFTER and head * 2 > len(queue):  # drop the taken front (amortised O(1) a block)
            del queue[:head]
            head = 0
        self._head = head
        return out

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks, evicting the least recently freed cached ones; ``None`` if too few are free."""
        if n > len(self._queue) - self._head - self._num_ghosts:  # (`num_free`, inlined)
            return None
        out = self._take(n)  # the n least recently freed, in order
        block_hash, ref_cnt, cached, on_drop = self.block_hash, self.ref_cnt, self.cached, self.on_drop
        if not cached:
            # Nothing is findable, so no block here leaves the cache: a hash such a block still holds is
            # stale, and a stale hash is never read as a match (`is_findable`: the cache must point back).
            # Most replays cache nothing (`private_prefixes`): this skips two reads per block for them.
            for b in out:
                ref_cnt[b] = 1
            return out
        dropped: list[tuple[int, int]] = []
        for b in out:  # (one loop per block, no call: the simulator allocates millions of them)
            ref_cnt[b] = 1
            h = block_hash[b]
            if h is not None:
                block_hash[b] = None
                if cached.get(h) == b:
                    del cached[h]
                    if on_drop is not None:
                        dropped.append((b, h))
        if dropped:
            on_drop(dropped)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, in the given order (that order is the eviction order)."""
        ref_cnt = self.ref_cnt
        freed = []
        for b in block_ids:
            left = ref_cnt[b] - 1
            ref_cnt[b] = left
            if not left:
                freed.append(b)
            elif left < 0:
                ref_cnt[b] = 0
                self._queue += freed
                raise RuntimeError(f"KV pool: block {b} freed twice")
        self._queue += freed

    def is_findable(self, block_id: int) -> bool:
        """Whether a prefix lookup can return this block (a block with equal content may hold the hash)."""
        h = self.block_hash[block_id]
        return h is not None and self.cached.get(h) == block_id

    def uncache(self, block_id: int) -> None:
        """Forget a block's hash (its content is about to change)."""
        h = self.block_hash[block_id]
        if h is not None and self.cached.get(h) == block_id:
            del self.cached[h]
        self.block_hash[block_id] = None

    def cache(self, block_ids: Sequence[int], block_hashes: Sequence[int]) -> None:
        """Make full blocks findable by their hashes (a block with equal content already cached wins)."""
        block_hash, cached = self.block_hash, self.cached
        for b, h in zip(block_ids, block_hashes):  # (once per block of every sequence: locals, no calls)
            block_hash[b] = h
        if cached.keys().isdisjoint(block_hashes):  # the common case, in C: no hash here is cached yet
            cached.update(zip(block_hashes, block_ids))  # (a chain's hashes are distinct: as setdefault)
        else:
            for b, h in zip(block_ids, block_hashes):
                cached.setdefault(h, b)

    def reset_prefix_cache(self) -> None:
        self.cached.clear()
        self.block_hash = [None] * (self.num_blocks + 1)


def chain_hashes(token_ids: Sequence[int], block_size: int, prev: list[int]) -> list[int]:
    """Append to ``prev`` the hashes of the full blocks of ``token_ids`` (the tokens that follow the
    blocks ``prev`` hashes). Each hash covers its block's tokens and, through the parent hash, every token
    before it: equal hashes mean equal prefixes. (Python's int-tuple hash is deterministic across
    processes; a 64-bit collision is ~2^-64.)"""
    parent = prev[-1] if prev else 0
    tokens = iter(token_ids)
    append = prev.append
    # zip over one iterator, block_size times, cuts the block tuples in C (a trailing partial block is
    # left out): 1.6x faster than a slice and tuple() per block (a Mooncake prompt has 512 blocks)
    for block in zip(*[tokens] * block_size):
        parent = hash((parent, block))
        append(parent)
    return prev


def _prompt_hashes(prompt: Any, block_size: int, count: int | None = None) -> np.ndarray:
    """The hashes of a prompt's full blocks (its first ``count``), int64: from its structure where it offers
    them (a workload's `StreamPrompt`: no token read), else chained over its tokens."""
    from_structure = getattr(prompt, "block_hashes", None)
    hashes = from_structure(block_size, count) if from_structure is not None else None
    if hashes is None:
        full = len(prompt) // block_size if count is None else min(count, len(prompt) // block_size)
        part = prompt[:full * block_size]
        hashes = np.array(chain_hashes(part.tolist() if hasattr(part, "tolist") else [int(t) for t in part],
                                       block_size, []), dtype=np.int64)
    return hashes


class _PromptHashes:
    """The block hashes of prompts that are numpy arrays or a workload's `StreamPrompt`s (which compute them
    from their structure), kept while the prompt lives: a search replays the same requests at many rates and
    configs, and hashing a long prompt costs more than the rest of its admission. Keyed by the prompt's
    identity (a weak reference drops the entry with it) and the block size; stored as int64 arrays (a Python
    list of big ints takes 5x the memory)."""

    def __init__(self) -> None:
        self._hashes: dict[tuple[int, int], tuple[weakref.ref, np.ndarray]] = {}

    def get(self, prompt: Any, block_size: int) -> list[int]:
        """A new list of the hashes of the prompt's full blocks."""
        return self.array(prompt, block_size).tolist()

    def array(self, prompt: Any, block_size: int) -> np.ndarray:
        """The hashes of the prompt's full blocks (int64; the memoized array itself: do not change it)."""
        key = (id(prompt), block_size)
        found = self._hashes.get(key)
        if found is not None and found[0]() is prompt:
            return found[1]
        hashes = _prompt_hashes(prompt, block_size)
        if isinstance(prompt, np.ndarray) or hasattr(prompt, "block_hashes"):  # (a list takes no weak reference)
            self._hashes[key] = (weakref.ref(prompt, lambda _, key=key: self._hashes.pop(key, None)), hashes)
        return hashes


PROMPT_HASHES = _PromptHashes()


def private_prefixes(prompts: Sequence[tuple[str, Any]], block_size: int) -> dict[str, int]:
    """For a closed workload whose outputs never continue a prompt (the simulator's, whose output tokens come
    from a counter): sequence id -> the index of its first block that no other prompt has, for the sequences
    that have one among their prompt's full blocks. No other sequence can find that block or any after it: a
    chained hash covers every token before it, so equal hashes mean equal prefixes. ``prompts``: (sequence
    id, prompt) pairs."""
    depths = _PRIVATE_DEPTHS.get([prompt for _, prompt in prompts], block_size)
    return {seq_id: d for (seq_id, _), d in zip(prompts, depths) if d >= 0}


def _private_depths(prompts: list[Any], block_size: int) -> list[int]:
    """Per prompt, the number of its leading full blocks that another prompt also has, or -1 when that is all
    of them (or it has none: its first full block will hold outputs). Only the prompts whose first block
    another has are hashed in full (a trace's unique prompts cost one block's hash each)."""
    firsts = [int(_prompt_hashes(p, block_size, 1)[0]) if len(p) >= block_size else None for p in prompts]
    count = Counter(firsts)
    depths = [-1 if h is None or count[h] > 1 else 0 for h in firsts]
    shared = [i for i, h in enumerate(firsts) if h is not None and count[h] > 1]
    if not shared:
        return depths
    chains = [PROMPT_HASHES.array(prompts[i], block_size) for i in shared]
    lengths = np.fromiter(map(len, chains), dtype=np.int64, count=len(chains))
    starts = np.cumsum(lengths) - lengths
    flat = np.concatenate(chains)
    # block by block, among the prompts whose blocks so far all have a twin: a chained hash covers its prefix, so
    # block j's twin is another prompt's block j, whose earlier blocks are twins too. (Sorting every block's hash
    # at once had taken 3x the memoized hashes' memory at its peak: 85 MB on Mooncake's 7,980 prompts.)
    leading = np.full(len(chains), -1, dtype=np.int64)  # -1: every block has a twin
    alive = np.arange(len(chains))
    j = 0
    while len(alive):
        alive = alive[lengths[alive] > j]
        _, inverse, counts = np.unique(flat[starts[alive] + j], return_inverse=True, return_counts=True)
        twinned = counts[inverse] > 1
        leading[alive[~twinned]] = j
        alive = alive[twinned]
        j += 1
    for i, d in zip(shared, leading.tolist()):
        depths[i] = d
    return depths


class _PrivateDepths:
    """`_private_depths` of the last list of prompts asked for, kept with the prompts (so that their ids stay
    theirs): a search replays the same prompts at many rates and configs."""

    def __init__(self) -> None:
        self._last: tuple[tuple[int, ...], list[Any], list[int]] | None = None

    def get(self, prompts: list[Any], block_size: int) -> list[int]:
        key = (block_size, *map(id, prompts))
        if self._last is None or self._last[0] != key:
            self._last = (key, prompts, _private_depths(prompts, block_size))
        return self._last[2]


_PRIVATE_DEPTHS = _PrivateDepths()


class KVCacheManager:
    """Block tables of the sequences on top of a `BlockPool` (check-then-act: `allocate_slots` returns
    ``None`` when the pool cannot serve the request and the caller decides whom to preempt)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_reuse: bool,
                 tiers: TierManager | None = None) -> None:
        self.tiers = tiers  # None: no host or disk tier, a reused cached block's KV is dropped
        self.pool = BlockPool(num_blocks, tiers.demote_all if tiers is not None else None)
        self.block_size = block_size
        self.enable_prefix_reuse = enable_prefix_reuse
        self.tables: dict[str, list[int]] = {}
        self.hashes: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.num_evicted: dict[str, int] = {}  # computed tokens whose KV was evicted (compacted sequences only)
        self.swapped_evicted: dict[str, int] = {}  # ... and of compacted sequences while swapped to the host
        # sequence id -> block index from which no other sequence can find its blocks (`private_prefixes`):
        # those are cached only when it is preempted (it looks them up itself when it comes back)
        self.private_from: dict[str, int] = {}
        self.peak_used_blocks = 0
        self.evicted_tokens = 0  # KV slots that eviction compactions dropped, over every sequence (a metric)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        return self.tables.get(seq_id, [])

    def num_kv_tokens(self, seq: HasTokens) -> int:
        """KV slots the sequence fills: its computed tokens less those evicted."""
        return seq.num_computed_tokens - self.num_evicted.get(seq.seq_id, 0)

    def _hashes(self, seq: HasTokens) -> list[int]:
        hashes = self.hashes.get(seq.seq_id)
        if hashes is None:
            prompt = getattr(seq, "prompt", None)
            hashes = self.hashes[seq.seq_id] = [] if prompt is None else PROMPT_HASHES.get(prompt, self.block_size)
        num_full = seq.num_tokens // self.block_size
        if len(hashes) < num_full:
            chain_hashes(seq.tokens(len(hashes) * self.block_size, num_full * self.block_size), self.block_size, hashes)
        return hashes

    def get_computed_blocks(self, seq: HasTokens) -> list[int]:
        """Cached blocks holding this new sequence's leading full blocks. At least one token is left to
        compute, so that the step that follows produces the logits to sample from."""
        if not self.enable_prefix_reuse:
            return []
        if seq.seq_id not in self.hashes and self.private_from.get(seq.seq_id) == 0:
            return []  # never cached (nor hashed) and no other sequence's blocks can be its prefix
        return self._device_hits(self._hashes(seq), (seq.num_tokens - 1) // self.block_size)

    def _device_hits(self, hashes: list[int], max_hit: int) -> list[int]:
        """The device blocks cached under ``hashes[:max_hit]``, up to the first hash that has none."""
        lookup = self.pool.cached.get
        hits: list[int] = []
        # looked up a slice at a time without a Python loop per block (a waiting sequence is looked up at
        # every step); the first miss ends the hits
        for start in range(0, max_hit, LOOKUP_SLICE):
            found = list(map(lookup, hashes[start:min(start + LOOKUP_SLICE, max_hit)]))
            if None in found:
                hits += found[:found.index(None)]
                break
            hits += found
        return hits

    def allocate_slots(self, seq: HasTokens, num_new_tokens: int,
                       computed_blocks: Sequence[int] = ()) -> list[int] | None:
        """Room for ``num_new_tokens`` more tokens after the sequence's KV slots plus the prefix hits in
        ``computed_blocks``. Returns the new blocks, or ``None`` (nothing changed) if they don't fit."""
        seq_id = seq.seq_id
        table = self.tables.get(seq_id, [])
        num_tokens = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        if seq_id in self.num_evicted:
            num_tokens -= self.num_evicted[seq_id]  # (`num_kv_tokens`, inlined: called per sequence per step)
        if not computed_blocks and num_tokens <= len(table) * self.block_size:
            return []  # the common decode step: room left in the last block
        # (`blocks_for`, inlined: a call saved per chunk and per decode block)
        num_new_blocks = max(0, -(-num_tokens // self.block_size) - len(table) - len(computed_blocks))
        pool = self.pool
        if num_new_blocks + (pool.num_free_among(computed_blocks) if computed_blocks else 0) > pool.num_free():
            return None
        if computed_blocks:  # (most allocations have no prefix hit: two calls saved per chunk and block)
            pool.touch(computed_blocks)
        new_blocks = pool.allocate(num_new_blocks)
        if new_blocks is None:  # unreachable after the check above; kept as a hard invariant
            raise RuntimeError("KV pool: allocation failed after a successful capacity check")
        table = self.tables.setdefault(seq_id, table)
        if computed_blocks:
            table.extend(computed_blocks)
        table.extend(new_blocks)
        self.num_cached_blocks.setdefault(seq_id, len(computed_blocks))
        used = pool.num_used()
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used
        return new_blocks

    def cache_full_blocks(self, seq: HasTokens, private: bool = False) -> None:
        """Register the sequence's blocks that are now full of computed tokens in the prefix cache; past
        `private_from` only when ``private`` (it is being preempted)."""
        num_full = seq.num_computed_tokens // self.block_size
        if not private and seq.seq_id in self.private_from:
            num_full = min(num_full, self.private_from[seq.seq_id])
        done = self.num_cached_blocks.get(seq.seq_id, 0)
        if num_full <= done or not self.enable_prefix_reuse or seq.seq_id in self.num_evicted:
            return  # (a compacted sequence's blocks hold no prefix's KV)
        self._register(self.tables[seq.seq_id][done:num_full], self._hashes(seq)[done:num_full])
        self.num_cached_blocks[seq.seq_id] = num_full

    def _register(self, blocks: Sequence[int], block_hashes: Sequence[int]) -> None:
        """Make full blocks findable in the prefix cache (and copy them down under write-through)."""
        self.pool.cache(blocks, block_hashes)
        if self.tiers is not None:
            self.tiers.write_through_copies(blocks, block_hashes)

    def free(self, seq: HasTokens, finished: bool = False) -> None:
        """Release a finished or preempted sequence's blocks, tail first (a preempted one's full blocks cached
        first: it may find them when it comes back)."""
        if not finished and seq.seq_id in self.private_from:
            self.cache_full_blocks(seq, private=True)
        table = self.tables.pop(seq.seq_id, [])
        self.pool.free(table[::-1])
        self.num_cached_blocks.pop(seq.seq_id, None)
        self.num_evicted.pop(seq.seq_id, None)

    # ---- lower tiers (see `tiers`) ------------------------------------------------------------------
    def promote_prefix(self, seq: HasTokens, max_blocks: int | None = None, prefetch: bool = False) -> int:
        """Bring the lower-tier blocks that continue the sequence's prefix hits up to the device, as free
        cached blocks that `get_computed_blocks` then finds (at most ``max_blocks``, and no more than the
        free blocks; a chain stops at the first miss). Returns the blocks promoted."""
        tiers = self.tiers
        if tiers is None or not tiers.levels or not self.enable_prefix_reuse:
            return 0
        device_hits, lower = self._prefix_chain(seq)
        self.pool.touch(device_hits)  # keep this chain's device blocks from being reused by the promotion
        if not prefetch:
            self._count_prefetch_hits(device_hits)
        limit = min(self.pool.num_free(), len(lower) if max_blocks is None else max_blocks)
        hashes, found = [], []
        for h in lower[:limit]:
            where = tiers.pin(h)
            if where is None:
                break  # a corrupt disk block: the rest of the chain is recomputed
            hashes.append(h)
            found.append(where)
        new_blocks = (self.pool.allocate(len(found)) or []) if found else []
        if new_blocks:  # (a chain's hashes are distinct and none is on the device: cached as one run)
            tiers.promote_all(found, new_blocks)
            self.pool.cache(new_blocks, hashes)
            if prefetch:
                tiers.prefetched.update(hashes)
        self.pool.free(device_hits[::-1] + new_blocks[::-1])
        if prefetch:
            tiers.stats.prefetched += len(new_blocks)
        else:
            tiers.stats.prefetch_misses += len(new_blocks)
        return len(new_blocks)

    def _prefix_chain(self, seq: HasTokens, max_lower: int | None = None) -> tuple[list[int], list[int]]:
        """(device blocks, lower-tier hashes) of the sequence's leading cached blocks, up to the first
        lower-tier block missing from the device and after it, those found anywhere below or on it (up to the
        ``max_lower``-th lower-tier one)."""
        max_hit = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes(seq)
        device = self._device_hits(hashes, max_hit)  # (its leading run, as `get_computed_blocks` finds it)
        lower: list[int] = []
        on_device, below = self.pool.cached.get, self.tiers.lookup
        for h in hashes[len(device):max_hit]:
            b = on_device(h)
            if b is not None:
                device.append(b)
            elif below(h) is not None:
                lower.append(h)
                if len(lower) == max_lower:
                    break
            else:
                break
        return device, lower

    def lower_prefix_blocks(self, seq: HasTokens, at_most: int | None = None) -> int:
        """How many of the sequence's leading cached blocks sit in a lower tier (counted up to ``at_most``)."""
        if self.tiers is None or not self.tiers.levels or not self.enable_prefix_reuse:
            return 0
        return len(self._prefix_chain(seq, at_most)[1])

    def _count_prefetch_hits(self, device_hits: Sequence[int]) -> None:
        prefetched = self.tiers.prefetched
        for b in device_hits:
            h = self.pool.block_hash[b]
            if h in prefetched:
                prefetched.discard(h)
                self.tiers.stats.prefetch_hits += 1

    def is_swapped(self, seq: HasTokens) -> bool:
        return self.tiers is not None and seq.seq_id in self.tiers.swapped

    def swap_out(self, seq: HasTokens) -> bool:
        """Preemption by swap: copy the sequence's KV blocks to the host and free them on the device;
        False (nothing changed) when the tiers cannot take them: the caller recomputes. A compacted
        sequence keeps its count of evicted tokens while swapped (its KV slots are its kept tokens)."""
        if self.tiers is None:
            return False
        table = self.tables.get(seq.seq_id, [])
        if not self.tiers.swap_out(seq.seq_id, table[:self.blocks_for(self.num_kv_tokens(seq))]):
            return False
        evicted = self.num_evicted.get(seq.seq_id)
        self.free(seq)
        if evicted is not None:
            self.swapped_evicted[seq.seq_id] = evicted
        return True

    def can_swap_in(self, seq: HasTokens, num_new_tokens: int) -> bool:
        kv_tokens = seq.num_computed_tokens - self.swapped_evicted.get(seq.seq_id, 0)
        return self.blocks_for(kv_tokens + num_new_tokens) <= self.pool.num_free()

    def swap_in(self, seq: HasTokens) -> None:
        """Bring a swapped sequence's blocks back into fresh device blocks (check `can_swap_in` first);
        its full blocks are cached again after the step (unless it was compacted: see `cache_full_blocks`)."""
        n = len(self.tiers.swapped[seq.seq_id])
        blocks = self.pool.allocate(n)
        if blocks is None:
            raise RuntimeError(f"KV pool: swap-in of {seq.seq_id} needs {n} blocks, {self.pool.num_free()} free")
        self.tiers.swap_in(seq.seq_id, blocks)
        self.tables[seq.seq_id] = blocks
        self.num_cached_blocks[seq.seq_id] = 0
        if seq.seq_id in self.swapped_evicted:
            self.num_evicted[seq.seq_id] = self.swapped_evicted.pop(seq.seq_id)
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used())

    def take_transfers(self, since: int = 0) -> list:
        return self.tiers.take_transfers(since) if self.tiers is not None else []

    # ---- eviction compactions ---------------------------------------------------------------------
    def prepare_compaction(self, seq: HasTokens, num_kv_tokens: int) -> list[tuple[int, int]] | None:
        """Make the blocks that will hold the sequence's first ``num_kv_tokens`` slots safe to rewrite in
        place. A block other sequences share is replaced by a fresh copy; so is a block the prefix cache
        can find (the cache keeps its prefix) while free blocks last, after which such blocks just leave
        the cache. Returns the ``(src, dst)`` block copies the executor makes before the step's forward
        pass (the table already names ``dst``), or ``None`` (nothing changed) if the shared blocks need
        more free blocks than there are."""
        table = self.tables[seq.seq_id]
        pool = self.pool
        kept = range(self.blocks_for(num_kv_tokens))
        to_copy = [i for i in kept if pool.ref_cnt[table[i]] > 1]
        room = pool.num_free() - len(to_copy)
        if room < 0:
            return None
        for i in kept:
            b = table[i]
            if pool.ref_cnt[b] > 1 or pool.block_hash[b] is None:
                continue
            if room > 0 and pool.is_findable(b):
                to_copy.append(i)
                room -= 1
            else:
                pool.uncache(b)
        copies = list(zip([table[i] for i in to_copy], pool.allocate(len(to_copy))))
        self.peak_used_blocks = max(self.peak_used_blocks, pool.num_used())
        for i, (_, dst) in zip(to_copy, copies):
            table[i] = dst
        pool.free([src for src, _ in reversed(copies)])  # this sequence's references to the originals
        return copies

    def prepare_prefix_copies(self, seq: HasTokens, num_computed: int, num_kv_tokens: int) -> list[tuple[int, int]]:
        """Before a sequence's first compaction, planned for after a step that completes full blocks not yet
        cached (the last chunk of its prompt): fresh blocks into which the executor copies those of them the
        compaction rewrites (the first ``blocks_for(num_kv_tokens)``), after the forward pass has written
        them and before the compaction does, so that `truncate` can cache the prompt's prefix that the
        compaction overwrites. ``num_computed``: the sequence's computed tokens after the step. In prefix
        order while free blocks last (a prefix chain ends at its first gap). Returns the ``(src, dst)``
        pairs; none without prefix reuse or after a first compaction (later KV depends on what it kept)."""
        if not self.enable_prefix_reuse or seq.seq_id in self.num_evicted:
            return []
        done = self.num_cached_blocks.get(seq.seq_id, 0)
        end = min(num_computed // self.block_size, self.blocks_for(num_kv_tokens))
        n = min(end - done, self.pool.num_free())
        if n <= 0:
            return []
        copies = list(zip(self.tables[seq.seq_id][done:done + n], self.pool.allocate(n)))
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used())
        return copies

    def truncate(self, seq: HasTokens, num_kv_tokens: int, prefix_copies: Sequence[tuple[int, int]] = ()) -> None:
        """After a compaction (with ``seq.num_computed_tokens`` counting the step's tokens): the sequence
        keeps its first ``num_kv_tokens`` slots; the blocks past them go back to the pool, tail first.
        At a sequence's first compaction (with prefix reuse) the prompt's prefix stays cached: the uncached
        full blocks the compaction rewrote, as ``prefix_copies`` (`prepare_prefix_copies`, made by the
        executor) hold them from before it, and its full blocks past the kept slots, which it did not touch,
        when the chain reaches them. All go back to the pool as free cached blocks, the tail first."""
        table = self.tables[seq.seq_id]
        kept_blocks = self.blocks_for(num_kv_tokens)
        if self.enable_prefix_reuse and seq.seq_id not in self.num_evicted:  # its first compaction
            done = self.num_cached_blocks.get(seq.seq_id, 0)
            blocks = [dst for _, dst in prefix_copies]
            if done + len(blocks) >= kept_blocks:  # the chain reaches the blocks past the kept slots
                blocks += table[max(done, kept_blocks):seq.num_computed_tokens // self.block_size]
            self._register(blocks, self._hashes(seq)[done:done + len(blocks)])
            self.num_cached_blocks[seq.seq_id] = done + len(blocks)
        tail = table[kept_blocks:]
        del table[len(table) - len(tail):]
        self.pool.free(tail[::-1])
        self.pool.free([dst for _, dst in reversed(prefix_copies)])
        evicted = seq.num_computed_tokens - num_kv_tokens
        self.evicted_tokens += evicted - self.num_evicted.get(seq.seq_id, 0)
        self.num_evicted[seq.seq_id] = evicted

    def forget(self, seq: HasTokens) -> None:
        """Drop a finished sequence's cached hashes (kept across preemption, dropped at the end)."""
        self.hashes.pop(seq.seq_id, None)
        self.private_from.pop(seq.seq_id, None)
