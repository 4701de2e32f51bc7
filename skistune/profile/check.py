"""How fast this machine runs a profile's steps now, against when the profile was measured.

A profile is a snapshot: on a shared host the same grid point measured an hour apart moved by 10% and
more (BENCHMARKS.md, "Hardware profile"), and every prediction made from the profile moves with it. The
check times a few of the profile's own 16-bit step points again, the way the profiler timed them
(`StepBench`: the same engine, setup and medians), and reports now / then per kind of step (decode,
prefill, mixed) and over all: 1.10 means this machine now runs those steps 10% slower than the profile
says, so its predictions of them are optimistic (about 9% short of today's times). The kinds are reported
apart because they drift apart: decodes read memory, prefills compute. `skistune profile --check FILE` prints it;
`benchmarks/fidelity.py` measures it before and after its replays, so that the drift of the machine and
the error of the model can be told apart.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from ..config import KVConfig
from ..runtime.kv_layout import kv_traffic
from ..runtime.llm import Runtime
from ..runtime.presets import get_preset
from .cost import ScaledStepCost, StepCostModel
from .measure import DTYPES, _check_memory, _pool_tokens, check_target
from .profile import HardwareProfile
from .records import StepPoint, kv_bits
from .steps import StepBench, fill_kv

PER_KIND = 2  # points of each kind (decode, prefill, mixed) timed again: the fastest and the median one
MAX_KV_TOKENS = 8192  # ... among those holding at most this much KV (a small pool, quickly filled)
SETTINGS = dict(warmup=1, repeats=3, max_repeats=5, min_time_s=0.3)  # the quick grid's


@dataclass(frozen=True)
class CheckedPoint:
    kind: str
    grid: dict
    then_s: float  # the profile's median
    now_s: float  # measured again now

    @property
    def ratio(self) -> float:
        return self.now_s / self.then_s


@dataclass(frozen=True)
class SpeedCheck:
    points: tuple[CheckedPoint, ...]

    @property
    def ratio(self) -> float:
        """Median of now / then over the points: above 1, this machine is slower now."""
        return statistics.median(p.ratio for p in self.points)

    def by_kind(self) -> dict[str, float]:
        """Median of now / then per kind of step. The kinds move apart: on a shared VM one-token decodes (memory
        bound) ran x1.7-2.0 of their profiled time while prefills (compute bound) ran x1.04, 15 minutes
        after the profile, and the median over all points read x1.045."""
        kinds = dict.fromkeys(p.kind for p in self.points)
        return {k: statistics.median(p.ratio for p in self.points if p.kind == k) for k in kinds}

    def by_kind_text(self) -> str:
        """`by_kind` in words: ``decode x1.113, prefill x1.018``."""
        return ", ".join(f"{k} x{r:.3f}" for k, r in self.by_kind().items())

    def verdict(self, tolerance: float = 0.05) -> str:
        """What the ratios mean for predictions from the profile, in words: per kind where they disagree."""
        kinds = self.by_kind()
        off = {k: r for k, r in kinds.items() if abs(r - 1) >= tolerance}
        if not off:
            return f"every kind of step within {tolerance:.0%} of when it was measured"
        return "; ".join(_kind_verdict(k, r) for k, r in off.items()) + (
            f" (the others within {tolerance:.0%})" if len(off) < len(kinds) else "")

    def summary_line(self) -> str:
        """The check in one line, as `skistune profile --check` and `skistune evaluate --mode compare` print it."""
        return (f"this machine runs the profile's steps x{self.ratio:.3f} (median of {len(self.points)}; "
                f"{self.by_kind_text()}): {self.verdict()}")

    def to_dict(self) -> dict:
        return {"ratio": self.ratio, "by_kind": self.by_kind(),
                "points": [{"kind": p.kind, "grid": p.grid, "then_s": p.then_s, "now_s": p.now_s, "ratio": p.ratio}
                           for p in self.points]}


def cost_at_speed(step_cost: StepCostModel, checks: Sequence[Mapping]) -> ScaledStepCost:
    """``step_cost`` at the speed the given checks timed (`SpeedCheck.to_dict` of each; before and after a run, the
    speed it most likely ran at): per kind, the geometric mean of the checks' now / then; compactions and kinds
    no check timed, that of their overall ratios."""
    if not checks:
        raise ValueError("no speed check to scale the step costs by")

    mean = statistics.geometric_mean
    kinds = dict.fromkeys(k for c in checks for k in c["by_kind"])
    factors = tuple((k, mean([c["by_kind"][k] for c in checks if k in c["by_kind"]])) for k in kinds)
    return ScaledStepCost(step_cost, factors, mean([c["ratio"] for c in checks]))


def _kind_verdict(kind: str, ratio: float) -> str:
    """One kind's now / then in plain words: how much slower or faster this machine runs such steps than the
    profile says, and which way its predictions err. ("predictions of them about 47% fast" had been read as
    a speed, not as predictions too optimistic.) A prediction's error against today's time is then / now - 1:
    x2.00 now, this machine runs them 100% slower and the predictions are 50% short of today's times."""
    if ratio > 1:
        return (f"{kind} steps x{ratio:.2f}: this machine runs them {ratio - 1:.0%} slower than the profile says, "
                f"so its predictions of them are optimistic (about {1 - 1 / ratio:.0%} short of today's times)")
    return (f"{kind} steps x{ratio:.2f}: this machine runs them {1 - ratio:.0%} faster than the profile says, "
            f"so its predictions of them are pessimistic (about {1 / ratio - 1:.0%} over today's times)")


