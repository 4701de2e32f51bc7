"""KV tiers: exact block and slot moves of the torch-free accounting, then the runtime's real copies
(swap and offload preserve the KV bit for bit, a corrupt disk block is recomputed, never used)."""
import os
from dataclasses import dataclass

import pytest

from skistune.runtime.block_manager import KVCacheManager, TokenList
from skistune.runtime.tiers import DEVICE, DISK, HOST, TierManager


@dataclass
class Seq(TokenList):
    seq_id: str
    token_ids: list[int]
    num_computed_tokens: int = 0


def moves(kv):
    return [(t.src_tier, t.dst_tier, t.src_blocks, t.dst_blocks) for t in kv.take_transfers()]


def run_seq(kv, seq):
    """Allocate, compute and cache all of a sequence's tokens, then free it."""
    kv.promote_prefix(seq)
    hits = kv.get_computed_blocks(seq)
    assert kv.allocate_slots(seq, len(seq.token_ids) - len(hits) * kv.block_size, hits) is not None
    seq.num_computed_tokens = len(seq.token_ids)
    kv.cache_full_blocks(seq)
    kv.free(seq)
    return hits


def new_kv(num_blocks=4, host=2, disk=1, **kw):
    return KVCacheManager(num_blocks, 2, True, TierManager(host, disk, **kw))


def test_reused_cached_blocks_move_down_a_tier_in_free_order():
    kv = new_kv()
    run_seq(kv, Seq("a", [1, 2, 3, 4]))  # blocks 1, 2; freed tail first: free queue 3, 4, 2, 1
    assert moves(kv) == []
    run_seq(kv, Seq("b", [9, 8, 7, 6, 5, 4, 3]))  # 4 blocks: 3, 4, then 2 and 1 are reused
    assert moves(kv) == [(DEVICE, HOST, [2, 1], [0, 1])]
    assert list(kv.tiers.host.cached.values()) == [0, 1]
    # b freed tail first: free queue 1 (partial, uncached), 2, 4, 3. c reuses them all: each cached one
    # goes to the host after the host's least recently used block went to disk (which drops its own)
    run_seq(kv, Seq("c", [11, 12, 13, 14, 15, 16, 17, 18]))
    assert moves(kv) == [(HOST, DISK, [0], [0]), (DEVICE, HOST, [2], [0]), (HOST, DISK, [1], [0]),
                         (DEVICE, HOST, [4], [1]), (HOST, DISK, [0], [0]), (DEVICE, HOST, [3], [0])]
    assert kv.tiers.host.peak_used == 2 and kv.tiers.disk.peak_used == 1


def test_prefix_hit_in_a_lower_tier_is_promoted():
    kv = new_kv(num_blocks=4, host=4, disk=0)
    a = Seq("a", [1, 2, 3, 4, 5])
    run_seq(kv, a)
    run_seq(kv, Seq("b", [9, 8, 7, 6, 5, 4, 3, 2]))  # pushes a's two full blocks (2, 1) to the host
    assert moves(kv) == [(DEVICE, HOST, [2, 1], [0, 1])]
    again = Seq("a2", [1, 2, 3, 4, 5])
    hits = run_seq(kv, again)
    assert len(hits) == 2 and kv.tiers.stats.promotions == 2
    # the promotion takes free blocks 1 and 2 (b's: they go down first), then copies a's blocks up (slot
    # 1 held a's first block); a2's new block 3 pushes b's block down into the slot just freed
    assert moves(kv) == [(DEVICE, HOST, [1, 2], [2, 3]), (HOST, DEVICE, [1, 0], [1, 2]), (DEVICE, HOST, [3], [1])]
    assert len(kv.tiers.host.cached) == 3
    assert kv.tiers.stats.prefetch_misses == 2


def test_lower_tier_prefix_blocks_are_counted_up_to_what_is_asked():
    kv = new_kv(num_blocks=4, host=4, disk=0)
    run_seq(kv, Seq("a", [1, 2, 3, 4, 5]))
    run_seq(kv, Seq("b", [9, 8, 7, 6, 5, 4, 3, 2]))  # pushes a's two full blocks to the host
    again = Seq("a2", [1, 2, 3, 4, 5])
    assert kv.lower_prefix_blocks(again) == 2 and kv.lower_prefix_blocks(again, at_most=1) == 1
    assert kv.lower_prefix_blocks(Seq("c", [7, 7, 7, 7, 7]), at_most=1) == 0

