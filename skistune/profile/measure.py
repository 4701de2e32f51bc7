"""Measuring a `HardwareProfile`: the grids (full and ``--quick``), the runtime they run on, and the
order of the stages (steps, scheduler overhead, attention kernel, quantize-on-append, transfers, power),
then the fits.

Quantized KV is measured on a few grid points: whole steps at 8 and 4 bits (enough for the step fit's
dequantization and quantize-on-append terms: with the 16-bit points they see three ratios of bytes read
to elements converted), the attention kernel at 8, 4 and 2 bits, and quantize-on-append at each."""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..config import KVConfig
from ..kernels.linear import machine_rule, measured_weights, pass_times
from ..kernels.quant import QUANT_BITS
from ..runtime.kv_layout import kv_block_bytes, kv_traffic, ring_bytes
from ..runtime.llm import Runtime
from ..runtime.presets import get_preset
from .cost import IdleWake, ProjectionTimes, parallel_rows
from .fingerprint import machine_fingerprint
from .fit import fit_linear, fit_transfer
from .kernels import (
    ATTENTION_FEATURES,
    QUANTIZE_FEATURES,
    attention_features,
    attention_timings,
    quantize_features,
    quantize_timings,
)
from .power import average_w, find_meter, measured_power, modeled_power
from .profile import CPU_HOST_NOTE, PAGE_CACHE_NOTE, HardwareProfile, Measured, disk_note, fit_step_points
from .records import BLOCK_IO, BLOCK_IO_FEATURES, GridPoint, StepPoint, block_io_features, kv_bits
from .steps import StepBench, fill_kv
from .transfers import block_copy_timings, disk_free_bytes, disk_timings, page_cache_dropped

Progress = Callable[[str, int, int], None]  # (what was just measured, units done, units in all)
DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}  # what the runtime serves with on each device


