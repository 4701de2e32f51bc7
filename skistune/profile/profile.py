"""`HardwareProfile`: what `skistune profile` measured on one machine for one model, with the fitted cost
functions every later prediction reads, and the file format (``profiles/<name>.json``). Torch-free to
load; comparing the fingerprint with this machine's imports torch.

A file that cannot be read back (truncated, corrupted, a field missing or of the wrong type) raises
``ValueError`` naming the file and the field; one measured on another fingerprint warns and names what
differs. A file measured before quantized KV existed (no step points below 16 bits, no quantize-on-append
kernel) still loads: its step costs extrapolate quantized KV from the bytes it reads, and
`HardwareProfile.quantized_kv_note` says so (the simulator adds it to the notes of every config that
quantizes KV).
"""
from __future__ import annotations

import contextlib
import importlib.resources
import json
import math
import os
import uuid
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from skistune.config import load_json, shown, shown_name
from skistune.kernels.cache import exclusive, user_cache_dir
from skistune.paths import shipped_or_path

from skistune.kernels.rows import ProjectionRule
from skistune.quality.model import FORMAT as QUALITY_FORMAT
from skistune.runtime.presets import get_preset
from skistune.runtime.tiers import CPU_HOST_NOTE  # noqa: F401 (a tier note of profiles; re-exported)

from .cost import (ALL_FEATURES, IDLE_WAKE_GAP_S, MIXED_FEATURES, IdleWake, ProjectionTimes, StepCostModel,
                   parallel_rows)
from .fields import entry, finite, integer, items, number, text
from .fingerprint import Fingerprint, fingerprint_diff, machine_fingerprint
from .fit import MIN_S_PER_BYTE, FitQuality, LinearFit, StepFit, TransferFit, fit_step_cost
from .power import POWER_SOURCES, PowerModel
from .records import BLOCK_IO, BLOCK_IO_FEATURES, LINKS, GridPoint, StepPoint, block_io_features, kv_bits

FORMAT = "skistune.hardware_profile"
FORMAT_VERSION = 1
DEVICES = ("cpu", "cuda")
DRIFT_NOTE_AT = 0.10  # a kind of step that ran this much faster or slower at the end of the measurement is noted
# a quick profile measured while its steps drifted by this factor or more, or whose step fit misses its own
# training points by this much at the median, is not kept for `skistune optimize`: measured beside a busy
# process on a 2-core host, one ran its decode steps x14 slower at the end than at the start, another's fit
# missed by 63% at the median, and every later search read them. (Not R²: the H200 profile's flat step times
# give R² 0.06 at a 6.8% median error.)
UNRELIABLE_DRIFT = 2.0
UNRELIABLE_MEDIAN_ERROR = 0.25
STEP_FIT_NOTE_AT = 0.15  # median miss of the step fit's held-out points from which predictions say so
# a quick profile that drifted by this factor or more (kept, with its note) is measured once more when it is
# measured for a command, and the steadier of the two kept: one drifted x0.68 within itself on a 2-core host
# and put the chat baseline's capacity at 0.0153 req/s, where a profile of the same host had read 0.12
REMEASURE_DRIFT = 1.25


# notes that hold only for a prediction whose config uses the tier: keyed by tier, with the links whose transfers
# the notes are about (a disk tier's blocks also cross device <-> host, so its configs carry both tiers' notes)
TIER_LINKS = {"host": ("device_to_host", "host_to_device"), "disk": ("host_to_disk", "disk_to_host")}
PAGE_CACHE_NOTE = ("disk-tier reads may have been timed from the page cache, not the disk (no posix_fadvise here "
                   "to drop it first)")
# the tier notes `measure._notes` wrote into the one `notes` list before tier notes were kept apart (the
# shipped profiles): told apart on reading such a file by these texts (and CPU_HOST_NOTE)
LEGACY_PAGE_CACHE_NOTE = "disk reads may come from the page cache (no posix_fadvise here)"
LEGACY_DISK_PREFIX = "disk: "  # then the --disk-dir, or:
LEGACY_TEMP_DISK = "a temporary directory"


def disk_note(disk_dir: str | os.PathLike[str] | None) -> str:
    """Where the profile timed its disk transfers (``disk_dir``, or a new temporary directory when None)."""
    where = os.fspath(disk_dir) if disk_dir is not None else "a new temporary directory (the system's default)"
    return (f"disk-tier transfers were timed on a scratch file in {where}: a disk tier on another drive may be "
            "faster or slower (`skistune profile --disk-dir DIR` times the drive the tier will use)")


class FingerprintWarning(UserWarning):
    """A profile measured on another machine or software stack than this one."""


@dataclass(frozen=True)
class Measured:
    """Timings at grid points, the cost function fitted to them and its prediction at each point."""

    points: tuple[GridPoint, ...]
    fit: Any  # LinearFit or TransferFit
    predicted_s: tuple[float, ...]

    def to_dict(self) -> dict:
        return {"points": [_with_residual(p.to_dict(), p.timing.median_s, predicted_s)
                           for p, predicted_s in zip(self.points, self.predicted_s)],
                "fit": self.fit.to_dict()}