def test_write_through_copies_full_blocks_once_and_demotion_is_free():
    kv = new_kv(num_blocks=4, host=4, disk=0, write_through=True)
    run_seq(kv, Seq("a", [1, 2, 3, 4, 5]))
    assert moves(kv) == [(DEVICE, HOST, [1, 2], [0, 1])]
    run_seq(kv, Seq("b", [9, 8, 7, 6, 5, 4, 3]))  # reuses 2 and 1: already on the host, nothing moves
    # b reuses 4, 3, 2 and 1 (a's 2 and 1 already on the host: no copy), then writes its own full blocks
    # 4, 3, 2 through; the host is full at the third, so its least recently used block (slot 1) is dropped
    assert moves(kv) == [(DEVICE, HOST, [4, 3, 2], [2, 3, 1])]
    assert kv.tiers.stats.demotions == 2


@pytest.mark.parametrize("host, disk", [(5, 0), (5, 8), (40, 8), (0, 8)])
@pytest.mark.parametrize("move", ["write_through", "demote"])
def test_a_run_of_blocks_moves_down_as_block_by_block_stores(host, disk, move):
    """`write_through_copies` and `demote_all` take the host's slots in one loop where no block goes down to the
    disk: the same transfers, LRU order, counts and peak as storing each block in turn (`_store`)."""
    import random

    rng = random.Random(host * 100 + disk)
    one_run, each = (TierManager(host, disk, write_through=True) for _ in range(2))
    for _ in range(60):
        hashes = rng.sample(range(30), rng.randint(1, 7))  # distinct in a batch, as a prefix chain's are
        blocks = [rng.randint(1, 99) for _ in hashes]
        if move == "write_through":
            one_run.write_through_copies(blocks, hashes)
        else:
            one_run.demote_all(list(zip(blocks, hashes)))
        for b, h in zip(blocks, hashes):
            if move == "demote":
                each.stats.demotions += 1
            elif h in each.host.cached or not each.write_through:
                continue  # (write-through: what the host holds already is not copied again)
            each._store(0, h, DEVICE, b)
        if rng.random() < 0.2:  # a slot taken and given back (a swap in and out) goes to the released queue
            for tiers in (one_run, each):
                tiers.host.release(tiers.host.take()) if tiers.host.num_free() else None
    assert [(t.src_tier, t.dst_tier, t.src_blocks, t.dst_blocks) for t in one_run.pending] == \
        [(t.src_tier, t.dst_tier, t.src_blocks, t.dst_blocks) for t in each.pending]
    assert list(one_run.host.cached.items()) == list(each.host.cached.items())
    assert list(one_run.disk.cached.items()) == list(each.disk.cached.items())
    assert one_run.stats == each.stats and one_run.host.peak_used == each.host.peak_used
    # the small tiers filled and dropped or moved blocks down; the large host took all 30 hashes in free slots
    assert host == 0 and move == "write_through" or sum(one_run.stats.blocks_moved.values()) > min(host or 8, 29)


def test_a_promoted_chain_from_both_tiers_moves_up_as_block_by_block_copies():
    """`promote_all`: each run of pinned blocks from one tier as one run of copies; the same transfers (a chain that
    goes from the host to the disk and back is three), counts and freed slots, in order, as an `emit` and a
    `release` per block."""
    one_run, each = (TierManager(4, 4) for _ in range(2))
    for tiers in (one_run, each):
        for h in (1, 2):
            tiers._store(0, h, DEVICE, 10 + h)
        for h in (3, 4):  # (straight to the disk tier)
            tiers._store(1, h, DEVICE, 10 + h)
        tiers._store(0, 5, DEVICE, 15)
        tiers.take_transfers()
    chain = [1, 2, 3, 4, 5]
    blocks = [7, 6, 9, 8, 3]
    found = [one_run.pin(h) for h in chain]
    assert [pool.name for pool, _ in found] == [HOST, HOST, DISK, DISK, HOST]
    one_run.promote_all(found, blocks)
    for h, b in zip(chain, blocks):
        pool, slot = each.pin(h)
        each.emit(pool.name, DEVICE, slot, b)
        pool.release(slot)
        each.stats.promotions += 1
    assert [(t.src_tier, t.dst_tier, t.src_blocks, t.dst_blocks) for t in one_run.pending] == \
        [(t.src_tier, t.dst_tier, t.src_blocks, t.dst_blocks) for t in each.pending] == \
        [(HOST, DEVICE, [0, 1], [7, 6]), (DISK, DEVICE, [0, 1], [9, 8]), (HOST, DEVICE, [2], [3])]
    assert one_run.stats == each.stats and one_run.stats.promotions == 5
    for pool in ("host", "disk"):
        assert list(getattr(one_run, pool)._released) == list(getattr(each, pool)._released)
        assert getattr(one_run, pool).num_free() == 4

