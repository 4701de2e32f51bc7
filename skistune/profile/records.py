"""The measured records a profile holds, and the checks that read them back from JSON. Torch-free.

Every reader names where a bad value sits (``step.points[3].timing.median_s: expected a number``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import shown
from ..runtime.kv_layout import FULL_PRECISION_BITS
from .cost import StepShape
from .fields import entry, int_map, integer, number, text


@dataclass(frozen=True)
class Timing:
    """Median over repeats, with the 10th and 90th percentiles to show the spread."""

    median_s: float
    p10_s: float
    p90_s: float
    repeats: int

    @classmethod
    def of(cls, samples_s: list[float]) -> "Timing":
        p10, p50, p90 = np.percentile(np.asarray(samples_s, dtype=np.float64), [10, 50, 90])
        return cls(float(p50), float(p10), float(p90), len(samples_s))

    def to_dict(self) -> dict:
        return {"median_s": self.median_s, "p10_s": self.p10_s, "p90_s": self.p90_s, "repeats": self.repeats}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "Timing":
        median_s = number(data, "median_s", where, minimum=1e-12)
        return cls(median_s, number(data, "p10_s", where), number(data, "p90_s", where),
                   integer(data, "repeats", where, minimum=1))


# compaction: decode steps that also compact; packing: quantized decode steps that complete a block each; scored:
# prefill chunks under an eviction policy that scores by attention
STEP_KINDS = ("decode", "prefill", "mixed", "compaction", "packing", "scored")


def kv_bits(grid: dict[str, int]) -> int:
    """The KV bits (keys and values alike) a grid point was measured at: its ``bits`` coordinate, 16 in
    files measured before quantized KV existed (they have no such coordinate)."""
    return grid.get("bits", FULL_PRECISION_BITS)

LINKS = ("device_to_host", "host_to_device", "host_to_disk", "disk_to_host")
# the disk tier's conversions of one KV block (`transfers.block_io_timings`): from the device pool's or the host
# pool's part tensors to the bytes of one write, and from the bytes of one read into the device pool's
BLOCK_IO = ("device_to_bytes", "host_to_bytes", "bytes_to_device")
# their cost: per block (one conversion call), per part tensor of a block, per byte (`block_io_features`)
BLOCK_IO_FEATURES = ("blocks", "parts", "bytes")


def block_io_features(blocks: int, parts: int, nbytes: int) -> list[float]:
    """The `BLOCK_IO_FEATURES` of converting ``blocks`` blocks of ``parts`` part tensors each, ``nbytes`` in all."""
    return [float(blocks), float(blocks * parts), float(nbytes)]


@dataclass(frozen=True)
class StepPoint:
    """One grid point of whole ``Engine.step()`` timings: its coordinates, the step's shape, the time."""

    kind: str
    grid: dict[str, int]  # decode: batch, context; prefill: chunk, cached; mixed: batch, context, chunk; + bits
    shape: StepShape
    timing: Timing
    held_out: bool = False  # kept out of the fit, to check it on points it has not seen

    def to_dict(self) -> dict:
        return {"kind": self.kind, "grid": dict(self.grid), "shape": self.shape._asdict(),
                "timing": self.timing.to_dict(), "held_out": self.held_out}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "StepPoint":
        shape = int_map(data, "shape", where)
        try:
            step_shape = StepShape(**shape)
        except TypeError:
            names = ", ".join(StepShape._fields)
            raise ValueError(f"{where}.shape: expected the fields {names}") from None
        held_out = entry(data, "held_out", where)
        if not isinstance(held_out, bool):
            raise ValueError(f"{where}.held_out: expected true or false, got {shown(held_out)}")
        return cls(text(data, "kind", where, choices=STEP_KINDS), int_map(data, "grid", where), step_shape,
                   Timing.from_dict(entry(data, "timing", where), f"{where}.timing"), held_out)


@dataclass(frozen=True)
class GridPoint:
    """A timing at named integer coordinates (kernel calls, scheduler steps, transfer sizes)."""

    kind: str
    grid: dict[str, int]
    timing: Timing

    def to_dict(self) -> dict:
        return {"kind": self.kind, "grid": dict(self.grid), "timing": self.timing.to_dict()}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "GridPoint":
        return cls(text(data, "kind", where), int_map(data, "grid", where),
                   Timing.from_dict(entry(data, "timing", where), f"{where}.timing"))
