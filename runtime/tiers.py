"""KV tiers below the device pool: host and disk pools with capacities in blocks, and the transfers that
move blocks between them. Pure Python, no torch: the runtime executes the transfers with real copies
(`kv_store.TierStore`), the simulator prices them with the profile's transfer fits.

What lives in a lower tier:
- cached prefix blocks (by their chain hash), least recently used first. When the device pool reuses a
  free-but-cached block, its KV moves down to the host instead of being dropped; when the host is full,
  the host's least recently used cached block moves down to disk first; the disk drops its least
  recently used one. A prefix lookup that finds a block in a lower tier promotes it back to the device.
- swapped sequences (``preemption: swap``): a preempted sequence's blocks move to host slots and come
  back when it is rescheduled. Only the host holds them: with no room the preemption recomputes.

``demote_first`` decides who yields host room: ``cached_prefix`` keeps cached prefix blocks (a swap only
takes free host slots), ``preempted`` lets a swap push cached prefix blocks down to disk (or drop them).
``write_policy: write_through`` copies each block to the host as soon as it is full and cached, so that
its later demotion costs no transfer; ``write_back`` copies it only when it is demoted.

Every decision appends a `Transfer` to a pending list in decision order. That order is safe to execute
as is: a slot is always read (moved away) by an earlier transfer than the one that overwrites it.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

DEVICE, HOST, DISK = "device", "host", "disk"
# said of every run and prediction on a CPU whose config has a host or disk tier (a disk tier's blocks cross
# device <-> host too): the "device" pool is host memory there, so the tier's copies are not a bus's
CPU_HOST_NOTE = "device is the CPU: device <-> host transfers are block copies within host memory"
# the profile's measured links each transfer crosses (disk -> device goes through host memory)
LINKS = {(DEVICE, HOST): ("device_to_host",), (HOST, DEVICE): ("host_to_device",),
         (HOST, DISK): ("host_to_disk",), (DEVICE, DISK): ("device_to_host", "host_to_disk"),
         (DISK, DEVICE): ("disk_to_host", "host_to_device")}


@dataclass
class Transfer:
    """Copy block ``src_blocks[i]`` of ``src_tier`` to block ``dst_blocks[i]`` of ``dst_tier`` (device ids
    are pool block ids, host and disk ids are slots ``0..capacity-1``)."""

    src_tier: str
    dst_tier: str
    src_blocks: list[int]
    dst_blocks: list[int]
    # set by the runtime as it runs a transfer to disk: the slots whose write the disk refused (`ran` reads it)
    lost: list[int] = field(default_factory=list, compare=False)

    @property
    def links(self) -> tuple[str, ...]:
        return LINKS[(self.src_tier, self.dst_tier)]


class TierPool:
    """Slots of one lower tier: free ones, and the cached prefix blocks it holds (hash -> slot, LRU first).
    Slots that are neither hold swapped sequences."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        # free slots: those never used (``_fresh`` on, handed out in order: a TiB disk tier has millions
        # of slots, so they are not listed), then released ones in release order
        self._fresh = 0
        self._released: deque[int] = deque()
        self.cached: OrderedDict[int, int] = OrderedDict()
        self.peak_used = 0

    def num_free(self) -> int:
        return self.capacity - self._fresh + len(self._released)

    def num_used(self) -> int:
        return self.capacity - self.num_free()

    def take(self) -> int:
        if self._fresh < self.capacity:
            slot, self._fresh = self._fresh, self._fresh + 1
        else:
            slot = self._released.popleft()
        self.peak_used = max(self.peak_used, self.num_used())
        return slot

    def release(self, slot: int) -> None:
        self._released.append(slot)

    def release_all(self, slots: list[int]) -> None:
        self._released += slots

    def cache_all(self, block_hashes: Sequence[int], refresh: bool = False) -> list[tuple[int, int]]:
        """Cache each hash not already here, in order, in a free slot or else in the least recently used cached
        block's slot (that block is dropped: for a tier with none below it); a hash that finds neither (every
        slot holds a swapped sequence) is left out; one already here becomes the most recently used with
        ``refresh``. Returns (position in ``block_hashes``, slot) of those cached. One loop for a run of blocks,
        no call per block: the simulator writes and demotes millions."""
        cached, released, stored = self.cached, self._released, []
        for i, h in enumerate(block_hashes):
            if h in cached:
                if refresh:
                    cached.move_to_end(h)
                continue
            if self._fresh < self.capacity:  # (`take`, inlined)
                slot = self._fresh
                self._fresh += 1
            elif released:
                slot = released.popleft()
            elif cached:
                slot = cached.popitem(last=False)[1]
            else:
                continue
            cached[h] = slot
            stored.append((i, slot))
        self.peak_used = max(self.peak_used, self.num_used())  # (slots in use only grew in the loop)
        return stored