def test_swap_out_and_in_moves_a_sequences_blocks():
    kv = new_kv(num_blocks=4, host=3, disk=0, swap=True)
    s = Seq("s", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(s, 5) == [1, 2, 3]
    s.num_computed_tokens = 5
    assert kv.swap_out(s) and kv.block_table("s") == [] and kv.pool.num_free() == 4
    assert moves(kv) == [(DEVICE, HOST, [1, 2, 3], [0, 1, 2])]
    t = Seq("t", [1, 2, 3])
    kv.allocate_slots(t, 3)
    t.num_computed_tokens = 3
    assert not kv.swap_out(t) and kv.block_table("t") == [4, 3]  # no host slots left: t keeps its blocks
    kv.free(t)
    assert kv.can_swap_in(s, 1)
    kv.swap_in(s)
    assert moves(kv) == [(HOST, DEVICE, [0, 1, 2], kv.block_table("s"))]
    assert kv.tiers.host.num_free() == 3


def test_a_compacted_sequence_swaps_with_its_evicted_count():
    kv = new_kv(num_blocks=8, host=4, disk=0, swap=True)  # blocks of 2 tokens
    s = Seq("s", list(range(10)))
    assert kv.allocate_slots(s, 10) is not None
    s.num_computed_tokens = 10
    assert kv.prepare_compaction(s, 4) == []
    kv.truncate(s, 4)  # 6 of its 10 tokens evicted: 2 blocks left
    table = kv.block_table("s")
    assert kv.num_kv_tokens(s) == 4 and len(table) == 2
    assert kv.swap_out(s) and kv.block_table("s") == [] and "s" not in kv.num_evicted
    assert moves(kv) == [(DEVICE, HOST, table, [0, 1])]
    s.token_ids.append(99)  # its next token: 5 KV slots, 3 blocks (11 tokens would need 6)
    kv.pool.allocate(5)  # leave exactly 3 free
    assert kv.can_swap_in(s, 1)
    kv.swap_in(s)
    assert kv.num_kv_tokens(s) == 4 and kv.allocate_slots(s, 1) is not None and len(kv.block_table("s")) == 3
    assert not kv.swapped_evicted


def test_swap_without_host_room_falls_back():
    kv = new_kv(num_blocks=4, host=2, disk=0, swap=True)
    s = Seq("s", [1, 2, 3, 4, 5])
    kv.allocate_slots(s, 5)
    s.num_computed_tokens = 5
    assert not kv.swap_out(s) and kv.tiers.stats.swap_fallbacks == 1
    assert moves(kv) == []


def test_swap_may_push_cached_prefix_down_when_preempted_go_first():
    kv = new_kv(num_blocks=4, host=2, disk=2, swap=True, swap_evicts_prefix=True)
    run_seq(kv, Seq("a", [1, 2, 3, 4]))
    run_seq(kv, Seq("b", [9, 8, 7, 6, 5, 4, 3]))
    moves(kv)
    s = Seq("s", [7, 7, 7])
    kv.allocate_slots(s, 3)
    s.num_computed_tokens = 3
    assert kv.swap_out(s)
    assert [m[:2] for m in moves(kv)][-1] == (DEVICE, HOST)
    assert len(kv.tiers.disk.cached) == 2 and not kv.tiers.host.cached


def test_corrupt_disk_block_is_a_miss():
    kv = new_kv(num_blocks=3, host=0, disk=4)
    kv.tiers.verify_disk = lambda slot: slot != 1
    run_seq(kv, Seq("a", [1, 2, 3, 4, 5]))
    run_seq(kv, Seq("b", [9, 8, 7, 6, 5, 4]))
    transfers = kv.take_transfers()
    assert [(t.src_tier, t.dst_tier, t.src_blocks, t.dst_blocks) for t in transfers] == [(DEVICE, DISK, [2, 1], [0, 1])]
    kv.tiers.ran(transfers)  # the runtime wrote them
    hits = run_seq(kv, Seq("a2", [1, 2, 3, 4, 5]))
    assert hits == [] and kv.tiers.stats.corrupt_blocks == 1  # slot 1 holds a's first block: corrupt


def test_a_block_whose_disk_write_has_not_run_is_not_checked_before_it():
    kv = new_kv(num_blocks=4, host=0, disk=4)
    kv.tiers.verify_disk = lambda slot: False  # every block on disk would fail its checksum if read now
    run_seq(kv, Seq("a", [1, 2, 3, 4, 5]))
    run_seq(kv, Seq("b", [9, 8, 7, 6, 5, 4, 3, 2]))  # a's blocks go to disk: writes still pending
    transfers = kv.take_transfers()  # the step's transfers, taken but not run yet (or run by a prefetch
    assert [t.dst_tier for t in transfers] == [DISK]  # still in flight)
    assert kv.tiers.pin(next(iter(kv.tiers.disk.cached))) is not None  # not a miss: the write comes first
    kv.tiers.ran(transfers)  # the runtime ran them: now a read is checked
    assert kv.tiers.pin(next(iter(kv.tiers.disk.cached))) is None and kv.tiers.stats.corrupt_blocks == 1


def test_a_disk_write_the_disk_refused_is_counted_once_and_its_slot_never_read():
    """`ran` learns of the refused writes from the transfers (the runtime marks them): counted, left out of
    the blocks moved, and a later lookup of the block is a miss without a read, not a corrupt block."""
    kv = new_kv(num_blocks=3, host=0, disk=4)
    checked = []
    kv.tiers.verify_disk = lambda slot: checked.append(slot) or True
    run_seq(kv, Seq("a", [1, 2, 3, 4, 5]))
    run_seq(kv, Seq("b", [9, 8, 7, 6, 5, 4]))
    [write] = kv.take_transfers()  # device -> disk: a's blocks [2, 1] to slots [0, 1]
    write.lost.append(1)  # the disk refused slot 1's write: a's first block
    kv.tiers.ran([write])
    stats = kv.tiers.stats
    assert stats.disk_write_errors == 1 and stats.blocks_moved == {"device->disk": 1}
    assert checked == [1]  # (told once: the disk pool drops the bytes it kept of the block)
    assert run_seq(kv, Seq("a2", [1, 2, 3, 4, 5])) == []  # a miss ...
    assert stats.corrupt_blocks == 0 and checked == [1]  # ... without a read, not a corrupt block


def test_no_tiers_means_no_transfers():
    kv = KVCacheManager(4, 2, True)
    run_seq(kv, Seq("a", [1, 2, 3, 4]))
    run_seq(kv, Seq("b", [9, 8, 7, 6, 5, 4, 3]))
    assert kv.take_transfers() == [] and kv.promote_prefix(Seq("a", [1, 2, 3, 4])) == 0


# ---- the runtime: real copies between the pools ------------------------------------------------------
torch = pytest.importorskip("torch")
from skistune.runtime.request import Request  # noqa: E402

from tiny import tiny_runtime  # noqa: E402

BLOCK_BYTES = 2048  # the tiny model's block: 2 layers x (K, V) x 4 tokens x 2 heads x 16 dims x 4 bytes


def serve(rt, prompts, max_new_tokens=12):
    engine = rt.new_engine()
    records = [engine.add_request(Request(f"r{i}", p, max_new_tokens)) for i, p in enumerate(prompts)]
    engine.run_until_done()
    return [r.output_token_ids for r in records], engine


def prompts(n, length=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 100, (length,), generator=g).tolist() for _ in range(n)]


