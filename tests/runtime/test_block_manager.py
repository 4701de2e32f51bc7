"""Block accounting: exact block ids, eviction order, prefix reuse, and a property test."""
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings, strategies as st

import numpy as np

from skistune.runtime.block_manager import BlockPool, KVCacheManager, TokenList, chain_hashes


@dataclass
class Seq(TokenList):
    seq_id: str
    token_ids: list = field(default_factory=list)
    num_computed_tokens: int = 0


def compute(kv, seq, n, hits=()):
    """Allocate for n new tokens after the hits, then mark them computed (as one engine step does)."""
    blocks = kv.allocate_slots(seq, n, hits)
    if blocks is not None:
        seq.num_computed_tokens += len(hits) * kv.block_size + n
        kv.cache_full_blocks(seq)
    return blocks


def test_pool_allocates_lowest_ids_first_and_reuses_least_recently_freed():
    pool = BlockPool(4)
    assert pool.allocate(2) == [1, 2]
    assert pool.allocate(3) is None  # only 2 free: nothing changes
    assert pool.num_free() == 2
    pool.free([2, 1])
    assert pool.allocate(4) == [3, 4, 2, 1]
    assert pool.num_free() == 0


def test_chain_hashes_hash_each_full_block_with_its_parent():
    tokens = list(range(3, 60))  # 3 full blocks of 16 and 9 tokens over
    expected, parent = [], 0
    for start in range(0, 48, 16):
        parent = hash((parent, tuple(tokens[start:start + 16])))
        expected.append(parent)
    assert chain_hashes(tokens, 16, []) == expected
    assert chain_hashes(tokens[16:], 16, expected[:1]) == expected  # continued from a parent
    assert chain_hashes(np.array(tokens, dtype=np.int32).tolist(), 16, []) == expected
    assert chain_hashes(tokens[:15], 16, []) == [] and chain_hashes(tokens[48:], 16, expected) == expected


def test_allocation_drops_the_hashes_of_reused_cached_blocks():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.cache(blocks, [11, 12, 13])
    pool.free(blocks[::-1])  # free queue: 3, 2, 1 (all still findable)
    assert pool.allocate(2) == [3, 2]
    assert pool.cached == {11: 1} and pool.block_hash[2] is None and pool.is_findable(1)


def test_sequence_blocks_grow_by_block_size_and_free_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_reuse=False)
    s = Seq("a", list(range(10)))
    assert compute(kv, s, 10) == [1, 2, 3]
    s.token_ids.append(99)
    assert compute(kv, s, 1) == []  # 11 tokens still fit in 3 blocks
    s.token_ids.append(98)
    assert compute(kv, s, 1) == []  # 12 tokens: block 3 is now full
    s.token_ids.append(97)
    assert compute(kv, s, 1) == [4]
    kv.free(s)
    assert kv.pool.free_blocks()[-4:] == [4, 3, 2, 1]  # tail freed first, evicted first
    assert kv.pool.num_free() == 8


def test_prefix_hits_share_full_blocks_and_leave_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_reuse=True)
    a = Seq("a", list(range(12)))
    assert compute(kv, a, 12) == [1, 2, 3]
    b = Seq("b", list(range(12)))  # identical prompt: 2 full blocks hit, the last block recomputed
    hits = kv.get_computed_blocks(b)
    assert hits == [1, 2]
    assert compute(kv, b, 4, hits) == [4]
    assert kv.block_table("b") == [1, 2, 4]
    assert kv.pool.ref_cnt[1] == 2 and kv.pool.ref_cnt[4] == 1
    c = Seq("c", list(range(8)) + [50, 51, 52, 53])  # diverges in block 3
    assert kv.get_computed_blocks(c) == [1, 2]


def test_freed_blocks_stay_cached_until_reused():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_reuse=True)
    a = Seq("a", list(range(9)))
    compute(kv, a, 9)
    kv.free(a)
    b = Seq("b", list(range(9)))
    assert kv.get_computed_blocks(b) == [1, 2]  # free but cached
    # taking the hits uses free capacity: 2 cached + 1 new block; block 4 (never used) goes first
    assert compute(kv, b, 1, kv.get_computed_blocks(b)) == [4]
    kv.free(b)
    # a sequence that needs every block evicts the cached ones, least recently freed first
    c = Seq("c", [7] * 16)
    assert compute(kv, c, 16) == [3, 4, 2, 1]
    assert kv.get_computed_blocks(Seq("d", list(range(9)))) == []


def test_a_partly_computed_block_is_never_cached():
    """Guards against registering the block that holds a chunk's last few computed tokens in the prefix cache,
    where another sequence would take its uncomputed slots as a hit."""
    kv = KVCacheManager(num_blocks=8, block_size=16, enable_prefix_reuse=True)
    a = Seq("a", list(range(32)))  # two blocks' worth of prompt, computed in chunks of 20 and 12
    assert compute(kv, a, 20) == [1, 2]
    assert kv.num_cached_blocks["a"] == 1 and list(kv.pool.cached.values()) == [1]
    assert kv.get_computed_blocks(Seq("b", list(range(33)))) == [1]  # block 2 holds 4 of its 16 tokens
    compute(kv, a, 12)
    assert kv.num_cached_blocks["a"] == 2 and kv.get_computed_blocks(Seq("c", list(range(33)))) == [1, 2]


