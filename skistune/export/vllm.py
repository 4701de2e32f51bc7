"""`vllm`: a `vllm serve --config` YAML and the equivalent `vllm serve MODEL --flag ...` command line.

Facts from the project's engine reference (engines-and-algorithms.md, kept outside this repository), §1 (vLLM
`arg_utils.py` @99d7eb5d, about v0.11, and @002f10e0, the newest). The YAML follows vLLM's loader: a flat dict
of flag names without dashes, ``true`` is the bare flag, and ``false`` is dropped (so the default would win):
an off switch is written in its ``no-`` form (``no-enable-prefix-caching: true``). Dict-valued flags are JSON
strings.

Mapping, knob -> vLLM:
  bitwidth.key/value_bits   --kv-cache-dtype auto (16) | fp8 (8); one dtype for keys and values. 4 and 2
                            bits are written as fp8: the portable set is auto/fp8/fp8_e4m3/fp8_e5m2, and
                            the newest literal's int4/nvfp4/turboquant dtypes have no documented behaviour
                            in the reference.
  bitwidth.layer_bits       newest: fp8 with --kv-cache-dtype-skip-layers naming the 16-bit layers;
                            0.11 has no such flag: one dtype, the widest layer's.
  bitwidth.group_size       fp8 has per-tensor scales (checkpoint or 1.0); 32 stands for that. A note says
                            the measured quality needs calibrated scales: k_scale/v_scale from the checkpoint
                            (llm-compressor), or in 0.11 --calculate-kv-scales (the newest's note says it is
                            deprecated by PR #37201 and removed by PR #49389).
  eviction.*                none: vLLM keeps every token of a running sequence.
  prefix_reuse.*            --enable-prefix-caching / --no-enable-prefix-caching, --block-size (0.11 accepts
                            1, 8, 16, 32, 64, 128, rounded to by ratio; the newest any positive int). Off with
                            a host or disk tier is warned (`tiers_without_prefix_reuse`): the CPU tier is a
                            tier of the prefix cache.
  batching.*                --max-num-seqs, --max-num-batched-tokens, --enable-chunked-prefill /
                            --no-enable-chunked-prefill, --long-prefill-token-threshold (V1 caps one long
                            prompt's tokens per step at it; not written when the chunk size equals the
                            budget, where it caps nothing: the flag's default, 0, is no cap), --scheduling-policy
                            fcfs (vLLM's other policy, priority, orders by client-sent priorities); preemption
                            is always recompute in the V1 engine (swap was V0 only). vLLM's SchedulerConfig
                            refuses max_num_seqs > max_num_batched_tokens (vllm/config/scheduler.py, not in
                            the reference's table), so --max-num-seqs is capped at the budget, warned.
                            Chunking off with a budget below the model's context: the same SchedulerConfig
                            refuses max_num_batched_tokens < max_model_len, so --max-model-len is the
                            budget, noted (`_unchunked_model_len`; the flag is not in the reference's table,
                            it is the one that check names); skistune's runtime refuses the same requests
                            then. --max-num-seqs and --max-num-batched-tokens (whose defaults vLLM chooses
                            by GPU) and --gpu-memory-utilization pin the values the search evaluated: a
                            note says what vLLM would choose without them (`_pinned_note`).
  offload.device_*          --kv-cache-memory-bytes, else --gpu-memory-utilization.
  offload.host_kv_bytes     newest: --kv-offloading-size GiB (total across TP ranks) with the native
                            backend; 0.11: --kv-transfer-config OffloadingConnector with num_cpu_blocks
                            (cpu_bytes_to_use is required only from about v0.15). Whether
                            --kv-offloading-size already existed in 0.11 the reference does not say, so
                            0.11 uses the connector it documents for that version.
  offload.disk_kv_bytes     through LMCache (LMCacheConnectorV1), configured by an LMCache file written as
                            the export's companion (`lmcache.lmcache_companion`, the file --to lmcache
                            writes, named after this one: vllm.yaml -> vllm-lmcache.yaml), which the command
                            names in LMCACHE_CONFIG_FILE (vLLM's --config YAML cannot set the environment):
                            vLLM's own offloading has no disk tier except the newest TieringOffloadingSpec,
                            whose tier keys the reference does not give.
  offload.write_policy/     the OffloadingConnector writes finished blocks to CPU as they are produced
  demote_first, prefetch.*  (write_through, cached prefixes) and loads hits back asynchronously (always on;
                            no depth setting).
The reference lists no version note for --kv-cache-memory-bytes, --long-prefill-token-threshold,
--no-enable-chunked-prefill or LMCacheConnectorV1: they are taken as present in both versions.
"""
from __future__ import annotations