def _with_residual(point: dict, measured_s: float, predicted_s: float) -> dict:
    return {**point, "predicted_s": predicted_s, "rel_error": predicted_s / measured_s - 1.0}


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    model: str
    device: str
    dtype: str
    quick: bool
    kv_bytes_per_token: int  # at 16 bits in the KV store's dtype, over all layers (checked by the simulator)
    block_size: int
    fingerprint: Fingerprint
    duration_s: float
    steps: tuple[StepPoint, ...]
    step_fit: StepFit
    overhead: Measured  # engine steps with no model: fixed + per sequence
    attention: Measured  # one layer's paged attention kernel
    transfers: dict[str, Measured]  # per link: device_to_host, host_to_device, host_to_disk, disk_to_host
    power: PowerModel
    notes: tuple[str, ...] = ()  # hold for every prediction from this profile
    quantize: Measured | None = None  # quantize-on-append of one layer; None in files measured before it existed
    # free space of the disk the transfers were timed on, when they were: bounds the disk KV tier the
    # optimizer may recommend for this machine (None: not recorded, as in files written before it was)
    disk_free_bytes: int | None = None
    # what the steps after an idle engine take over the same steps back to back (`cost.IdleWake`); None where
    # not measured (files written before it)
    idle_wake: IdleWake | None = None
    # each kind's first step point timed again at the end of the measurement, end / start (`measure._drift`):
    # how still the machine stood while the profile was taken (empty in files written before it was recorded)
    drift: dict[str, float] = field(default_factory=dict)
    # tier (`TIER_LINKS`) -> notes that hold only for predictions whose config uses that tier
    tier_notes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # the disk tier's conversions of blocks to and from bytes (`records.BLOCK_IO`): linear in the blocks, their
    # part tensors and their bytes (`records.BLOCK_IO_FEATURES`); empty in files measured before they were timed
    block_io: dict[str, Measured] = field(default_factory=dict)

    @property
    def all_notes(self) -> tuple[str, ...]:
        """Every note on how the profile was measured: the general ones, then each tier's."""
        return self.notes + tuple(n for tier in TIER_LINKS for n in self.tier_notes.get(tier, ()))

    @property
    def step_cost(self) -> StepCostModel:
        return self.step_fit.model

    @property
    def threads(self) -> int:
        return self.fingerprint.threads

    def run_as_measured(self, runtime) -> None:
        """Make ``runtime`` (the real model, on this profile's device) compute its projections as the profile's
        steps did (`StepCostModel.rows`), so that replays checking this profile's predictions run the steps it
        timed. The runtime's own rule is this machine's cached one (`kernels.linear.machine_rule`), measured
        once, maybe on a busy machine: a rule cached under load made batch-1 decodes x1.45 the profile's (26.3
        against 18.2 ms), which a fidelity run read as a 25-28% error in every TBT p50."""
        if runtime.model.device.type == self.device:
            runtime.model.rule = self.step_cost.rows

    def transfer_time_s(self, nbytes: int, link: str) -> float:
        if link not in self.transfers:
            raise ValueError(f"transfer link {link!r}: not in this profile (has {', '.join(self.transfers)})")
        return self.transfers[link].fit.time_s(nbytes)

    def refit_steps(self) -> "HardwareProfile":
        """The same measurements with the step cost model fitted again by this version's model (its
        features; the rows the steps were measured with), on the same training and held-out points: a
        profile written by an older version gains what the model learned without measuring again. Refused
        (``ValueError``) where the training points do not cover the steps the simulator predicts from the
        fit (`step_coverage_gaps`)."""
        gaps = step_coverage_gaps(self.steps)
        if gaps:
            raise ValueError(f"profile {self.name}: cannot refit the step cost model: its training step points "
                             f"have no {', no '.join(gaps)}, and the simulator would extrapolate such steps "
                             "from it; measure the profile again (`skistune profile`)")
        return replace(self, step_fit=fit_step_points(self.steps, self.step_cost.rows, self.step_cost.table,
                                                      self._parallel_rows()))

    def _parallel_rows(self) -> tuple[int, ...]:
        """Where the model's elementwise ops go parallel on this device (`cost.parallel_rows`): as the fit
        recorded them, else from the model's preset (none for a model that is not one: a test's tiny Llama)."""
        if self.step_cost.parallel_rows:
            return self.step_cost.parallel_rows
        try:
            spec = get_preset(self.model)
        except ValueError:
            return ()
        return parallel_rows(spec, self.device)

    @property
    def fitted_before_parallel_terms(self) -> bool:
        """Whether the step fit predates the terms for elementwise ops going parallel (`cost.parallel_rows`)
        where this profile's device and model have them: a refit adds them, from the same points."""
        return not self.step_cost.parallel_rows and bool(self._parallel_rows())

    @property
    def fitted_before_mixed_term(self) -> bool:
        """Whether the step fit predates the term for steps that run decode rows and prefill chunks together
        (`cost.MIXED_FEATURES`) while the profile measured such steps: a refit adds it, from the same points."""
        return (self.step_cost.fitted_terms <= ALL_FEATURES.index(MIXED_FEATURES[0])
                and any(p.kind == "mixed" for p in self.steps))

    @property
    def fitted_before_current_terms(self) -> bool:
        """Whether a refit from the profile's own points would add terms this version's step model has."""
        return self.fitted_before_parallel_terms or self.fitted_before_mixed_term

    @property
    def step_coverage_note(self) -> str | None:
        """A note when the step fit's training points do not cover the steps it predicts (a file edited
        down to a few points): its step times for those steps are extrapolations."""
        gaps = step_coverage_gaps(self.steps)
        if not gaps:
            return None
        return (f"profile {self.name}: its step fit's training points have no {', no '.join(gaps)}: its step "
                "times for such steps are extrapolated and cannot be trusted; measure it again (`skistune profile`)")

    @property
    def measures_quantized_kv(self) -> bool:
        """Whether the step fit saw steps with quantized KV (else its quantized-KV terms are zero)."""
        return any(kv_bits(p.grid) != 16 for p in self.steps)

    @property
    def drift_note(self) -> str | None:
        """A note when the machine's speed moved by `DRIFT_NOTE_AT` or more while the profile was measured."""
        moved = {k: r for k, r in self.drift.items() if abs(r - 1) >= DRIFT_NOTE_AT}
        if not moved:
            return None
        kinds = ", ".join(f"{k} steps x{r:.2f}" for k, r in moved.items())
        # (--cache replaces the CPU quick profile optimize keeps for this machine: no help for a GPU's, or another's)
        model = "" if self.model == "smollm2-135m" else f" --model {self.model}"
        how = (f"`skistune profile --cache{model}` replaces the quick profile `skistune optimize` keeps" if
               self.quick and self.device == "cpu" else
               f"`skistune profile --device {self.device}{model}{' --quick' if self.quick else ''} --out FILE` on the "
               "machine it describes")
        return (f"profile {self.name}: the machine's speed moved while it was measured ({kinds} at the end against "
                f"the start): its predictions carry that much error; measure it again on a quiet machine ({how})")

    @property
    def step_fit_note(self) -> str | None:
        """A note when the step-time fit, which every prediction reads, misses its held-out points (else its own)
        by `STEP_FIT_NOTE_AT` or more at the median: a quick profile missing them by 94% had been used silently,
        flagged only by `skistune profile --show`. (Not R² alone: a GPU's step times vary little, and the shipped
        H200 profile's R² of 0.06 goes with a median error of 7%.)"""
        name, q = (("held-out points", self.step_fit.held_out) if self.step_fit.held_out is not None
                   else ("its own points", self.step_fit.train))
        if q.median_rel_error < STEP_FIT_NOTE_AT:
            return None
        r2 = f", R² {q.r2:.2f}" if q.r2 is not None else ""
        return (f"profile {self.name}: its step-time fit misses its {name} by {q.median_rel_error:.0%} at the median"
                f"{r2}: predictions from it carry errors that large; measure it again (`skistune profile`)")

    @property
    def drift_factor(self) -> float:
        """How far the most-drifting kind of step moved while measured, as a factor >= 1 (x0.68 reads 1.47)."""
        return max((max(r, 1 / r) for r in self.drift.values()), default=1.0)

    @property
    def unreliable(self) -> str | None:
        """Why this profile's timings cannot be trusted (the machine's speed moved by `UNRELIABLE_DRIFT` or
        more while measuring, or the step fit misses its points by `UNRELIABLE_MEDIAN_ERROR` at the median),
        or None."""
        reasons = [f"{k} steps ran x{r:.2f} at the end against the start" for k, r in self.drift.items()
                   if not 1 / UNRELIABLE_DRIFT < r < UNRELIABLE_DRIFT]
        miss = self.step_fit.train.median_rel_error
        if miss > UNRELIABLE_MEDIAN_ERROR:
            reasons.append(f"its step fit misses the measured steps by {miss:.0%} at the median")
        return "; ".join(reasons) or None

    @property
    def quantized_kv_note(self) -> str | None:
        """What a prediction for quantized KV rests on, where it is not measured."""
        if self.measures_quantized_kv:
            return None
        return (f"profile {self.name} has no quantized-KV measurements: the step time of 8/4/2-bit KV is "
                "extrapolated from the bytes it reads, with (de)quantization taken as free; re-profile "
                "(`skistune profile`) to measure it")

    @property
    def transfer_gaps(self) -> dict[str, tuple[str, ...]]:
        """Per tier (`TIER_LINKS`), what of the runtime's way of moving KV this profile did not time (files
        measured before it was), to be said beside predictions whose config uses that tier."""
        gaps: dict[str, tuple[str, ...]] = {}
        copies = self.transfers.get("device_to_host")
        if copies is not None and not any(p.grid.get("parts", 1) > 1 for p in copies.points):
            gaps["host"] = (f"profile {self.name} timed device <-> host copies of whole blocks only: the per-copy "
                            "latency charged to each of the part tensors the runtime copies a block as is its fit's "
                            "intercept, not a measurement; re-profile (`skistune profile`) to time it",)
        if not self.block_io:
            gaps["disk"] = (f"profile {self.name} did not time the disk tier's conversions of KV blocks to and "
                            "from bytes (one per part tensor per block): disk-tier transfer times price the device "
                            "side as a device <-> host copy and leave out the host tier's; re-profile "
                            "(`skistune profile`) to time them",)
        return gaps

    def power_w(self, utilisation: float = 1.0) -> float:
        return self.power.power_w(utilisation)

    def flagged_fits(self) -> list[str]:
        """Fits whose R² is below the threshold, as ``name (R² value)``: every fit the file marks ``flagged``,
        the step fit on its held-out points too (one at R² 0.917 was marked in the file, not listed)."""
        fits = {"step": self.step_fit.train, "scheduler overhead": self.overhead.fit.quality,
                "paged attention": self.attention.fit.quality}
        if self.step_fit.held_out is not None:  # (not named "step ...": that one is the training points' fit)
            fits["held-out step points"] = self.step_fit.held_out
        if self.quantize is not None:
            fits["quantize-on-append"] = self.quantize.fit.quality
        fits |= {f"transfer {link}": m.fit.quality for link, m in self.transfers.items()}
        fits |= {f"block conversion {kind}": m.fit.quality for kind, m in self.block_io.items()}
        return [f"{name} (R² {q.r2:.3f})" for name, q in fits.items() if q.flagged]

    def energy_j_per_token(self) -> list[dict]:
        """Energy per generated token at each decode grid point: busy power x the fitted step time / batch,
        as the simulator charges it (a median measured on a loaded host can be an outlier: a quick profile's
        batch-1 step read 0.845 s against 0.058 s fitted), and from the measured median beside it."""
        busy_w = self.power.power_w(1.0)
        return [{**p.grid, "j_per_token": busy_w * self.step_cost.predict_s(p.shape) / p.grid["batch"],
                 "measured_j_per_token": busy_w * p.timing.median_s / p.grid["batch"]}
                for p in self.steps if p.kind == "decode"]

    # ---- file format ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "version": FORMAT_VERSION, "name": self.name, "model": self.model,
            "device": self.device, "dtype": self.dtype, "quick": self.quick,
            "kv_bytes_per_token": self.kv_bytes_per_token, "block_size": self.block_size,
            "duration_s": self.duration_s, "fingerprint": self.fingerprint.to_dict(), "notes": list(self.notes),
            "step": {"points": [_with_residual(p.to_dict(), p.timing.median_s, self.step_cost.predict_s(p.shape))
                                for p in self.steps], "cost_model": self.step_cost.to_dict(),
                     "fit": _step_fit_dict(self.step_fit)},
            "overhead": self.overhead.to_dict(), "kernels": self._kernels_dict(),
            "transfers": {link: m.to_dict() for link, m in self.transfers.items()},
            "disk_free_bytes": self.disk_free_bytes, "drift": dict(self.drift),
            **({"idle_wake": _idle_wake_dict(self.idle_wake)} if self.idle_wake is not None else {}),
            "tier_notes": {tier: list(notes) for tier, notes in self.tier_notes.items()},
            **({"block_io": {kind: m.to_dict() for kind, m in self.block_io.items()}} if self.block_io else {}),
            "power": {**self.power.to_dict(), "energy_j_per_token": self.energy_j_per_token()},
        }

    def _kernels_dict(self) -> dict:
        kernels = {"paged_attention": self.attention.to_dict()}
        if self.quantize is not None:
            kernels["quantize_append"] = self.quantize.to_dict()
        return kernels

    @classmethod
    def from_dict(cls, data: Any) -> "HardwareProfile":
        """The profile a file's JSON holds, every field checked, and what its fitted models predict too
        (`check_predictions`), naming the field or the model at fault (``ValueError``)."""
        profile = cls._from_dict(data)
        check_predictions(profile)
        return profile

    @classmethod
    def _from_dict(cls, data: Any) -> "HardwareProfile":
        if text(data, "format", "profile") != FORMAT:
            raise ValueError(f"format: {shown(data['format'])} is not {FORMAT!r}")
        if integer(data, "version", "profile") != FORMAT_VERSION:
            raise ValueError(f"version: {data['version']} is not {FORMAT_VERSION} (measure it again)")
        step = entry(data, "step", "profile")
        kernels = entry(data, "kernels", "profile")
        return cls(
            name=text(data, "name", "profile"), model=text(data, "model", "profile"),
            device=text(data, "device", "profile", choices=DEVICES), dtype=text(data, "dtype", "profile"),
            quick=_boolean(data, "quick", "profile"),
            kv_bytes_per_token=integer(data, "kv_bytes_per_token", "profile", minimum=1),
            block_size=integer(data, "block_size", "profile", minimum=1),
            fingerprint=Fingerprint.from_dict(entry(data, "fingerprint", "profile")),
            duration_s=number(data, "duration_s", "profile"),
            steps=tuple(StepPoint.from_dict(p, f"step.points[{i}]")
                        for i, p in enumerate(items(step, "points", "step"))),
            step_fit=_read_step_fit(step), overhead=_read_measured(data, "overhead", _read_linear),
            attention=_read_measured(kernels, "paged_attention", _read_linear, "kernels"),
            transfers=_read_transfers(data), power=_read_power(entry(data, "power", "profile")),
            **_read_notes(data),
            quantize=(_read_measured(kernels, "quantize_append", _read_linear, "kernels")
                      if isinstance(kernels, dict) and "quantize_append" in kernels else None),
            disk_free_bytes=(None if data.get("disk_free_bytes") is None
                             else integer(data, "disk_free_bytes", "profile")),
            drift=_read_drift(data.get("drift") or {}), block_io=_read_block_io(data),
            idle_wake=_read_idle_wake(data))

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically (a temp file in the same folder, then renamed over ``path``)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        # os.open with 0o666 lets the umask decide the mode, as for any file the user writes
        # (tempfile.mkstemp would leave a shared profile readable by its owner only)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(self.to_dict(), fh, indent=1)
                fh.write("\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path


# What a profile's fitted models may predict for the steps and transfers it measured (`check_predictions`). A
# file whose step coefficients were all 0.0 loaded and optimized to 5,663 req/s at a TBT p99 of 0.0 ms and
# 0.000 J/token; one whose coefficients were all 1e300 put every latency at infinity (null in the output) and
# the capacity search at a 300-digit "...0.0 ms". No step, copy or conversion takes no time, and none of the
# measured ones takes an hour, nor a whole step (a forward pass of the model) a microsecond; a fit gives no
# bandwidth past `MIN_S_PER_BYTE`'s 1 PB/s; no one machine draws nothing, nor a megawatt, busy.
MAX_PREDICTED_S = 3600.0
MIN_STEP_S = 1e-6
MAX_BYTES_PER_S = 1.0 / MIN_S_PER_BYTE
MAX_POWER_W = 1e6


def check_predictions(profile: HardwareProfile) -> None:
    """``ValueError`` naming the model and the measured point where a fitted model predicts a time that is not
    positive, finite and under `MAX_PREDICTED_S` (the step cost model at every step point, where it must be
    `MIN_STEP_S` at least; each transfer link and block conversion at its points; the scheduler overhead at its
    batches), a transfer fit's bandwidth past `MAX_BYTES_PER_S`, or busy power that is not positive and below
    `MAX_POWER_W`. Its coefficients are each checked on reading; this checks what they add up to where the
    profile measured."""
    cost = profile.step_cost
    for i, p in enumerate(profile.steps):
        _check_time(cost.predict_s(p.shape), "step.cost_model", f"{_step_text(p)} (step.points[{i}])",
                    MIN_STEP_S)
    for link, measured in profile.transfers.items():
        fit, where = measured.fit, f"transfers.{link}.fit"
        if not fit.bytes_per_s <= MAX_BYTES_PER_S * (1 + 1e-9):
            raise ValueError(f"{where}.bytes_per_s: {fit.bytes_per_s:.3g} B/s is past {MAX_BYTES_PER_S:.3g} B/s "
                             f"(1 PB/s), the most a transfer fit gives: {_MEASURE_AGAIN}")
        for i, g in enumerate(measured.points):
            nbytes, calls = _grid_value(g, "bytes", f"transfers.{link}.points[{i}]"), g.grid.get("parts", 1)
            _check_time(fit.time_s(nbytes, calls), where, f"a copy of {nbytes:,} bytes in {calls} call"
                        f"{'s' * (calls != 1)} (transfers.{link}.points[{i}])")
    for kind, measured in profile.block_io.items():
        for i, g in enumerate(measured.points):
            at = f"block_io.{kind}.points[{i}]"
            blocks, parts, nbytes = (_grid_value(g, key, at) for key in ("blocks", "parts", "bytes"))
            _check_time(measured.fit.predict_s(block_io_features(blocks, parts, nbytes)), f"block_io.{kind}.fit",
                        f"{blocks} block{'s' * (blocks != 1)} of {nbytes:,} bytes ({at})")
    if profile.overhead.fit.names != ("fixed", "seqs"):
        raise ValueError("overhead.fit: expected the features fixed, seqs")
    for i, g in enumerate(profile.overhead.points):
        batch = _grid_value(g, "batch", f"overhead.points[{i}]")
        _check_time(profile.overhead.fit.predict_s([1.0, float(batch)]), "overhead.fit",
                    f"scheduling {batch} sequence{'s' * (batch != 1)} (overhead.points[{i}])")
    busy_w = profile.power.power_w(1.0)
    if not 0 < busy_w < MAX_POWER_W:
        raise ValueError(f"power: idle_w + dynamic_w must be positive and below {MAX_POWER_W:,.0f} W (the machine "
                         f"busy), got {busy_w:.3g} W: {_MEASURE_AGAIN}")


_MEASURE_AGAIN = "measure the profile again (`skistune profile`)"


def _check_time(seconds: float, model: str, what: str, minimum: float = 0.0) -> None:
    if not (math.isfinite(seconds) and seconds > minimum and seconds < MAX_PREDICTED_S):
        least = "positive" if minimum == 0 else f"at least {_duration(minimum)}"
        raise ValueError(f"{model}: predicted times must be {least}, finite and under an hour: it predicts "
                         f"{_duration(seconds)} for {what}; {_MEASURE_AGAIN}")


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds) or abs(seconds) >= 1:
        return f"{seconds:.3g} s"
    return f"{seconds * 1e3:.3g} ms" if abs(seconds) >= 1e-3 or seconds == 0 else f"{seconds * 1e6:.3g} µs"


