"""`lmcache`: an LMCache configuration file (`LMCACHE_CONFIG_FILE=<yaml>`), the host and disk tiers of the KV
cache behind an engine's LMCache connector. Facts from the project's engine reference
(engines-and-algorithms.md, kept outside this repository), §1 (LMCacheConnectorV1) and §3 (LMCache keys,
`lmcache/v1/config.py` @000620e3).

An LMCache file holds the tiers only: batching, eviction, KV width, block size and the device pool are
the engine's settings, so they are listed as out of scope (export them with ``--to vllm``). The vLLM
export of a config with a disk tier, which vLLM reaches through LMCache, writes this same file as its
companion (`lmcache_file`, the one code path of both), named in the command's LMCACHE_CONFIG_FILE.

Mapping, knob -> LMCache:
  offload.host_kv_bytes   local_cpu + max_local_cpu_size. The reference says "GB"; LMCache multiplies by
                          1024**3 (checked in lmcache/v1/config users, not in the reference), so GiB.
  offload.disk_kv_bytes   local_disk + max_local_disk_size (GiB, as above). skistune has no path knob: the
                          file names DISK_PATH, a placeholder to edit.
                          Neither tier: the file configures no storage, warned (LMCache would store
                          nothing).
  offload.write_policy    write_through: LMCache stores chunks as the engine saves them (save_kv_layer /
                          wait_for_save), not when the device evicts them.
  offload.demote_first    cached_prefix: LMCache holds hashed prefix chunks.
  prefetch.*              use_layerwise: loads pipelined per layer (unit layers, one layer ahead).
                          enable_async_loading is not used: the reference says its semantics were not
                          checked in source.
  prefix_reuse.enabled    LMCache exists to reuse stored prefixes; off cannot be expressed (with a tier, the
                          warning every exporter gives: `tiers_without_prefix_reuse`).
  chunk_size              no skistune knob: LMCache's default, 256 tokens per hashed chunk.
"""
from __future__ import annotations

import json
from pathlib import PurePath
from typing import Any

from skistune.export.base import Companion, EngineVersion, Exporter, Plan, Rendered
from skistune.export.common import GIB, command_line, dump_yaml, model_id, size_setting, tiers_without_prefix_reuse
from skistune.runtime.presets import ModelSpec

DISK_PATH = "file:///var/tmp/skistune-lmcache/"  # placeholder: skistune's config names no disk path
CHUNK_SIZE = 256  # LMCache's default chunk (reference §3); skistune has no chunk knob
CONNECTOR = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}


def lmcache_file(plan: Plan, version: EngineVersion) -> tuple[dict[str, Any], str]:
    """The LMCache configuration file for the config's tiers: its settings and its text. The one code path
    of ``--to lmcache`` and of the vLLM export's companion file; accounts for the tier and prefetch knobs."""
    settings = lmcache_settings(plan)
    if settings["local_disk"]:
        plan.notes.append(f"local_disk {DISK_PATH} is a placeholder in the LMCache file (skistune has no disk-path "
                          "knob): point it at the disk the tier should use")
    header = (f"LMCache {version.name} configuration, written by skistune export.\n"
              "Use: LMCACHE_CONFIG_FILE=<this file> with the engine's LMCache connector "
              "(vLLM: LMCacheConnectorV1).")
    return settings, dump_yaml(settings, header)


def lmcache_companion(plan: Plan, engine_file: str) -> tuple[dict[str, Any], Companion]:
    """The LMCache file an engine's command names in LMCACHE_CONFIG_FILE, beside ``engine_file`` and named
    after it (``vllm.yaml`` -> ``vllm-lmcache.yaml``: two exports in one folder keep their own), with its
    settings."""
    version = LMCacheExporter.versions[-1]
    settings, text = lmcache_file(plan, version)
    path = PurePath(engine_file)
    name = str(path.with_name(f"{path.stem}-lmcache.yaml"))
    return settings, Companion(LMCacheExporter.name, version.name, name, text)