@dataclass
class TierStats:
    """Counters of the tiers over a run (bytes come from block counts times the block bytes)."""

    blocks_moved: dict[str, int] = field(default_factory=dict)  # "src->dst" -> blocks
    demotions: int = 0
    promotions: int = 0
    swapped_out: int = 0  # sequences
    swapped_in: int = 0
    swap_fallbacks: int = 0  # preemptions that recomputed for want of host room
    prefetched: int = 0  # blocks promoted ahead of use
    prefetch_hits: int = 0  # blocks a sequence found on the device thanks to a prefetch
    prefetch_misses: int = 0  # blocks promoted on demand when the sequence was admitted
    corrupt_blocks: int = 0  # disk blocks whose checksum failed when read back (recomputed)
    # disk writes the disk refused (full, over quota, an I/O error): the blocks are lost, recomputed when needed,
    # and not in ``blocks_moved``
    disk_write_errors: int = 0
    transfer_s: float = 0.0  # time spent copying (filled by the executor)
    stall_s: float = 0.0  # time the step waited for transfers (filled by the executor)


class TierManager:
    """Lower tiers (host, then disk; a tier of capacity 0 is skipped) and the pending transfers."""

    def __init__(self, host_blocks: int, disk_blocks: int, *, write_through: bool = False,
                 swap_evicts_prefix: bool = False, swap: bool = False) -> None:
        self.host = TierPool(HOST, host_blocks)
        self.disk = TierPool(DISK, disk_blocks)
        self.levels = [p for p in (self.host, self.disk) if p.capacity > 0]
        self.write_through = write_through and host_blocks > 0
        self.swap_evicts_prefix = swap_evicts_prefix
        self.swap = swap  # preemption: swap asked for; without host slots every swap falls back (counted)
        self.swapped: dict[str, list[int]] = {}  # seq id -> host slots, in block-table order
        self.pending: list[Transfer] = []
        self.prefetched: set[int] = set()  # hashes promoted ahead of use and not yet used
        self.stats = TierStats()
        # set by the runtime: reads a disk slot and checks its checksum (the simulator has no files)
        self.verify_disk: Callable[[int], bool] | None = None
        # disk slot -> writes to it decided but not yet run (with `verify_disk` only): a block demoted in this
        # schedule, or by a prefetch still in flight, is not checked before its write lands
        self.unwritten_disk: dict[int, int] = {}
        # disk slots promoted before their write ran, until the promotion has run: if the disk refuses the
        # write, the promotion copies up the bytes the disk pool kept of it
        self.promoted_unwritten: set[int] = set()
        # disk slots whose block's write the disk refused (`ran`): a lookup finds nothing there to read
        self.lost_disk: set[int] = set()

    # ---- transfers ---------------------------------------------------------------------------------
    def emit(self, src_tier: str, dst_tier: str, src: int, dst: int) -> None:
        """Record one block copy, merged into the previous transfer when it crosses the same link (the
        destinations of one transfer are never its sources: the tiers differ)."""
        key = f"{src_tier}->{dst_tier}"
        self.stats.blocks_moved[key] = self.stats.blocks_moved.get(key, 0) + 1
        if dst_tier == DISK and self.verify_disk is not None:
            self.unwritten_disk[dst] = self.unwritten_disk.get(dst, 0) + 1
            self.lost_disk.discard(dst)  # (a new block goes there)
        last = self.pending[-1] if self.pending else None
        if last is not None and (last.src_tier, last.dst_tier) == (src_tier, dst_tier):
            last.src_blocks.append(src)
            last.dst_blocks.append(dst)
        else:
            self.pending.append(Transfer(src_tier, dst_tier, [src], [dst]))

    def _emit_run(self, src_tier: str, dst_tier: str, srcs: list[int], dsts: list[int]) -> None:
        """`emit` of copies ``srcs[i]`` -> ``dsts[i]`` across one link in turn, as two list extends (a run written
        through, demoted to the host or promoted; not to the disk, whose slots `emit` tracks)."""
        key = f"{src_tier}->{dst_tier}"
        self.stats.blocks_moved[key] = self.stats.blocks_moved.get(key, 0) + len(srcs)
        last = self.pending[-1] if self.pending else None
        if last is not None and (last.src_tier, last.dst_tier) == (src_tier, dst_tier):
            last.src_blocks += srcs
            last.dst_blocks += dsts
        else:
            self.pending.append(Transfer(src_tier, dst_tier, srcs, dsts))

    def take_transfers(self, since: int = 0) -> list[Transfer]:
        """The pending transfers from index ``since`` on, removed from the pending list."""
        out, self.pending = self.pending[since:], self.pending[:since]
        return out

    # ---- cached prefix blocks ----------------------------------------------------------------------
    def lookup(self, block_hash: int) -> tuple[TierPool, int] | None:
        for pool in self.levels:
            slot = pool.cached.get(block_hash)
            if slot is not None:
                return pool, slot
        return None

    def demote_all(self, dropped: Sequence[tuple[int, int]]) -> None:
        """The device is reusing these (block, hash) cached free blocks, in order: keep their KV one tier down."""
        if self.levels:
            self.stats.demotions += len(dropped)
            blocks, block_hashes = zip(*dropped)
            self._store_run(blocks, block_hashes, refresh=True)

    def write_through_copies(self, blocks: Sequence[int], block_hashes: Sequence[int]) -> None:
        """Write-through: blocks just filled and cached (``block_hashes[i]`` is ``blocks[i]``'s) are copied to
        the host now, those it does not hold yet, in order."""
        if self.write_through:
            self._store_run(blocks, block_hashes, refresh=False)

    def _store_run(self, blocks: Sequence[int], block_hashes: Sequence[int], refresh: bool) -> None:
        """`_store` of each device block into the first tier, in order; with ``refresh`` a block that tier holds
        already becomes its most recently used (else it is left as it is). As one run (`TierPool.cache_all`) where
        that tier is the host and takes them all without moving any of its blocks down to the disk; else block
        by block."""
        first = self.levels[0]
        if first is not self.host or (len(self.levels) > 1 and first.num_free() < len(blocks)):
            for b, h in zip(blocks, block_hashes):
                if refresh or h not in first.cached:
                    self._store(0, h, DEVICE, b)
            return
        stored = first.cache_all(block_hashes, refresh)
        if stored:
            self._emit_run(DEVICE, HOST, [blocks[i] for i, _ in stored], [slot for _, slot in stored])

    def _store(self, level: int, block_hash: int, src_tier: str, src: int) -> None:
        """Put the block ``src`` of ``src_tier`` into tier ``levels[level]``, making room by moving that
        tier's least recently used cached block one level down (or dropping it at the bottom)."""
        pool = self.levels[level]
        if block_hash in pool.cached:  # already there (write-through, or an older copy)
            pool.cached.move_to_end(block_hash)
            return
        if pool.num_free():
            slot = pool.take()
        elif pool.cached:
            old_hash, slot = pool.cached.popitem(last=False)
            if level + 1 < len(self.levels):
                self._store(level + 1, old_hash, pool.name, slot)  # read before this slot is overwritten
        else:
            return  # every slot holds a swapped sequence: the block is dropped
        self.emit(src_tier, pool.name, src, slot)
        pool.cached[block_hash] = slot

    def pin(self, block_hash: int) -> tuple[TierPool, int] | None:
        """Take a lower-tier cached block out of its LRU order (so that no demotion reuses its slot while
        it is promoted); a disk block whose checksum fails is dropped and reported as a miss (None)."""
        found = self.lookup(block_hash)
        if found is None:
            return None
        pool, slot = found
        del pool.cached[block_hash]
        if pool is not self.disk or self.verify_disk is None:
            return found
        if slot in self.unwritten_disk:
            # a block whose write to disk has not run yet has nothing to check (the write runs before the read
            # that promotes it: decision order, and a step waits for the previous prefetch first)
            self.promoted_unwritten.add(slot)
            return found
        if slot in self.lost_disk:  # its write was refused: a miss, counted when the write failed
            self.lost_disk.discard(slot)
            pool.release(slot)
            return None
        if not self.verify_disk(slot):
            self.stats.corrupt_blocks += 1
            pool.release(slot)
            return None
        return found

    def ran(self, transfers: list[Transfer]) -> None:
        """The runtime executed these transfers: their disk blocks can be checked from now on, and the
        writes the disk refused (``Transfer.lost``) are counted and their blocks known lost."""
        for t in transfers:
            if t.dst_tier == DISK:
                for slot in t.dst_blocks:
                    left = self.unwritten_disk.get(slot, 0) - 1
                    if left > 0:
                        self.unwritten_disk[slot] = left
                    else:
                        self.unwritten_disk.pop(slot, None)
                for slot in t.lost:
                    self._lost(t, slot)
            elif t.src_tier == DISK:
                self.promoted_unwritten.difference_update(t.src_blocks)

    def _lost(self, t: Transfer, slot: int) -> None:
        """The disk refused to write block ``slot`` of transfer ``t``: it moved nowhere (bytes moved count
        what was written), and unless a promotion already took it (which copies up the bytes the disk pool
        kept) or a newer write to the slot is pending, the slot holds nothing a lookup can use."""
        self.stats.disk_write_errors += 1
        link = f"{t.src_tier}->{t.dst_tier}"
        self.stats.blocks_moved[link] -= 1
        if slot in self.promoted_unwritten or slot in self.unwritten_disk:
            return
        self.lost_disk.add(slot)
        self.verify_disk(slot)  # (fails without a read, and drops the bytes the disk pool kept)

    def promote_all(self, found: Sequence[tuple[TierPool, int]], blocks: Sequence[int]) -> None:
        """Copy pinned blocks (``found[i]``: pool, slot) up into device ``blocks[i]``, in order, and free their
        slots (after the copies are recorded): each run of blocks from one tier as one run of copies."""
        start = 0
        while start < len(blocks):
            pool = found[start][0]
            end = start + 1
            while end < len(blocks) and found[end][0] is pool:
                end += 1
            slots = [slot for _, slot in found[start:end]]
            self._emit_run(pool.name, DEVICE, slots, list(blocks[start:end]))
            pool.release_all(slots)
            start = end
        self.stats.promotions += len(blocks)

    # ---- swapped sequences -------------------------------------------------------------------------
    def swap_out(self, seq_id: str, blocks: list[int]) -> bool:
        """Copy a preempted sequence's blocks to host slots; False (nothing done) without room, counted as a
        swap fallback (also with no host tier at all: a disk-only config still asked for swap)."""
        if not self.swap:
            return False
        room = self.host.num_free() + (len(self.host.cached) if self.swap_evicts_prefix else 0)
        if self.host.capacity == 0 or len(blocks) > room:
            self.stats.swap_fallbacks += 1
            return False
        while self.host.num_free() < len(blocks):  # push cached prefix blocks down (demote_first: preempted)
            old_hash, slot = self.host.cached.popitem(last=False)
            if self.disk.capacity > 0:
                self._store(1, old_hash, HOST, slot)
            self.host.release(slot)
        slots = [self.host.take() for _ in blocks]
        for b, s in zip(blocks, slots):
            self.emit(DEVICE, HOST, b, s)
        self.swapped[seq_id] = slots
        self.stats.swapped_out += 1
        return True

    def swap_in(self, seq_id: str, blocks: list[int]) -> None:
        """Copy a swapped sequence's host slots into the device ``blocks`` and free the slots."""
        slots = self.swapped.pop(seq_id)
        for s, b in zip(slots, blocks):
            self.emit(HOST, DEVICE, s, b)
        for s in slots:
            self.host.release(s)
        self.stats.swapped_in += 1

    def reset(self) -> None:
        """Forget every cached prefix block (swapped sequences keep their slots)."""
        for pool in self.levels:
            for slot in pool.cached.values():
                pool.release(slot)
            pool.cached.clear()
        self.prefetched.clear()
        self.lost_disk.clear()  # (their slots are free now)