def _grid_value(point: GridPoint, key: str, where: str) -> int:
    if key not in point.grid:
        raise ValueError(f"{where}.grid.{key}: missing")
    return point.grid[key]


def _step_text(p: StepPoint) -> str:
    """A measured step as people say it: ``a decode step of 1 sequence at 32 tokens of context``."""
    g = p.grid

    def seqs(n: int) -> str:
        return f"{n} sequence{'s' * (n != 1)}"

    texts = {"decode": lambda: f"a decode step of {seqs(g['batch'])} at {g['context']} tokens of context",
             "prefill": lambda: f"a prefill chunk of {g['chunk']} tokens after {g['cached']} cached",
             "mixed": lambda: (f"a step of {seqs(g['batch'])} decoding at {g['context']} tokens of context and a "
                               f"{g['chunk']}-token prefill chunk"),
             "compaction": lambda: f"a decode step of {seqs(g['batch'])} compacted to {g['budget']} tokens",
             "packing": lambda: (f"a decode step of {seqs(g['batch'])} at {g['context']} tokens of context that "
                                 f"packs a completed block each"),
             "scored": lambda: (f"a prefill chunk of {g['chunk']} tokens after {g['cached']} cached, scored by "
                                "attention for eviction")}
    try:
        return texts[p.kind]()
    except KeyError:  # (a grid without the usual coordinates)
        return f"a {p.kind} step of {seqs(p.shape.num_seqs)} and {p.shape.num_tokens} tokens"


