"""Executes a scheduled step with the real model: flattens the batch, builds the attention metadata
once, runs the forward pass and samples greedily.

With eviction (`eviction`), a step also runs the scheduler's compactions (`SchedulerOutput.compactions`):
before the forward pass it copies the blocks made private by copy-on-write; during it, attention hands
the statistics the policy scores with to `EvictionStats`; after it, each layer's kept tokens (per KV head)
move to the front of the sequence's slots. Positions: RoPE uses each token's true position, while the
KV is written at, and attention reads, KV slots (``ScheduledSeq.kv_start`` on), so a kept token keeps the
position its key was rotated with (the H2O/SnapKV convention, see `eviction`).

A quantized side is compacted through full precision: the kept tokens are read (dequantized from packed
blocks, or from the ring), then written at their new slots as a fresh sequence would have them: full
blocks quantized, and the slots from `PagedKVStore.full_precision_start` on in the ring.
"""
from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..config import EvictionConfig
from ..kernels.attention import RingInfo, build_attention_metadata, quantize_blocks
from ..kernels.quant import dequantize_keys, dequantize_values
from .block_manager import KVCacheManager
from .eviction import EvictionStats, kept_slots, make_policy
from .kv_store import KVSide, PagedKVStore, TierStore
from .model import LlamaModel
from .scheduler import Compaction, SchedulerOutput
from .tiers import TierManager, Transfer, layered_split


class RingSlots:
    """Which full-precision ring slot each running sequence of a quantized store uses, and the first
    KV slot it wrote there itself (the slots before it came from the prefix cache, packed only). A ring
    slot is released once the sequence no longer holds KV blocks (finished or preempted): the block
    manager is the one record of what is running. A swapped sequence's rows wait in host memory
    (`park`) until it resumes (`unpark`). Ring rows are indexed by KV slot, not by position."""

    def __init__(self, num_slots: int) -> None:
        self.free = list(range(num_slots - 1, -1, -1))
        self.assigned: dict[str, tuple[int, int]] = {}  # seq id -> (slot, ring start)
        self.parked: dict[str, tuple[int, list[torch.Tensor]]] = {}  # swapped seq id -> (ring start, host rows)

    def park(self, seq_id: str, rings: list[torch.Tensor]) -> None:
        """Copy a swapped sequence's rows of every ring (``[slots, ring_tokens, n_kv, D]`` each) to host
        memory and free its slot (nothing to do for a sequence that never got one)."""
        if seq_id not in self.assigned:
            return
        slot, start = self.assigned.pop(seq_id)
        self.parked[seq_id] = (start, [ring[slot].to("cpu", copy=True) for ring in rings])
        self.free.append(slot)

    def unpark(self, seq_id: str, rings: list[torch.Tensor]) -> None:
        """Give a resumed sequence a free slot with its parked rows and ring start."""
        if seq_id not in self.parked:
            return
        start, rows = self.parked.pop(seq_id)
        slot = self.free.pop()
        for ring, saved in zip(rings, rows):
            ring[slot].copy_(saved)
        self.assigned[seq_id] = (slot, start)

    def release_finished(self, kv: KVCacheManager) -> None:
        for seq_id in [s for s in self.assigned if not kv.block_table(s)]:
            self.free.append(self.assigned.pop(seq_id)[0])

    def get(self, seq_id: str, start: int, block_size: int) -> tuple[int, int]:
        if seq_id not in self.assigned:
            if start % block_size:  # the sequence starts after whole prefix-cache blocks, or at 0
                raise RuntimeError(f"sequence {seq_id}: first computed position {start} is not block-aligned")
            self.assigned[seq_id] = (self.free.pop(), start)
        return self.assigned[seq_id]

    def rewritten(self, seq_id: str) -> None:
        """After a compaction the sequence has written all its slots itself: the ring starts at slot 0."""
        self.assigned[seq_id] = (self.assigned[seq_id][0], 0)


