"""Paged KV-cache accounting: a pool of fixed-size blocks, block tables per sequence, reference counts
and prefix reuse by chained block hashes (vLLM v1 semantics). Pure Python, no torch: the simulator
drives this same code.

Block 0 is the null block: never allocated, it pads block tables (the KV store keeps it zeroed).
A freed block keeps its hash and stays findable until it is reused ("free but cached"); the free
queue is least-recently-freed first, and a sequence frees its blocks tail first so that shared
prefix blocks outlive the tails that nobody else has.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, Sequence

NULL_BLOCK = 0


class HasTokens(Protocol):
    """What the block manager needs of a sequence."""

    seq_id: str
    token_ids: list[int]
    num_computed_tokens: int


class BlockPool:
    """Blocks ``1..num_blocks``, their reference counts and the prefix-cache index."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"KV pool: needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * (num_blocks + 1)
        self.block_hash: list[int | None] = [None] * (num_blocks + 1)
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks + 1))
        self.cached: dict[int, int] = {}  # block hash -> block id

    def num_free(self) -> int:
        return len(self.free_queue)

    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def num_free_among(self, block_ids: Sequence[int]) -> int:
        """How many of these (cached) blocks sit in the free queue: touching them uses free capacity."""
        return sum(1 for b in block_ids if self.ref_cnt[b] == 0)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (prefix hits), pulling free ones out of the free queue."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks, evicting the least recently freed cached ones; ``None`` if too few are free."""
        if n > len(self.free_queue):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, in the given order (that order is the eviction order)."""
        for b in block_ids:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] < 0:
                raise RuntimeError(f"KV pool: block {b} freed twice")
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None

    def cache(self, block_id: int, block_hash: int) -> None:
        """Make a full block findable by its hash (a block with equal content already cached wins)."""
        self.block_hash[block_id] = block_hash
        self.cached.setdefault(block_hash, block_id)

    def reset_prefix_cache(self) -> None:
        self.cached.clear()
        self.block_hash = [None] * (self.num_blocks + 1)


def chain_hashes(token_ids: Sequence[int], block_size: int, start_block: int, prev: list[int]) -> list[int]:
    """Append the hashes of full blocks from ``start_block`` on to ``prev``. Each hash covers its block's
    tokens and, through the parent hash, every token before it: equal hashes mean equal prefixes.
    (Python's int-tuple hash is deterministic across processes; a 64-bit collision is ~2^-64.)"""
    parent = prev[-1] if prev else 0
    for i in range(start_block, len(token_ids) // block_size):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        prev.append(parent)
    return prev


class KVCacheManager:
    """Block tables of the sequences on top of a `BlockPool` (check-then-act: `allocate_slots` returns
    ``None`` when the pool cannot serve the request and the caller decides whom to preempt)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_reuse: bool) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_reuse = enable_prefix_reuse
        self.tables: dict[str, list[int]] = {}
        self.hashes: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.peak_used_blocks = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: str) -> list[int]:
        return self.tables.get(seq_id, [])

    def _hashes(self, seq: HasTokens) -> list[int]:
        hashes = self.hashes.setdefault(seq.seq_id, [])
        if len(hashes) < len(seq.token_ids) // self.block_size:
            chain_hashes(seq.token_ids, self.block_size, len(hashes), hashes)
        return hashes

    def get_computed_blocks(self, seq: HasTokens) -> list[int]:
        """Cached blocks holding this new sequence's leading full blocks. At least one token is left to
        compute, so that the step that follows produces the logits to sample from."""
        if not self.enable_prefix_reuse:
            return []
        max_hit = (len(seq.token_ids) - 1) // self.block_size
        hits = []
        for h in self._hashes(seq)[:max_hit]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def allocate_slots(self, seq: HasTokens, num_new_tokens: int,
                       computed_blocks: Sequence[int] = ()) -> list[int] | None:
        """Room for ``num_new_tokens`` more tokens after ``seq.num_computed_tokens`` plus the prefix hits
        in ``computed_blocks``. Returns the new blocks, or ``None`` (nothing changed) if they don't fit."""
        table = self.tables.get(seq.seq_id, [])
        num_tokens = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        if not computed_blocks and num_tokens <= len(table) * self.block_size:
            return []  # the common decode step: room left in the last block
        num_new_blocks = max(0, self.blocks_for(num_tokens) - len(table) - len(computed_blocks))
        if num_new_blocks + self.pool.num_free_among(computed_blocks) > self.pool.num_free():
            return None
        self.pool.touch(computed_blocks)
        new_blocks = self.pool.allocate(num_new_blocks)
        if new_blocks is None:  # unreachable after the check above; kept as a hard invariant
            raise RuntimeError("KV pool: allocation failed after a successful capacity check")
        table = self.tables.setdefault(seq.seq_id, table)
        table.extend(computed_blocks)
        table.extend(new_blocks)
        self.num_cached_blocks.setdefault(seq.seq_id, len(computed_blocks))
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used())
        return new_blocks

    def cache_full_blocks(self, seq: HasTokens) -> None:
        """Register the sequence's blocks that are now full of computed tokens in the prefix cache."""
        num_full = seq.num_computed_tokens // self.block_size
        done = self.num_cached_blocks.get(seq.seq_id, 0)
        if num_full <= done or not self.enable_prefix_reuse:
            return
        hashes = self._hashes(seq)
        table = self.tables[seq.seq_id]
        for i in range(done, num_full):
            self.pool.cache(table[i], hashes[i])
        self.num_cached_blocks[seq.seq_id] = num_full

    def free(self, seq: HasTokens) -> None:
        """Release a finished or preempted sequence's blocks, tail first."""
        table = self.tables.pop(seq.seq_id, [])
        self.pool.free(table[::-1])
        self.num_cached_blocks.pop(seq.seq_id, None)

    def forget(self, seq: HasTokens) -> None:
        """Drop a finished sequence's cached hashes (kept across preemption, dropped at the end)."""
        self.hashes.pop(seq.seq_id, None)