def _read_notes(data: Any) -> dict[str, Any]:
    """``notes`` and ``tier_notes``; a file written before tier notes were kept apart has its tier notes in
    ``notes``: they are told apart by the texts the profiler then wrote, and worded as it words them now."""
    notes = tuple(str(n) for n in items(data, "notes", "profile", nonempty=False))
    if "tier_notes" in data:
        section = entry(data, "tier_notes", "profile")
        if not isinstance(section, dict) or not set(section) <= set(TIER_LINKS):
            raise ValueError(f"profile.tier_notes: expected an object of {'/'.join(TIER_LINKS)} -> notes, "
                             f"got {shown(section)}")
        tiers = {tier: items(section, tier, "profile.tier_notes", nonempty=False) for tier in section}
        return {"notes": notes, "tier_notes": {tier: tuple(str(n) for n in ns) for tier, ns in tiers.items()}}
    general, tiers = [], {"host": [], "disk": []}
    for note in notes:
        if note == CPU_HOST_NOTE:
            tiers["host"].append(note)
        elif note == LEGACY_PAGE_CACHE_NOTE:
            tiers["disk"].append(PAGE_CACHE_NOTE)
        elif note.startswith(LEGACY_DISK_PREFIX):
            where = note.removeprefix(LEGACY_DISK_PREFIX)
            tiers["disk"].append(disk_note(None if where == LEGACY_TEMP_DISK else where))
        else:
            general.append(note)
    return {"notes": tuple(general), "tier_notes": {tier: tuple(ns) for tier, ns in tiers.items() if ns}}


