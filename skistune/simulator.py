"""The simulator: the runtime's own engine, scheduler and block accounting, with a clock instead of a
model. Each step's duration comes from the hardware profile's fitted step-cost model.

Runs of decode steps in which the batch cannot change (no arrival, no admission, no finish, no
preemption, blocks enough) are advanced in one event (`ProfileExecutor.fast_forward`), so the cost grows with events,
not tokens; so is the rest of the chunked prefill of a sequence that runs alone with nothing waiting. With eviction, the scheduler's compactions happen inside such runs too (`Scheduler.plan_decode_run`):
each sequence's KV slots, hence its blocks and the KV bytes a step reads, follow the budget.

Quantized KV (``bitwidth.*``) enters twice, both from the runtime's own layout (`kv_layout`): the pool
holds more blocks at fewer bits (less the full-precision rings), and each step reads the bytes of its
context at the configured bits and pays the profile's dequantization and quantize-on-append terms
(`kv_layout.kv_traffic`, `profile.cost`); a step that completes blocks pays for packing them, in a decode
run too (every block-size-th step of each sequence, `_blocks_completed`).

Tier transfers are priced as the runtime's `TierStore` runs them (`ProfileExecutor._transfer_s`): a host <->
device copy makes one call per part tensor of the layout (`kv_layout.part_tensors`: 60 for SmolLM2 at 16 bits,
180 quantized), each paying the link's measured per-call latency, plus its bytes over the link's bandwidth; a
disk transfer writes or reads block by block, converting each block's parts to or from bytes
(`HardwareProfile.block_io`). KV peak and capacity count the full-precision rings (`Engine`).
"""
from __future__ import annotations

import functools
import math
import os
import random
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Callable, Sequence

import numpy as np

from skistune.config import KVConfig
from skistune.profile.cost import IDLE_WAKE_GAP_S, IdleWake, StepCostModel, StepShape, decode_shape, step_shape
from skistune.profile.records import block_io_features
from skistune.runtime.engine import Engine, VirtualClock, layerwise_depth
from skistune.runtime.kv_layout import (KVTraffic, kv_pool_blocks, kv_traffic, layout_notes, part_tensors,
                                        quantized_sides, ring_bytes, ring_bytes_per_seq)
from skistune.runtime.metrics import PERCENTILE_NAMES, PERCENTILES, Metrics
from skistune.runtime.presets import ModelSpec
from skistune.runtime.request import Request
from skistune.runtime.scheduler import DecodeCompaction, ScheduledSeq, SchedulerOutput
from skistune.runtime.tiers import DEVICE, DISK, Transfer, layered_split, layered_step_s

# Knobs the optimizer searches: their effect the runtime implements and the simulator models.
MODELED_KNOBS = frozenset({
    "batching.max_num_seqs", "batching.max_num_batched_tokens", "batching.chunked_prefill", "batching.chunk_size",
    "batching.policy", "prefix_reuse.enabled", "prefix_reuse.block_size",
    "offload.device_memory_fraction", "offload.device_kv_bytes",
    # tiers: transfers priced by the profile's transfer fits, prefetch overlapped with the step's compute
    "offload.host_kv_bytes", "offload.disk_kv_bytes", "offload.demote_first", "offload.write_policy",
    "batching.preemption", "prefetch.enabled", "prefetch.depth", "prefetch.unit",
})
# Knobs that change the model's outputs. The simulator models their cost (eviction: compactions and the
# smaller KV read; bits: pool capacity, bytes read, (de)quantization), and a quality profile prices their
# loss: the optimizer searches them only under a quality floor (or a quality objective), since without one
# 2-bit KV and a 10% budget would look free.
LOSSY_KNOBS = frozenset({
    "eviction.policy", "eviction.budget_tokens", "eviction.budget_fraction", "eviction.sink_tokens",
    "eviction.recent_window", "eviction.layer_schedule",
    "bitwidth.key_bits", "bitwidth.value_bits", "bitwidth.group_size", "bitwidth.full_precision_window",
    "bitwidth.layer_bits",
})
PREDICTED_SHAPES = 1 << 16  # step shapes whose predicted time a cost model keeps at once (~25 MB at most)
PSEUDO_TOKEN_BASE = 3  # simulated tokens avoid the low special ids (BOS/EOS/pad)
DECODE_LINE_SPAN = 1 << 20  # KV tokens between the two predictions a decode cost line is drawn through
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # profile dtype -> bytes of one KV element
# the finest capacity resolution: far below any prediction's error; much finer (~1e-15), the lattice's steps
# fall below the resolution of floats and the bisection never ends
MIN_PRECISION = 1e-6


@dataclass(frozen=True)
class SimTarget:
    """What is simulated: the model's shape and the hardware's step costs and memory."""

    spec: ModelSpec
    step_cost: StepCostModel
    kv_itemsize: int  # bytes of a KV element at 16-bit precision on this device (4 for fp32 on CPU); what
    #                   a config stores at its bits follows from it (`kv_layout`)
    device_free_bytes: int  # memory the KV pool fraction applies to
    notes: tuple[str, ...] = ()
    quantized_kv_note: str | None = None  # added to the notes of configs that quantize KV (see HardwareProfile)
    transfers: dict[str, Any] = field(default_factory=dict)  # link -> fit with time_s(nbytes, calls) (HardwareProfile)
    # the disk tier's block conversions (`records.BLOCK_IO`) -> their `LinearFit` (`records.BLOCK_IO_FEATURES`);
    # empty: not measured
    block_io: dict[str, Any] = field(default_factory=dict)
    # link -> notes on how its transfers were measured: added to the notes of configs whose tiers cross it
    link_notes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # what the steps that follow an idle engine take more (`cost.IdleWake`); None: not measured
    idle_wake: IdleWake | None = None


