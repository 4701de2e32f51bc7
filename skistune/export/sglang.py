"""`sglang`: an SGLang `--config` YAML and the equivalent `python -m sglang.launch_server` command line.

Facts from the project's engine reference (engines-and-algorithms.md, kept outside this repository), §2
(`python/sglang/srt/server_args.py` @001067ff, the newest). SGLang's YAML keys are used as written in
``--{key}``, so they are dashed; a store_true flag is written ``true`` and left out when off. ``--model-path``
(the command's model flag) is not in the reference; it is SGLang's usual model flag.

Mapping, knob -> SGLang:
  bitwidth.key/value_bits   --kv-cache-dtype auto (16) | fp8_e4m3 (8); one dtype for keys and values. 4
                            and 2 bits are written as fp8_e4m3: the portable set is auto/fp8_e4m3/fp8_e5m2.
  bitwidth.group_size       fp8 scales are per tensor (--quantization-param-path, else 1.0); 32 stands for it.
                            A note says the measured quality needs calibrated scales (that flag).
  eviction.*                none: --radix-eviction-policy evicts cached prefixes, not tokens of running
                            sequences.
  prefix_reuse.*            radix cache (off: --disable-radix-cache), --page-size. Off with a host or disk
                            tier: radix cache on, warned (`tiers_without_prefix_reuse`; HiCache needs it).
  batching.*                --max-running-requests, --max-prefill-tokens (SGLang caps prefill tokens per
                            batch; decode tokens are not counted), --chunked-prefill-size (-1: off; a
                            budget for the whole prefill batch per step, as SGLang's PrefillAdder takes each
                            request's chunk from what is left, where chunk_size caps one sequence: warned
                            unless it equals max_num_batched_tokens, which caps the batch alike),
                            --schedule-policy fcfs | lpm (longest prefix match); retraction recomputes.
                            --max-prefill-tokens is left out where the chunk budget equals it and it is at
                            most SGLang's default, 16384: the chunk budget then bounds every step either
                            way (`_max_prefill_tokens`; the baseline's 8192 reads as SGLang's default).
  automatic values          --page-size, --max-running-requests, --chunked-prefill-size, --mem-fraction-static
                            (or --max-total-tokens) default to None, which SGLang resolves by GPU and pool:
                            they are written (skistune's predictions rest on the tuned values), with a note
                            saying what SGLang would choose without them (`_pinned_note`).
  offload.device_*          --mem-fraction-static (SGLang's fraction covers the weights too), or
                            --max-total-tokens = device_kv_bytes / KV bytes per token of the model.
  offload.host_kv_bytes     --enable-hierarchical-cache --hicache-size: the host pool itself, in whole GB
                            (1e9 bytes: SGLang's host pool is host_size * 1e9 bytes, checked in its source;
                            the reference says "GB per rank") on one rank. --hicache-size overrides
                            --hicache-ratio (host pool / device pool, whose default 2 is the design doc's
                            minimum for a ratio), so the size is written as asked, not raised to twice the
                            device pool; a host pool not larger than the device pool gets a note (SGLang's
                            host pool source asserts, or in later trees warns, that it should be larger).
  offload.write_policy      --hicache-write-policy write_back | write_through.
  offload.disk_kv_bytes     --hicache-storage-backend file: storage backends take no size setting.
  prefetch.*                host-to-device loads are always layer-overlapped (unit layers, one layer ahead);
                            with a disk tier --hicache-storage-prefetch-policy timeout (prefetch, bounded)
                            or wait_complete (prefetch off: wait for the whole load).
"""
from __future__ import annotations

from typing import Any

from skistune.export.base import EngineVersion, Exporter, Plan, Rendered
from skistune.export.common import (GB, command_line, dump_yaml, fixed_scaling, fp8_scales_note, listed, model_id,
                                    no_eviction, single_kv_bits, size_differs, tiers_without_prefix_reuse)
from skistune.runtime.presets import ModelSpec

WIDTHS = (16, 8)
MAX_PREFILL_TOKENS = 16384  # SGLang's default --max-prefill-tokens (reference §2)
# What SGLang resolves its automatic (None) flags to, as `skistune.optimize.sglang_baseline_config` records
# them, for the note that the export pins them (`_pinned_note`).
AUTOMATIC = {"page-size": "the page size by attention backend (1 for the usual ones)",
             "max-running-requests": "running requests from the KV pool (its tokens / 2, at most 2048-4096)",
             "chunked-prefill-size": "a chunk of 8192 on GPUs of 35-160 GiB (2048 below)",
             "mem-fraction-static": "a memory fraction by GPU memory (about 0.9)",
             "max-total-tokens": "the KV pool from the memory fraction"}


def _dtype(width: int) -> str:
    return "auto" if width == 16 else "fp8_e4m3"