def on_stream(stream):
    """Work enqueued inside runs on ``stream`` (a CUDA side stream), or where it would anyway (None)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class LayerLoader:
    """A step's host <-> device copies run layer by layer on the prefetch worker while the forward pass
    computes (``prefetch.unit: layers``): layer i's copies finish before layer i reads or writes its KV,
    and the loader runs at most ``depth`` layers ahead of the compute."""

    def __init__(self, n_layers: int, depth: int) -> None:
        self.depth = depth
        self.ready = [threading.Event() for _ in range(n_layers)]
        self.reached = [threading.Event() for _ in range(n_layers)]  # the compute got to layer i
        self.stall_s = 0.0

    def load(self, store: TierStore, transfers: list[Transfer], stream=None) -> float:
        """The worker's side: every layer's copies in order; the seconds the copies took (not the waits
        for the compute to reach a layer: `TierMetrics.transfer_s` is time spent copying)."""
        try:
            return self._load(store, transfers, stream)
        finally:  # a failed copy must not leave the forward pass waiting: its error surfaces after the step
            for ready in self.ready:
                ready.set()

    @torch.inference_mode()  # (a worker thread: the mode is per thread, and the KV store is an inference tensor)
    def _load(self, store: TierStore, transfers: list[Transfer], stream) -> float:
        copying_s = 0.0
        for i, ready in enumerate(self.ready):
            if i >= self.depth:
                self.reached[i - self.depth].wait()
            started = time.perf_counter()
            with on_stream(stream):
                store.run(transfers, layer=i)  # (run synchronizes its current stream: this one)
            copying_s += time.perf_counter() - started
            ready.set()
        return copying_s

    def before_layer(self, i: int) -> None:
        """The forward pass's side, before layer i: let the loader go on, wait for layer i's KV."""
        self.reached[i].set()
        if not self.ready[i].is_set():
            waited = time.perf_counter()
            self.ready[i].wait()
            self.stall_s += time.perf_counter() - waited


class ModelRunner:
    def __init__(self, model: LlamaModel, store: PagedKVStore, eviction: EvictionConfig = EvictionConfig(),
                 layerwise_depth: int = 0) -> None:
        self.model = model
        self.store = store
        self.ring_slots = RingSlots(store.slots) if store.quantized else None
        self.eviction = eviction
        self.policy = make_policy(eviction)
        self.stats = EvictionStats(self.policy, model.device) if self.policy is not None else None
        # teacher-forced scoring (perplexity): with keep_logits, every computed token's logits of the last
        # step, per sequence ``[num_new_tokens, vocab]``, not only the sampled ones
        self.keep_logits = False
        self.step_logits: dict[str, torch.Tensor] = {}
        # KV tiers (see `_move_tiers`): the pools of the engine's tiers and the prefetch worker
        self._tiers: TierManager | None = None
        self.tier_store: TierStore | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._prefetch_job: tuple[Future, list[Transfer]] | None = None  # (the worker's job, its transfers)
        self._stream = None
        self.layerwise_depth = layerwise_depth  # > 0: host <-> device copies go layer by layer (`LayerLoader`)
        self._loader: tuple[LayerLoader, Future] | None = None

    def _ring_info(self, out: SchedulerOutput, kv: KVCacheManager) -> RingInfo | None:
        if self.ring_slots is None:
            return None
        self.ring_slots.release_finished(kv)
        pairs = [self.ring_slots.get(s.seq.seq_id, s.kv_start, self.store.block_size) for s in out.scheduled]
        return RingInfo([p[0] for p in pairs], [p[1] for p in pairs], self.store.ring_tokens, self.store.window)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> dict[str, int]:
        if self.stats is not None:
            self._forget(out)
        self._move_tiers(out, kv)
        self._copy_blocks(out)
        try:
            sample_rows, logits, meta = self._forward(out, kv)
        finally:
            self._finish_layer_loads(kv)
        if self.keep_logits:
            self._keep_logits(out, logits)
            logits = logits[sample_rows]
        if meta.want_stats:
            self._observe(out, meta)
        for c in out.compactions:
            self._copy_pairs(c.prefix_copies)  # the prompt's blocks as the forward pass wrote them: cached
            self._compact(c, kv)
        sampling_ids = [s.seq.seq_id for s in out.scheduled if s.samples]
        return dict(zip(sampling_ids, logits.argmax(-1).tolist()))

    def _forward(self, out: SchedulerOutput, kv: KVCacheManager):
        """The forward pass: the rows of the sampling sequences' last tokens, the logits of those rows (of
        every row with ``keep_logits``; of one row when none samples), and the step's attention metadata
        (with the statistics it collected)."""
        token_ids, positions, tables, query_lens, context_lens, sample_rows = [], [], [], [], [], []
        for s in out.scheduled:
            end = s.start + s.num_new_tokens
            token_ids.extend(s.seq.tokens(s.start, end))
            positions.extend(range(s.start, end))  # true positions (RoPE); the KV goes to slots from kv_start
            tables.append(kv.block_table(s.seq.seq_id))
            query_lens.append(s.num_new_tokens)
            context_lens.append(s.kv_start + s.num_new_tokens)
            if s.samples:
                sample_rows.append(len(token_ids) - 1)
        # (a step of prefill chunks that all end mid-prompt needs no logits: one row keeps shapes simple)
        logit_rows = list(range(len(token_ids))) if self.keep_logits else sample_rows or [len(token_ids) - 1]
        device = self.model.device
        meta = build_attention_metadata(tables, query_lens, context_lens, self.store.block_size,
                                        self._ring_info(out, kv), device,
                                        first_slots=[s.seq.kv_first_slot for s in out.scheduled],
                                        scored_queries=self._scored_queries(out))
        logits = self.model.forward(torch.tensor(token_ids, device=device), torch.tensor(positions, device=device),
                                    self.store, meta, torch.tensor(logit_rows, device=device),
                                    before_layer=self._loader[0].before_layer if self._loader else None)
        return sample_rows, logits, meta

    def _keep_logits(self, out: SchedulerOutput, logits: torch.Tensor) -> None:
        self.step_logits = dict(zip([s.seq.seq_id for s in out.scheduled],
                                    logits.split([s.num_new_tokens for s in out.scheduled])))

    # ---- tiers: transfers of the step ---------------------------------------------------------------
    def prepare(self, kv: KVCacheManager) -> None:
        """Called by the engine once it has sized its tiers, before any request: their pools are made (the
        host pool, pinned on a GPU; the disk file) now, not in the first step, where zero-filling a 2 GiB
        host tier added about 1 s to the first request's TTFT."""
        if kv.tiers is not None:
            self._tier_store(kv.tiers)

    def _tier_store(self, tiers: TierManager) -> TierStore:
        """The host and disk pools of this engine's tiers (made when the engine sized them: `prepare`)."""
        if self._tiers is not tiers:
            self._tiers = tiers
            self.tier_store = TierStore(self.store, tiers.host.capacity, tiers.disk.capacity)
            if self.tier_store.disk is not None:
                tiers.verify_disk = self.tier_store.disk.verify
        return self.tier_store

    def _move_tiers(self, out: SchedulerOutput, kv: KVCacheManager) -> None:
        """Wait for the previous step's prefetch, run this step's transfers (both before the forward pass
        reads or writes any block they touch), then start this step's prefetch on the worker thread (on
        CUDA, its own stream) to overlap the forward pass."""
        tiers = kv.tiers
        if tiers is None:
            return
        store = self._tier_store(tiers)
        waited_from = time.perf_counter()
        waited = self._wait_prefetch()
        whole, layered = layered_split(out, self.layerwise_depth > 0)
        moved_s = (store.run(whole) if whole else 0.0) + self._swap_rings(out)
        tiers.ran(whole)
        if waited or moved_s:  # nothing waited for, nothing moved: no time (a run that moved nothing had read 0.07 ms)
            tiers.stats.transfer_s += moved_s
            tiers.stats.stall_s += time.perf_counter() - waited_from
        if layered:
            loader = LayerLoader(self.model.spec.n_layers, self.layerwise_depth)
            self._loader = (loader, self._submit(loader.load, store, layered, self._side_stream()))
        if out.prefetch:
            self._prefetch_job = (self._submit(self._run_prefetch, store, out.prefetch), out.prefetch)

    def _swap_rings(self, out: SchedulerOutput) -> float:
        """Quantized KV: the full-precision ring rows of the step's swapped sequences go to host memory, and
        those of its resumed ones come back (their packed blocks move with the tiers' transfers); seconds."""
        if self.ring_slots is None or not (out.swapped or out.swapped_in):
            return 0.0
        started = time.perf_counter()
        rings = [side.ring for layer in self.store.layers for side in layer if side.ring is not None]
        for seq in out.swapped:
            self.ring_slots.park(seq.seq_id, rings)
        for seq in out.swapped_in:
            self.ring_slots.unpark(seq.seq_id, rings)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        return time.perf_counter() - started

    def _submit(self, fn, *args) -> Future:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skistune-prefetch")
        return self._worker.submit(fn, *args)

    def _side_stream(self):
        """The CUDA stream tier copies overlap the compute on (None on a CPU)."""
        if self.model.device.type != "cuda":
            return None
        self._stream = self._stream or torch.cuda.Stream(self.model.device)
        return self._stream

    @torch.inference_mode()  # (runs on the worker thread)
    def _run_prefetch(self, store: TierStore, transfers: list) -> float:
        with on_stream(self._side_stream()):
            return store.run(transfers)  # (run synchronizes its current stream: this one)

    def _finish_layer_loads(self, kv: KVCacheManager) -> None:
        """After the forward pass: the layer-wise copies' time, and how long the layers waited for them."""
        if self._loader is None:
            return
        loader, job = self._loader
        self._loader = None
        for reached in loader.reached:  # (all set already, unless the forward pass failed)
            reached.set()
        kv.tiers.stats.transfer_s += job.result()
        kv.tiers.stats.stall_s += loader.stall_s

    def _wait_prefetch(self) -> bool:
        """Wait for the previous step's prefetch, if any (whether there was one)."""
        if self._prefetch_job is None:
            return False
        job, transfers = self._prefetch_job
        self._prefetch_job = None
        self._tiers.stats.transfer_s += job.result()
        self._tiers.ran(transfers)
        return True

    # ---- eviction ---------------------------------------------------------------------------------
    def _scored_queries(self, out: SchedulerOutput) -> list[int] | None:
        """Per scheduled sequence, how many of its last queries the policy's statistics sum; None when the
        policy needs no attention statistics (none, streaming)."""
        if self.policy is None or not self.policy.needs_attention:
            return None
        return [self.policy.scored_queries(s.seq.num_prefill_tokens, s.start, s.num_new_tokens)
                for s in out.scheduled]

    def _forget(self, out: SchedulerOutput) -> None:
        """Preempted sequences recompute their KV from scratch; finished ones are gone (swapped ones keep
        their statistics: they resume with the KV they had)."""
        for seq_id in [s.seq_id for s in out.preempted] + out.finished_seq_ids:
            self.stats.drop(seq_id)

    def _copy_blocks(self, out: SchedulerOutput) -> None:
        """Copy-on-write copies of the step's compactions, every layer's keys and values (the block tables
        already name the copies, so this runs before the forward pass writes into them)."""
        self._copy_pairs([pair for c in out.compactions for pair in c.copies])

    def _copy_pairs(self, pairs) -> None:
        """Copy blocks ``src -> dst`` (every layer's keys and values, scales and zero points)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.model.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.model.device)
        for side in (side for layer in self.store.layers for side in layer):
            for t in (side.data, side.scale, side.zero):
                if t is not None:
                    t[dst] = t[src]

    def _observe(self, out: SchedulerOutput, meta) -> None:
        for layer, per_seq in enumerate(meta.stats):
            for s, seq_stats in zip(out.scheduled, per_seq):
                self.stats.observe(layer, s.seq.seq_id, seq_stats.probs_sum, seq_stats.probs_last)

    def _compact(self, c: Compaction, kv: KVCacheManager) -> None:
        """Move each layer's kept tokens (per KV head, ascending) to the slots ``[dst_first_slot[l],
        new_num_kv_tokens)``; `Scheduler.update` frees the blocks past them afterwards."""
        ev, store = self.eviction, self.store
        blocks = torch.tensor(kv.block_table(c.seq_id)[:kv.blocks_for(c.kv_len)], device=self.model.device)
        ring = self.ring_slots.assigned[c.seq_id] if self.ring_slots is not None else None
        for layer, sides in enumerate(store.layers):
            kept = kept_slots(self.policy, self.stats, c, layer, self.model.spec.n_kv_heads,
                              ev.sink_tokens, ev.recent_window)  # [KVH, keep_l]
            for side in sides:
                old = read_slots(side, store, blocks, c.kv_len, ring)  # everything read before anything is written
                write_slots(side, store, blocks, arrange(old, kept, c.dst_first_slot[layer]), ring)
            self.stats.compact(c.seq_id, layer, kept, c.dst_first_slot[layer])
        if self.ring_slots is not None:
            self.ring_slots.rewritten(c.seq_id)


def arrange(old: torch.Tensor, kept: torch.Tensor, num_empty: int) -> torch.Tensor:
    """The new slots of one side of one layer: ``num_empty`` empty slots, then the kept tokens ``kept [KVH,
    keep]`` of ``old [kv_len, KVH, D]`` (each KV head its own) -> ``[num_empty + keep, KVH, D]``. The empty
    slots hold a copy of the first kept token: a key block quantized per channel then spans only real
    tokens' values (the copies are masked, never attended)."""
    moved = old.gather(0, kept.T.unsqueeze(-1).expand(-1, -1, old.shape[-1]))  # [keep, KVH, D]
    filler = moved[:1] if len(moved) else old.new_zeros(1, *old.shape[1:])
    return torch.cat([filler.expand(num_empty, -1, -1), moved])