def _pool_tokens(decode: list[tuple[int, int]], mixed: list[tuple[int, int, int]], prefill: list[tuple[int, int]],
                 steps: int, block_size: int) -> int:
    """KV tokens the largest of these points holds at once, with room for block rounding and growth."""
    grow = [b * (c + steps + b * c // 4096 + block_size) for b, c in decode]
    grow += [b * (c + steps + b * c // 4096 + block_size) + n + block_size for b, c, n in mixed]
    return max(grow + [n + k + block_size for n, k in prefill]) + 64 * block_size


@dataclass(frozen=True)
class Grid:
    """Where to measure. Prefill points are (chunk, cached) with cached a multiple of chunk (the scheduler
    cuts a prompt into whole chunks); mixed points are (batch, context, chunk)."""

    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    max_decode_kv_tokens: int  # decode points with batch x context above this are skipped (memory, time)
    prefill: tuple[tuple[int, int], ...]
    mixed: tuple[tuple[int, int, int], ...]
    warmup: int
    repeats: int  # at least this many timed calls per point, and at least min_time_s of them ...
    max_repeats: int  # ... but no more than this many
    min_time_s: float
    overhead_batches: tuple[int, ...]
    overhead_repeats: int
    kernel_repeats: int
    copy_blocks: tuple[int, ...]
    disk_bytes: tuple[int, ...]
    transfer_repeats: int
    idle_s: float  # idle power measurement, where a meter exists
    # quantized KV (keys and values at the same bits): these (batch, context) and (chunk, cached) points again,
    # as whole steps at each of step_bits and as the attention kernel at each of kernel_bits
    quant_decode: tuple[tuple[int, int], ...]
    quant_prefill: tuple[tuple[int, int], ...]
    step_bits: tuple[int, ...]
    kernel_bits: tuple[int, ...]
    quantize_blocks: tuple[int, ...]  # quantize-on-append: full blocks per call, at each of kernel_bits
    # eviction: decode steps that also compact every sequence, at (batch, budget in tokens), with this policy
    compaction: tuple[tuple[int, int], ...] = ()
    compaction_policy: str = "h2o"
    # ... and prefill chunks at (chunk, cached) under that policy, which scores by attention, at a budget no prompt
    # reaches (`cost.SCORED_FEATURES`)
    scored_prefill: tuple[tuple[int, int], ...] = ()
    # the projections alone: one pass over the layers' weights and one over the LM head at these rows
    # (`cost.ProjectionTimes`), median of this many rounds
    projection_rows: tuple[int, ...] = ()
    projection_rounds: int = 3
    # the attention kernel alone at these decode (batch, context) points (None: at every decode step point)
    attention_decode: tuple[tuple[int, int], ...] | None = None
    # quantized KV: decode steps at (batch, context) in which every sequence completes a block and the step packs
    # it (`cost.PACKING_FEATURES`), at each of step_bits
    quant_packing: tuple[tuple[int, int], ...] = ()
    # rounds of a request's first steps timed back to back and after each of `IDLE_WAKE_GAPS_S` (`_idle_wake`): a
    # later step's slow wake-up came in 1 of 16 idle/round pairs in one full profile and 7 of 16 in the next, 20
    # minutes on
    idle_wake_rounds: int = 3

    def __post_init__(self) -> None:
        for chunk, cached in self.prefill + self.quant_prefill + self.scored_prefill:
            if cached % chunk:
                raise ValueError(f"prefill point ({chunk}, {cached}): cached tokens must be a multiple of the chunk")
        for bits in self.step_bits + self.kernel_bits:
            if bits not in QUANT_BITS:
                raise ValueError(f"quantized grid: {bits} bits is not one of {QUANT_BITS}")

    def decode(self) -> list[tuple[int, int]]:
        return [(b, c) for b in self.decode_batches for c in self.decode_contexts
                if b * c <= self.max_decode_kv_tokens]

    def kernel_decode(self) -> list[tuple[int, int]]:
        """The decode points the attention kernel is timed at alone."""
        return self.decode() if self.attention_decode is None else list(self.attention_decode)

    def units(self) -> int:
        """Progress units: one per grid point, kernel case, transfer stage, the idle wake-up and the power figure."""
        plain = len(self.decode()) + len(self.prefill)
        quant = len(self.quant_decode) + len(self.quant_prefill)
        steps = (plain + len(self.mixed) + len(self.step_bits) * (quant + len(self.quant_packing))
                 + len(self.compaction) + len(self.scored_prefill))
        kernels = (len(self.kernel_decode()) + len(self.prefill)
                   + len(self.kernel_bits) * (quant + len(self.quantize_blocks)))
        return steps + len(self.overhead_batches) + kernels + 2 + 1 + 1 + bool(self.projection_rows)

    def pool_tokens(self, block_size: int) -> int:
        """KV tokens the largest 16-bit grid point holds at once, with room for block rounding and growth."""
        return _pool_tokens(self.decode(), list(self.mixed), list(self.prefill), self.warmup + self.max_repeats + 8,
                            block_size)

    def quant_pool_tokens(self, block_size: int) -> int:
        """The same for the quantized step points (their decode points step twice as long, skipping the steps
        that complete a block; their packing points a block's worth of steps per measured one)."""
        steps = self.warmup + self.max_repeats + 8
        return max(_pool_tokens(list(self.quant_decode), [], list(self.quant_prefill), 2 * steps, block_size),
                   _pool_tokens(list(self.quant_packing), [], [], block_size * steps, block_size)
                   if self.quant_packing else 0)

    def quant_seqs(self) -> int:
        """Sequences a quantized step point runs at once (each needs a full-precision ring slot), with room
        for one that finishes while the next starts."""
        return max([b for b, _ in self.quant_decode + self.quant_packing] + [1]) + 2


# Step sizes include some that are not powers of two or multiples of 16 (batch 3; chunks of 37 and 131
# tokens): serving steps have any size, and a CPU's BLAS speed depends on the rows modulo 16
# (`kernels/linear.py`), which a grid of round sizes alone would not show.
# every size to 16 (where a BLAS changes kernels from one row count to the next), then wider steps
PROJECTION_ROWS = tuple(range(1, 17)) + (20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 128, 160, 192, 256, 384, 512, 768,
                                         1024, 1536, 2048)

FULL_GRID = Grid(
    decode_batches=(1, 2, 3, 4, 8, 16, 32, 64), decode_contexts=(32, 128, 512, 1024, 2048), max_decode_kv_tokens=32768,
    # (cached contexts of about 512 and 1,536 tokens, rounded to whole chunks: the profiler prefills them chunk by chunk)
    prefill=tuple((n, n * round(k / n)) for n in (5, 9, 16, 37, 64, 131, 256, 512) for k in (0, 512, 1536)),
    # (and a new prompt's chunk beside one to three decodes, as serving at a low rate mostly has: steps on
    # each side of the elementwise ops' thresholds, `cost.parallel_rows`, for the mixed term, `cost.MIXED_FEATURES`)
    mixed=((2, 512, 64), (4, 256, 256), (8, 1024, 64), (16, 512, 256), (32, 128, 512), (64, 256, 128),
           (1, 128, 9), (3, 128, 16), (1, 512, 37), (2, 64, 100)),
    warmup=2, repeats=5, max_repeats=25, min_time_s=1.0,
    overhead_batches=(1, 4, 16, 64, 256), overhead_repeats=30, kernel_repeats=10,
    copy_blocks=(1, 2, 4, 8, 16, 32, 64), disk_bytes=tuple(4096 * 4 ** i for i in range(8)),
    transfer_repeats=5, idle_s=2.0,
    quant_decode=((1, 512), (4, 2048), (16, 128), (16, 1024), (64, 512)),
    quant_prefill=((64, 0), (512, 0), (64, 1536), (256, 512)),
    step_bits=(8, 4), kernel_bits=QUANT_BITS, quantize_blocks=(1, 16, 64, 256, 1024),
    # (on each side of the KV rows' grain, `cost.PARALLEL_COMPACTION_FEATURES`: 170 slots for SmolLM2)
    compaction=((1, 32), (4, 64), (1, 128), (1, 192), (1, 256), (1, 1024), (8, 256), (8, 1024), (32, 256)),
    scored_prefill=((9, 0), (37, 0), (131, 0), (256, 0), (512, 0), (64, 512), (256, 512)),
    projection_rows=PROJECTION_ROWS, quant_packing=((1, 512), (4, 512), (16, 128)), idle_wake_rounds=16)

QUICK_GRID = Grid(
    decode_batches=(1, 2, 3, 4, 8, 16, 32, 64), decode_contexts=(64, 512, 2048), max_decode_kv_tokens=16384,
    # (short chunks too: real prompts and the last chunks of long ones have any size, and a straight line
    # through 32-256 tokens alone predicted 5-token chunks 30-50% slow)
    prefill=((9, 0), (32, 0), (256, 0), (128, 256), (16, 512), (32, 512), (256, 512), (256, 1536)),
    mixed=((4, 256, 64), (16, 1024, 128), (1, 512, 32)),
    warmup=1, repeats=3, max_repeats=10, min_time_s=0.3,
    overhead_batches=(1, 16, 128), overhead_repeats=15, kernel_repeats=5,
    copy_blocks=(1, 4, 16, 64), disk_bytes=(64 << 10, 1 << 20, 4 << 20, 16 << 20), transfer_repeats=5, idle_s=1.0,
    # a few quantized-KV steps (8 and 4 bits), enough to fit what converting codes costs: decode runs the
    # compiled CPU kernel now, so they take seconds, not the minutes of the PyTorch path (which dequantized
    # whole contexts); `skistune profile` (the full grid) also times the attention and quantize kernels
    quant_decode=((4, 2048), (16, 512)), quant_prefill=((64, 512), (128, 0)), step_bits=(8, 4), kernel_bits=(),
    # (two sequences at the larger budget: the point's setup prefills every prompt in one step, and 8 x 1,024
    # tokens took 4 s of it; two budgets on each side of SmolLM2's grain of 170 KV rows, so that the jump past it,
    # the fixed cost and the cost per slot are not all set by three points)
    quantize_blocks=(), compaction=((1, 64), (1, 128), (1, 256), (2, 1024)),
    scored_prefill=((32, 0), (256, 0), (128, 256)),
    # the attention kernel alone at the corners and the middle of the decode grid (it explains the steps;
    # the step fit does not read it): at all 21 decode points it took 8 s on a 2-core EPYC
    attention_decode=((1, 64), (1, 2048), (4, 512), (8, 2048), (16, 512), (64, 64)),
    # the projection table to 256 rows, the quick grid's largest step (past it the table goes on along its
    # last segment, where the products are compute-bound): the full table's sizes to 2,048 took 32 of the
    # quick profile's 78 s on a 2-core EPYC; one timed pass after the warm-up pass at each size (two rounds
    # took 5 s more)
    projection_rows=tuple(range(1, 17)) + (20, 24, 32, 48, 64, 96, 128, 192, 256), projection_rounds=1,
    quant_packing=((1, 512), (4, 128)))


def held_out_mask(points: list[StepPoint], every: int = 3) -> list[bool]:
    """Every ``every``-th interior point of each kind and bitwidth (strictly inside its grid on every other
    axis): the fit is checked on interpolation, never on the edges it would have to extrapolate to."""
    mask = [False] * len(points)
    for group in dict.fromkeys((p.kind, kv_bits(p.grid)) for p in points):
        members = [i for i, p in enumerate(points) if (p.kind, kv_bits(p.grid)) == group]
        axes = {axis: [points[i].grid[axis] for i in members] for axis in points[members[0]].grid if axis != "bits"}
        interior = [i for i in members
                    if all(min(axes[a]) < points[i].grid[a] < max(axes[a]) for a in axes)]
        for i in interior[::every]:
            mask[i] = True
    return mask


class _Tracker:
    def __init__(self, total: int, progress: Progress | None) -> None:
        self.total, self.done, self.progress = total, 0, progress

    def __call__(self, label: str) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(label, self.done, self.total)


def _bench(runtime: Runtime, grid: Grid) -> StepBench:
    return StepBench(runtime, warmup=grid.warmup, repeats=grid.repeats, max_repeats=grid.max_repeats,
                     min_time_s=grid.min_time_s)


def _grid_steps(bench: StepBench, decode, prefill, mixed, tick: _Tracker) -> list[StepPoint]:
    points = []
    tag = "" if bench.bits == 16 else f", {bench.bits}-bit KV"
    for batch, context in decode:
        points.append(bench.decode(batch, context))
        tick(f"decode step: batch {batch}, context {context}{tag}")
    for chunk, cached in prefill:
        points.append(bench.prefill(chunk, cached))
        tick(f"prefill step: chunk {chunk}, cached {cached}{tag}")
    for batch, context, chunk in mixed:
        points.append(bench.mixed(batch, context, chunk))
        tick(f"mixed step: batch {batch}, context {context}, chunk {chunk}{tag}")
    return points


def quantized_pool(runtime: Runtime, grid: Grid, bits: int) -> KVConfig:
    """``runtime``'s config with ``bits``-bit keys and values and a device pool that holds the quantized
    step points (their blocks at those bits plus every sequence's full-precision ring)."""
    spec, bs, itemsize = runtime.spec, runtime.store.block_size, runtime.model.dtype.itemsize
    config = runtime.config.with_knobs({"bitwidth.key_bits": bits, "bitwidth.value_bits": bits,
                                        "batching.max_num_seqs": grid.quant_seqs()})
    blocks = -(-grid.quant_pool_tokens(bs) // bs)
    pool = blocks * kv_block_bytes(spec, bs, itemsize, config) + ring_bytes(config, spec, itemsize)
    return config.with_knobs({"offload.device_kv_bytes": pool})


def _measure_steps(bench: StepBench, grid: Grid, tick: _Tracker) -> list[StepPoint]:
    """The 16-bit grid on ``bench``'s runtime, then the quantized points on the same model with a KV store
    at each of the grid's step bits (one store at a time: each is dropped before the next is built)."""
    points = _grid_steps(bench, grid.decode(), grid.prefill, grid.mixed, tick)
    for bits in grid.step_bits:
        quantized = bench.runtime.with_config(quantized_pool(bench.runtime, grid, bits))
        fill_kv(quantized)
        qbench = _bench(quantized, grid)
        points += _grid_steps(qbench, grid.quant_decode, grid.quant_prefill, (), tick)
        for batch, context in grid.quant_packing:
            points.append(qbench.packing(batch, context))
            tick(f"decode step that packs a block a sequence: batch {batch}, context {context}, {bits}-bit KV")
        del quantized, qbench
    for batch, budget in grid.compaction:
        evicting = bench.runtime.with_config(compaction_pool(bench.runtime, grid, batch, budget))
        fill_kv(evicting)
        points.append(_bench(evicting, grid).compaction(batch, budget))
        tick(f"decode step with compactions: batch {batch}, budget {budget} ({grid.compaction_policy})")
        del evicting
    if grid.scored_prefill:
        scoring = bench.runtime.with_config(scoring_pool(bench.runtime, grid))
        fill_kv(scoring)
        sbench = _bench(scoring, grid)
        for chunk, cached in grid.scored_prefill:
            points.append(sbench.prefill(chunk, cached, kind="scored"))
            tick(f"prefill step scored by attention: chunk {chunk}, cached {cached} ({grid.compaction_policy})")
        del scoring, sbench
    mask = held_out_mask(points)
    return [StepPoint(p.kind, p.grid, p.shape, p.timing, held) for p, held in zip(points, mask)]


def _projection_times(runtime: Runtime, grid: Grid, tick: _Tracker) -> ProjectionTimes | None:
    """The grid's projection passes on ``runtime``'s model and projection rule: every layer's weights (at most
    `kernels.linear.MEASURED_BYTES` of them, the time scaled to all of them), and the LM head."""
    if not grid.projection_rows:
        return None
    model = runtime.model
    weights = model.streamed_weights()
    layers = measured_weights(weights)[:-1]
    scale = sum(w.numel() for w in weights[:-1]) / sum(w.numel() for w in layers)
    rows = grid.projection_rows
    layers_s = [t * scale for t in pass_times(layers, rows, model.rule, grid.projection_rounds)]
    head_s = pass_times([model.lm_head], rows, model.rule, grid.projection_rounds)
    tick(f"projection passes at {len(rows)} sizes")
    return ProjectionTimes(tuple(rows), tuple(layers_s), tuple(head_s))


def compaction_pool(runtime: Runtime, grid: Grid, batch: int, budget: int) -> KVConfig:
    """``runtime``'s config with the grid's eviction policy at ``budget`` tokens and a device pool that holds
    ``batch`` sequences of a budget plus the block they grow by before each compaction, and room to spare."""
    bs = runtime.store.block_size
    return _evicting_pool(runtime, grid, budget, batch * (-(-budget // bs) + 3) + 64)


def scoring_pool(runtime: Runtime, grid: Grid) -> KVConfig:
    """``runtime``'s config with the grid's eviction policy at a budget of the longest scored prefill point's prompt
    (a sequence is compacted once it holds a block more: none is) and a device pool that holds two such prompts."""
    longest = max(chunk + cached for chunk, cached in grid.scored_prefill)
    return _evicting_pool(runtime, grid, longest, 2 * -(-(longest + 1) // runtime.store.block_size) + 64)


def _evicting_pool(runtime: Runtime, grid: Grid, budget: int, blocks: int) -> KVConfig:
    """``runtime``'s config with the grid's eviction policy at ``budget`` tokens and a device pool of ``blocks``."""
    spec, bs, itemsize = runtime.spec, runtime.store.block_size, runtime.model.dtype.itemsize
    config = runtime.config.with_knobs({"eviction.policy": grid.compaction_policy, "eviction.budget_tokens": budget})
    return config.with_knobs({"offload.device_kv_bytes": blocks * kv_block_bytes(spec, bs, itemsize, config)})


def _linear(names: tuple[str, ...], points: list[GridPoint], features: Callable[[GridPoint], list[float]]) -> Measured:
    x = np.array([features(p) for p in points], dtype=np.float64)
    fit = fit_linear(names, x, np.array([p.timing.median_s for p in points]))
    return Measured(tuple(points), fit, tuple(fit.predict_s(row) for row in x))


def _overhead(bench: StepBench, grid: Grid, tick: _Tracker) -> Measured:
    points = []
    for batch in grid.overhead_batches:
        points.append(bench.overhead(batch, grid.overhead_repeats))
        tick(f"scheduler overhead: batch {batch}")
    return _linear(("fixed", "seqs"), points, lambda p: [1.0, p.grid["batch"]])


def _kernel_args(runtime: Runtime, grid: Grid, tick: _Tracker) -> dict:
    return dict(spec=runtime.spec, block_size=runtime.store.block_size, dtype=runtime.model.dtype,
                device=runtime.model.device, warmup=2, repeats=grid.kernel_repeats,
                min_time_s=grid.min_time_s / 4, tick=tick)


def _attention(runtime: Runtime, grid: Grid, tick: _Tracker) -> Measured:
    args = _kernel_args(runtime, grid, tick)
    with torch.inference_mode():
        points = attention_timings(**args, decode=grid.kernel_decode(), prefill=grid.prefill)
        points += attention_timings(**args, decode=grid.quant_decode, prefill=grid.quant_prefill,
                                    bits=grid.kernel_bits)
    spec, bs, itemsize = runtime.spec, runtime.store.block_size, runtime.model.dtype.itemsize
    return _linear(ATTENTION_FEATURES, points, lambda p: attention_features(p, spec, bs, itemsize))


def _quantize(runtime: Runtime, grid: Grid, tick: _Tracker) -> Measured | None:
    """Quantize-on-append of one layer (None when the grid measures no quantized bits)."""
    if not (grid.kernel_bits and grid.quantize_blocks):
        return None
    with torch.inference_mode():
        points = quantize_timings(**_kernel_args(runtime, grid, tick), blocks=grid.quantize_blocks,
                                  bits=grid.kernel_bits)
    spec, bs = runtime.spec, runtime.store.block_size
    return _linear(QUANTIZE_FEATURES, points, lambda p: quantize_features(p, spec, bs))


def _transfers(runtime: Runtime, grid: Grid, disk_dir: Path | None, tick: _Tracker
               ) -> tuple[dict[str, Measured], dict[str, Measured]]:
    """(the links' fits, the disk tier's block conversions' fits: `records.BLOCK_IO`)."""
    store = runtime.store
    # the 16-bit store the steps are measured with holds a block as one tensor per layer's keys and values
    points = block_copy_timings(runtime.model.device, store.block_bytes, grid.copy_blocks,
                                parts=2 * len(store.layers), warmup=2, repeats=grid.transfer_repeats)
    tick("block copies device <-> host")
    points += disk_timings(disk_dir, grid.disk_bytes, warmup=1, repeats=grid.transfer_repeats)
    tick("file I/O host <-> disk")
    kinds = {kind: [p for p in points if p.kind == kind] for kind in dict.fromkeys(p.kind for p in points)}
    return ({kind: _transfer_fit(mine) for kind, mine in kinds.items() if kind not in BLOCK_IO},
            {kind: _linear(BLOCK_IO_FEATURES, mine, lambda p: block_io_features(p.grid["blocks"], p.grid["parts"],
                                                                                 p.grid["bytes"]))
             for kind, mine in kinds.items() if kind in BLOCK_IO})


def _transfer_fit(points: list[GridPoint]) -> Measured:
    """A transfer fit of points that each moved ``bytes`` in ``parts`` calls (one where not recorded)."""
    sizes, calls = [p.grid["bytes"] for p in points], [p.grid.get("parts", 1) for p in points]
    fit = fit_transfer(sizes, [p.timing.median_s for p in points], calls)
    return Measured(tuple(points), fit, tuple(fit.time_s(b, c) for b, c in zip(sizes, calls)))


DRIFT_RETIMINGS = 3  # the drift points are timed again this many times at the end; the median ratio is kept


def _drift(bench: StepBench, steps: list[StepPoint]) -> dict[str, float]:
    """The first 16-bit decode and prefill points timed again at the end of the measurement: end / start per
    kind. On a shared VM a one-token decode (memory bound) ran at x1.7-2.0 of its time 15 minutes earlier
    while prefills (compute bound) held, so a profile records how still the machine stood while it was taken.
    Each is timed `DRIFT_RETIMINGS` times, in turns, and the median kept: a slowdown in the last seconds alone
    had flagged a run whose whole grid held within 7% of an earlier one (x1.27 from one re-timing;
    `benchmarks/profile_drift.py` compares a run's points with a reference profile's in the order measured)."""
    firsts = {kind: next((p for p in steps if p.kind == kind and kv_bits(p.grid) == 16), None)
              for kind in ("decode", "prefill")}
    ratios: dict[str, list[float]] = {kind: [] for kind, first in firsts.items() if first is not None}
    for _ in range(DRIFT_RETIMINGS):
        for kind in ratios:
            g = firsts[kind].grid
            again = (bench.decode(g["batch"], g["context"]) if kind == "decode"
                     else bench.prefill(g["chunk"], g["cached"]))
            ratios[kind].append(again.timing.median_s / firsts[kind].timing.median_s)
    return {kind: statistics.median(r) for kind, r in ratios.items()}


IDLE_WAKE_CHUNK = 32  # the prompt timed after an idle engine: a short step, which the wake-up moves the most
IDLE_WAKE_STEPS = 4  # its steps timed after the idle: the prefill, then decodes (the second was slow now and then)
IDLE_WAKE_GAPS_S = (0.25, 2.0)  # the idles it is timed after (`cost.IdleWake` interpolates between them)


def _idle_wake(bench: StepBench, rounds: int, tick: _Tracker) -> IdleWake:
    """What the steps of a request that follows an idle engine take over the same steps back to back, after each
    of `IDLE_WAKE_GAPS_S` of idle, in ``rounds`` rounds: a short prompt's prefill and decodes (`IDLE_WAKE_STEPS`),
    back to back and after each idle in every round; the extra is a round's step over the median of its kind
    back to back. At low arrival rates every prompt's first step follows an idle engine, and the simulator,
    fed back-to-back step times only, predicted every TTFT p50 of `benchmarks/fidelity.py` short (-22% as a
    median of 18 replays on the Intel host; -13% with one point, after 0.5 s). Timed three times after each
    idle, the first step's extra had read 2.0-34.7 ms from one profile to the next on that host."""
    times_s = bench.after_idle(IDLE_WAKE_CHUNK, IDLE_WAKE_STEPS, (0.0,) + IDLE_WAKE_GAPS_S, rounds)
    back = np.median(times_s[0], axis=0)  # [steps]
    extras = times_s[1:] - back
    tick("steps after an idle engine")
    return IdleWake(IDLE_WAKE_GAPS_S, tuple(tuple(tuple(float(x) for x in steps) for steps in by_round)
                                            for by_round in extras))


def busy_note(load_average: float | None, cores: int) -> str | None:
    """A note when other work kept the machine busy as the measurement began (the 1-minute load average at
    least half the cores, or one core's worth): a profile measured so is slow throughout, which its own
    start-to-end drift does not show (a quick profile on a loaded 2-core VM predicted steps 10x the shipped
    one's, and every config then broke a 200 ms SLO)."""
    if load_average is None or load_average < max(1.0, cores / 2):
        return None
    return (f"measured while the machine was busy (load average {load_average:.1f} on {cores} cores as it began): "
            "its step times are likely slower than this machine's when quiet; measure again on a quiet machine")


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):  # (no load average on this platform)
        return None


def memory_backed(folder: str | os.PathLike[str], mounts_file: str = "/proc/mounts") -> str | None:
    """The file-system type (``tmpfs``, ``ramfs``) when ``folder`` lies on one held in memory, else None: a tester's
    tmpfs "disk" read at 25 GB/s, three times the host tier, with nothing said (fadvise drops nothing there)."""
    try:
        target = os.path.realpath(folder)
        mounts = [line.split()[1:3] for line in Path(mounts_file).read_text().splitlines() if len(line.split()) > 2]
    except OSError:
        return None
    best = max((m for m in mounts if target == m[0] or target.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=None)
    return best[1] if best is not None and best[1] in ("tmpfs", "ramfs") else None


def _notes(runtime: Runtime, disk_dir: Path | None, busy: str | None = None) -> dict[str, Any]:
    """The profile's ``notes`` (every prediction) and ``tier_notes`` (only those whose config uses the tier)."""
    memory = memory_backed(disk_dir if disk_dir is not None else tempfile.gettempdir())
    tier_notes = {"disk": (disk_note(disk_dir),) + (() if page_cache_dropped() and not memory else (PAGE_CACHE_NOTE,))
                  + ((f"the disk tier was timed on a memory-backed file system ({memory}): its figures are memory's, "
                      "not a drive's (give --disk-dir on the drive the tier will use)",) if memory else ())}
    if runtime.model.device.type == "cpu":
        tier_notes["host"] = (CPU_HOST_NOTE,)
    return {"notes": tuple(runtime.notes) + ((busy,) if busy else ()), "tier_notes": tier_notes}


def measure_profile(runtime: Runtime, grid: Grid, *, name: str, model: str, quick: bool,
                    disk_dir: Path | None = None, progress: Progress | None = None) -> HardwareProfile:
    """Measure every stage on ``runtime`` (its model, KV store and device) and fit the cost functions."""
    from skistune.runtime.disk_pool import default_disk_dir

    started = time.perf_counter()
    disk_dir = disk_dir if disk_dir is not None else default_disk_dir()  # (the drive the runtime's tier will use)
    busy = busy_note(load_average(), os.cpu_count() or 1)  # (before this process adds to the load)
    device = runtime.model.device
    tick = _Tracker(grid.units(), progress)
    fill_kv(runtime)
    bench = _bench(runtime, grid)
    meter = find_meter(device.type)
    if meter is None:
        steps = _measure_steps(bench, grid, tick)
    else:
        steps, busy_w = average_w(meter, lambda: _measure_steps(bench, grid, tick))
    table = _projection_times(runtime, grid, tick)
    step_fit = fit_step_points(steps, runtime.model.rule, table, parallel_rows(runtime.spec, device.type))
    overhead = _overhead(bench, grid, tick)
    attention = _attention(runtime, grid, tick)
    quantize = _quantize(runtime, grid, tick)
    transfers, block_io = _transfers(runtime, grid, disk_dir, tick)
    drift = _drift(bench, steps)
    idle_wake = _idle_wake(bench, grid.idle_wake_rounds, tick)
    fingerprint = machine_fingerprint(device.type)
    power = (modeled_power(device.type, fingerprint.cpu_count) if meter is None
             else measured_power(meter, grid.idle_s, busy_w))
    tick(f"power: {power.source}")
    return HardwareProfile(
        name=name, model=model, device=device.type, dtype=str(runtime.model.dtype).removeprefix("torch."),
        quick=quick, kv_bytes_per_token=bench.kv_bytes_per_token, block_size=runtime.store.block_size,
        fingerprint=fingerprint, duration_s=time.perf_counter() - started, steps=tuple(steps),
        step_fit=step_fit, overhead=overhead, attention=attention, transfers=transfers, power=power,
        **_notes(runtime, disk_dir, busy), quantize=quantize, disk_free_bytes=disk_free_bytes(disk_dir), drift=drift,
        block_io=block_io, idle_wake=idle_wake)


def _available_bytes(device: str) -> int | None:
    """Free memory where the weights and KV go (None where this platform does not say)."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    from skistune.host_memory import available_memory_bytes

    return available_memory_bytes()  # (None: measure and let the allocator say if it does not fit)


def _check_memory(model: str, dtype: torch.dtype, pool_bytes: int, device: str) -> None:
    spec = get_preset(model)
    # the model keeps q/k/v and gate/up fused: while it is built, those weights exist twice
    need = 2 * spec.param_count() * torch.empty((), dtype=dtype).element_size() + pool_bytes
    free = _available_bytes(device)
    if free is not None and need > free:
        raise ValueError(f"model {model}: needs about {need / 2 ** 30:.1f} GiB of {device} memory "
                         f"(weights and the profiling KV pool), {free / 2 ** 30:.1f} GiB is free")


def check_target(model: str, device: str) -> None:
    """A ``ValueError`` (one line) unless ``model`` is a preset and ``device`` is here to measure on."""
    if device not in DTYPES:
        raise ValueError(f"--device {device!r}: expected one of {', '.join(DTYPES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device on this machine")
    get_preset(model)


def profile_model(model: str = "smollm2-135m", *, device: str = "cpu", quick: bool = False,
                  disk_dir: Path | None = None, progress: Progress | None = None,
                  grid: Grid | None = None) -> HardwareProfile:
    """Profile a model preset on this machine (real weights where the preset has them, else random)."""
    check_target(model, device)
    grid = grid or (QUICK_GRID if quick else FULL_GRID)
    spec, dtype = get_preset(model), DTYPES[device]
    block_size = KVConfig().prefix_reuse.block_size
    bytes_per_token = kv_traffic(KVConfig(), spec, dtype.itemsize).bytes_per_token
    pool_bytes = grid.pool_tokens(block_size) * bytes_per_token
    # the quantized step points' store (fewer tokens at under 16 bits, plus rings) lives next to the 16-bit
    # one: it is smaller than that one
    _check_memory(model, dtype, 2 * pool_bytes, device)
    config = KVConfig().with_knobs({"offload.device_kv_bytes": pool_bytes})
    runtime = Runtime.from_preset(model, config, device=device, dtype=dtype)
    # the projection rule timed again with the machine, and cached for the runtime: one cached on a busy machine
    # had made batch-1 decodes x1.45 slower than the quiet machine's rule (10 s on a quiet 2-core host)
    runtime.model.rule = machine_rule(runtime.model.streamed_weights(), spec.name, fresh=True)
    name = f"{device}-{model}" + ("-quick" if quick else "")
    return measure_profile(runtime, grid, name=name, model=model, quick=quick, disk_dir=disk_dir,
                           progress=progress)
