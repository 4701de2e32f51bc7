"""Export targets by name, and `export`, the one entry point the CLI and the Python API call."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from skistune.config import KVConfig, did_you_mean, load_config, load_provenance
from skistune.export.base import Exporter, ExportResult, ExportWarning, show
from skistune.export.layers import LayerCountError, LayersExporter
from skistune.export.lmcache import LMCacheExporter
from skistune.export.native import NativeExporter
from skistune.export.sglang import SglangExporter
from skistune.export.trtllm import TrtllmExporter
from skistune.export.vllm import VllmExporter
from skistune.runtime.presets import PRESETS, get_preset

FALLBACK_MODEL = "smollm2-135m"  # for a config that records no model (written by hand, or a KVConfig)
# `export`'s model (and the command line's --model) when none is given: None, the model the tuned file records
# in its provenance (`skistune optimize --model`), else FALLBACK_MODEL. A fixed preset here had exported a
# config tuned for llama-3-8b with SmolLM2's layer count and KV bytes per token.
DEFAULT_MODEL: str | None = None

EXPORTERS: dict[str, Exporter] = {e.name: e for e in (NativeExporter(), VllmExporter(), SglangExporter(),
                                                      LMCacheExporter(), TrtllmExporter(), LayersExporter())}


def exporter_names() -> tuple[str, ...]:
    return tuple(EXPORTERS)


def get_exporter(target: str) -> Exporter:
    try:
        return EXPORTERS[target]
    except KeyError:
        raise ValueError(f"--to {target!r}{did_you_mean(target, EXPORTERS)}: unknown export target (known: "
                         f"{', '.join(EXPORTERS)})") from None


SERVING_ENGINES = ("vllm", "sglang", "lmcache", "trtllm")  # (native and layers are skistune's own files)


def _lost_gain_note(provenance: Mapping[str, Any], result: ExportResult, engine: str, target: str) -> str | None:
    """When a tuned file's predicted gain over the baseline rests on knobs this export could not write (its
    warnings): the gain no longer applies as predicted, and a search restricted to the engine finds what it
    deploys (a --quality result exported to vLLM had dropped its 8-bit values and swap, each warned about, with
    no word that the x1.30 went with them)."""
    baseline = provenance.get("baseline")
    gain = baseline.get("gain") if isinstance(baseline, Mapping) else None
    if not result.warnings or not isinstance(gain, Mapping):
        return None
    better = {k: v for k, v in gain.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 1.0}
    if not better:
        return None
    told = ", ".join(f"{k} x{v:.3g}" for k, v in better.items())
    search = f" (skistune optimize --target {target} searches only what {engine} deploys)" \
        if target in ("vllm", "sglang") else ""
    return (f"the predicted gain over the baseline ({told}, the file's provenance) rests on the config as tuned; "
            f"the knobs warned about are written otherwise, so it does not carry over as predicted{search}")


def _tuned_on(provenance: Mapping[str, Any]) -> tuple[str, str] | None:
    """(profile name, device) the config was tuned with, or None. Files written before the device was
    recorded name it as the profile's prefix (cpu-..., cuda-...)."""
    try:
        profile = provenance["profile"]
        name = str(profile["name"])
        return name, str(profile.get("device") or name.split("-", 1)[0])
    except (TypeError, KeyError, AttributeError):
        return None


def recorded_model(provenance: Mapping[str, Any]) -> str | None:
    recorded = provenance.get("model")
    return recorded if isinstance(recorded, str) else None


def tuned_model(asked: str | None, provenance: Mapping[str, Any], config: str | Path) -> str:
    """The model preset to export for: ``asked``, else the one the config was tuned for, else
    `FALLBACK_MODEL`. Asking for another model than the recorded one is allowed (a config tuned on a small
    model, deployed on a larger one) but warned about (`_model_warning`): byte pools become other token
    counts."""
    recorded = recorded_model(provenance)
    if asked is None:
        if recorded is not None and recorded not in PRESETS:
            raise ValueError(f"{config}: tuned for model {recorded!r} (its provenance), which is not a preset here "
                             f"(known: {', '.join(PRESETS)}): give --model")
        return recorded or FALLBACK_MODEL
    get_preset(asked)  # (an unknown preset is the error, before any warning about it)
    return asked


def _model_warning(model: str, provenance: Mapping[str, Any], config: str | Path) -> ExportWarning | None:
    """An export for another model than the one the file was tuned for, as an export warning like any knob's:
    in the result's warnings (so in --json's), and refused by --strict (docs/export.md promises that of every
    warning; a Python warning on standard error alone had let a CI job with --strict --json deploy byte pools
    and per-layer settings sized for another model)."""
    recorded = recorded_model(provenance)
    if recorded is None or recorded == model:
        return None
    return ExportWarning("provenance.model", recorded, f"settings for {model}",
                         f"exported for model {model} (--model), but {config} was tuned for {recorded}: its byte "
                         "sizes and per-layer settings were chosen for that model")


def export(config: KVConfig | str | Path, target: str, engine_version: str | None = None, strict: bool = False,
           *, model: str | None = DEFAULT_MODEL, file_name: str | None = None) -> ExportResult:
    """Write ``config`` (a `KVConfig` or a config file's path) in ``target``'s own format for one engine
    version (default: the newest the exporter knows). ``model`` (a preset name) gives the layer count and
    the KV bytes per token where a target needs them; None: the model a tuned file's provenance records, else
    `FALLBACK_MODEL` (another model than the recorded one is a warning, ``provenance.model``). ``file_name`` is
    the name the command line uses for the written file. With ``strict``, any warning (a knob the target
    cannot express, another model) raises ``ValueError``."""
    exporter = get_exporter(target)
    version = exporter.version(engine_version)
    cfg = config if isinstance(config, KVConfig) else load_config(str(config))
    provenance = {} if isinstance(config, KVConfig) else load_provenance(config)
    spec = get_preset(tuned_model(model, provenance, config))
    try:
        result = exporter.export(cfg, version, spec, file_name or exporter.default_file, provenance=provenance)
    except LayerCountError as exc:  # (a fault of the file, named as its other faults are)
        raise (exc if isinstance(config, KVConfig) else LayerCountError(f"{config}: {exc}")) from None
    other_model = _model_warning(spec.name, provenance, config)
    if other_model is not None:  # (first: it bears on every size and per-layer setting below)
        result = replace(result, warnings=(other_model, *result.warnings))
    tuned_on = _tuned_on(provenance)
    if tuned_on is not None and tuned_on[1] == "cpu" and target in SERVING_ENGINES:
        result = replace(result, notes=result.notes + (
            f"this config was tuned with profile {tuned_on[0]}, measured on a CPU: its memory fraction and batch "
            f"caps suit that machine; for a GPU, measure it (skistune profile --device cuda) and tune with that "
            "profile before deploying",))
    gain = _lost_gain_note(provenance, result, exporter.engine, target)
    if gain is not None:
        result = replace(result, notes=(gain, *result.notes))
    if strict and result.warnings:
        listed = ", ".join(f"{w.knob}={show(w.value, w.knob)} (would write {w.written})" for w in result.warnings)
        raise ValueError(f"--strict: {len(result.warnings)} knob(s) cannot be expressed in {exporter.engine} "
                         f"{version.name}: {listed}; without --strict the warnings say why")
    return result
