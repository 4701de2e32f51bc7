"""What a profile was measured on: the machine, its accelerator and the software stack.

A profile's timings hold only for the fingerprint they were measured on; loading one measured elsewhere
warns and names the fields that differ. The measurement date is recorded but never compared.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from importlib import metadata

from skistune import openmp_wait

# not compared (nor part of the cached quick profile's key): when, and how much memory the machine has,
# which bounds the host tier the optimizer may recommend there but not the timings
NOT_COMPARED = ("date", "host_memory_bytes")
# fields added after profiles were first written: a profile without one loads with None ("not recorded")
ADDED_LATER = ("cpu_arch", "host_memory_bytes", "openmp_wait")
COUNTS = ("cpu_count", "threads")  # at least 1 (a header had read "-3 threads")


@dataclass(frozen=True)
class Fingerprint:
    """Machine and software a profile was measured on (``None`` where a component is absent)."""

    cpu_model: str  # "model name": often masked on VMs ("AMD EPYC"), hence cpu_arch
    cpu_arch: str | None  # `cpu_arch_from_cpuinfo`; None in profiles written before it was recorded
    cpu_count: int
    threads: int  # torch intra-op threads the runtime used
    gpu_model: str | None
    gpu_memory_bytes: int | None  # the GPU's total memory (a MIG slice's, where one is used)
    gpu_driver: str | None
    cuda_version: str | None
    torch_version: str
    triton_version: str | None
    skistune_version: str
    python_version: str
    os: str
    date: str  # ISO 8601, UTC
    host_memory_bytes: int | None = None  # `host_memory_bytes()`; None in profiles written before it was recorded
    # how OpenMP's threads waited (`skistune.openmp_wait`): a CPU's step times depend on it (sleeping threads
    # x1.6 of spinning ones on an Intel host); None in profiles written before it was recorded
    openmp_wait: str | None = None

    @property
    def chip(self) -> str:
        """What the profile's timings are of: the GPU where one was used, else the CPU."""
        return self.gpu_model or self.cpu_model

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Fingerprint":
        if not isinstance(data, dict):
            raise ValueError(f"fingerprint: expected an object, got {type(data).__name__}")
        kwargs = {}
        for f in fields(cls):
            if f.name not in data and f.name not in ADDED_LATER:
                raise ValueError(f"fingerprint.{f.name}: missing")
            kwargs[f.name] = _checked(f.name, data.get(f.name), f.type)
            if f.name in COUNTS and kwargs[f.name] < 1:
                raise ValueError(f"fingerprint.{f.name}: expected a positive count, got {kwargs[f.name]}")
        return cls(**kwargs)

    def compared(self) -> dict:
        """The fields that decide whether timings hold elsewhere: all but `NOT_COMPARED`; on a CPU profile
        (no CUDA) not Triton's version: its kernels do not run there, and installing it (the test extras do)
        had made this machine's quick profile read as measured elsewhere, and measured again; on a GPU profile,
        or one that did not record it, not OpenMP's wait policy (the CPU computes none of a GPU's steps)."""
        cpu = self.cuda_version is None and self.gpu_model is None
        return {k: v for k, v in self.to_dict().items()
                if k not in NOT_COMPARED and not (cpu and k == "triton_version")
                and not (k == "openmp_wait" and (not cpu or v is None))}

    def key(self) -> str:
        """Short digest of the compared fields: names the cached quick profile of this machine."""
        return hashlib.sha256(json.dumps(self.compared(), sort_keys=True).encode()).hexdigest()[:12]


def _checked(name: str, value: object, type_name: str) -> object:
    """Check a JSON value against the field's annotation (``str``, ``int``, ``str | None``)."""
    if value is None and "None" in type_name:
        return None
    want = int if type_name.startswith("int") else str
    if not isinstance(value, want) or isinstance(value, bool):
        raise ValueError(f"fingerprint.{name}: expected {want.__name__}, got {type(value).__name__}")
    return value


def fingerprint_diff(measured: Fingerprint, here: Fingerprint) -> list[str]:
    """``field: measured -> here`` for each compared field that differs (a field the profile predates
    reads ``not recorded``)."""
    a, b = measured.compared(), here.to_dict()
    return [f"{k}: {_shown(k, a[k], 'not recorded')} -> {_shown(k, b[k], 'unknown')}{HINTS.get(k, '')}"
            for k in a if a[k] != b[k]]


HINTS = {"openmp_wait": " (OpenMP's threads wait otherwise in this process: set OMP_WAIT_POLICY and GOMP_SPINCOUNT as "
                        "when it was measured, and import skistune before torch, which sets them)"}


