"""Export targets by name, and `export`, the one entry point the CLI and the Python API call."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from skistune.config import KVConfig, load_config
from skistune.export.base import Exporter, ExportResult, show
from skistune.export.layers import LayersExporter
from skistune.export.lmcache import LMCacheExporter
from skistune.export.native import NativeExporter
from skistune.export.sglang import SglangExporter
from skistune.export.trtllm import TrtllmExporter
from skistune.export.vllm import VllmExporter
from skistune.runtime.presets import get_preset

DEFAULT_MODEL = "smollm2-135m"

EXPORTERS: dict[str, Exporter] = {e.name: e for e in (NativeExporter(), VllmExporter(), SglangExporter(),
                                                      LMCacheExporter(), TrtllmExporter(), LayersExporter())}


def exporter_names() -> tuple[str, ...]:
    return tuple(EXPORTERS)


def get_exporter(target: str) -> Exporter:
    try:
        return EXPORTERS[target]
    except KeyError:
        raise ValueError(f"--to {target!r}: unknown export target (known: {', '.join(EXPORTERS)})") from None


SERVING_ENGINES = ("vllm", "sglang", "lmcache", "trtllm")  # (native and layers are skistune's own files)


def _tuned_on(path: str | Path) -> tuple[str, str] | None:
    """(profile name, device) from the provenance `skistune optimize` writes into a tuned file, or None (a
    config written by hand, or unreadable: `load_config` has read its knobs already). Files written before
    the device was recorded name it as the profile's prefix (cpu-..., cuda-...)."""
    import yaml

    try:
        profile = yaml.safe_load(Path(path).read_text(encoding="utf-8"))["provenance"]["profile"]
        name = str(profile["name"])
        return name, str(profile.get("device") or name.split("-", 1)[0])
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return None


def export(config: KVConfig | str | Path, target: str, engine_version: str | None = None, strict: bool = False,
           *, model: str = DEFAULT_MODEL, file_name: str | None = None) -> ExportResult:
    """Write ``config`` (a `KVConfig` or a config file's path) in ``target``'s own format for one engine
    version (default: the newest the exporter knows). ``model`` (a preset name) gives the layer count and
    the KV bytes per token where a target needs them; ``file_name`` is the name the command line uses for
    the written file. With ``strict``, any knob the target cannot express raises ``ValueError``."""
    exporter = get_exporter(target)
    version = exporter.version(engine_version)
    cfg = config if isinstance(config, KVConfig) else load_config(str(config))
    result = exporter.export(cfg, version, get_preset(model), file_name or exporter.default_file)
    tuned_on = None if isinstance(config, KVConfig) else _tuned_on(config)
    if tuned_on is not None and tuned_on[1] == "cpu" and target in SERVING_ENGINES:
        result = replace(result, notes=result.notes + (
            f"this config was tuned with profile {tuned_on[0]}, measured on a CPU: its memory fraction and batch "
            f"caps suit that machine; for a GPU, measure it (skistune profile --device cuda) and tune with that "
            "profile before deploying",))
    if strict and result.warnings:
        listed = ", ".join(f"{w.knob}={show(w.value, w.knob)} (would write {w.written})" for w in result.warnings)
        raise ValueError(f"--strict: {len(result.warnings)} knob(s) cannot be expressed in {exporter.engine} "
                         f"{version.name}: {listed}; without --strict the warnings say why")
    return result