import json
from fractions import Fraction
from typing import Any

from skistune.export.base import Companion, EngineVersion, Exporter, Plan, Rendered
from skistune.export.common import (GIB, command_line, dump_yaml, fixed_scaling, fp8_scales_note, listed, model_id,
                                    no_eviction, round_up_width, single_kv_bits, size_differs, size_setting,
                                    tiers_without_prefix_reuse)
from skistune.export.layers import check_layer_bits
from skistune.export.lmcache import connector_json, lmcache_companion
from skistune.runtime.presets import ModelSpec

WIDTHS = (16, 8)
# Why the newest's narrower dtypes are not used; 0.11 has none narrower than fp8 to explain (its literal is
# the portable set plus fp8_inc), so its warnings say nothing about them.
NEWEST_DTYPES = "; the newest also lists int4/nvfp4/turboquant dtypes, whose behaviour the reference does not give"
# How vLLM gets calibrated fp8 scales (reference §1, §7), for the fp8 note; 0.11 predates the deprecation.
CHECKPOINT_SCALES = "vLLM reads k_scale/v_scale from a calibrated checkpoint (e.g. quantized with llm-compressor)"
# Why a CPU tier with prefix caching off is not the tuned config (`tiers_without_prefix_reuse`).
TIER = "vLLM's CPU tier (its offloading connector, or LMCache) is a tier of the prefix cache: it serves prefix hits"
# What vLLM chooses by GPU when --max-num-seqs and --max-num-batched-tokens are not given (reference §1,
# `get_batch_defaults`, server defaults), for the note that the export pins them (`_pinned_note`).
HARDWARE_DEFAULTS = ("256 sequences and 2048 tokens on GPUs under 70 GiB and on A100, 1024 and 8192 on H100/H200, "
                     "1024 and 16384 on GPUs of 160 GiB or more")


def _dtype(width: int) -> str:
    return "auto" if width == 16 else "fp8"