def _shown(name: str, value: object, absent: str) -> object:
    return absent if value is None and name in ADDED_LATER else value


def machine_fingerprint(device: str = "cpu") -> Fingerprint:
    """The fingerprint of this machine with ``device`` as the accelerator (``cpu`` or ``cuda``)."""
    import torch  # imported here: loading a profile must not need torch until it is compared

    gpu_model = gpu_memory_bytes = gpu_driver = None
    if device == "cuda" and torch.cuda.is_available():
        gpu_model = torch.cuda.get_device_name()
        gpu_memory_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        gpu_driver = _nvidia_driver()
    return Fingerprint(
        cpu_model=_cpu_model(), cpu_arch=_cpu_arch(), cpu_count=os.cpu_count() or 1,
        threads=torch.get_num_threads(),
        gpu_model=gpu_model, gpu_memory_bytes=gpu_memory_bytes, gpu_driver=gpu_driver,
        cuda_version=torch.version.cuda if device == "cuda" else None,
        torch_version=torch.__version__, triton_version=_version("triton"),
        skistune_version=_version("skistune") or "unknown", python_version=platform.python_version(),
        os=f"{platform.system()} {platform.machine()}",
        date=datetime.now(timezone.utc).replace(microsecond=0).isoformat(), host_memory_bytes=host_memory_bytes(),
        openmp_wait=openmp_wait())


def recorded_memory(fp: Fingerprint, device: str) -> int | None:
    """The memory of the machine ``fp`` was taken on: as recorded, or, for a CPU profile of this very machine
    written before memory was recorded, this machine's (a cached quick profile may be that old); else None."""
    if fp.host_memory_bytes is not None:
        return fp.host_memory_bytes
    return host_memory_bytes() if is_this_machine(fp, device) else None


def is_this_machine(fp: Fingerprint, device: str) -> bool:
    """Whether a CPU profile with this fingerprint was measured on this machine (same CPU, same cores)."""
    return device == "cpu" and (fp.cpu_model, fp.cpu_arch, fp.cpu_count) == (_cpu_model(), _cpu_arch(), os.cpu_count())


def host_memory_bytes() -> int | None:
    """The memory this process may use: the machine's physical memory, or the container's cgroup limit
    where that is lower (a container sees the host's RAM in sysconf); None where neither is readable."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = None  # not POSIX
    limits = [physical] if physical and physical > 0 else []
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # v2, v1
        try:
            with open(path, encoding="ascii") as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) > 0:  # "max" (v2) or a huge number (v1) when unlimited
            limits.append(int(text))
    return min(limits) if limits else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: fall back to what the platform module knows
    return platform.processor() or platform.machine() or "unknown"


def _cpu_arch() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            arch = cpu_arch_from_cpuinfo(fh.read())
    except OSError:
        arch = None  # not Linux
    return arch or platform.processor() or None


X86_SIMD = ("avx512f", "avx2", "avx", "sse4_2")  # widest first


def cpu_arch_from_cpuinfo(text: str) -> str | None:
    """The microarchitecture in /proc/cpuinfo ``text`` (its first processor), or None if neither x86 nor Arm.

    On cloud VMs "model name" is often masked ("AMD EPYC" on an AVX2-only Zen and on an AVX-512 host whose
    compute-bound steps run ~1.3-1.4x faster), so family/model/stepping and the widest SIMD level tell CPU
    generations apart: "AuthenticAMD family 23 model 1 stepping 2, avx2",
    "arm implementer 0x41 part 0xd0c, asimd".
    """
    info: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info.setdefault(key.strip(), value.strip())
        elif info and not line.strip():
            break  # the first processor's block ends
    if "vendor_id" in info:  # x86
        flags = set(info.get("flags", "").split())
        simd = next((s for s in X86_SIMD if s in flags), "no sse4_2")
        if "amx_tile" in flags:
            simd += " amx_tile"
        return (f"{info['vendor_id']} family {info.get('cpu family', '?')} model {info.get('model', '?')} "
                f"stepping {info.get('stepping', '?')}, {simd}")
    if "CPU implementer" in info:  # aarch64
        features = set(info.get("Features", "").split())
        simd = " ".join(s for s in ("sve", "asimd") if s in features) or "no asimd"
        return f"arm implementer {info['CPU implementer']} part {info.get('CPU part', '?')}, {simd}"
    return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _nvidia_driver() -> str | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except pynvml.NVMLError:
        return None