def _read_drift(data: Any) -> dict[str, float]:
    if not isinstance(data, dict) or not set(data) <= {"decode", "prefill"}:
        raise ValueError(f"profile.drift: expected an object of decode/prefill -> ratio, got {shown(data)}")
    return {k: number(data, k, "profile.drift", minimum=1e-9) for k in data}


def _boolean(data: Any, key: str, where: str) -> bool:
    value = entry(data, key, where)
    if not isinstance(value, bool):
        raise ValueError(f"{where}.{key}: expected true or false, got {shown(value)}")
    return value


def _step_fit_dict(fit: StepFit) -> dict:
    return {"knee_loss": {str(k): e for k, e in fit.knee_loss.items()},
            "train": fit.train.to_dict(), "held_out": None if fit.held_out is None else fit.held_out.to_dict()}


def _read_quality(data: Any, where: str) -> FitQuality:
    r2 = None if entry(data, "r2", where) is None else number(data, "r2", where, minimum=float("-inf"))
    return FitQuality(r2=r2,
                      median_rel_error=number(data, "median_rel_error", where),
                      max_rel_error=number(data, "max_rel_error", where),
                      points=integer(data, "points", where, minimum=1))


def _read_step_fit(step: Any) -> StepFit:
    try:
        model = StepCostModel.from_dict(entry(step, "cost_model", "step"))
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"step.cost_model: malformed ({type(exc).__name__}: {exc})") from None
    fit = entry(step, "fit", "step")
    knees = entry(fit, "knee_loss", "step.fit")
    if not isinstance(knees, dict):
        raise ValueError("step.fit.knee_loss: expected an object of knee -> loss")
    held = entry(fit, "held_out", "step.fit")
    try:
        knee_loss = {int(k): number(knees, k, "step.fit.knee_loss") for k in knees}
    except ValueError as exc:
        raise ValueError(f"step.fit.knee_loss: {exc}") from None
    return StepFit(model, _read_quality(entry(fit, "train", "step.fit"), "step.fit.train"),
                   None if held is None else _read_quality(held, "step.fit.held_out"), knee_loss)