# ---- layer-wise loading (``prefetch.unit: layers``) -------------------------------------------------------
def layered_split(out, layerwise: bool) -> tuple[list[Transfer], list[Transfer]]:
    """A scheduled step's transfers (``out``: a `SchedulerOutput`) as (those run whole before the forward
    pass, those run layer by layer alongside it). Everything is whole unless ``layerwise``, and in a step
    with compactions (their copy-on-write copies read blocks before the forward pass). Disk I/O moves whole
    blocks (one positional read or write per block, every layer at once), so everything up to the last
    transfer touching the disk runs first, whole; the rest (host <-> device copies) may go layer by layer.
    Decision order stays an execution order: the whole part completes before any layer of the rest, and
    each layer runs the rest in order. The runtime and the simulator both split with this."""
    transfers = out.transfers
    if not layerwise or out.compactions:
        return transfers, []
    last_disk = max((i for i, t in enumerate(transfers) if DISK in (t.src_tier, t.dst_tier)), default=-1)
    return transfers[:last_disk + 1], transfers[last_disk + 1:]


def layered_step_s(compute_s: float, transfer_s: float, n_layers: int) -> float:
    """A step whose KV copies run layer by layer ahead of its compute: layer i computes once its KV is in
    and layer i-1 is done. With uniform layers (copy t = T/L, compute c = C/L each) the last layer ends at
    max(C + t, T + c): the copies hide behind the compute but the first layer's, or the compute behind
    the copies but the last layer's. (How far ahead the loader may run, ``depth``, does not change this
    time for uniform layers; it bounds the staging a real engine needs.)"""
    if transfer_s <= 0:
        return compute_s
    return max(compute_s + transfer_s / n_layers, transfer_s + compute_s / n_layers)