class VllmExporter(Exporter):
    name = "vllm"
    engine = "vLLM"
    versions = (
        EngineVersion("0.11", "vllm/engine/arg_utils.py @99d7eb5d (about v0.11); reference §1",
                      {"block_sizes": (1, 8, 16, 32, 64, 128), "skip_layers": False, "offload": "connector",
                       "other_dtypes": "", "gpu_memory_utilization": 0.9,
                       "kv_scales": f"{CHECKPOINT_SCALES}, or calculates them with --calculate-kv-scales"}),
        EngineVersion("main-002f10e0", "vllm/engine/arg_utils.py, config/cache.py @002f10e0 (the newest in the "
                                       "reference, about v0.2x-0.30, 2026); reference §1",
                      {"block_sizes": None, "skip_layers": True, "offload": "size", "other_dtypes": NEWEST_DTYPES,
                       "gpu_memory_utilization": 0.92,
                       "kv_scales": f"{CHECKPOINT_SCALES}; --calculate-kv-scales is deprecated (PR #37201) and "
                                    "removed by PR #49389"}),
    )
    default_file = "vllm-config.yaml"

    def render(self, plan: Plan, version: EngineVersion, model: ModelSpec, file_name: str) -> Rendered:
        flags, width = self._kv_dtype(plan, version, model)
        fixed_scaling(plan, "fp8 scales are per tensor, from the checkpoint or 1.0")
        if flags["kv-cache-dtype"] == "fp8":
            fp8_scales_note(plan, version["kv_scales"])
        no_eviction(plan, "vLLM has no KV eviction or compression: a running sequence keeps every token")
        flags.update(self._blocks(plan, version))
        flags.update(self._batching(plan, model))
        flags.update(self._memory(plan))
        self._pinned_note(plan, version, flags)
        offload, companions = self._offload(plan, version, model, width, flags["block-size"], file_name)
        flags.update(offload)
        header = [f"vLLM {version.name} engine arguments: vllm serve MODEL --config <this file>",
                  "written by skistune export; keys are vLLM's flags without the leading dashes"]
        env = {"LMCACHE_CONFIG_FILE": companions[0].file_name} if companions else {}
        if env:  # vLLM's --config file cannot set the environment: the line to serve with
            header += ["LMCache (LMCacheConnectorV1) reads its settings from the file LMCACHE_CONFIG_FILE names:",
                       "  " + command_line(["vllm", "serve", "MODEL", "--config", file_name], env=env)]
        command = command_line(["vllm", "serve", model_id(model)], flags, env)
        return Rendered(dump_yaml(flags, "\n".join(header)), command, companions)

    def _kv_dtype(self, plan: Plan, version: EngineVersion, model: ModelSpec) -> tuple[dict[str, Any], int]:
        """--kv-cache-dtype (and, per layer, --kv-cache-dtype-skip-layers); the width used for sizes."""
        layer_bits = plan.config.bitwidth.layer_bits
        if layer_bits is None or not version["skip_layers"]:
            width = single_kv_bits(plan, WIDTHS, _dtype, version["other_dtypes"])
            return {"kv-cache-dtype": _dtype(width)}, width
        check_layer_bits(plan.config, model)
        widths = [round_up_width(max(pair), WIDTHS) for pair in layer_bits]
        skip = [layer for layer, w in enumerate(widths) if w == 16] if 8 in widths else []
        flags: dict[str, Any] = {"kv-cache-dtype": "fp8" if 8 in widths else "auto"}
        if skip:
            flags["kv-cache-dtype-skip-layers"] = skip
        if any(b != w for pair, w in zip(layer_bits, widths) for b in pair):
            written = f"kv-cache-dtype {flags['kv-cache-dtype']}" + (f", 16-bit layers {skip}" if skip else "")
            plan.instead("bitwidth.layer_bits", written, "vLLM has 16-bit or fp8 KV per layer, one dtype for keys "
                         "and values; each layer's wider width, rounded up" + version["other_dtypes"])
        else:
            plan.express("bitwidth.layer_bits")
        return flags, max(widths)

    def _blocks(self, plan: Plan, version: EngineVersion) -> dict[str, Any]:
        size, allowed = plan.value("prefix_reuse.block_size"), version["block_sizes"]
        if allowed is not None and size not in allowed:
            # nearest by ratio (block sizes are powers of two: 4 is as far from 8 as 16 is), ties to the larger
            nearest = min(allowed, key=lambda s: (Fraction(max(s, size), min(s, size)), -s))
            plan.instead("prefix_reuse.block_size", f"block-size {nearest}",
                         f"vLLM {version.name} accepts block sizes {', '.join(map(str, allowed))}; the nearest")
            size = nearest
        else:
            plan.express("prefix_reuse.block_size")
        caching = "enable-prefix-caching" if plan.value("prefix_reuse.enabled") else "no-enable-prefix-caching"
        if not tiers_without_prefix_reuse(plan, f"{caching}, with the CPU tier", TIER):
            plan.express("prefix_reuse.enabled")
        return {"block-size": size, caching: True}

    def _batching(self, plan: Plan, model: ModelSpec) -> dict[str, Any]:
        b = plan.config.batching
        flags: dict[str, Any] = {"max-num-seqs": self._max_num_seqs(plan),
                                 "max-num-batched-tokens": b.max_num_batched_tokens}
        plan.express("batching.max_num_batched_tokens", "batching.chunk_size")
        if b.chunked_prefill:
            flags["enable-chunked-prefill"] = True
            # A threshold equal to the step's budget (the most a chunk may be) caps nothing: no prompt takes more
            # than the budget in a step anyway. It is left out, and vLLM's default, 0, is no cap in both versions
            # (V1's scheduler cuts a prompt's tokens only when 0 < threshold < tokens). The baseline (chunk =
            # budget) then reads as vLLM's own "no per-request cap", not as a pinned 2048.
            if b.chunk_size < b.max_num_batched_tokens:
                flags["long-prefill-token-threshold"] = b.chunk_size
            plan.express("batching.chunked_prefill")
        else:
            flags["no-enable-chunked-prefill"] = True
            flags.update(self._unchunked_model_len(plan, model))
        flags["scheduling-policy"] = "fcfs"
        plan.fixed("batching.policy", "fcfs", "vLLM orders by arrival (fcfs) or by priorities clients send "
                   "(priority); it has no longest-prefix-first or deadline order", written="scheduling-policy fcfs")
        plan.fixed("batching.preemption", "recompute", "vLLM's V1 engine always preempts by recompute (swap was "
                   "V0 only)")
        return flags

    @staticmethod
    def _max_num_seqs(plan: Plan) -> int:
        """--max-num-seqs, at most the step's token budget: vLLM's SchedulerConfig will not start with more
        sequences than max_num_batched_tokens (a decode step needs a token for each of them).
        skistune's runtime keeps more sequences resident than a step can decode, so a cap is a warning."""
        b = plan.config.batching
        if b.max_num_seqs <= b.max_num_batched_tokens:
            plan.express("batching.max_num_seqs")
            return b.max_num_seqs
        plan.instead("batching.max_num_seqs", f"max-num-seqs {b.max_num_batched_tokens} (the token budget)",
                     f"vLLM will not start with max_num_seqs above max_num_batched_tokens "
                     f"({b.max_num_batched_tokens}; its SchedulerConfig check): the runtime was tuned with more "
                     "resident sequences than vLLM takes")
        return b.max_num_batched_tokens

    @staticmethod
    def _pinned_note(plan: Plan, version: EngineVersion, flags: dict[str, Any]) -> None:
        """One note that the batch caps (whose defaults vLLM chooses by GPU) and a memory utilization other
        than the version's default are pinned: skistune's predictions rest on the values the search evaluated,
        so they stay, and the note says what vLLM would choose without them (the baseline's 256/2048 are
        vLLM's defaults on small GPUs only: without the flags an H100 gets 1024/8192)."""
        pinned = [f"--max-num-seqs {flags['max-num-seqs']}",
                  f"--max-num-batched-tokens {flags['max-num-batched-tokens']}"]
        otherwise = HARDWARE_DEFAULTS
        utilization, default = flags.get("gpu-memory-utilization"), version["gpu_memory_utilization"]
        if utilization is not None and utilization != default:
            pinned.append(f"--gpu-memory-utilization {utilization}")
            otherwise += f", and a memory utilization of {default}"
        plan.notes.append(f"{listed(pinned)} pin the tuned values (skistune's predictions rest on them); without "
                          f"them vLLM {version.name} would choose {otherwise}")

    @staticmethod
    def _unchunked_model_len(plan: Plan, model: ModelSpec) -> dict[str, Any]:
        """Without chunked prefill vLLM will not start with max_num_batched_tokens below max_model_len (its
        SchedulerConfig check), so the model length is the budget: vLLM then refuses requests longer than the
        budget, prompt and output together, as skistune's runtime does under that config (a request's
        recompute after a preemption is one step there)."""
        budget = plan.config.batching.max_num_batched_tokens
        plan.express("batching.chunked_prefill")
        if budget >= model.max_context:
            return {}
        plan.notes.append(f"chunked prefill off: --max-model-len {budget} (the step budget; vLLM will not start "
                          f"with max_num_batched_tokens below max_model_len, {model.name}'s {model.max_context}-"
                          f"token context): requests longer than {budget} tokens, prompt and output together, are "
                          "refused, as skistune predicted")
        return {"max-model-len": budget}

    def _memory(self, plan: Plan) -> dict[str, Any]:
        off = plan.config.offload
        plan.express("offload.device_kv_bytes", "offload.device_memory_fraction")
        if off.device_kv_bytes is not None:
            return {"kv-cache-memory-bytes": off.device_kv_bytes}
        plan.notes.append("offload.device_memory_fraction is written as --gpu-memory-utilization, which vLLM takes "
                          "of the whole GPU memory (weights and activations included), while skistune's fraction "
                          "is of the memory left after the weights: vLLM's KV pool comes out smaller; set "
                          "offload.device_kv_bytes for an exact pool (--kv-cache-memory-bytes)")
        return {"gpu-memory-utilization": off.device_memory_fraction}

    def _offload(self, plan: Plan, version: EngineVersion, model: ModelSpec, width: int, block_size: int,
                 file_name: str) -> tuple[dict[str, Any], tuple[Companion, ...]]:
        """The offload flags and the companion files they need (LMCache's, for a disk tier)."""
        off = plan.config.offload
        if off.disk_kv_bytes:
            settings, companion = lmcache_companion(plan, file_name)
            plan.notes.append(f"disk tier through LMCache: its settings are the LMCache file {companion.file_name} "
                              "(the export's companion file, what --to lmcache writes), which the command names in "
                              "LMCACHE_CONFIG_FILE")
            return {"kv-transfer-config": connector_json(settings["use_layerwise"])}, (companion,)
        plan.express("offload.disk_kv_bytes")
        if not off.host_kv_bytes:
            plan.express("offload.host_kv_bytes")
            return {}, ()
        self._native_offload_behaviour(plan)
        if version["offload"] == "size":
            size = size_setting(plan, "offload.host_kv_bytes", GIB, "kv-offloading-size")
            return {"kv-offloading-size": size, "kv-offloading-backend": "native"}, ()
        block_bytes = model.kv_bytes_per_token(width, width) * block_size
        blocks = max(1, off.host_kv_bytes // block_bytes)  # rounded down: never more host memory than asked...
        plan.notes.append(f"num_cpu_blocks {blocks} = host_kv_bytes / {block_bytes} bytes per {block_size}-token "
                          f"block of {model.name} at {width}-bit KV, on one rank (tensor parallel 1)")
        if size_differs(off.host_kv_bytes, blocks * block_bytes):  # ...but at least one block
            plan.instead("offload.host_kv_bytes", f"num_cpu_blocks {blocks} ({blocks * block_bytes} bytes)",
                         f"the OffloadingConnector sizes the CPU pool in whole blocks ({block_bytes} bytes each)")
        else:
            plan.express("offload.host_kv_bytes")
        extra = {"block_size": block_size, "num_cpu_blocks": blocks}
        connector = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
        return {"kv-transfer-config": json.dumps(connector, separators=(",", ":"))}, ()

    @staticmethod
    def _native_offload_behaviour(plan: Plan) -> None:
        """What vLLM's OffloadingConnector always does (reference §1), against the tier knobs."""
        plan.fixed("offload.write_policy", "write_through", "vLLM's OffloadingConnector writes finished blocks to "
                   "CPU as they are produced")
        plan.fixed("offload.demote_first", "cached_prefix", "the CPU copies serve prefix-cache hits; preempted "
                   "sequences are recomputed, not moved")
        plan.fixed("prefetch.enabled", True, "the OffloadingConnector always loads CPU hits back asynchronously "
                   "(DMA overlapped with compute)", written="asynchronous loads (always on)")
        plan.fixed("prefetch.unit", "blocks", "the OffloadingConnector moves whole blocks")
        plan.fixed("prefetch.depth", 1, "vLLM has no prefetch-depth setting", written="no depth setting (1)")