def _read_linear(data: Any, where: str) -> LinearFit:
    names = items(data, "features", where)
    coef = [number({"c": c}, "c", f"{where}.coef[{i}]") for i, c in enumerate(items(data, "coef", where))]
    if len(names) != len(coef) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{where}: needs one feature name per coefficient")
    return LinearFit(tuple(names), tuple(coef), _read_quality(entry(data, "quality", where), f"{where}.quality"))


def _read_transfer(data: Any, where: str) -> TransferFit:
    return TransferFit(number(data, "latency_s", where), number(data, "bytes_per_s", where, minimum=1e-300),
                       _read_quality(entry(data, "quality", where), f"{where}.quality"))


def _read_measured(data: Any, key: str, read_fit, where: str = "profile") -> Measured:
    section = entry(data, key, where)
    name = key if where == "profile" else f"{where}.{key}"
    raw = items(section, "points", name)
    points = tuple(GridPoint.from_dict(p, f"{name}.points[{i}]") for i, p in enumerate(raw))
    predicted_s = tuple(number(p, "predicted_s", f"{name}.points[{i}]") for i, p in enumerate(raw))
    return Measured(points, read_fit(entry(section, "fit", name), f"{name}.fit"), predicted_s)


def _read_transfers(data: Any) -> dict[str, Measured]:
    section = entry(data, "transfers", "profile")
    if not isinstance(section, dict) or not section:
        raise ValueError("transfers: expected an object of links")
    unknown = sorted(set(section) - set(LINKS))
    if unknown:
        raise ValueError(f"transfers.{unknown[0]}: unknown link (known: {', '.join(LINKS)})")
    return {link: _read_measured(section, link, _read_transfer, "transfers") for link in section}


def _read_block_io(data: Any) -> dict[str, Measured]:
    """The disk tier's block conversions (none in files measured before they were timed)."""
    section = data.get("block_io") or {}
    if not isinstance(section, dict):
        raise ValueError("block_io: expected an object of conversions")
    unknown = sorted(set(section) - set(BLOCK_IO))
    if unknown:
        raise ValueError(f"block_io.{unknown[0]}: unknown conversion (known: {', '.join(BLOCK_IO)})")
    out = {kind: _read_measured(section, kind, _read_linear, "block_io") for kind in section}
    for kind, measured in out.items():
        if measured.fit.names != BLOCK_IO_FEATURES:
            raise ValueError(f"block_io.{kind}.fit: expected the features {', '.join(BLOCK_IO_FEATURES)}")
    return out


def _read_power(data: Any) -> PowerModel:
    return PowerModel(text(data, "source", "power", choices=POWER_SOURCES), number(data, "idle_w", "power"),
                      number(data, "dynamic_w", "power"), text(data, "note", "power"))


def read_json_file(path: str | os.PathLike[str], what: str) -> Any:
    """A JSON file's contents, or ``ValueError`` naming the file and what is wrong (``what``: "profile")."""
    try:
        raw = Path(path).read_text(encoding="utf-8-sig")  # (a byte-order mark is dropped)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a {what} (not UTF-8 text; corrupted?)") from None
    try:
        return load_json(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON at line {exc.lineno} column {exc.colno} "
                         f"({exc.msg}; truncated or corrupted?)") from None
    except ValueError as exc:  # (nested past `load_json`'s bound, or a number of over 4,300 digits)
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


SHIPPED_PACKAGE = "skistune.profiles"  # the repository's profiles/ folder, installed with the package


def shipped_profiles() -> dict[str, Path]:
    """The hardware profiles that ship with skistune, by name (the file's name less ``.json``; the quality
    profiles beside them, ``quality-*.json``, are `skistune.quality`'s)."""
    return {name: path for name, path in shipped_json_files().items() if not name.startswith("quality-")}


def shipped_json_files() -> dict[str, Path]:
    """Every profile file that ships with skistune (hardware and quality), by name (less ``.json``)."""
    root = importlib.resources.files(SHIPPED_PACKAGE)
    return {entry.name.removesuffix(".json"): Path(str(entry)) for entry in root.iterdir()
            if entry.name.endswith(".json")}


def profile_path(spec: str | os.PathLike[str]) -> Path:
    """The profile file ``spec`` names: a file, or a bare name that is no file here (``cpu-smollm2-135m``), the
    shipped profile of that name (`shipped_profiles`)."""
    return shipped_or_path(spec, shipped_profiles(), "profile")


