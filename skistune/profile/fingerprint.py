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

NOT_COMPARED = ("date",)


@dataclass(frozen=True)
class Fingerprint:
    """Machine and software a profile was measured on (``None`` where a component is absent)."""

    cpu_model: str
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

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Fingerprint":
        if not isinstance(data, dict):
            raise ValueError(f"fingerprint: expected an object, got {type(data).__name__}")
        kwargs = {}
        for f in fields(cls):
            if f.name not in data:
                raise ValueError(f"fingerprint.{f.name}: missing")
            kwargs[f.name] = _checked(f.name, data[f.name], f.type)
        return cls(**kwargs)

    def key(self) -> str:
        """Short digest of the compared fields: names the cached quick profile of this machine."""
        compared = {k: v for k, v in self.to_dict().items() if k not in NOT_COMPARED}
        return hashlib.sha256(json.dumps(compared, sort_keys=True).encode()).hexdigest()[:12]


def _checked(name: str, value: object, type_name: str) -> object:
    """Check a JSON value against the field's annotation (``str``, ``int``, ``str | None``)."""
    if value is None and "None" in type_name:
        return None
    want = int if type_name.startswith("int") else str
    if not isinstance(value, want) or isinstance(value, bool):
        raise ValueError(f"fingerprint.{name}: expected {want.__name__}, got {type(value).__name__}")
    return value


def fingerprint_diff(measured: Fingerprint, here: Fingerprint) -> list[str]:
    """``field: measured -> here`` for each compared field that differs."""
    a, b = measured.to_dict(), here.to_dict()
    return [f"{k}: {a[k]} -> {b[k]}" for k in a if k not in NOT_COMPARED and a[k] != b[k]]


def machine_fingerprint(device: str = "cpu") -> Fingerprint:
    """The fingerprint of this machine with ``device`` as the accelerator (``cpu`` or ``cuda``)."""
    import torch  # imported here: loading a profile must not need torch until it is compared

    gpu_model = gpu_memory_bytes = gpu_driver = None
    if device == "cuda" and torch.cuda.is_available():
        gpu_model = torch.cuda.get_device_name()
        gpu_memory_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        gpu_driver = _nvidia_driver()
    return Fingerprint(
        cpu_model=_cpu_model(), cpu_count=os.cpu_count() or 1, threads=torch.get_num_threads(),
        gpu_model=gpu_model, gpu_memory_bytes=gpu_memory_bytes, gpu_driver=gpu_driver,
        cuda_version=torch.version.cuda if device == "cuda" else None,
        torch_version=torch.__version__, triton_version=_version("triton"),
        skistune_version=_version("skistune") or "unknown", python_version=platform.python_version(),
        os=f"{platform.system()} {platform.machine()}",
        date=datetime.now(timezone.utc).replace(microsecond=0).isoformat())


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: fall back to what the platform module knows
    return platform.processor() or platform.machine() or "unknown"


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