def test_swap_preserves_kv_bit_for_bit():
    ps = prompts(4)
    reference, _ = serve(tiny_runtime(), ps)
    knobs = {"offload.device_kv_bytes": 12 * BLOCK_BYTES, "batching.preemption": "swap"}
    swapped, engine = serve(tiny_runtime(**knobs, **{"offload.host_kv_bytes": 32 * BLOCK_BYTES}), ps)
    m = engine.metrics(1.0)
    assert m.preemptions > 0 and m.tiers.swapped_out == m.preemptions == m.tiers.swapped_in
    assert m.tiers.swap_fallbacks == 0 and swapped == reference
    # swaps, plus the cached prefix blocks of finished requests demoted when the pool reuses them
    assert m.tiers.moved_bytes["device->host"] >= m.tiers.moved_bytes["host->device"] > 0
    assert m.tiers.peak_bytes["host"] <= 32 * BLOCK_BYTES


@pytest.mark.parametrize("knobs, blocks", [
    ({"bitwidth.key_bits": 4, "bitwidth.value_bits": 4}, 14),  # the newest tokens' full-precision ring rows swap too
    ({"bitwidth.key_bits": 2, "bitwidth.value_bits": 8, "bitwidth.full_precision_window": 4}, 14),
    ({"eviction.policy": "h2o", "eviction.budget_tokens": 20}, 9),  # its statistics and evicted count stay with it
    ({"eviction.policy": "snapkv", "eviction.budget_tokens": 20, "bitwidth.key_bits": 4, "bitwidth.value_bits": 4}, 9),
], ids=["int4", "k2v8-window", "h2o", "snapkv-int4"])
def test_swap_of_quantized_or_compacted_kv_resumes_exactly(knobs, blocks):
    from skistune.runtime.kv_layout import kv_block_bytes, ring_bytes
    from tiny import TINY

    ps = prompts(4, length=14, seed=5)
    knobs = {**knobs, "batching.max_num_seqs": 4, "prefix_reuse.enabled": False}
    reference, _ = serve(tiny_runtime(**knobs), ps, max_new_tokens=16)
    config = tiny_runtime(**knobs).config
    pool = ring_bytes(config, TINY, 4) + blocks * kv_block_bytes(TINY, 4, 4, config)  # < 4 sequences' blocks
    pressure = {"offload.device_kv_bytes": pool, "offload.host_kv_bytes": 64 * BLOCK_BYTES,
                "batching.preemption": "swap"}
    swapped, engine = serve(tiny_runtime(**knobs, **pressure), ps, max_new_tokens=16)
    m = engine.metrics(1.0)
    assert m.preemptions > 0 and m.tiers.swapped_out == m.preemptions == m.tiers.swapped_in
    assert m.tiers.swap_fallbacks == 0 and swapped == reference
    runner = engine.executor
    rings = runner.ring_slots
    assert rings is None or not rings.parked  # (a slot is released at the step after its finish)
    assert not engine.kv.swapped_evicted and engine.kv.pool.num_free() == engine.kv.pool.num_blocks