def load_profile(path: str | os.PathLike[str], *, check_fingerprint: bool = True,
                 model: str | None = None) -> HardwareProfile:
    """Read and validate a profile file, or the shipped profile a bare name names (`profile_path`) (measured for
    ``model``, when given: else a ``ValueError``, before any warning); warn (`FingerprintWarning`) if it was
    measured elsewhere."""
    path = profile_path(path)
    data = read_json_file(path, "profile")
    if isinstance(data, dict) and data.get("format") == QUALITY_FORMAT:  # (the other kind of profile file)
        raise ValueError(f"{path}: a quality profile, not a hardware profile: print it with "
                         f"`skistune quality --show {path}`")
    try:
        profile = HardwareProfile.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    if model is not None:
        check_profile_model(profile, model)
    if check_fingerprint:
        warn_if_elsewhere(profile, path)
    return profile


def _idle_wake_dict(wake: IdleWake) -> list[dict]:
    """Per idle: its first step's typical extra (``extra_s``, what files before the rounds had) and the rounds."""
    return [{"idle_s": g, "extra_s": max(0.0, wake.typical_s(g)[0]), "rounds_s": [list(r) for r in rounds]}
            for g, rounds in zip(wake.idle_s, wake.rounds_s)]


def _read_idle_wake(data: dict) -> IdleWake | None:
    """The ``idle_wake`` points (none in files written before them), checked and ordered by idle: their rounds
    (``rounds_s``: per round, the extra of each step from the first after the idle), or in files written before
    the rounds, the first step's extra alone."""
    if "idle_wake" not in data:
        return None
    points = items(data, "idle_wake", "profile")
    read = []
    for i, p in enumerate(points):
        where = f"idle_wake[{i}]"
        idle, first = number(p, "idle_s", where, minimum=IDLE_WAKE_GAP_S), number(p, "extra_s", where)
        if "rounds_s" not in p:
            read.append((idle, ((first,),)))
            continue
        rounds = items(p, "rounds_s", where)
        for r, steps in enumerate(rounds):
            if not isinstance(steps, list) or not steps:
                raise ValueError(f"{where}.rounds_s[{r}]: expected a list of step extras, got {shown(steps)}")
        read.append((idle, tuple(tuple(finite(x, f"{where}.rounds_s[{r}][{k}]") for k, x in enumerate(steps))
                                 for r, steps in enumerate(rounds))))
    if len({g for g, _ in read}) < len(read):
        raise ValueError("idle_wake: two points at the same idle")
    read.sort()
    return IdleWake(tuple(g for g, _ in read), tuple(r for _, r in read))