def target_from_profile(profile, model: str | None = None) -> SimTarget:
    """The simulation target a hardware profile describes (its step costs hold for its own model only)."""
    from skistune.profile.profile import TIER_LINKS, check_profile_model
    from skistune.runtime.kv_layout import CPU_KV_SPACE_BYTES
    from skistune.runtime.presets import get_preset

    if model is not None:
        check_profile_model(profile, model)
    spec = get_preset(profile.model)
    itemsize = _profile_itemsize(profile, spec)
    if profile.device == "cpu":
        device_free = CPU_KV_SPACE_BYTES
    else:  # what the runtime reads once its weights are loaded (`torch.cuda.mem_get_info`): the rest
        total = int(getattr(profile.fingerprint, "gpu_memory_bytes", 0) or 0)
        if total <= 0:
            raise ValueError(f"profile {profile.name!r}: no device memory recorded for {profile.device}")
        weights = spec.param_count() * itemsize
        device_free = total - weights
        if device_free <= 0:
            raise ValueError(f"profile {profile.name!r}: {profile.model}'s weights ({weights / 2**30:.1f} GiB) "
                             f"fill the device's {total / 2**30:.1f} GiB")
    drift = tuple(n for n in (profile.drift_note, profile.step_coverage_note, profile.step_fit_note) if n)
    return SimTarget(spec, profile.step_cost, itemsize, device_free, notes=tuple(profile.notes) + drift,
                     quantized_kv_note=profile.quantized_kv_note,
                     transfers={link: m.fit for link, m in profile.transfers.items()},
                     block_io={kind: m.fit for kind, m in profile.block_io.items()},
                     link_notes={link: profile.tier_notes.get(tier, ()) + profile.transfer_gaps.get(tier, ())
                                 for tier in TIER_LINKS for link in TIER_LINKS[tier]},
                     idle_wake=profile.idle_wake)