def test_offloaded_prefix_comes_back_from_disk_and_corruption_is_recomputed():
    rt = tiny_runtime(**{"offload.device_kv_bytes": 5 * BLOCK_BYTES, "offload.disk_kv_bytes": 16 * BLOCK_BYTES})
    shared, other = prompts(2, length=13, seed=1)
    reference, _ = serve(tiny_runtime(), [shared], max_new_tokens=4)
    engine = rt.new_engine()
    outputs = []
    for i, p in enumerate([shared, other, shared, other, shared]):
        rec = engine.add_request(Request(f"r{i}", p, 4))
        if i == 4:  # flip a byte in every block the disk holds: the hits must be recomputed
            disk = engine.executor.tier_store.disk
            for slot in disk.crc:
                byte = os.pread(disk.fd, 1, slot * disk.block_bytes + 7)
                os.pwrite(disk.fd, bytes([byte[0] ^ 0xFF]), slot * disk.block_bytes + 7)
        engine.run_until_done()
        outputs.append(rec.output_token_ids)
    m = engine.metrics(1.0)
    assert len(reference[0]) == 4 and outputs[0] == outputs[2] == outputs[4] == reference[0]
    assert m.tiers.promotions >= 3 and m.tiers.corrupt_blocks >= 1
    assert engine.records[2].prefix_hit_tokens == 12 and engine.records[4].prefix_hit_tokens < 12


