"""Measuring a `HardwareProfile`: the grids (full and ``--quick``), the runtime they run on, and the
order of the stages (steps, scheduler overhead, attention kernel, transfers, power), then the fits."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..config import KVConfig
from ..runtime.llm import Runtime
from ..runtime.presets import get_preset
from .fingerprint import machine_fingerprint
from .fit import fit_linear, fit_step_cost, fit_transfer
from .kernels import ATTENTION_FEATURES, attention_features, attention_timings
from .power import average_w, find_meter, measured_power, modeled_power
from .profile import HardwareProfile, Measured
from .records import GridPoint, StepPoint
from .steps import StepBench, fill_kv
from .transfers import block_copy_timings, disk_timings, page_cache_dropped

Progress = Callable[[str, int, int], None]  # (what was just measured, units done, units in all)
DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}  # what the runtime serves with on each device


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

    def __post_init__(self) -> None:
        for chunk, cached in self.prefill:
            if cached % chunk:
                raise ValueError(f"prefill point ({chunk}, {cached}): cached tokens must be a multiple of the chunk")

    def decode(self) -> list[tuple[int, int]]:
        return [(b, c) for b in self.decode_batches for c in self.decode_contexts
                if b * c <= self.max_decode_kv_tokens]

    def units(self) -> int:
        """Progress units: one per grid point, kernel case, transfer stage and the power figure."""
        steps = len(self.decode()) + len(self.prefill) + len(self.mixed)
        return steps + len(self.overhead_batches) + len(self.decode()) + len(self.prefill) + 2 + 1

    def pool_tokens(self, block_size: int) -> int:
        """KV tokens the largest grid point holds at once, with room for block rounding and growth."""
        steps = self.warmup + self.max_repeats + 8
        decode = [b * (c + steps + b * c // 4096 + block_size) for b, c in self.decode()]
        mixed = [b * (c + steps + b * c // 4096 + block_size) + n + block_size for b, c, n in self.mixed]
        prefill = [n + k + block_size for n, k in self.prefill]
        return max(decode + mixed + prefill) + 64 * block_size


FULL_GRID = Grid(
    decode_batches=(1, 2, 4, 8, 16, 32, 64), decode_contexts=(32, 128, 512, 1024, 2048), max_decode_kv_tokens=32768,
    prefill=tuple((n, k) for n in (16, 64, 256, 512) for k in (0, 512, 1536)),
    mixed=((2, 512, 64), (4, 256, 256), (8, 1024, 64), (16, 512, 256), (32, 128, 512), (64, 256, 128)),
    warmup=2, repeats=5, max_repeats=25, min_time_s=1.0,
    overhead_batches=(1, 4, 16, 64, 256), overhead_repeats=30, kernel_repeats=10,
    copy_blocks=(1, 2, 4, 8, 16, 32, 64), disk_bytes=tuple(4096 * 4 ** i for i in range(8)),
    transfer_repeats=5, idle_s=2.0)

QUICK_GRID = Grid(
    decode_batches=(1, 2, 4, 8, 16, 32, 64), decode_contexts=(64, 512, 2048), max_decode_kv_tokens=16384,
    prefill=((32, 0), (256, 0), (128, 256), (32, 512), (256, 512)), mixed=((4, 256, 64), (16, 1024, 128)),
    warmup=1, repeats=3, max_repeats=10, min_time_s=0.3,
    overhead_batches=(1, 16, 128), overhead_repeats=15, kernel_repeats=5,
    copy_blocks=(1, 4, 16, 64), disk_bytes=(64 << 10, 1 << 20, 4 << 20, 16 << 20), transfer_repeats=5, idle_s=1.0)


def held_out_mask(points: list[StepPoint], every: int = 3) -> list[bool]:
    """Every ``every``-th interior point of each kind (strictly inside the grid on every axis): the fit
    is checked on interpolation, never on the edges it would have to extrapolate to."""
    mask = [False] * len(points)
    for kind in {p.kind for p in points}:
        members = [i for i, p in enumerate(points) if p.kind == kind]
        axes = {axis: [points[i].grid[axis] for i in members] for axis in points[members[0]].grid}
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


def _measure_steps(bench: StepBench, grid: Grid, tick: _Tracker) -> list[StepPoint]:
    points = []
    for batch, context in grid.decode():
        points.append(bench.decode(batch, context))
        tick(f"decode step: batch {batch}, context {context}")
    for chunk, cached in grid.prefill:
        points.append(bench.prefill(chunk, cached))
        tick(f"prefill step: chunk {chunk}, cached {cached}")
    for batch, context, chunk in grid.mixed:
        points.append(bench.mixed(batch, context, chunk))
        tick(f"mixed step: batch {batch}, context {context}, chunk {chunk}")
    mask = held_out_mask(points)
    return [StepPoint(p.kind, p.grid, p.shape, p.timing, held) for p, held in zip(points, mask)]


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


def _attention(runtime: Runtime, grid: Grid, tick: _Tracker) -> Measured:
    spec, store = runtime.spec, runtime.store
    with torch.inference_mode():
        points = attention_timings(spec, store.block_size, runtime.model.dtype, runtime.model.device,
                                   decode=grid.decode(), prefill=grid.prefill, warmup=2,
                                   repeats=grid.kernel_repeats, min_time_s=grid.min_time_s / 4, tick=tick)
    per_layer_bytes = store.block_bytes // store.block_size // spec.n_layers
    return _linear(ATTENTION_FEATURES, points, lambda p: attention_features(p, per_layer_bytes))


def _transfers(runtime: Runtime, grid: Grid, disk_dir: Path | None, tick: _Tracker) -> dict[str, Measured]:
    store = runtime.store
    points = block_copy_timings(runtime.model.device, store.block_bytes, grid.copy_blocks, warmup=2,
                                repeats=grid.transfer_repeats)
    tick("block copies device <-> host")
    points += disk_timings(disk_dir, grid.disk_bytes, warmup=1, repeats=grid.transfer_repeats)
    tick("file I/O host <-> disk")
    out = {}
    for link in dict.fromkeys(p.kind for p in points):
        mine = [p for p in points if p.kind == link]
        fit = fit_transfer([p.grid["bytes"] for p in mine], [p.timing.median_s for p in mine])
        out[link] = Measured(tuple(mine), fit, tuple(fit.time_s(p.grid["bytes"]) for p in mine))
    return out


def _notes(runtime: Runtime, disk_dir: Path | None) -> tuple[str, ...]:
    notes = list(runtime.notes)
    if runtime.model.device.type == "cpu":
        notes.append("device is the CPU: device <-> host transfers are block copies within host memory")
    notes.append(f"disk: {disk_dir}" if disk_dir is not None else "disk: a temporary directory")
    if not page_cache_dropped():
        notes.append("disk reads may come from the page cache (no posix_fadvise here)")
    return tuple(notes)


def measure_profile(runtime: Runtime, grid: Grid, *, name: str, model: str, quick: bool,
                    disk_dir: Path | None = None, progress: Progress | None = None) -> HardwareProfile:
    """Measure every stage on ``runtime`` (its model, KV store and device) and fit the cost functions."""
    started = time.perf_counter()
    device = runtime.model.device
    tick = _Tracker(grid.units(), progress)
    fill_kv(runtime)
    bench = StepBench(runtime, warmup=grid.warmup, repeats=grid.repeats, max_repeats=grid.max_repeats,
                      min_time_s=grid.min_time_s)
    meter = find_meter(device.type)
    if meter is None:
        steps = _measure_steps(bench, grid, tick)
    else:
        steps, busy_w = average_w(meter, lambda: _measure_steps(bench, grid, tick))
    step_fit = fit_step_cost([p.shape for p in steps], [p.timing.median_s for p in steps],
                             [p.held_out for p in steps])
    overhead = _overhead(bench, grid, tick)
    attention = _attention(runtime, grid, tick)
    transfers = _transfers(runtime, grid, disk_dir, tick)
    fingerprint = machine_fingerprint(device.type)
    power = (modeled_power(device.type, fingerprint.cpu_count) if meter is None
             else measured_power(meter, grid.idle_s, busy_w))
    tick(f"power: {power.source}")
    return HardwareProfile(
        name=name, model=model, device=device.type, dtype=str(runtime.model.dtype).removeprefix("torch."),
        quick=quick, kv_bytes_per_token=bench.kv_bytes_per_token, block_size=runtime.store.block_size,
        fingerprint=fingerprint, duration_s=time.perf_counter() - started, steps=tuple(steps),
        step_fit=step_fit, overhead=overhead, attention=attention, transfers=transfers, power=power,
        notes=_notes(runtime, disk_dir))


def _available_bytes(device: str) -> int | None:
    """Free memory where the weights and KV go (None where this platform does not say)."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass  # not Linux: measure and let the allocator say if it does not fit
    return None


