"""Export a tuned `KVConfig` to the engines' own files and flags, per engine version.

    from skistune.export import export
    result = export("skistune-tuned.yaml", "vllm")        # newest vLLM the exporter knows
    print(result.text); print(result.command)
    for w in result.warnings: print(w)                     # knobs vLLM cannot express, and what was written
    for c in result.companions: print(c.file_name)         # files the command needs beside it (LMCache's)

Targets: native (the skistune YAML), vllm, sglang, lmcache, trtllm, layers (per-layer bits and budgets).
Every exporter accounts for every knob that matters in the config: expressed, or named in a warning with
the nearest setting written instead (``strict=True`` makes that an error). See docs/export.md.
"""
from skistune.export.base import Companion, EngineVersion, Exporter, ExportResult, ExportWarning, relevant_knobs
from skistune.export.layers import layer_budgets
from skistune.export.registry import (DEFAULT_MODEL, EXPORTERS, FALLBACK_MODEL, export, exporter_names,
                                      get_exporter)

__all__ = ["Companion", "DEFAULT_MODEL", "EXPORTERS", "EngineVersion", "ExportResult", "ExportWarning", "Exporter",
           "FALLBACK_MODEL", "export", "exporter_names", "get_exporter", "layer_budgets", "relevant_knobs"]