def _kv_tokens(p: StepPoint) -> int:
    g = p.grid
    if p.kind == "prefill":
        return g["chunk"] + g["cached"]
    return g["batch"] * g["context"] + g.get("chunk", 0)


def check_points(profile: HardwareProfile, per_kind: int = PER_KIND) -> list[StepPoint]:
    """The 16-bit step points timed again: per kind, among those holding at most `MAX_KV_TOKENS`, the
    fastest and the median (by the profile's time), so that both the fixed costs and the KV terms show."""
    picked = []
    for kind in ("decode", "prefill", "mixed"):
        points = sorted((p for p in profile.steps if p.kind == kind and kv_bits(p.grid) == 16
                         and _kv_tokens(p) <= MAX_KV_TOKENS), key=lambda p: p.timing.median_s)
        if points:
            chosen = {0, len(points) // 2} if per_kind > 1 else {len(points) // 2}
            picked += [points[i] for i in sorted(chosen)][:per_kind]
    return picked


def check_device(profile: HardwareProfile) -> None:
    """A one-line ``ValueError`` when this machine lacks the device ``profile`` was measured on (it had read
    ``--device cuda: ...``, an option the user never passed)."""
    if profile.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"profile {profile.name} ({profile.model}) was measured on cuda and this machine has no "
                         "CUDA device: check it on a machine with one")


def speed_check(profile: HardwareProfile, runtime: Runtime | None = None, per_kind: int = PER_KIND,
                progress: Callable[[str, int, int], None] | None = None) -> SpeedCheck:
    """Time `check_points` again on ``runtime`` (its model; a store sized for the points replaces its own)
    or on the profile's model loaded here."""
    points = check_points(profile, per_kind)
    if not points:
        raise ValueError(f"profile {profile.name}: no 16-bit step points of at most {MAX_KV_TOKENS} KV tokens "
                         "to time again")
    block_size = KVConfig().prefix_reuse.block_size
    decode = [(p.grid["batch"], p.grid["context"]) for p in points if p.kind == "decode"]
    mixed = [(p.grid["batch"], p.grid["context"], p.grid["chunk"]) for p in points if p.kind == "mixed"]
    prefill = [(p.grid["chunk"], p.grid["cached"]) for p in points if p.kind == "prefill"]
    tokens = _pool_tokens(decode, mixed, prefill, SETTINGS["warmup"] + SETTINGS["max_repeats"] + 8, block_size)
    if runtime is None:  # (a CUDA profile on a CPU machine, a model too large for it: one line, as profile_model)
        check_device(profile)
        try:
            check_target(profile.model, profile.device)
            dtype = DTYPES[profile.device]
            _check_memory(profile.model, dtype, 2 * tokens * kv_traffic(
                KVConfig(), get_preset(profile.model), dtype.itemsize).bytes_per_token, profile.device)
        except ValueError as exc:
            raise ValueError(f"profile {profile.name} ({profile.model} on {profile.device}): {exc}") from None
        runtime = Runtime.from_preset(profile.model, KVConfig(), device=profile.device, dtype=dtype)
    profile.run_as_measured(runtime)  # (its own steps, as it timed them: with its projection rule)
    bytes_per_token = kv_traffic(KVConfig(), runtime.spec, runtime.model.dtype.itemsize).bytes_per_token
    runtime = runtime.with_config(KVConfig().with_knobs({"offload.device_kv_bytes": tokens * bytes_per_token}))
    fill_kv(runtime)
    bench = StepBench(runtime, **SETTINGS)
    checked = []
    for i, p in enumerate(points):
        g = p.grid
        if progress is not None:
            progress(f"timing the profile's {p.kind} step {g} again", i, len(points))
        now = (bench.decode(g["batch"], g["context"]) if p.kind == "decode" else
               bench.prefill(g["chunk"], g["cached"]) if p.kind == "prefill" else
               bench.mixed(g["batch"], g["context"], g["chunk"]))
        checked.append(CheckedPoint(p.kind, dict(g), p.timing.median_s, now.timing.median_s))
    return SpeedCheck(tuple(checked))
