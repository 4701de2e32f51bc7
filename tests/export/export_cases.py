"""Shared cases of the export tests: every (exporter, version) pair, the golden input configs, and for every
knob a base config in which it matters plus a change of it."""
from __future__ import annotations

from pathlib import Path

from skistune.config import KVConfig, load_config
from skistune.export import EXPORTERS

HERE = Path(__file__).resolve().parent
CONFIGS = HERE / "configs"
GOLDEN = HERE / "golden"
GOLDEN_CONFIGS = sorted(p.stem for p in CONFIGS.glob("*.yaml"))

TARGET_VERSIONS = [(name, v.name) for name, e in EXPORTERS.items() for v in e.versions]
TV_IDS = [f"{t}-{v}" for t, v in TARGET_VERSIONS]

GIB = 1 << 30
H2O = {"eviction.policy": "h2o", "eviction.budget_tokens": 256}
STREAM = {"eviction.policy": "streaming", "eviction.budget_tokens": 256}
STREAM_FRACTION = {"eviction.policy": "streaming", "eviction.budget_fraction": 0.5}
Q4 = {"bitwidth.key_bits": 4, "bitwidth.value_bits": 4}
HOST = {"offload.host_kv_bytes": 8 * GIB}
HOST_PREFETCH = {**HOST, "prefetch.enabled": True}
DISK = {"offload.disk_kv_bytes": 100 * GIB}

# (knob, base knobs in which the knob matters, the change). Every knob of KVConfig appears at least once
# (test_every_knob_has_a_case), so a new knob cannot skip the contract.
KNOB_CASES: list[tuple[str, dict, dict]] = [
    ("eviction.policy", {}, H2O),
    ("eviction.policy", {}, STREAM),
    ("eviction.budget_tokens", H2O, {"eviction.budget_tokens": 512}),
    ("eviction.budget_tokens", STREAM, {"eviction.budget_tokens": 512}),
    ("eviction.budget_fraction", STREAM_FRACTION, {"eviction.budget_fraction": 0.25}),
    ("eviction.sink_tokens", STREAM, {"eviction.sink_tokens": 8}),
    ("eviction.sink_tokens", H2O, {"eviction.sink_tokens": 8}),
    ("eviction.recent_window", STREAM, {"eviction.recent_window": 512}),
    ("eviction.layer_schedule", STREAM, {"eviction.layer_schedule": "pyramid"}),
    ("eviction.layer_schedule", H2O, {"eviction.layer_schedule": "pyramid"}),
    ("bitwidth.key_bits", {}, {"bitwidth.key_bits": 8}),
    ("bitwidth.key_bits", {}, {"bitwidth.key_bits": 2}),
    ("bitwidth.value_bits", {}, {"bitwidth.value_bits": 4}),
    ("bitwidth.value_bits", {"bitwidth.key_bits": 8, "bitwidth.value_bits": 8}, {"bitwidth.value_bits": 16}),
    ("bitwidth.group_size", Q4, {"bitwidth.group_size": 64}),
    ("bitwidth.full_precision_window", Q4, {"bitwidth.full_precision_window": 128}),
    ("bitwidth.layer_bits", {}, {"bitwidth.layer_bits": [[8, 8]] * 15 + [[16, 16]] * 15}),
    ("bitwidth.layer_bits", {}, {"bitwidth.layer_bits": [[4, 2]] * 30}),
    ("offload.device_memory_fraction", {}, {"offload.device_memory_fraction": 0.7}),
    ("offload.device_kv_bytes", {}, {"offload.device_kv_bytes": 2 * GIB}),
    ("offload.host_kv_bytes", {}, HOST),
    ("offload.disk_kv_bytes", {}, DISK),
    ("offload.disk_kv_bytes", HOST, DISK),
    ("offload.demote_first", HOST, {"offload.demote_first": "preempted"}),
    ("offload.write_policy", HOST, {"offload.write_policy": "write_through"}),
    ("offload.write_policy", {**HOST, **DISK}, {"offload.write_policy": "write_through"}),
    ("prefetch.enabled", HOST, {"prefetch.enabled": True}),
    ("prefetch.enabled", {**HOST, **DISK}, {"prefetch.enabled": True}),
    ("prefetch.depth", HOST_PREFETCH, {"prefetch.depth": 4}),
    ("prefetch.unit", HOST_PREFETCH, {"prefetch.unit": "layers"}),
    ("batching.max_num_seqs", {}, {"batching.max_num_seqs": 64}),
    ("batching.max_num_batched_tokens", {}, {"batching.max_num_batched_tokens": 4096}),
    ("batching.chunked_prefill", {}, {"batching.chunked_prefill": False}),
    ("batching.chunk_size", {}, {"batching.chunk_size": 256}),
    ("batching.policy", {}, {"batching.policy": "prefix"}),
    ("batching.policy", {}, {"batching.policy": "edf"}),
    ("batching.preemption", {}, {"batching.preemption": "swap"}),
    ("prefix_reuse.enabled", {}, {"prefix_reuse.enabled": False}),
    ("prefix_reuse.enabled", HOST, {"prefix_reuse.enabled": False}),
    ("prefix_reuse.block_size", {}, {"prefix_reuse.block_size": 64}),
    ("prefix_reuse.block_size", {}, {"prefix_reuse.block_size": 1}),
    ("prefix_reuse.block_size", {}, {"prefix_reuse.block_size": 256}),
]
KNOB_IDS = [f"{i:02d}-{knob}" for i, (knob, _, _) in enumerate(KNOB_CASES)]


def config_of(knobs: dict) -> KVConfig:
    return KVConfig().with_knobs(knobs)


def golden_config(name: str) -> KVConfig:
    return load_config(str(CONFIGS / f"{name}.yaml"))
