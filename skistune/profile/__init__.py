"""Hardware profiles: measure this machine's runtime step, kernels, transfers and power; fit cost functions;
read them back with their provenance.

Loading and predicting are torch-free (the simulator imports this package); measuring imports torch and
the runtime, so `measure_profile`, `profile_model`, `Grid`, `FULL_GRID` and `QUICK_GRID` are loaded on
first use.
"""
from __future__ import annotations

from typing import Any

from .cost import (
    ALL_FEATURES,
    EVICTION_FEATURES,
    FEATURES,
    QUANT_FEATURES,
    StepCostModel,
    StepShape,
    decode_shape,
    design_matrix,
    step_shape,
)
from .fingerprint import Fingerprint, fingerprint_diff, machine_fingerprint
from .fit import R2_FLAG_BELOW, FitQuality, LinearFit, StepFit, TransferFit
from .power import PowerModel
from .profile import (
    FingerprintWarning,
    HardwareProfile,
    Measured,
    ProfileCacheWarning,
    cache_dir,
    cached_profile_path,
    default_profile,
    load_profile,
    read_cached_profile,
    shipped_profiles,
)
from .records import LINKS, GridPoint, StepPoint, Timing

_MEASURING = {"measure_profile", "profile_model", "Grid", "FULL_GRID", "QUICK_GRID"}

__all__ = [
    "ALL_FEATURES", "EVICTION_FEATURES", "FEATURES", "QUANT_FEATURES", "StepCostModel", "StepShape", "decode_shape", "design_matrix",
    "step_shape",
    "Fingerprint", "fingerprint_diff", "machine_fingerprint",
    "R2_FLAG_BELOW", "FitQuality", "LinearFit", "StepFit", "TransferFit", "PowerModel",
    "FingerprintWarning", "HardwareProfile", "Measured", "ProfileCacheWarning", "cache_dir", "cached_profile_path",
    "default_profile", "load_profile", "read_cached_profile", "shipped_profiles", "LINKS", "GridPoint", "StepPoint", "Timing",
    "FULL_GRID", "QUICK_GRID", "Grid", "measure_profile", "profile_model",
]


def __getattr__(name: str) -> Any:
    if name in _MEASURING:
        from . import measure

        return getattr(measure, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