class SglangExporter(Exporter):
    name = "sglang"
    engine = "SGLang"
    versions = (EngineVersion("main-001067ff", "python/sglang/srt/server_args.py @001067ff (the newest in the "
                                               "reference); reference §2"),)
    default_file = "sglang-config.yaml"

    def render(self, plan: Plan, version: EngineVersion, model: ModelSpec, file_name: str) -> Rendered:
        width = single_kv_bits(plan, WIDTHS, _dtype, "; fp4/mxfp8 dtypes are outside SGLang's portable set")
        fixed_scaling(plan, "fp8 scales are per tensor, from --quantization-param-path or 1.0")
        if width == 8:
            fp8_scales_note(plan, "SGLang reads them from --quantization-param-path (a JSON file of scales)")
        no_eviction(plan, "SGLang keeps every token of a running sequence (--radix-eviction-policy evicts cached "
                    "prefixes only)")
        flags: dict[str, Any] = {"kv-cache-dtype": _dtype(width)}
        flags.update(self._cache(plan))
        flags.update(self._batching(plan))
        flags.update(self._memory(plan, model, width))
        self._pinned_note(plan, flags)
        flags.update(self._hicache(plan, model, width))
        header = (f"SGLang {version.name} server arguments: python -m sglang.launch_server --model-path MODEL "
                  "--config <this file>\nwritten by skistune export; keys are SGLang's flags without the dashes")
        command = command_line(["python", "-m", "sglang.launch_server", "--model-path", model_id(model)], flags)
        return Rendered(dump_yaml(flags, header), command)

    def _cache(self, plan: Plan) -> dict[str, Any]:
        flags: dict[str, Any] = {"page-size": plan.value("prefix_reuse.block_size")}
        plan.express("prefix_reuse.block_size")
        if tiers_without_prefix_reuse(plan, "radix cache on", "HiCache (the host and disk tiers) is a hierarchical "
                                      "radix cache: it serves prefix-cache hits and needs the radix cache"):
            return flags
        if not plan.value("prefix_reuse.enabled"):
            flags["disable-radix-cache"] = True
        plan.express("prefix_reuse.enabled")
        return flags

    def _batching(self, plan: Plan) -> dict[str, Any]:
        b = plan.config.batching
        flags: dict[str, Any] = {"max-running-requests": b.max_num_seqs, **self._max_prefill_tokens(plan),
                                 "chunked-prefill-size": b.chunk_size if b.chunked_prefill else -1,
                                 "schedule-policy": "lpm" if b.policy == "prefix" and plan.config.prefix_reuse.enabled
                                 else "fcfs"}
        if b.policy == "prefix" and not plan.config.prefix_reuse.enabled:  # (lpm orders by radix-cache matches)
            plan.notes.append("batching.policy prefix with prefix reuse off is written as --schedule-policy fcfs: "
                              "with the radix cache disabled no request has a prefix match to order by")
        plan.express("batching.max_num_seqs", "batching.max_num_batched_tokens", "batching.chunked_prefill")
        if b.chunked_prefill and b.chunk_size != b.max_num_batched_tokens:
            plan.instead("batching.chunk_size", f"chunked-prefill-size {b.chunk_size} (for the whole prefill batch)",
                         "SGLang's --chunked-prefill-size is a budget for all the prefill tokens of a step (each "
                         "request's chunk is taken from what is left), not a cap per sequence: several prompts "
                         "share it")
        else:
            plan.express("batching.chunk_size")
        if b.policy == "edf":
            plan.instead("batching.policy", "schedule-policy fcfs", "SGLang's priority policy orders by priorities "
                         "clients send; it has no deadline order")
        else:
            plan.express("batching.policy")
        plan.fixed("batching.preemption", "recompute", "SGLang retracts a request by freeing its KV and "
                   "recomputing it; it has no swap")
        return flags

    @staticmethod
    def _max_prefill_tokens(plan: Plan) -> dict[str, Any]:
        """--max-prefill-tokens, left out only where it has the effect of SGLang's default (16384): chunked
        prefill on with --chunked-prefill-size equal to the budget, at most the default. SGLang's PrefillAdder
        takes every prefill token of a step from the chunk budget (each request's chunk from what is left of
        it) and charges max_prefill_tokens the same tokens, so a cap not below the chunk budget never runs out
        first. Its other check, a whole prompt longer than what is left of max_prefill_tokens waits, runs only
        with chunking off since SGLang PR #25741 (2026-05; found in SGLang's source, the reference does not say
        whether its snapshot has it). Before that PR it ran with chunking on too, and the default, the looser
        cap, is the nearer to skistune's runtime, which takes any request's chunk from what is left of the
        budget. Either way a step prefills at most the chunk budget, so the baseline's budget of 8192 is
        written as SGLang's default, not pinned."""
        b = plan.config.batching
        if b.chunked_prefill and b.chunk_size == b.max_num_batched_tokens <= MAX_PREFILL_TOKENS:
            plan.notes.append(f"batching.max_num_batched_tokens {b.max_num_batched_tokens} is the step budget "
                              f"--chunked-prefill-size {b.chunk_size} sets (decode tokens are not counted against "
                              f"it): --max-prefill-tokens is left at SGLang's default, {MAX_PREFILL_TOKENS}, which "
                              "caps nothing more")
            return {}
        plan.notes.append("batching.max_num_batched_tokens is written as --max-prefill-tokens: SGLang caps the "
                          "prefill tokens of a batch; decode tokens are not counted against it")
        return {"max-prefill-tokens": b.max_num_batched_tokens}

    @staticmethod
    def _pinned_note(plan: Plan, flags: dict[str, Any]) -> None:
        """One note naming the automatic flags written (SGLang resolves them by GPU and pool when they are
        None): skistune's predictions rest on the values the search evaluated, so they stay pinned, and the
        note says what SGLang would choose without them (an export of the baseline is not SGLang's defaults
        on every GPU: the chunk is 2048 under 35 GiB)."""
        pinned = [key for key in AUTOMATIC if key in flags and flags[key] != -1]  # (-1: chunked prefill off)
        plan.notes.append(f"{listed([f'--{key} {flags[key]}' for key in pinned])} pin the tuned values (skistune's "
                          f"predictions rest on them); without them SGLang would choose "
                          f"{listed([AUTOMATIC[key] for key in pinned])}")

    def _memory(self, plan: Plan, model: ModelSpec, width: int) -> dict[str, Any]:
        off = plan.config.offload
        plan.express("offload.device_kv_bytes", "offload.device_memory_fraction")
        if off.device_kv_bytes is None:
            plan.notes.append("offload.device_memory_fraction is written as --mem-fraction-static, which SGLang "
                              "takes of the whole GPU memory (weights included): its KV pool comes out smaller")
            return {"mem-fraction-static": off.device_memory_fraction}
        per_token = model.kv_bytes_per_token(width, width)
        plan.notes.append(f"--max-total-tokens = offload.device_kv_bytes / {per_token} bytes per token of "
                          f"{model.name} at {width}-bit KV")
        return {"max-total-tokens": max(1, off.device_kv_bytes // per_token)}

    def _hicache(self, plan: Plan, model: ModelSpec, width: int) -> dict[str, Any]:
        off = plan.config.offload
        plan.express("offload.host_kv_bytes", "offload.disk_kv_bytes")
        if not (off.host_kv_bytes or off.disk_kv_bytes):
            return {}
        flags: dict[str, Any] = {"enable-hierarchical-cache": True}
        if off.host_kv_bytes:
            flags["hicache-size"] = self._host_gb(plan)
        else:
            plan.instead("offload.host_kv_bytes", "SGLang's default host pool (--hicache-ratio default)",
                         "HiCache stages the disk tier (L3) through a host pool (L2)")
        flags["hicache-write-policy"] = off.write_policy
        plan.express("offload.write_policy")
        plan.fixed("offload.demote_first", "cached_prefix", "HiCache demotes radix-tree nodes (cached prefixes); "
                   "retracted requests are recomputed")
        flags.update(self._disk_and_prefetch(plan))
        return flags

    def _host_gb(self, plan: Plan) -> int:
        """--hicache-size: the host pool in whole GB. It replaces --hicache-ratio (reference §2), so the ratio's
        minimum of 2 does not apply: raising the pool to twice the device pool doubled a tuned host tier."""
        off = plan.config.offload
        size = max(1, round(off.host_kv_bytes / GB))
        if size_differs(off.host_kv_bytes, size * GB):  # whole GB are SGLang's unit: no printed digit to allow
            plan.instead("offload.host_kv_bytes", f"hicache-size {size}", "SGLang sizes the host pool in whole GB "
                         "(1e9 bytes)")
        if off.device_kv_bytes is not None and size * GB <= off.device_kv_bytes:
            plan.notes.append(f"hicache-size {size} GB is not larger than the device pool ({off.device_kv_bytes} "
                              "bytes): SGLang's host pool asserts that it is larger (later trees only warn that "
                              "the host cache is less effective); checked in SGLang's source, not the reference")
        plan.notes.append("--hicache-size is per rank: the size assumes one rank (tensor parallel 1)")
        return size

    def _disk_and_prefetch(self, plan: Plan) -> dict[str, Any]:
        off, pf = plan.config.offload, plan.config.prefetch
        flags: dict[str, Any] = {}
        if off.disk_kv_bytes:
            flags["hicache-storage-backend"] = "file"
            flags["hicache-storage-prefetch-policy"] = "timeout" if pf.enabled else "wait_complete"
            plan.instead("offload.disk_kv_bytes", "hicache-storage-backend file (no size cap)",
                         "SGLang's storage backends take no size setting")
            plan.express("prefetch.enabled")
        else:
            plan.fixed("prefetch.enabled", True, "SGLang always loads host KV layer by layer, overlapped with "
                       "compute", written="layer-overlapped loads (always on)")
        plan.fixed("prefetch.unit", "layers", "SGLang's host-to-device loads go layer by layer")
        plan.fixed("prefetch.depth", 1, "layer N+1 loads while layer N computes; SGLang has no depth setting")
        return flags
