"""Power: measured where a meter exists, declared (and marked ``modeled``) where none does.

- ``nvml``: the GPU's total-energy counter (``pynvml`` from ``nvidia-ml-py``); covers the GPU board only.
- ``rapl``: the CPU packages' energy counters under /sys/class/powercap, where this user may read them.
- ``modeled``: neither exists: idle + dynamic x utilisation, both from the CPU's rated power, which is
  itself an assumption (`RATED_W_PER_CPU`); every report that uses it must say it is modeled.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

POWER_SOURCES = ("nvml", "rapl", "modeled")
RAPL_ROOT = Path("/sys/class/powercap")
# Rated (TDP) watts per logical CPU of current server parts: EPYC 7763 280 W / 64 cores = 4.4 W,
# Xeon 8380 270 W / 40 cores = 6.8 W (both before SMT). A declared figure, not a measurement.
RATED_W_PER_CPU = 6.0
MODELED_GPU_RATED_W = 300.0  # board power of a PCIe data-centre GPU (A100 PCIe, L40S ~300-350 W)
IDLE_FRACTION = 0.3  # servers idle at roughly a third of their rated power


@dataclass(frozen=True)
class PowerModel:
    """``power_w(u) = idle_w + dynamic_w x u`` for utilisation ``u`` in [0, 1]."""

    source: str
    idle_w: float
    dynamic_w: float
    note: str

    @property
    def modeled(self) -> bool:
        return self.source == "modeled"

    @property
    def modeled_note(self) -> str | None:
        """The line every figure that uses a modeled power carries (None where a meter measured it)."""
        return f"energy is {self.note}" if self.modeled else None  # ("modeled, no power meter readable: ...")

    def power_w(self, utilisation: float = 1.0) -> float:
        return self.idle_w + self.dynamic_w * min(1.0, max(0.0, utilisation))

    def energy_j(self, busy_s: float, idle_s: float = 0.0) -> float:
        return self.power_w(1.0) * busy_s + self.idle_w * idle_s

    def to_dict(self) -> dict:
        return {"source": self.source, "idle_w": self.idle_w, "dynamic_w": self.dynamic_w, "note": self.note}


class EnergyMeter(Protocol):
    source: str

    def read_j(self) -> float: ...


class RaplMeter:
    """Sum of the package zones' counters, in joules, unwrapping each counter's overflow."""

    source = "rapl"

    def __init__(self, zones: list[Path]) -> None:
        self.zones = zones
        self.ranges_uj = [int((z / "max_energy_range_uj").read_text()) for z in zones]
        self.last_uj = [self._raw(z) for z in zones]
        self.total_uj = 0

    @staticmethod
    def _raw(zone: Path) -> int:
        return int((zone / "energy_uj").read_text())

    def read_j(self) -> float:
        for i, zone in enumerate(self.zones):
            now = self._raw(zone)
            delta = now - self.last_uj[i]
            self.total_uj += delta if delta >= 0 else delta + self.ranges_uj[i]
            self.last_uj[i] = now
        return self.total_uj / 1e6


class NvmlMeter:
    """The GPU's energy counter since the driver loaded (millijoules, Volta and newer)."""

    source = "nvml"

    def __init__(self, pynvml: Any, handle: Any) -> None:
        self.pynvml = pynvml
        self.handle = handle

    def read_j(self) -> float:
        return self.pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000.0


def rapl_zones(root: Path = RAPL_ROOT) -> list[Path]:
    """Readable package zones (``intel-rapl:N``; their sub-zones are parts of the package and would
    count twice). Reading needs root on most kernels since 5.10, hence the check."""
    zones = []
    for zone in sorted(root.glob("intel-rapl:*")) if root.is_dir() else []:
        if zone.name.count(":") != 1:
            continue
        try:
            RaplMeter._raw(zone)
            int((zone / "max_energy_range_uj").read_text())
        except (OSError, ValueError):
            continue
        zones.append(zone)
    return zones


def _nvml_handle(pynvml: Any, torch: Any) -> Any:
    """NVML's handle of the current CUDA device: by PCI bus id, since NVML ignores CUDA_VISIBLE_DEVICES."""
    index = torch.cuda.current_device()
    bus_id = getattr(torch.cuda.get_device_properties(index), "pci_bus_id", None)
    if bus_id:
        try:
            return pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        except pynvml.NVMLError:
            pass  # an id format this NVML does not take: the index matches when no devices are hidden
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def _nvml_meter() -> NvmlMeter | None:
    try:
        import pynvml
        import torch
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        meter = NvmlMeter(pynvml, _nvml_handle(pynvml, torch))
        meter.read_j()  # pre-Volta GPUs have no energy counter: fail here, not mid-measurement
        return meter
    except pynvml.NVMLError:
        return None


def find_meter(device: str, rapl_root: Path = RAPL_ROOT) -> EnergyMeter | None:
    """The energy meter for ``device``, or None where this machine has none we can read."""
    if device == "cuda":
        return _nvml_meter()
    zones = rapl_zones(rapl_root)
    return RaplMeter(zones) if zones else None


def average_w(meter: EnergyMeter, fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``fn`` and return its result and the meter's average power over it."""
    e0_j, t0 = meter.read_j(), time.perf_counter()
    result = fn()
    return result, (meter.read_j() - e0_j) / max(time.perf_counter() - t0, 1e-9)


def measured_power(meter: EnergyMeter, idle_s: float, busy_w: float) -> PowerModel:
    """Idle power over ``idle_s`` seconds of sleep; the dynamic part is what the busy run added."""
    _, idle_w = average_w(meter, lambda: time.sleep(idle_s))
    what = "GPU board (host CPU not counted)" if meter.source == "nvml" else "CPU packages"
    return PowerModel(meter.source, idle_w, max(0.0, busy_w - idle_w),
                      f"measured: {what}, idle over {idle_s:g} s, busy over the decode grid")


def modeled_power(device: str, cpu_count: int) -> PowerModel:
    if device == "cuda":
        rated_w, what = MODELED_GPU_RATED_W, f"a GPU rated {MODELED_GPU_RATED_W:g} W (install nvidia-ml-py to measure)"
    else:
        rated_w, what = RATED_W_PER_CPU * cpu_count, f"{cpu_count} CPUs x {RATED_W_PER_CPU:g} W rated"
    return PowerModel("modeled", IDLE_FRACTION * rated_w, (1 - IDLE_FRACTION) * rated_w,
                      f"modeled, no power meter readable: {what}, idle at {IDLE_FRACTION:.0%} of rated")