def _check_memory(model: str, dtype: torch.dtype, pool_bytes: int, device: str) -> None:
    spec = get_preset(model)
    # the model keeps q/k/v and gate/up fused: while it is built, those weights exist twice
    need = 2 * spec.param_count() * torch.empty((), dtype=dtype).element_size() + pool_bytes
    free = _available_bytes(device)
    if free is not None and need > free:
        raise ValueError(f"model {model}: needs about {need / 2 ** 30:.1f} GiB of {device} memory "
                         f"(weights and the profiling KV pool), {free / 2 ** 30:.1f} GiB is free")


def profile_model(model: str = "smollm2-135m", *, device: str = "cpu", quick: bool = False,
                  disk_dir: Path | None = None, progress: Progress | None = None,
                  grid: Grid | None = None) -> HardwareProfile:
    """Profile a model preset on this machine (real weights where the preset has them, else random)."""
    if device not in DTYPES:
        raise ValueError(f"--device {device!r}: expected one of {', '.join(DTYPES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device on this machine")
    grid = grid or (QUICK_GRID if quick else FULL_GRID)
    spec, dtype = get_preset(model), DTYPES[device]
    block_size = KVConfig().prefix_reuse.block_size
    bytes_per_token = spec.n_layers * 2 * spec.n_kv_heads * spec.head_dim * torch.empty((), dtype=dtype).element_size()
    pool_bytes = grid.pool_tokens(block_size) * bytes_per_token
    _check_memory(model, dtype, pool_bytes, device)
    config = KVConfig().with_knobs({"offload.device_kv_bytes": pool_bytes})
    runtime = Runtime.from_preset(model, config, device=device, dtype=dtype)
    name = f"{device}-{model}" + ("-quick" if quick else "")
    return measure_profile(runtime, grid, name=name, model=model, quick=quick, disk_dir=disk_dir,
                           progress=progress)