def _profile_itemsize(profile, spec: ModelSpec) -> int:
    """The KV element size the profile was measured with, checked against the bytes per token it recorded
    (the runtime's layout at 16 bits)."""
    itemsize = DTYPE_BYTES.get(profile.dtype)
    if itemsize is None:
        raise ValueError(f"profile {profile.name!r}: KV dtype {profile.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    expected = kv_traffic(KVConfig(), spec, itemsize).bytes_per_token
    if profile.kv_bytes_per_token != expected:
        raise ValueError(f"profile {profile.name!r}: {profile.kv_bytes_per_token} KV bytes per token, but "
                         f"{profile.model} in {profile.dtype} stores {expected}: measure it again")
    return itemsize


WAKE_SEED = 0  # the rounds a replay's wake-ups draw (`IdleWake`): seeded, so a replay predicts the same each time


class ProfileExecutor:
    """Executes a step by advancing the virtual clock by its predicted duration. Sampled tokens are a
    deterministic pseudo-random sequence (content is irrelevant to timing; distinct tokens keep output
    blocks from matching each other in the prefix cache by accident)."""

    def __init__(self, step_cost: StepCostModel, kv: KVTraffic, clock: VirtualClock, vocab: int,
                 transfers: dict[str, Any] | None = None, block_bytes: int = 0, layerwise_layers: int = 0,
                 ring_swap_bytes: int = 0, *, parts: int = 1, rings: int = 0, block_io: dict[str, Any] | None = None,
                 idle_wake: IdleWake | None = None):
        self.step_cost = step_cost
        self.idle_wake = idle_wake
        self._last_end_s = -math.inf  # when the last step ended: the replay's first step follows an idle engine
        self._wake_rng = random.Random(WAKE_SEED)
        self._wake_left: list[float] = []  # the extras of the steps still to come after a wake-up, the next last
        self.layerwise_layers = layerwise_layers  # > 0 (the model's layers): copies overlap layer by layer
        self.transfers = transfers or {}  # link -> transfer fit
        self.block_io = block_io or {}  # the disk tier's block conversion -> fit (`records.BLOCK_IO`)
        self.block_bytes = block_bytes
        self.parts = parts  # tensors a block is stored across (`kv_layout.part_tensors`): one copy call each
        self.ring_swap_bytes = ring_swap_bytes  # quantized KV: a swap also moves the sequence's ring rows ...
        self.rings = rings  # ... one copy call per ring (per quantized layer side)
        self.kv = kv
        self.clock = clock
        self.vocab = vocab
        self.num_steps = 0  # every step, each fast-forwarded one too
        self.num_scheduled = 0  # ... of which the scheduler scheduled one at a time (`execute`)
        self.num_fast_forwards = 0
        self._tokens_drawn = 0
        self._decode_lines: dict[int, tuple[float, float]] = {}  # batch -> (step s at 0 KV tokens, s per token)
        self._predicted = step_cost.predicted  # step shape -> its predicted time (`_predict_s`), shared by replays
        self._lone_chunks: dict[tuple[int, int, bool], float] = {}  # (start, tokens, samples) -> `_lone_chunk_s`
        # quantized KV whose packing the profile prices: a decode run's steps that complete blocks cost more
        self._packing = bool(kv.block_size) and float(step_cost.packing_s(np.ones(1))[0]) > 0

    def next_tokens(self, n: int) -> list[int]:
        """Knuth's multiplicative hash of a counter: spread out, deterministic. The hash of counter c depends on
        c modulo the span of ids only, so the tokens are slices of one cycle of it (`_token_cycle`)."""
        first, self._tokens_drawn = self._tokens_drawn + 1, self._tokens_drawn + n
        cycle = _token_cycle(self.vocab - PSEUDO_TOKEN_BASE)
        start = first % len(cycle)
        out = cycle[start:start + n]
        while len(out) < n:  # (past the cycle's end: on from its start)
            out += cycle[:n - len(out)]
        return out

    def transfer_s(self, transfers: Sequence[Transfer]) -> float:
        """Predicted time of tier transfers, in order, each as the runtime's `TierStore` runs it."""
        return sum(self._transfer_s(t) for t in transfers)

    def _transfer_s(self, t: Transfer) -> float:
        """Host <-> device: one copy call per part tensor, each moving the transfer's blocks of that part (run
        layer by layer, the calls are the same, a layer's parts at a time). Disk: block by block, one write
        (or read) of its bytes each, its parts converted to (or from) those bytes (`_block_io_s`)."""
        blocks = len(t.src_blocks)
        nbytes = blocks * self.block_bytes
        if DISK not in (t.src_tier, t.dst_tier):
            (link,) = t.links
            return self.transfers[link].time_s(nbytes, self.parts)
        disk_link = "host_to_disk" if t.dst_tier == DISK else "disk_to_host"
        return self.transfers[disk_link].time_s(nbytes, blocks) + self._block_io_s(t, nbytes, blocks)

    def _block_io_s(self, t: Transfer, nbytes: int, blocks: int) -> float:
        """A disk transfer's conversions: every part of every block, from its tier's tensors to bytes, or from
        bytes into the device's. A profile that did not time them (`HardwareProfile.transfer_gaps`, which the
        notes then say): the device side priced as the device <-> host copy of the blocks, the host side free."""
        fit = self.block_io.get("bytes_to_device" if t.dst_tier == DEVICE else f"{t.src_tier}_to_bytes")
        if fit is not None:
            return fit.predict_s(block_io_features(blocks, self.parts, nbytes))
        copies = [link for link in t.links if link in ("device_to_host", "host_to_device")]
        return sum(self.transfers[link].time_s(nbytes, self.parts) for link in copies)

    def ring_swap_s(self, out: SchedulerOutput) -> float:
        """Predicted time of the ring rows a step's swaps move (`model_runner.RingSlots.park` / `unpark`): per
        sequence, one copy of its row of each ring."""
        if not self.ring_swap_bytes or not (out.swapped or out.swapped_in):
            return 0.0
        return (len(out.swapped) * self.transfers["device_to_host"].time_s(self.ring_swap_bytes, self.rings)
                + len(out.swapped_in) * self.transfers["host_to_device"].time_s(self.ring_swap_bytes, self.rings))

    def execute(self, out: SchedulerOutput, kv) -> dict[str, int]:
        self.num_steps += 1
        self.num_scheduled += 1
        step_s = self._predict_s(step_shape(out, self.kv))
        if self.idle_wake is not None:  # (a call saved per step where the profile has none)
            step_s += self._wake_s(self.clock.now() - self._last_end_s)
        if kv.tiers is not None:  # on-demand copies add; a prefetch overlaps the step, late data stalls it
            whole, layered = layered_split(out, self.layerwise_layers > 0)
            sync_s, layered_s, prefetch_s = (self.transfer_s(t) for t in (whole, layered, out.prefetch))
            sync_s += self.ring_swap_s(out)
            pipelined_s = layered_step_s(step_s, layered_s, self.layerwise_layers)  # the runtime's `LayerLoader`
            late_s = max(0.0, prefetch_s - pipelined_s)
            kv.tiers.stats.transfer_s += sync_s + layered_s + prefetch_s
            kv.tiers.stats.stall_s += sync_s + (pipelined_s - step_s) + late_s
            step_s = pipelined_s + sync_s + late_s
        self.clock.advance(step_s)
        self._last_end_s = self.clock.now()
        sampling = [s.seq.seq_id for s in out.scheduled if s.samples]
        return dict(zip(sampling, self.next_tokens(len(sampling))))

    def _predict_s(self, shape: StepShape) -> float:
        """The profile's time for a step of this shape, each shape predicted once (`StepCostModel.predicted`, kept
        across replays): a replay's steps repeat shapes (on Azure conv's sample 51,307 predictions were of 15,338
        shapes: the chunks of prompts longer than a chunk, the lone first steps of equal prompts)."""
        step_s = self._predicted.get(shape)
        if step_s is None:
            if len(self._predicted) >= PREDICTED_SHAPES:  # (an overloaded replay's shapes rarely repeat)
                self._predicted.clear()
            step_s = self._predicted[shape] = self.step_cost.predict_s(shape)
        return step_s

    def _lone_chunk_s(self, seq, start: int, n: int) -> float:
        """`_predict_s` of a step that computes tokens ``start..start + n`` of a lone sequence's prompt, by
        those numbers (most lone chunks are a prompt's first ones, the same for every prompt: no step's
        shape built for them)."""
        key = (start, n, start + n == seq.num_tokens)
        step_s = self._lone_chunks.get(key)
        if step_s is None:
            if len(self._lone_chunks) >= PREDICTED_SHAPES:
                self._lone_chunks.clear()
            shape = step_shape(SchedulerOutput([ScheduledSeq.of(seq, start, n, start)]), self.kv)
            step_s = self._lone_chunks[key] = self._predict_s(shape)
        return step_s

    def _wake_s(self, idle_s: float) -> float:
        """What a step adds for the idle engine it follows: after ``idle_s`` of idle (`IDLE_WAKE_GAP_S` or more),
        a round of the profile's wake-ups is drawn for this step and the few after it (`IdleWake.draw_s`); a
        step back to back takes the next of those, if any are left."""
        if idle_s >= IDLE_WAKE_GAP_S:
            self._wake_left = self.idle_wake.draw_s(idle_s, self._wake_rng)[::-1]
        return self._wake_left.pop() if self._wake_left else 0.0

    def _wake_run(self, step_s: np.ndarray) -> np.ndarray:
        """A decode run's step times with the extras left from a wake-up added to its first steps (taken from
        `_wake_left` by `_took_wake_run`, once the steps that run are known)."""
        if not self._wake_left:
            return step_s
        m = min(len(self._wake_left), len(step_s))
        step_s = step_s.copy()
        step_s[:m] += self._wake_left[::-1][:m]
        return step_s

    def _took_wake_run(self, k: int) -> None:
        del self._wake_left[max(0, len(self._wake_left) - k):]

    def fast_forward(self, engine: Engine, next_arrival_s: float) -> None:
        """Advance, in one event each, the steps that start before the next arrival and whose outcome is
        known: the rest of a lone sequence's chunked prefill, then runs of pure decode steps of the running
        batch (a run that ends with a finish leaves a smaller batch, which may run on at once)."""
        self._advance_prefill(engine, next_arrival_s)
        while self._advance_run(engine, next_arrival_s):
            pass

    def _advance_prefill(self, engine: Engine, next_arrival_s: float) -> None:
        """The chunks of `Scheduler.lone_prefill` that start before the next arrival, in one event. Times
        add up step by step, as the clock and the engine's busy time do when the steps run one at a time."""
        lone = engine.scheduler.lone_prefill()
        if lone is None:
            return
        seq, chunks = lone
        now_s, start, steps = self.clock.now(), seq.num_computed_tokens, 0
        for n in chunks:
            if now_s >= next_arrival_s:
                break
            end_s = now_s + self._lone_chunk_s(seq, start, n)
            if self.idle_wake is not None:  # (the first chunk may follow an idle engine, the rest back to back)
                end_s += self._wake_s(now_s - self._last_end_s if not steps else 0.0)
            engine.busy_s += end_s - now_s
            now_s, start, steps = end_s, start + n, steps + 1
        if not steps:
            return
        self.num_steps += steps
        self.num_fast_forwards += 1
        token = self.next_tokens(1)[0] if start == seq.num_tokens else None
        self.clock.wait_until(now_s)
        self._last_end_s = now_s
        engine.scheduler.advance_prefill(seq, chunks[:steps], now_s, token, engine.eos_token_id)

    def _advance_run(self, engine: Engine, next_arrival_s: float) -> bool:
        """Advance the longest run of pure decode steps of the running batch that starts before the next
        arrival, finishes no sequence before its last step and fits the free blocks, in one event; returns
        whether it ended with a finish (no arrival or full pool stopped it) and the rest may run on."""
        seqs = engine.scheduler.steady_decodes()
        if seqs is None:
            return False
        run = self._decode_run(engine, seqs, engine.scheduler.max_decode_run(seqs))
        if run is None:
            return False
        step_s, compactions, used_blocks = run
        step_s = self._wake_run(step_s)
        now_s = self.clock.now()
        end_s = now_s + step_s.cumsum()  # (the arrays' methods: numpy's functions add a Python wrapper per call)
        k = int((end_s - step_s).searchsorted(next_arrival_s, side="left"))  # steps starting before it
        if k < 1:
            return False
        self._took_wake_run(k)
        n = len(seqs)
        tokens = self.next_tokens(k * n)  # drawn step by step, in batch order: as k single steps draw them
        times = array("d")  # (the records' type: each sequence's slice of it is copied in whole)
        times.frombytes(end_s[:k].tobytes())
        finished = engine.scheduler.advance_decodes(times, [tokens[i::n] for i in range(n)],
                                                    [[e for e in per_seq if e.step <= k] for per_seq in compactions])
        if used_blocks is not None:  # blocks freed by compactions: the peak is that of the steps one at a time
            engine.kv.peak_used_blocks = max(engine.kv.peak_used_blocks, int(used_blocks[:k].max()))
        last_end_s = float(end_s[k - 1])
        self.clock.wait_until(last_end_s)
        engine.busy_s += last_end_s - now_s
        if engine.kv.tiers is not None:  # demotions and write-through copies of the run, charged at its end
            moved_s = self.transfer_s(engine.kv.take_transfers())
            engine.kv.tiers.stats.transfer_s += moved_s
            engine.kv.tiers.stats.stall_s += moved_s
            self.clock.advance(moved_s)
            engine.busy_s += moved_s
        self._last_end_s = self.clock.now()
        self.num_steps += k
        self.num_fast_forwards += 1
        return bool(finished)

    def _decode_run(self, engine: Engine, seqs: list, k_max: int
                    ) -> tuple[np.ndarray, list[list[DecodeCompaction]], np.ndarray | None] | None:
        """(step times, compactions by sequence, blocks in use at each step or None when they only grow)
        of the longest run (<= k_max steps) that fits the pool; None if it is shorter than two steps."""
        if engine.scheduler.eviction is None:
            k_max = _steps_with_blocks(engine, seqs, k_max)
            if k_max < 2:
                return None
            first_reads = [s.num_tokens for s in seqs]  # every sequence reads one slot more a step
            first, per_step = self._decode_cost_line(len(seqs), sum(first_reads))
            step_s = first + per_step * np.arange(k_max, dtype=np.float64)
            if self._packing:
                step_s += self.step_cost.packing_s(_blocks_completed(first_reads, k_max, self.kv.block_size))
            return step_s, [], None
        k_max, compactions = engine.scheduler.plan_decode_run(seqs, k_max)
        if k_max < 2:
            return None
        reads = _kv_reads(engine, seqs, k_max, compactions)  # [seqs, steps] KV slots each decode reads
        kv = engine.kv
        used = kv.pool.num_used() - sum(len(kv.block_table(s.seq_id)) for s in seqs) \
            + (-(-reads // kv.block_size)).sum(axis=0)
        k_max = min(k_max, int(np.searchsorted(np.maximum.accumulate(used), kv.pool.num_blocks, side="right")))
        if k_max < 2:
            return None
        step_s = self._decode_step_times(len(seqs), reads[:, :k_max].sum(axis=0))
        if self._packing:  # (a decode completes a block where it reads a whole number of blocks)
            step_s += self.step_cost.packing_s((reads[:, :k_max] % self.kv.block_size == 0).sum(axis=0))
        for row, per_seq in zip(reads, compactions):  # each compaction adds to the step it follows
            for e in per_seq:
                if e.step <= k_max:
                    step_s[e.step - 1] += self.step_cost.compaction_s(int(row[e.step - 1]), e.new_num_kv_tokens)
        return step_s, compactions, used[:k_max]

    def _decode_step_times(self, batch: int, contexts: np.ndarray) -> np.ndarray:
        """Durations of decode steps of ``batch`` sequences reading ``contexts[j]`` KV tokens in all at step
        j: the predicted time is linear in the KV read, so two predictions give every step's."""
        c0 = int(contexts[0])
        first, per_step = self._decode_cost_line(batch, c0)
        return first + per_step * ((np.asarray(contexts, dtype=np.float64) - c0) / batch)

    def _decode_cost_line(self, batch: int, c0: int) -> tuple[float, float]:
        """(time of a decode step of ``batch`` sequences reading ``c0`` KV tokens in all, time added when
        each reads one more)."""
        line = self._decode_lines.get(batch)
        if line is None:  # once per batch size: a run then needs no prediction of its own (two saved per run)
            # every step-cost term is constant or linear in the KV read at a fixed batch: two far-apart
            # reads give the line exactly (to float rounding, not the 1-token difference's cancellation)
            zero = self._predict_s(decode_shape(batch, 0, self.kv))
            far = self._predict_s(decode_shape(batch, DECODE_LINE_SPAN, self.kv))
            line = self._decode_lines[batch] = (zero, (far - zero) / DECODE_LINE_SPAN)
        zero, per_token = line
        return zero + per_token * c0, per_token * batch


def _kv_reads(engine: Engine, seqs: list, k: int, compactions: list[list[DecodeCompaction]]) -> np.ndarray:
    """KV slots each sequence reads at each of the next k decode steps: one more each step, back to the
    kept slots (plus the new token) after each compaction."""
    steps = np.arange(1, k + 1, dtype=np.int64)
    reads = np.empty((len(seqs), k), dtype=np.int64)
    for i, seq in enumerate(seqs):
        row = reads[i]
        row[:] = engine.kv.num_kv_tokens(seq) + steps
        for e in compactions[i]:
            row[e.step:] -= row[e.step - 1] - e.new_num_kv_tokens
    return reads


def _blocks_completed(first_reads: list[int], k: int, block_size: int) -> np.ndarray:
    """Blocks the next k decode steps complete, step by step, where each sequence reads ``first_reads[i]`` KV
    slots at the first and one more at each: sequence i completes one at each step j with (first_reads[i] + j)
    a multiple of the block size, so every block_size steps from its own offset."""
    per_offset = np.bincount([-r % block_size for r in first_reads], minlength=block_size)
    return per_offset[np.arange(k) % block_size]


@functools.lru_cache(maxsize=4)
def _token_cycle(span: int) -> list[int]:
    """The simulator's pseudo-token of every counter modulo ``span`` (a vocabulary less the special ids), in
    order: a run's tokens are a slice of it (a Python list slice, where computing them cost a numpy call and
    a conversion of every token)."""
    return (PSEUDO_TOKEN_BASE + np.arange(span, dtype=np.int64) * 2654435761 % span).tolist()


def _steps_with_blocks(engine: Engine, seqs: list, k_max: int) -> int:
    """The most decode steps (<= k_max) whose new blocks fit in the free pool."""
    kv = engine.kv
    size = kv.block_size
    tables = kv.tables  # (`block_table`, inlined: once per sequence per run)
    room = [len(tables.get(s.seq_id, ())) * size - s.num_computed_tokens for s in seqs]  # free slots held
    free = kv.pool.num_free()

    def fits(k: int) -> bool:  # new blocks for k more tokens each: ceil((k - room) / size) where positive
        return sum([-((r - k) // size) for r in room if k > r]) <= free

    lo, hi = 0, max(k_max, 0)
    if fits(hi):  # the common case: blocks enough for the whole run
        return hi
    while lo < hi:  # largest k in [0, k_max] that fits (fits is monotone in k)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def build_engine(config: KVConfig, target: SimTarget, *, fast_forward: bool = True) -> tuple[Engine, ProfileExecutor]:
    num_blocks, block_bytes = kv_pool_blocks(config, target.spec, target.kv_itemsize, target.device_free_bytes)
    clock = VirtualClock()
    kv = kv_traffic(config, target.spec, target.kv_itemsize)
    links = _check_transfer_links(config, target)
    executor = ProfileExecutor(target.step_cost, kv, clock, target.spec.vocab_size, target.transfers, block_bytes,
                               target.spec.n_layers if layerwise_depth(config) else 0,
                               ring_bytes_per_seq(config, target.spec, target.kv_itemsize),
                               parts=part_tensors(config, target.spec), rings=quantized_sides(config, target.spec),
                               block_io=target.block_io, idle_wake=target.idle_wake)
    extrapolated = (target.quantized_kv_note,) if kv.quantized_elements_per_token and target.quantized_kv_note else ()
    engine = Engine(config, num_blocks=num_blocks, block_bytes=block_bytes, max_context=target.spec.max_context,
                    executor=executor, clock=clock, ring_bytes=ring_bytes(config, target.spec, target.kv_itemsize),
                    notes=target.notes + _link_notes(links, target) + extrapolated + _poor_link_fits(links, target)
                    + tuple(layout_notes(config, target.spec)),
                    fast_forward=executor.fast_forward if fast_forward else None, n_layers=target.spec.n_layers,
                    unique_outputs=True)
    return engine, executor


def _check_transfer_links(config: KVConfig, target: SimTarget) -> list[str]:
    """A config with host or disk tiers needs the profile's fits of the links its transfers cross; returns
    those links."""
    needed = set()
    if config.offload.host_kv_bytes:
        needed |= {"device_to_host", "host_to_device"}
    if config.offload.disk_kv_bytes:
        needed |= {"device_to_host", "host_to_disk", "disk_to_host", "host_to_device"}
    missing = sorted(needed - set(target.transfers))
    if missing:
        raise ValueError(f"offload tiers: the hardware profile has no transfer fit for {', '.join(missing)}: "
                         "measure one with `skistune profile`")
    return sorted(needed)


def _link_notes(links: list[str], target: SimTarget) -> tuple[str, ...]:
    """The profile's notes on how the links this config's tiers cross were measured, each once."""
    return tuple(dict.fromkeys(n for link in links for n in target.link_notes.get(link, ())))


def _poor_link_fits(links: list[str], target: SimTarget) -> tuple[str, ...]:
    """A note naming the links this config's tiers cross whose transfer fit the profile flags (R² below the
    threshold): a quick profile on a loaded host had predicted tier transfers 12x their measured time."""
    poor = [f"{link} (R² {target.transfers[link].quality.r2:.2f})" for link in links
            if target.transfers[link].quality.flagged]
    if not poor:
        return ()
    return (f"tier transfer times rest on poor fits of the profile: {', '.join(poor)}; measure the machine again "
            "(`skistune profile`) before trusting them",)


def as_config(config) -> KVConfig:
    """A `KVConfig`, a mapping of knob families (as a config file holds), or a config file's path."""
    from skistune.config import load_config

    if isinstance(config, KVConfig):
        return config
    if isinstance(config, Mapping):
        return KVConfig.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return load_config(os.fspath(config))
    raise TypeError(f"config: expected a KVConfig, a mapping of knob families or a config file, got "
                    f"{type(config).__name__}")


def request_list(requests) -> list[Request]:
    """``requests`` (any iterable of `Request`) as a list; anything else is a ``TypeError``."""
    if isinstance(requests, (str, bytes, Mapping)) or not isinstance(requests, Iterable):
        raise TypeError(f"requests: expected a sequence of Request, got {type(requests).__name__} (a workload's "
                        "requests: skistune.workloads.to_requests(workload, vocab_size=...); skistune.evaluate "
                        "takes a workload as it is)")
    requests = list(requests)
    bad = next((r for r in requests if not isinstance(r, Request)), None)
    if bad is not None:
        raise TypeError(f"requests: expected Request items, got {type(bad).__name__}")
    return requests


def _check_target(target) -> None:
    if not isinstance(target, SimTarget):
        raise TypeError(f"target: expected a SimTarget (skistune.sim_target(model, profile)), got "
                        f"{type(target).__name__}")


def simulate(config, requests: Sequence[Request], target: SimTarget) -> Metrics:
    """Predict the metrics of serving ``requests`` (arrival times relative to 0) with ``config`` (a
    `KVConfig`, a mapping of knob families or a config file). Bad input raises ``ValueError`` or
    ``TypeError`` before anything is simulated."""
    config, requests = as_config(config), request_list(requests)
    _check_target(target)
    engine, _ = build_engine(config, target)
    return engine.replay(requests)


def with_rate_scale(requests: Sequence[Request], scale: float) -> list[Request]:
    """The same requests arriving ``scale`` times as fast (deadlines keep their offset to arrival)."""
    out = []
    for r in requests:
        arrival_s = r.arrival_s / scale
        deadline_s = None if r.deadline_s is None else arrival_s + (r.deadline_s - r.arrival_s)
        out.append(Request(r.request_id, r.prompt_token_ids, r.max_new_tokens, arrival_s, deadline_s, r.stop_at_eos))
    return out


class CertainMiss:
    """`Engine.replay`'s ``stop`` for `capacity`: whether a replay is already certain to miss its SLOs, so
    that the rest of it can be skipped (past capacity, where a search spends most of its time, queues grow and
    the replay slows down). Certain: a request refused or dropped (every request must finish), or a TTFT, E2E
    or TBT percentile (the queueing guard's too) that already breaks its limit on lower bounds of every value
    the replay will have had: a request's TTFT and E2E are at least what they are so far (its first token or
    finish if it has them, else the time it has waited), a gap between tokens at least what it is (the open
    one: since its last token), and those still to come at least 0. A percentile (as `Percentiles` computes
    it: linear between order statistics) is at least its lower order statistic, which is over a limit where
    enough values are; the max and the mean never fall when a value rises; so what breaks on the bounds breaks
    at the replay's end. How many values each metric will have is known before the end: one per request, and
    a simulated request makes exactly its ``max_new_tokens`` (else the replay misses anyway). (TPOT, and
    SLO-like objects of other kinds, are left to the end.)"""

    def __init__(self, slos: Sequence, requests: Sequence[Request]) -> None:
        # (metric, percentile, the value over which it certainly breaks: a margin for a percentile's rounding)
        bounds = [s.breaks_above() for s in slos if hasattr(s, "breaks_above")]  # (`SLO`, `QueueGuard`)
        self.rules = [(metric, percentile, above_s * (1 + CERTAIN_MARGIN)) for metric, percentile, above_s in bounds
                      if metric in ("ttft", "e2e", "tbt")]
        self.thresholds = {m: sorted({t for metric, _, t in self.rules if metric == m})
                           for m in ("ttft", "e2e", "tbt")}
        self.counts = {"ttft": len(requests), "e2e": len(requests),
                       "tbt": sum(max(r.max_new_tokens - 1, 0) for r in requests)}
        self.final = {m: _Tally(t) for m, t in self.thresholds.items()}  # of the finished requests
        self.open: list = []  # the records of requests that arrived and have not finished
        self.seen = 0  # the engine's records looked at so far

    def __call__(self, engine: Engine) -> bool:
        records = engine.records
        self.open += records[self.seen:]
        self.seen = len(records)
        now_s = engine.clock.now()
        done: dict[str, list] = {"ttft": [], "e2e": [], "tbt": []}
        so_far: dict[str, list] = {"ttft": [], "e2e": [], "tbt": []}
        still = []
        for r in self.open:
            if r.rejected_reason is not None:
                return True
            if r.finish_s is not None:
                done["ttft"].append(r.token_times_s[0] - r.arrival_s)
                done["e2e"].append(r.finish_s - r.arrival_s)
                done["tbt"].append(r.token_times_s)
            else:
                still.append(r)
                so_far["ttft"].append((r.token_times_s[0] if r.token_times_s else now_s) - r.arrival_s)
                so_far["e2e"].append(now_s - r.arrival_s)
                so_far["tbt"].append(r.token_times_s)
        self.open = still
        if not self.rules:
            return False
        now = {}
        for metric in ("ttft", "e2e", "tbt"):
            if not self.thresholds[metric]:
                continue
            tbt = metric == "tbt"
            self.final[metric].add(_gaps(done[metric]) if tbt else np.array(done[metric]))
            now[metric] = _Tally(self.thresholds[metric])
            now[metric].add(_gaps(so_far[metric], now_s) if tbt else np.array(so_far[metric]))
        return any(self._certain(metric, percentile, over_s, now[metric])
                   for metric, percentile, over_s in self.rules)

    def _certain(self, metric: str, percentile: str, over_s: float, so_far: "_Tally") -> bool:
        """Whether ``metric`` at ``percentile`` is certain to end over ``over_s``: of its values, more are over
        it already than the percentile's lower order statistic leaves (as numpy places it), or the max or the
        mean already is."""
        n, final = self.counts[metric], self.final[metric]
        if not n:
            return False
        over = final.over[over_s] + so_far.over[over_s]
        if percentile == "max":
            return over > 0
        if percentile == "mean":
            return (final.total_s + so_far.total_s) / n > over_s
        lower = math.floor(PERCENTILE_Q[percentile] / 100 * (n - 1))  # the order statistic below the percentile
        return over >= n - lower


class _Tally:
    """Values of a metric: how many are over each threshold, and their sum."""

    def __init__(self, thresholds_s: list[float]) -> None:
        self.over = {t: 0 for t in thresholds_s}
        self.total_s = 0.0

    def add(self, values: np.ndarray) -> None:
        if len(values):
            self.total_s += float(values.sum())
            for t in self.over:
                self.over[t] += int(np.count_nonzero(values > t))


def _gaps(token_times: list, now_s: float | None = None) -> np.ndarray:
    """The gaps between each request's tokens (each its float64 array of token times), in one numpy pass (a
    replay finishes thousands of requests between two looks); ``now_s``: they still run, and each one's open
    gap, since its last token, counts as it is now."""
    token_times = [t for t in token_times if t]
    if not token_times:
        return np.zeros(0)
    if now_s is not None:
        tail = array("d", [now_s])
        token_times = [part for t in token_times for part in (t, tail)]
    times = np.frombuffer(b"".join(token_times), dtype=np.float64)
    lengths = np.fromiter(map(len, token_times), dtype=np.int64, count=len(token_times))
    if now_s is not None:  # (each request's times and its "now" are one run of times)
        lengths = lengths[0::2] + 1
    within = np.ones(max(len(times) - 1, 0), dtype=bool)
    within[np.cumsum(lengths)[:-1] - 1] = False  # no gap from one request's last time to the next one's first
    return np.diff(times)[within]


CERTAIN_MARGIN = 1e-9  # relative excess over a limit that `CertainMiss` takes as certain
PERCENTILE_Q = dict(zip(PERCENTILE_NAMES, PERCENTILES))  # "p50" -> 50 ... "p99.9" -> 99.9: `Percentiles`' own


@dataclass(frozen=True)
class Capacity:
    """The highest arrival-rate scale at which every SLO held (0 when none did at the lowest scale tried)."""

    rate_scale: float
    rate_rps: float
    metrics: Metrics | None  # at that scale
    evaluations: int


MAX_RATE_SCALE = 1024.0  # the highest arrival-rate scale `capacity` tries: a capacity there is "at least"


def _log2_scales(min_scale: float, max_scale: float) -> tuple[float, float]:
    """log2 of the lowest and highest rate scales the capacity search tries, checked."""
    for name, value in (("min_scale", min_scale), ("max_scale", max_scale)):
        if not (isinstance(value, Real) and 0 < value < math.inf):
            raise ValueError(f"{name} {value!r}: expected a rate scale > 0")
    if min_scale > max_scale:
        raise ValueError(f"min_scale {min_scale:g} is above max_scale {max_scale:g}")
    return math.log2(min_scale), math.log2(max_scale)


def lattice_step(precision: float) -> float:
    """The capacity search's resolution in log2 of the rate scale: the widest power-of-two fraction of one
    doubling whose ratio is within ``precision`` (1/8 at 10%, 1/64 at 2%)."""
    if not (isinstance(precision, Real) and MIN_PRECISION <= precision < math.inf):
        raise ValueError(f"precision {precision!r}: expected a relative resolution of at least {MIN_PRECISION:g} "
                         "(e.g. 0.02 for 2%)")
    step = 1.0
    while 2.0 ** step > 1 + precision:
        step /= 2
    return step


def _queue_limit(max_queue, parse_max_queue) -> float | None:
    """`capacity`'s ``max_queue`` in seconds (None: no guard)."""
    if max_queue is None:
        return None
    if isinstance(max_queue, str):
        try:
            return parse_max_queue(max_queue)
        except ValueError as e:  # (its messages name the command's option)
            raise ValueError(str(e).replace("--max-queue", "max_queue", 1)) from None
    if isinstance(max_queue, Real) and not isinstance(max_queue, bool) and 0 < max_queue < math.inf:
        return float(max_queue)
    raise ValueError(f"max_queue {max_queue!r}: expected a positive time such as '5s' or 5.0 (seconds), or None")


ISOLATION_GAP_S = 1e6  # arrivals this far apart: each request is served alone


def one_at_a_time(requests: Sequence[Request]) -> list[Request]:
    """The same requests, each arriving when the one before has long finished (`ISOLATION_GAP_S` apart): what
    no arrival rate, however low, improves on (the queueing guard's reference)."""
    return [Request(r.request_id, r.prompt_token_ids, r.max_new_tokens, i * ISOLATION_GAP_S,
                    None if r.deadline_s is None else i * ISOLATION_GAP_S + r.deadline_s - r.arrival_s, r.stop_at_eos)
            for i, r in enumerate(requests)]


def spread_over_time(requests: Sequence[Request]) -> bool:
    """Whether the requests arrive over time, so that scaling their arrival rate means something
    (`capacity`): not a single request, nor several that all arrive at once."""
    arrivals = [r.arrival_s for r in requests]
    return max(arrivals) > min(arrivals)


def capacity(config, requests: Sequence[Request], target: SimTarget, slos: Sequence,
             *, precision: float = 0.02, max_scale: float = MAX_RATE_SCALE, min_scale: float = 1 / 1024,
             start: float | None = None, max_queue: str | float | None = "5s", stop_early: bool = True) -> Capacity:
    """The highest arrival-rate scale at which every SLO holds, as Vidur-Search and AIConfigurator report
    capacity, to ``precision`` relative.

    The answer is the highest feasible point of a fixed lattice, 2 ** (k * `lattice_step`) for integer k,
    found by galloping out from ``start`` (a guess, e.g. a similar config's capacity) and bisecting. Where
    feasibility falls with the rate, every start gives the same answer, so a good guess only saves
    simulations (about 5 instead of 15) and configs of equal capacity still tie exactly.

    ``config``: as `simulate` takes it; ``slos``: SLO strings as `skistune optimize` takes them
    (``"p99=200ms"``, ``"ttft:p90<=1s"``, parsed by `slo.parse_slo`), `SLO` objects, or anything with a
    ``met(metrics)`` method (the optimizer's queueing guard); one string or SLO alone is a list of one;
    ``start``: 0 or None is no guess; ``max_queue``: the queueing guard `skistune optimize` applies
    (``--max-queue``, 5 s by default): TTFT p99 at most this much above that of the same requests served one
    at a time (a time such as ``"5s"``, seconds as a number, or None / ``"off"`` for none). Without it a
    TBT-only SLO holds at any rate for a config whose pool serves one sequence at a time while its queue grows
    without end; ``stop_early``: a replay is cut where it is already certain to miss an SLO (`CertainMiss`),
    which changes no answer (False: every replay runs to its end, slower). Bad input raises ``ValueError`` or
    ``TypeError`` before anything is simulated."""
    from skistune.objectives import QueueGuard, parse_max_queue
    from skistune.slo import as_slos

    slos = as_slos(slos, guards=True)
    queue_s = _queue_limit(max_queue, parse_max_queue)
    config, requests = as_config(config), request_list(requests)
    _check_target(target)
    if not requests:
        raise ValueError("capacity: no requests; give at least one")
    if not isinstance(stop_early, bool):
        raise TypeError(f"stop_early: expected True or False, got {stop_early!r}")
    if not spread_over_time(requests):  # (every scale gives the same schedule, shifted: no capacity to find)
        raise ValueError(f"capacity: a single request, or requests that all arrive at once (here at "
                         f"{requests[0].arrival_s:g} s), have no arrival rate to scale; give requests that arrive "
                         "over time")
    base_rps = len(requests) / max(r.arrival_s for r in requests)
    step = lattice_step(precision)
    low, high = _log2_scales(min_scale, max_scale)
    if start is not None and not (isinstance(start, Real) and math.isfinite(start)):
        raise ValueError(f"start {start!r}: expected a rate scale to search from (a number), or None")
    if queue_s is not None:
        slos.append(QueueGuard(simulate(config, one_at_a_time(requests), target).ttft_s.p99, queue_s))
    held: dict[float, Metrics | None] = {}

    def check(x: float) -> Metrics | None:
        if x not in held:
            engine, _ = build_engine(config, target)
            m = engine.replay(with_rate_scale(requests, 2.0 ** x),
                              stop=CertainMiss(slos, requests) if stop_early else None)
            ok = not engine.stopped and m.num_finished == m.num_requests and all(s.met(m) for s in slos)
            held[x] = m if ok else None
        return held[x]

    # without a guess, start at the trace's own rate and move a whole doubling at a time
    guessed = start is not None and start > 0
    x = min(max(round(math.log2(start) / step) * step, low), high) if guessed else 0.0
    best = highest_feasible(lambda x: check(x) is not None, x, step if guessed else 1.0, low, high, step)
    if best is None:
        return Capacity(0.0, 0.0, None, len(held))
    return Capacity(2.0 ** best, 2.0 ** best * base_rps, held[best], len(held))


def highest_feasible(feasible: Callable[[float], bool], x: float, stride: float, low: float, high: float,
                     step: float) -> float | None:
    """The highest point in [low, high] where ``feasible`` holds, to ``step`` (None if not even at ``low``),
    for a feasibility that falls as the point rises: gallop from ``x`` by ``stride``, doubling it, until the
    answer is bracketed, then bisect in multiples of ``step``. Starting from a multiple of ``step`` with a
    ``stride`` that is one (``step`` is a power-of-two fraction of 1), every point tried is one, clamped to
    the bounds: so every start gives the same answer."""
    if feasible(x):
        lo = x
        while True:  # gallop up until a point breaks
            if lo >= high:
                return lo
            hi = min(lo + stride, high)
            if not feasible(hi):
                break
            lo, stride = hi, stride * 2
    else:
        hi = x
        while True:  # gallop down until a point holds
            if hi <= low:
                return None
            lo = max(hi - stride, low)
            if feasible(lo):
                break
            hi, stride = lo, stride * 2
    while hi - lo > step * 1.5:  # bisect on the lattice
        mid = lo + round((hi - lo) / 2 / step) * step
        if feasible(mid):
            lo = mid
        else:
            hi = mid
    return lo