def test_prefix_reuse_off_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_reuse=False)
    compute(kv, Seq("a", list(range(12))), 12)
    assert kv.get_computed_blocks(Seq("b", list(range(12)))) == []


ops = st.lists(st.tuples(st.sampled_from(["new", "append", "free", "fork"]), st.integers(0, 7),
                         st.integers(1, 40)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 12), prefix=st.booleans())
def test_random_operations_never_leak_double_free_or_overflow(ops, num_blocks, prefix):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4, enable_prefix_reuse=prefix)
    live: dict[str, Seq] = {}
    counter = 0
    for op, pick, n in ops:
        names = sorted(live)
        if op == "new" or not names:
            counter += 1
            s = Seq(f"s{counter}", [pick % 3] * n)  # few distinct contents: many prefix hits
            hits = kv.get_computed_blocks(s)
            if compute(kv, s, n - len(hits) * 4, hits) is not None:
                live[s.seq_id] = s
        elif op == "append":
            s = live[names[pick % len(names)]]
            s.token_ids.extend([pick] * n)
            compute(kv, s, n)
        elif op == "fork":  # a new sequence with the same tokens as a live one (shares its full blocks)
            src = live[names[pick % len(names)]]
            counter += 1
            s = Seq(f"s{counter}", list(src.token_ids) + [pick])
            hits = kv.get_computed_blocks(s)
            if compute(kv, s, len(s.token_ids) - len(hits) * 4, hits) is not None:
                live[s.seq_id] = s
        else:
            kv.free(live.pop(names[pick % len(names)]))
        # invariants after every operation
        pool = kv.pool
        assert pool.num_used() <= num_blocks
        refs = [0] * (num_blocks + 1)
        for s in live.values():
            for b in kv.block_table(s.seq_id):
                refs[b] += 1
            assert len(kv.block_table(s.seq_id)) == kv.blocks_for(s.num_computed_tokens)
        assert refs == pool.ref_cnt
        assert set(pool.free_blocks()) == {b for b in range(1, num_blocks + 1) if refs[b] == 0}
    for s in list(live.values()):
        kv.free(s)
    assert kv.pool.num_free() == num_blocks


class ReferencePool:
    """The free queue as an ordered dict (least recently freed first), one operation per block: what
    `BlockPool`'s sliced list with ghosts must reproduce exactly."""

    def __init__(self, n):
        from collections import OrderedDict
        self.ref = [0] * (n + 1)
        self.queue = OrderedDict((b, None) for b in range(1, n + 1))

    def allocate(self, n):
        if n > len(self.queue):
            return None
        out = list(self.queue)[:n]
        for b in out:
            del self.queue[b]
            self.ref[b] = 1
        return out

    def touch(self, blocks):
        for b in blocks:
            if self.ref[b] == 0:
                del self.queue[b]
            self.ref[b] += 1

    def free(self, blocks):
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.queue[b] = None


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(1, 24))
def test_pool_takes_blocks_in_the_reference_queue_order_through_ghosts_and_compaction(seed, num_blocks):
    # Prefix hits on free blocks leave ghosts in the queue, and the taken front is dropped past 4,096
    # entries: neither may change which blocks an allocation gets, nor how many are free.
    rng = np.random.default_rng(seed)
    pool, ref = BlockPool(num_blocks), ReferencePool(num_blocks)
    pool.COMPACT_AFTER = 8  # (4,096 in use: here the front is dropped every few allocations)
    held: list[int] = []  # one entry per reference a "sequence" holds
    for _ in range(1500):
        op = rng.integers(4)
        if op == 0:
            n = int(rng.integers(0, num_blocks + 2))
            got = pool.allocate(n)
            assert got == ref.allocate(n)
            held += got or []
        elif op == 1 and held:  # free some references, in a random order
            picks = rng.permutation(len(held))[:int(rng.integers(1, len(held) + 1))]
            blocks = [held[i] for i in picks]
            for i in sorted(picks, reverse=True):
                del held[i]
            pool.free(blocks)
            ref.free(blocks)
        elif op == 2:  # a prefix hit: take references on some blocks, free or not
            blocks = [int(b) for b in rng.choice(np.arange(1, num_blocks + 1), size=int(rng.integers(1, 4)))]
            blocks = list(dict.fromkeys(blocks))
            pool.touch(blocks)
            ref.touch(blocks)
            held += blocks
        else:
            assert pool.free_blocks() == list(ref.queue)
        assert pool.num_free() == len(ref.queue) and pool.ref_cnt == ref.ref
    assert pool.free_blocks() == list(ref.queue)


def test_pool_refuses_a_double_free_and_keeps_its_count():
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.free(a)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([a[0]])
    assert pool.num_free() == 3 and pool.ref_cnt == [0, 0, 0, 0]