def _ring_rows(ring: tuple[int, int], first: int, end: int, ring_tokens: int, device) -> torch.Tensor:
    """Flat ring rows of the KV slots ``[first, end)`` of the sequence in ring slot ``ring[0]``."""
    return ring[0] * ring_tokens + torch.arange(first, end, device=device) % ring_tokens


def read_slots(side: KVSide, store: PagedKVStore, blocks: torch.Tensor, num_slots: int,
               ring: tuple[int, int] | None) -> torch.Tensor:
    """A sequence's KV slots ``[0, num_slots)`` of one side in full precision ``[num_slots, n_kv, D]``:
    packed blocks dequantized, the slots the ring covers read from it."""
    if not side.quantized:
        return side.data[blocks].flatten(0, 1)[:num_slots]
    dequantize = dequantize_keys if side.is_key else dequantize_values
    x = dequantize(side.data[blocks], side.scale[blocks], side.zero[blocks], side.bits).flatten(0, 1)[:num_slots]
    first = store.full_precision_start(num_slots, ring[1])
    flat_ring = side.ring.view(-1, *side.ring.shape[-2:])
    x[first:] = flat_ring[_ring_rows(ring, first, num_slots, store.ring_tokens, x.device)].to(x.dtype)
    return x


def write_slots(side: KVSide, store: PagedKVStore, blocks: torch.Tensor, new: torch.Tensor,
                ring: tuple[int, int] | None) -> None:
    """Write ``new [n, n_kv, D]`` (full precision) as the sequence's slots ``[0, n)`` of one side: in place
    at 16 bits; quantized, as a sequence whose ring starts at slot 0 holds them (every full block packed,
    the slots from the full-precision start on in the ring, which is what later appends read)."""
    n, n_kv, d = new.shape
    bs = store.block_size
    if not side.quantized:
        slots = blocks[torch.arange(n, device=new.device) // bs] * bs + torch.arange(n, device=new.device) % bs
        side.data.view(-1, n_kv, d).index_copy_(0, slots, new.to(side.data.dtype))
        return
    full = n // bs
    if full:
        quantize_blocks(side, new[:full * bs].to(side.scale.dtype).contiguous(), blocks[:full], store.value_group)
    first = store.full_precision_start(n, 0)
    side.ring.view(-1, n_kv, d)[_ring_rows(ring, first, n, store.ring_tokens, new.device)] = new[first:].to(
        side.ring.dtype)