def test_the_tier_pools_are_allocated_with_the_engine_not_in_the_first_step():
    """A 2 GiB host tier zero-filled in the first step added ~1 s to the first request's TTFT."""
    engine = tiny_runtime(**{"offload.host_kv_bytes": 8 * BLOCK_BYTES, "offload.disk_kv_bytes": 4 * BLOCK_BYTES}
                          ).new_engine()
    store = engine.executor.tier_store
    assert store is not None and store.host[0].shape[0] == 8 and store.disk.num_blocks == 4
    engine.add_request(Request("r0", prompts(1)[0], 2))
    engine.run_until_done()
    assert engine.executor.tier_store is store  # the same pools serve the steps
    assert tiny_runtime().new_engine().executor.tier_store is None  # no tiers: nothing allocated


def test_a_host_tier_larger_than_the_machine_is_a_clear_error_not_an_oom_kill(monkeypatch):
    """A 128 GiB host tier on a 23.5 GiB machine was zero-filled until the kernel killed the process."""
    from skistune.profile import fingerprint

    monkeypatch.setattr(fingerprint, "host_memory_bytes", lambda: 6 * BLOCK_BYTES)
    with pytest.raises(ValueError, match="offload.host_kv_bytes: .* host tier in host memory is more than this"):
        tiny_runtime(**{"offload.host_kv_bytes": 8 * BLOCK_BYTES, "offload.device_kv_bytes": 4 * BLOCK_BYTES}
                     ).new_engine()
    with pytest.raises(ValueError, match="offload.device_kv_bytes: .* KV pool in host memory is more than this"):
        tiny_runtime(**{"offload.device_kv_bytes": 8 * BLOCK_BYTES})  # (on a CPU the device pool is host memory)
    small = tiny_runtime(**{"offload.host_kv_bytes": 4 * BLOCK_BYTES, "offload.device_kv_bytes": 4 * BLOCK_BYTES})
    assert small.new_engine().executor.tier_store is not None


def test_a_disk_tier_past_the_largest_file_names_the_knob_and_leaves_no_file(monkeypatch, tmp_path):
    """100 TiB on ext4 (16 TiB files at most) failed as ``[Errno 27] File too large`` and left its 0-byte file
    in the temp dir: the file was sized before the finalizer that removes it was registered."""
    import errno
    import tempfile

    from skistune.runtime import disk_pool

    def too_large(fd, length):  # what ext4 answers; a real 100 TiB ftruncate succeeds on tmpfs or XFS
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    monkeypatch.setattr(disk_pool.os, "ftruncate", too_large)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the pool's file goes when no directory is given
    rt = tiny_runtime(**{"offload.device_kv_bytes": 5 * BLOCK_BYTES, "offload.disk_kv_bytes": 16 * BLOCK_BYTES})
    with pytest.raises(ValueError) as err:
        rt.new_engine()
    size = disk_pool.format_bytes(16 * BLOCK_BYTES)
    assert str(err.value) == (f"offload.disk_kv_bytes: a {size} disk tier does not fit in a file on {tmp_path} "
                              "(File too large)")
    assert list(tmp_path.iterdir()) == []


