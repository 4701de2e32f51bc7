"""`native`: the skistune YAML itself, every knob as written, and a tuned file's provenance (the file `skistune
optimize` writes and `skistune demo --config` / `skistune evaluate` read)."""
from __future__ import annotations

from skistune.export.base import EngineVersion, Exporter, Plan, Rendered
from skistune.export.common import command_line
from skistune.runtime.presets import ModelSpec


class NativeExporter(Exporter):
    name = "native"
    engine = "skistune"
    # The config format has one version so far; a new one would be added here with its converter.
    versions = (EngineVersion("1", "skistune/config.py (KVConfig)"),)
    default_file = "skistune-tuned.yaml"

    def render(self, plan: Plan, version: EngineVersion, model: ModelSpec, file_name: str) -> Rendered:
        plan.express(*plan.relevant)
        # (the provenance travels with the config: a re-export of this file had lost the model it was tuned for)
        return Rendered(plan.config.to_yaml(plan.provenance or None), command_line(["skistune", "evaluate", file_name],
                                                           {"mode": "run", "model": model.name}))
