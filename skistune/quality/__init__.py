"""Quality profiles: the measured quality cost of eviction and low-bit KV on a real model, and the model
that predicts the loss of any config from them (`skistune quality` measures one)."""
from __future__ import annotations

import importlib.resources
from pathlib import Path

from skistune.quality.model import QualityProfile

SHIPPED_PACKAGE = "skistune.profiles"
REFERENCE_MODEL = "smollm2-135m"  # the real model whose profile stands in for weightless presets

__all__ = ["QualityProfile", "shipped_quality_profile", "load_quality_profile", "quality_profile_path",
           "incomplete_notes", "REFERENCE_MODEL"]


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


def incomplete_notes(profile: QualityProfile) -> list[str]:
    """Notes for a profile whose grid was not measured to the end (an interrupted run), or whose layer count is
    not its model's: `quality --show` had printed such a file as if it were whole, and optimize used it silently."""
    from skistune.quality.grid import GRIDS
    from skistune.runtime.presets import get_preset

    lines = []
    try:
        layers = get_preset(profile.model).n_layers
    except ValueError:
        layers = None  # (a model this version has no preset of: nothing to compare with)
    if layers is not None and layers != profile.n_layers:
        lines.append(f"the profile says {profile.n_layers} layers, but {profile.model} has {layers}: its per-layer "
                     "figures do not map onto the model's layers")
    grid = GRIDS.get(profile.data["protocol"].get("grid"))
    if grid is not None:
        expected = len(grid.perplexity(profile.n_layers)) + len(grid.needle())
        taken = len(profile.data.get("perplexity", {})) + len(profile.data.get("needle", {}))
        if taken < expected:
            lines.append(f"incomplete: {taken} of the {grid.name} grid's {expected} measurements (an interrupted run; "
                         f"`skistune quality{' --quick' if grid.name == 'quick' else ''} --out FILE` resumes it): "
                         "figures outside what was measured read as outside the grid")
    return lines