def test_a_disk_pool_that_cannot_be_set_up_leaves_nothing_and_names_the_knob(monkeypatch, tmp_path):
    import errno

    from skistune.runtime import disk_pool

    def too_large(fd, length):
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    monkeypatch.setattr(disk_pool.os, "ftruncate", too_large)
    with pytest.raises(ValueError, match=r"^offload.disk_kv_bytes: a 100TiB disk tier does not fit in a file on "):
        disk_pool.DiskPool(100 << 30, 1024, directory=str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    missing = tmp_path / "gone"
    with pytest.raises(ValueError) as err:
        disk_pool.DiskPool(4, 1024, directory=str(missing))
    assert str(err.value) == f"offload.disk_kv_bytes: cannot create the disk tier's file on {missing} " \
                             "(No such file or directory)"


def test_the_disk_tier_lives_where_SKISTUNE_DISK_DIR_says_and_a_missing_folder_is_an_error(monkeypatch, tmp_path):
    """A tester found no way to put the disk tier on the drive `skistune profile --disk-dir` timed: it was
    always the temporary directory (and a missing TMPDIR fell back to /tmp silently)."""
    from skistune.profile.transfers import disk_free_bytes
    from skistune.runtime import disk_pool

    monkeypatch.setenv("SKISTUNE_DISK_DIR", str(tmp_path))
    pool = disk_pool.DiskPool(4, 1024)
    assert os.path.dirname(pool.path) == str(tmp_path)
    pool.close()
    assert disk_free_bytes(None) is not None
    monkeypatch.setenv("SKISTUNE_DISK_DIR", str(tmp_path / "gone"))
    with pytest.raises(ValueError) as err:
        disk_pool.DiskPool(4, 1024)
    assert str(err.value) == f"SKISTUNE_DISK_DIR={tmp_path / 'gone'}: not a directory (it names where the disk " \
                             "tier's file lives)"
    assert os.path.dirname(disk_pool.DiskPool(4, 1024, directory=str(tmp_path)).path) == str(tmp_path)  # (named)


def test_a_full_disk_loses_blocks_not_the_run(monkeypatch):
    """Writes the disk refuses (ENOSPC) lose their blocks, which are recomputed: same outputs, one warning."""
    import errno

    from skistune.runtime import disk_pool

    real_pwrite, calls = os.pwrite, []

    def full_after_two(fd, data, offset):  # the disk fills up after two writes
        calls.append(offset)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    rt = tiny_runtime(**{"offload.device_kv_bytes": 5 * BLOCK_BYTES, "offload.disk_kv_bytes": 16 * BLOCK_BYTES})
    shared, other = prompts(2, length=13, seed=1)
    reference, _ = serve(tiny_runtime(), [shared], max_new_tokens=4)
    monkeypatch.setattr(disk_pool.os, "pwrite", full_after_two)
    engine = rt.new_engine()
    outputs = []
    with pytest.warns(RuntimeWarning, match="No space left on device") as caught:
        for i, p in enumerate([shared, other, shared, other, shared]):
            rec = engine.add_request(Request(f"r{i}", p, 4))
            engine.run_until_done()
            outputs.append(rec.output_token_ids)
    disk = engine.executor.tier_store.disk
    assert len([w for w in caught if "KV disk tier" in str(w.message)]) == 1
    assert outputs[0] == outputs[2] == outputs[4] == reference[0]
    assert disk.write_errors == len(calls) - 2 > 0 and len(disk.crc) <= 2  # lost blocks hold no checksum
    # the metrics had counted every demoted block as moved to disk, and the write errors nowhere: now the
    # lost blocks are counted apart (not as corrupt: nothing was read back wrong) and moved counts the 2 written
    m = engine.metrics(1.0).tiers
    assert m.disk_write_errors == disk.write_errors and m.corrupt_blocks == 0
    assert m.moved_bytes == {"device->disk": 2 * BLOCK_BYTES}
    assert not disk._unwritten  # the lost blocks' bytes, kept in memory until the tiers saw the loss, are gone


def _serve_rounds(rt, rounds, max_new_tokens=3):
    """Serve each round's prompts together, one round after the other, on one engine."""
    engine, outputs = rt.new_engine(), []
    for n, prompts_ in enumerate(rounds):
        records = [engine.add_request(Request(f"r{n}-{i}", p, max_new_tokens)) for i, p in enumerate(prompts_)]
        engine.run_until_done()
        outputs.append([r.output_token_ids for r in records])
    return outputs, engine


@pytest.mark.parametrize("knobs", [{"batching.max_num_seqs": 2},
                                   {"batching.max_num_seqs": 1, "prefetch.enabled": True, "prefetch.depth": 1}],
                         ids=["same-step", "prefetch"])
def test_a_block_promoted_before_its_disk_write_was_refused_comes_up_from_memory(monkeypatch, knobs):
    """A block demoted to disk and promoted again before its write ran (in the same step, or by the next step
    while a prefetch wrote it) is not checked first. On a full disk its write then failed and the promotion
    read nothing: ``RuntimeError: disk pool: block in slot 3 failed its checksum after it was promoted``."""
    import errno

    from skistune.runtime import disk_pool

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    base, tails = prompts(3, length=8), prompts(7, length=3, seed=100)
    rounds = [[base[0] + tails[0], base[1] + tails[1]], [base[2] + tails[2], base[0] + tails[3]],
              [base[1] + tails[4], base[2] + tails[5], base[0] + tails[6]]]
    reference, _ = _serve_rounds(tiny_runtime(), rounds)
    monkeypatch.setattr(disk_pool.os, "pwrite", full)
    rt = tiny_runtime(**knobs, **{"offload.device_kv_bytes": 6 * BLOCK_BYTES, "offload.disk_kv_bytes": 8 * BLOCK_BYTES})
    with pytest.warns(RuntimeWarning, match="No space left on device"):
        outputs, engine = _serve_rounds(rt, rounds)
    m = engine.metrics(1.0).tiers
    assert outputs == reference and m.promotions > 0  # (each promoted block came up from the bytes kept of it)
    assert m.disk_write_errors > 0 and m.moved_bytes.get("device->disk", 0) == 0  # (every write was refused)
    assert not engine.executor.tier_store.disk._unwritten


def test_a_refused_disk_write_keeps_its_bytes_only_until_read_or_dropped(tmp_path, monkeypatch):
    import errno

    from skistune.runtime import disk_pool

    def over_quota(fd, data, offset):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    pool = disk_pool.DiskPool(2, 8, str(tmp_path))
    real_pwrite = os.pwrite
    monkeypatch.setattr(disk_pool.os, "pwrite", over_quota)
    with pytest.warns(RuntimeWarning, match="quota"):
        assert pool.write(0, b"abcdefgh") is False and pool.write(1, b"ijklmnop") is False
    assert pool.take(0) == b"abcdefgh" and not pool.verify(1)  # a promotion takes them; a check drops them
    assert not pool._unwritten and pool.write_errors == 2
    monkeypatch.setattr(disk_pool.os, "pwrite", real_pwrite)
    assert pool.write(1, b"qrstuvwx") is True and pool.verify(1) and pool.take(1) == b"qrstuvwx"


def test_the_disk_tiers_file_is_gone_even_when_the_process_is_killed(tmp_path):
    """SIGTERM (`timeout`, `docker stop`) ended a run without its finalizers and left the GB-sized
    skistune-kv-*.bin behind; the file is unlinked as soon as it is open, and positional I/O goes on."""
    import signal
    import subprocess
    import sys

    folder = tmp_path / "disk"
    folder.mkdir()
    # (run from tmp_path: from the checkout's root, `python -c` would import the root's folders, see conftest)
    child = subprocess.Popen([sys.executable, "-c", f"""
import time
from skistune.runtime.disk_pool import DiskPool
pool = DiskPool(4, 8, {str(folder)!r})
pool.write(2, b"abcdefgh")
print(pool.verify(2) and pool.take(2) == b"abcdefgh", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert child.stdout.readline().strip() == "True"
        assert list(folder.iterdir()) == []
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert list(folder.iterdir()) == []


def test_a_disk_error_of_the_program_is_not_swallowed(tmp_path, monkeypatch):
    """Only errors the disk causes lose a block; a bad file descriptor is a bug and raises."""
    import errno

    from skistune.runtime import disk_pool

    pool = disk_pool.DiskPool(2, 8, str(tmp_path))

    def bad_fd(fd, data, offset):
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    monkeypatch.setattr(disk_pool.os, "pwrite", bad_fd)
    with pytest.raises(OSError, match="Bad file descriptor"):
        pool.write(0, bytes(8))
    assert pool.write_errors == 0


def test_three_times_the_device_pool_completes_with_swap_and_offload():
    knobs = {"offload.device_kv_bytes": 10 * BLOCK_BYTES, "offload.host_kv_bytes": 24 * BLOCK_BYTES,
             "offload.disk_kv_bytes": 16 * BLOCK_BYTES, "batching.preemption": "swap",
             "prefetch.enabled": True, "prefetch.depth": 4}
    base = prompts(2, length=8, seed=2)
    ps = [base[i % 2] + q[:4] for i, q in enumerate(prompts(6, length=4, seed=3))]  # 6 x 24 tokens: 36 blocks
    reference, _ = serve(tiny_runtime(), ps)
    out, engine = serve(tiny_runtime(**knobs), ps)
    m = engine.metrics(1.0)
    assert m.num_finished == 6 and out == reference
    assert m.tiers.peak_bytes["device"] <= 10 * BLOCK_BYTES and m.tiers.peak_bytes["host"] <= 24 * BLOCK_BYTES
    kv = engine.kv
    assert kv.pool.num_free() == kv.pool.num_blocks and not kv.tiers.swapped  # no block leak
    assert kv.tiers.host.num_used() == len(kv.tiers.host.cached)