def lmcache_settings(plan: Plan) -> dict[str, Any]:
    """LMCache's keys for the config's host and disk tiers; accounts for the tier and prefetch knobs."""
    off, pf = plan.config.offload, plan.config.prefetch
    settings: dict[str, Any] = {"chunk_size": CHUNK_SIZE, "local_cpu": off.host_kv_bytes > 0}
    if off.host_kv_bytes:
        settings["max_local_cpu_size"] = size_setting(plan, "offload.host_kv_bytes", GIB, "max_local_cpu_size")
    else:
        plan.express("offload.host_kv_bytes")
    settings["local_disk"] = DISK_PATH if off.disk_kv_bytes else None
    if off.disk_kv_bytes:
        settings["max_local_disk_size"] = size_setting(plan, "offload.disk_kv_bytes", GIB, "max_local_disk_size")
    else:
        plan.express("offload.disk_kv_bytes")
    settings["use_layerwise"] = bool(pf.enabled and (off.host_kv_bytes or off.disk_kv_bytes))
    plan.fixed("offload.write_policy", "write_through", "LMCache stores KV chunks as the engine saves them")
    plan.fixed("offload.demote_first", "cached_prefix", "LMCache holds hashed prefix chunks; preempted "
               "sequences are the engine's business")
    plan.express("prefetch.enabled")
    plan.fixed("prefetch.unit", "layers", "LMCache's only overlapped loading is layer by layer (use_layerwise)")
    plan.fixed("prefetch.depth", 1, "use_layerwise loads one layer ahead of compute; LMCache has no depth "
               "setting")
    return settings


def connector_json(layerwise: bool) -> str:
    """vLLM's --kv-transfer-config for LMCache; ``use_layerwise`` is one of its documented extra keys."""
    config: dict[str, Any] = dict(CONNECTOR)
    if layerwise:
        config["kv_connector_extra_config"] = {"use_layerwise": True}
    return json.dumps(config, separators=(",", ":"))


class LMCacheExporter(Exporter):
    name = "lmcache"
    engine = "LMCache"
    versions = (EngineVersion("main-000620e3", "lmcache/v1/config.py @000620e3 (_CONFIG_DEFINITIONS); "
                                               "reference §3"),)
    default_file = "lmcache.yaml"
    scope = frozenset({"offload.host_kv_bytes", "offload.disk_kv_bytes", "offload.write_policy",
                       "offload.demote_first", "prefetch.enabled", "prefetch.unit", "prefetch.depth",
                       "prefix_reuse.enabled"})

    def render(self, plan: Plan, version: EngineVersion, model: ModelSpec, file_name: str) -> Rendered:
        settings, text = lmcache_file(plan, version)
        self._no_storage(plan)
        reuse = "LMCache reuses every stored prefix chunk a prompt matches"
        if not tiers_without_prefix_reuse(plan, "prefix reuse on", reuse):
            plan.fixed("prefix_reuse.enabled", True, reuse, written="prefix reuse on")
        command = command_line(["vllm", "serve", model_id(model)],
                               {"kv-transfer-config": connector_json(settings["use_layerwise"])},
                               env={"LMCACHE_CONFIG_FILE": file_name})
        return Rendered(text, command)

    @staticmethod
    def _no_storage(plan: Plan) -> None:
        """A config with no host or disk tier gives LMCache nothing to store: the file turns local_cpu off and
        names no disk, and the command would run LMCache for nothing. Warned (as the host tier, which
        lmcache_settings took as expressed), so that --strict refuses it. The vLLM export never gets here:
        it writes this file only for a disk tier."""
        off = plan.config.offload
        if off.host_kv_bytes or off.disk_kv_bytes:
            return
        plan.instead("offload.host_kv_bytes", "local_cpu false, local_disk null (no storage)", "the config has no host "
                     "or disk tier, so this LMCache file configures no storage and LMCache would store nothing "
                     "(export to an engine without LMCache, or give the config a tier)",
                     related=("offload.disk_kv_bytes",))
