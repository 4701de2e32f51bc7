"""Quality profiles: the measured quality cost of eviction and low-bit KV on a real model, and the model
that predicts the loss of any config from them (`skistune quality` measures one)."""
from __future__ import annotations

import importlib.resources
from pathlib import Path

from skistune.quality.model import QualityProfile

SHIPPED_PACKAGE = "skistune.profiles"
REFERENCE_MODEL = "smollm2-135m"  # the real model whose profile stands in for weightless presets

__all__ = ["QualityProfile", "shipped_quality_profile", "load_quality_profile", "quality_profile_path",
           "REFERENCE_MODEL"]


def shipped_quality_profile(model: str = REFERENCE_MODEL) -> QualityProfile | None:
    """The full quality profile shipped with skistune for ``model`` (None when there is none)."""
    entry = importlib.resources.files(SHIPPED_PACKAGE) / f"quality-{model}.json"
    if not entry.is_file():
        return None
    with importlib.resources.as_file(entry) as path:
        return QualityProfile.load(path)


def load_quality_profile(spec: str | Path | QualityProfile | None = None) -> QualityProfile | None:
    """A profile object, a file path or a shipped profile's name (`quality_profile_path`), or None for the shipped
    profile of the reference model."""
    if isinstance(spec, QualityProfile):
        return spec
    if spec is None:
        return shipped_quality_profile()
    return QualityProfile.load(quality_profile_path(spec))


def quality_profile_path(spec: str | Path) -> Path:
    """The quality profile file ``spec`` names: a file, or a bare name that is no file here
    (``quality-smollm2-135m``), the shipped profile of that name."""
    from skistune.paths import shipped_or_path
    from skistune.profile.profile import shipped_json_files

    shipped = {name: path for name, path in shipped_json_files().items() if name.startswith("quality-")}
    return shipped_or_path(spec, shipped, "quality profile")