def warn_if_elsewhere(profile: HardwareProfile, path: str | os.PathLike[str]) -> None:
    """Warn (`FingerprintWarning`) if ``profile``, read from ``path``, was measured on another machine or
    software (apart from `load_profile`: a command may refuse the profile first, in one line). The warning
    points at the caller's line outside skistune (`skistune.sim_target(...)`, not skistune's own call)."""
    differences = fingerprint_diff(profile.fingerprint, machine_fingerprint(profile.device))
    # (a field the profile predates proves no difference: a profile measured here by an earlier skistune had been
    # called another machine's for its missing cpu_arch)
    unrecorded = [d.split(":")[0] for d in differences if ": not recorded -> " in d]
    if len(differences) > len(unrecorded):
        warnings.warn(f"{path}: measured on a different machine or software ({'; '.join(differences)}); "
                      "its timings are that machine's and may not hold here", FingerprintWarning,
                      stacklevel=_caller_level())
    elif unrecorded:
        warnings.warn(f"{path}: measured by an earlier skistune that did not record {', '.join(unrecorded)}, so "
                      "whether it was measured on this machine is not known; `skistune profile` measures this one",
                      FingerprintWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The ``stacklevel`` (as seen from our caller's ``warnings.warn``) of the first frame outside skistune."""
    import sys

    package = os.path.dirname(os.path.dirname(__file__)) + os.sep  # (as code objects name their files)
    frame, level = sys._getframe(1), 1  # (our caller: level 1 of its warnings.warn)
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def check_profile_model(profile: HardwareProfile, model: str) -> None:
    """A ``ValueError`` unless ``profile`` was measured for the model preset ``model``."""
    from skistune.runtime.presets import PRESETS

    if model != profile.model:
        # (a model this skistune has no preset for cannot be given: "give --model gpt-17" was then refused)
        use = (f"give --model {profile.model} to use it, or " if profile.model in PRESETS else
               "a model this skistune has no preset for; ")
        raise ValueError(f"profile {shown(profile.name)} was measured for {shown_name(profile.model)}, not {model}: "
                         f"{use}measure one with `skistune profile --model {model}`")


def cache_dir() -> Path:
    """Where quick profiles are cached: ``$XDG_CACHE_HOME/skistune/profiles`` (``~/.cache`` by default)."""
    return user_cache_dir("profiles")


# 2: steps measured with this machine's own projection rule (1: with a fixed one); 3: device <-> host copies
# timed split into the runtime's part tensors too (their per-call latency), and the disk tier's block conversions;
# 4: prefill chunks scored by attention for eviction (`cost.SCORED_FEATURES`), which a cached profile of format 3
# lacks (its predictions would leave out what H2O, TOVA and SnapKV add to every prefill)
QUICK_CACHE_FORMAT = 4


def cached_profile_path(model: str, device: str, fingerprint: Fingerprint, folder: Path | None = None) -> Path:
    return (folder or cache_dir()) / f"quick-{device}-{model}-{fingerprint.key()}-v{QUICK_CACHE_FORMAT}.json"


def step_coverage_gaps(steps: Sequence[StepPoint]) -> list[str]:
    """What the training (not held-out) step points miss of the steps the simulator predicts: decodes of
    several sequences at several contexts, prefill chunks of several sizes, and mixed steps. A fit on
    fewer is free to put a step's whole time in the fixed cost: one refitted on five batch-1 decodes
    predicted a 2,048-token prefill and a 64-sequence decode at the 27 ms of a batch-1 decode."""
    train = [p for p in steps if not p.held_out]

    def values(kind: str, axis: str) -> set[int]:
        return {p.grid[axis] for p in train if p.kind == kind and axis in p.grid}

    needs = {"decode steps of more than one sequence": any(b > 1 for b in values("decode", "batch")),
             "decode steps at two or more context lengths": len(values("decode", "context")) >= 2,
             "prefill chunks of two or more sizes": len(values("prefill", "chunk")) >= 2,
             "mixed steps (decodes with a prefill chunk)": bool(values("mixed", "batch"))}
    return [what for what, covered in needs.items() if not covered]


def fit_step_points(steps: Sequence[StepPoint], rows: ProjectionRule, table: ProjectionTimes | None = None,
                    parallel: tuple[int, ...] = ()) -> StepFit:
    """The step cost model fitted on measured steps (their medians; the held-out ones checked), counting
    rows as the projection rule the steps ran with does, with the projection passes timed on the same
    machine where they were and the model's `parallel_rows` on this device: what a measurement and a refit
    both do."""
    return fit_step_cost([p.shape for p in steps], [p.timing.median_s for p in steps],
                         [p.held_out for p in steps], rows=rows, table=table, parallel=parallel)


class ProfileCacheWarning(UserWarning):
    """What happened to this machine's cached quick profile: damaged or untrusted and measured again, waited
    for while another process measured it, or measured but not cached (an unwritable cache folder)."""


def read_cached_profile(path: Path, *, check_fingerprint: bool = True) -> tuple[HardwareProfile | None, str | None]:
    """The cached quick profile at ``path`` when it can be used, else None and why not, as a phrase after
    "the cached profile PATH" (None where there is no file: not measured yet)."""
    if not path.is_file():
        return None, None
    try:
        cached = load_profile(path, check_fingerprint=check_fingerprint)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # (a cache entry never stops a command:
        # the readers raise ValueError by design, the others would be a reader's bug on a shape it missed)
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"is damaged ({why.removeprefix(f'{path}: ')})"
    # an entry from before quantized KV was measured is used as it is (its `quantized_kv_note` says what
    # quantized KV predictions then rest on): `skistune profile` measures it again on demand
    if cached.unreliable is not None:  # (one kept before this check existed is measured again)
        return None, f"cannot be trusted ({cached.unreliable})"
    if cached.fitted_before_current_terms:  # refitted from its own points (a third of a second), and kept
        with contextlib.suppress(ValueError):
            cached = cached.refit_steps()
            with contextlib.suppress(OSError):  # (written atomically: a reader sees the old file or the new)
                cached.save(path)
    return cached, None


def _cache_warning(message: str) -> None:
    warnings.warn(message, ProfileCacheWarning, stacklevel=_caller_level())


def _not_cached(folder: Path, exc: OSError) -> None:
    _cache_warning(f"this machine's quick profile is not cached: cannot write {folder} ({exc.strerror or exc}); "
                   "it is measured for this run only and again on the next (make the folder writable, set "
                   "XDG_CACHE_HOME to one that is, or keep one with `skistune profile --quick --out FILE` and "
                   "pass --profile FILE)")


def default_profile(model: str = "smollm2-135m", device: str = "cpu", *, folder: Path | None = None,
                    progress=None) -> HardwareProfile:
    """The quick profile of this machine for ``model``: from the cache (one per fingerprint and model),
    else measured now (`QUICK_GRID`: 31-58 s on the 2-core CPUs measured) and cached.

    One process measures at a time: the others wait on a lock beside the cache entry (a `ProfileCacheWarning`
    says so) and then read its profile. A damaged or untrusted entry is measured again, with a warning. Where
    the cache folder cannot be written, the profile is measured and used all the same, with a warning naming
    the folder and why (it had failed the command after the minute of measuring, on every run)."""
    path = cached_profile_path(model, device, machine_fingerprint(device), folder)
    cached, problem = read_cached_profile(path)
    if cached is not None:
        return cached
    if problem is not None:
        _cache_warning(f"the cached profile {path} {problem}; measuring it again")
    held = contextlib.ExitStack()
    try:
        waited = held.enter_context(exclusive(path, lambda pid: _cache_warning(
            "waiting for another skistune process measuring this machine's quick profile"
            f"{f' (pid {pid})' if pid else ''}")))
    except OSError as exc:  # not cacheable: said before the minute of measuring, not after it
        _not_cached(path.parent, exc)
        return _measure_quick(model, device, progress)
    with held:
        if waited:  # (measured meanwhile by the process waited for, unless it failed or was stopped)
            cached, problem = read_cached_profile(path)
            if cached is not None:
                return cached
        profile = _measure_quick(model, device, progress)
        try:
            profile.save(path)
        except OSError as exc:
            _not_cached(path.parent, exc)
    return profile


def _measure_quick(model: str, device: str, progress) -> HardwareProfile:
    """The quick profile measured now (twice where the first drifted); ``ValueError`` where it cannot be trusted."""
    from .measure import (
        profile_model,  # torch and the runtime only when something must be measured
    )

    profile = profile_model(model, device=device, quick=True, progress=progress)
    if profile.unreliable is not None or profile.drift_factor >= REMEASURE_DRIFT:  # a busy moment, likely passed:
        # once more (a first run lost its minute), keeping a drifting but usable first one over a worse second
        again = profile_model(model, device=device, quick=True, progress=progress)
        if profile.unreliable is not None or (again.unreliable is None and again.drift_factor < profile.drift_factor):
            profile = again
    if profile.unreliable is not None:  # not kept: every later search would read it
        raise ValueError(f"this machine's quick profile, measured twice just now, cannot be trusted "
                         f"({profile.unreliable}): another process was probably using the CPU; measure it again when "
                         "the machine is quiet (`skistune profile --cache`), or pass --profile FILE")
    return profile
