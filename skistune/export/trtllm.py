"""`trtllm`: a TensorRT-LLM LLM-API YAML (`kv_cache_config`, `scheduler_config` and the batching
arguments) for `trtllm-serve MODEL --config FILE` (``--config`` is the alias of ``--extra_llm_api_options``).

Facts from the project's engine reference (engines-and-algorithms.md, kept outside this repository), §3
(`tensorrt_llm/llmapi/llm_args.py`, docs `llm-api/reference/KvCacheConfig`). The reference pins no
TensorRT-LLM release numbers, so the versions are named after the one dated change it gives: PR #12449
(2026-03) removed ``onboard_blocks`` (onboarding then follows whether a host pool exists).

Mapping, knob -> TensorRT-LLM:
  bitwidth.key/value_bits   kv_cache_config.dtype auto (16) | fp8 (8); 4 and 2 bits are written as fp8
                            (nvfp4 needs a checkpoint quantized offline with ModelOpt). fp8 carries a note:
                            the measured quality needs calibrated scales, which come with the checkpoint (the
                            reference names no TensorRT-LLM setting for them).
  eviction streaming        max_attention_window (a list, repeated across layers: one entry per layer for a
                            pyramid schedule, the same schedule as the `layers` export: `layer_schedule`) +
                            sink_token_length. A fraction budget becomes the windows of a sequence at the
                            model's full context (a warning: the window is a token count). The reference does
                            not say whether the window counts the sink tokens; the whole budget is written as
                            the window. What the runtime keeps is written (runtime/eviction_budget.py): sinks
                            above the window are clipped to it, as the runtime clips them to the budget, and a
                            layer's budget of 0 (a pyramid over a budget smaller than the layers) is a window
                            of 1, the smallest that holds the token being computed; both warned. Other
                            policies (score-based) have no equivalent: no eviction.
  prefix_reuse.*            enable_block_reuse, tokens_per_block (a power of two greater than 1, per the
                            TensorRT-LLM KV-cache docs; the reference says "power of 2"). Off with a host
                            pool is warned (`tiers_without_prefix_reuse`): the pool keeps reusable blocks.
  batching.*                max_batch_size, max_num_tokens, enable_chunked_prefill; no per-sequence chunk
                            cap (a context chunk may fill max_num_tokens); with chunking off, nothing ties
                            max_num_tokens to max_seq_len in the reference (vLLM refuses a budget below the
                            model length; the reference gives no such TensorRT-LLM check, so max_seq_len is
                            not written); context_chunking_policy
                            FIRST_COME_FIRST_SERVED in scheduler_config (where TensorRT-LLM's SchedulerConfig
                            holds it; the reference names the field, not its block);
                            capacity_scheduler_policy GUARANTEED_NO_EVICT (the default, written explicitly):
                            a request is admitted only when its KV fits, so running requests are never
                            preempted (neither recomputed nor swapped; there is no KV swap).
  offload.device_*          free_gpu_memory_fraction, or max_tokens = device_kv_bytes / KV bytes per token.
  offload.host_kv_bytes     host_cache_size (bytes), plus onboard_blocks: true before PR #12449.
  offload.disk_kv_bytes     not written: newer releases list disk_cache_size / disk_cache_path, but the
                            reference gives neither their unit nor their release.
  offload.write_policy      write_back: blocks go to the host pool when the GPU evicts them (TensorRT-LLM's
                            KV-cache docs on offloading; the reference does not say).
  prefetch.*                no prefetch setting: host blocks are onboarded when reused.
"""
from __future__ import annotations

from typing import Any

from skistune.export.base import EVICTION_DETAILS, EngineVersion, Exporter, Plan, Rendered
from skistune.export.common import (command_line, dump_yaml, fixed_scaling, fp8_scales_note, model_id, single_kv_bits,
                                    tiers_without_prefix_reuse)
from skistune.export.layers import layer_schedule
from skistune.runtime.presets import ModelSpec

WIDTHS = (16, 8)
MIN_TOKENS_PER_BLOCK = 2


class TrtllmExporter(Exporter):
    name = "trtllm"
    engine = "TensorRT-LLM"
    versions = (
        EngineVersion("pre-pr12449", "llm_args.py KvCacheConfig with onboard_blocks (before PR #12449, "
                                     "2026-03); reference §3", {"onboard_blocks": True}),
        EngineVersion("post-pr12449", "llm_args.py KvCacheConfig after PR #12449 removed onboard_blocks; "
                                      "reference §3", {"onboard_blocks": False}),
    )
    default_file = "trtllm-config.yaml"

    def render(self, plan: Plan, version: EngineVersion, model: ModelSpec, file_name: str) -> Rendered:
        width = single_kv_bits(plan, WIDTHS, lambda w: "auto" if w == 16 else "fp8",
                               "; nvfp4 needs a checkpoint quantized offline with ModelOpt")
        fixed_scaling(plan, "TensorRT-LLM's fp8 KV carries its own scales")
        if width == 8:
            fp8_scales_note(plan, "TensorRT-LLM takes them from the checkpoint: quantize it with calibrated KV scales "
                            "(the reference names no setting for them)")
        kv: dict[str, Any] = {"dtype": "auto" if width == 16 else "fp8"}
        kv.update(self._blocks(plan))
        kv.update(self._memory(plan, model, width))
        kv.update(self._eviction(plan, model))
        kv.update(self._tiers(plan, version))
        data = self._batching(plan)
        data["kv_cache_config"] = kv
        data["scheduler_config"] = self._scheduler(plan)
        header = (f"TensorRT-LLM ({version.name}) LLM API options: trtllm-serve MODEL --config <this file>\n"
                  "written by skistune export")
        return Rendered(dump_yaml(data, header), command_line(["trtllm-serve", model_id(model)], {"config": file_name}))

    def _blocks(self, plan: Plan) -> dict[str, Any]:
        size = plan.value("prefix_reuse.block_size")
        if size < MIN_TOKENS_PER_BLOCK:
            plan.instead("prefix_reuse.block_size", f"tokens_per_block {MIN_TOKENS_PER_BLOCK}",
                         "TensorRT-LLM's tokens_per_block is a power of two greater than 1")
            size = MIN_TOKENS_PER_BLOCK
        else:
            plan.express("prefix_reuse.block_size")
        reuse = plan.value("prefix_reuse.enabled")
        if not tiers_without_prefix_reuse(plan, "enable_block_reuse false, with host_cache_size", "TensorRT-LLM's "
                                          "host pool keeps reusable blocks: it serves block-reuse (prefix) hits",
                                          disk=False):  # no disk tier is written (see _tiers)
            plan.express("prefix_reuse.enabled")
        return {"tokens_per_block": size, "enable_block_reuse": reuse}

    def _memory(self, plan: Plan, model: ModelSpec, width: int) -> dict[str, Any]:
        off = plan.config.offload
        plan.express("offload.device_kv_bytes", "offload.device_memory_fraction")
        if off.device_kv_bytes is None:
            return {"free_gpu_memory_fraction": off.device_memory_fraction}
        per_token = model.kv_bytes_per_token(width, width)
        plan.notes.append(f"max_tokens = offload.device_kv_bytes / {per_token} bytes per token of {model.name} at "
                          f"{width}-bit KV")
        return {"max_tokens": max(1, off.device_kv_bytes // per_token)}

    def _eviction(self, plan: Plan, model: ModelSpec) -> dict[str, Any]:
        """StreamingLLM (sinks + a recent window) is TensorRT-LLM's attention window with sink tokens."""
        ev = plan.config.eviction
        if ev.policy == "none":
            plan.express("eviction.policy")
            return {}
        if ev.policy != "streaming":
            plan.instead("eviction.policy", "no eviction (every token kept)", f"TensorRT-LLM has no score-based "
                         f"({ev.policy}) eviction; its only one is an attention window with sink tokens (streaming)",
                         related=EVICTION_DETAILS)
            return {}
        budgets = layer_schedule(plan.config, model)
        assert budgets is not None  # a streaming policy has a budget
        windows = self._windows(plan, budgets)
        if ev.budget_fraction is not None:
            plan.instead("eviction.budget_fraction", self._windows_text(windows, model),
                         "TensorRT-LLM's window is a token count: the budget of a sequence at the model's full "
                         "context")
        plan.express("eviction.policy", "eviction.budget_tokens")
        sinks = self._sinks(plan, min(windows))
        recent = min(windows) - sinks
        if ev.recent_window > recent:
            plan.instead("eviction.recent_window", f"{recent} (the smallest window less the sinks)",
                         "TensorRT-LLM keeps the newest max_attention_window - sink_token_length tokens")
        else:
            plan.express("eviction.recent_window")
        window = windows[:1] if len(set(windows)) == 1 else windows
        return {"max_attention_window": window, "sink_token_length": sinks}

    @staticmethod
    def _windows(plan: Plan, budgets: list[int]) -> list[int]:
        """Each layer's max_attention_window: its budget, at least 1. A pyramid over a budget smaller than the
        layers leaves the last layers a budget of 0 (the runtime keeps no past token there between
        compactions); a window of 0 tokens would hold not even the token being computed, so 1 is written, and
        warned: it is not the tuned schedule."""
        empty = [layer for layer, b in enumerate(budgets) if b < 1]
        if not empty:
            plan.express("eviction.layer_schedule")
            return budgets
        layers = f"layer {empty[0]}" if len(empty) == 1 else f"layers {empty[0]}-{empty[-1]}"
        plan.instead("eviction.layer_schedule", f"max_attention_window 1 for {layers}",
                     f"the schedule gives {layers} a budget of 0 tokens (skistune's runtime keeps no past token "
                     "there), and a TensorRT-LLM attention window holds at least the token being computed")
        return [max(1, b) for b in budgets]

    @staticmethod
    def _sinks(plan: Plan, smallest: int) -> int:
        """sink_token_length: the sinks the runtime keeps, clipped to the window (it clips the recent window
        first, then the sinks, to the budget: runtime/eviction_budget.py). Sinks wider than a layer's budget
        occur only where every layer keeps the same budget (a pyramid keeps the sinks in every layer, or falls
        back to uniform), so ``smallest`` window is every layer's. Clipped sinks are warned: the file then
        holds another value than the config, though the same tokens as the runtime kept."""
        sinks = plan.value("eviction.sink_tokens")
        if sinks <= smallest:
            plan.express("eviction.sink_tokens")
            return sinks
        plan.instead("eviction.sink_tokens", f"sink_token_length {smallest} (the window)",
                     f"the window keeps {smallest} tokens, fewer than the sinks: skistune's runtime clips the sinks "
                     f"to the budget (it kept the first {smallest} tokens), and a TensorRT-LLM window cannot hold "
                     "more sinks than tokens")
        return smallest

    @staticmethod
    def _windows_text(windows: list[int], model: ModelSpec) -> str:
        """What the file's max_attention_window holds, for a warning: one window, or the per-layer list's ends."""
        of = f"of {model.name}'s {model.max_context}-token context"
        if len(set(windows)) == 1:
            return f"max_attention_window {windows[0]} ({of})"
        return (f"per-layer max_attention_window {windows[0]} (layer 0) down to {windows[-1]} (layer "
                f"{len(windows) - 1}), mean {sum(windows) / len(windows):g} tokens {of}")

    def _tiers(self, plan: Plan, version: EngineVersion) -> dict[str, Any]:
        off, pf = plan.config.offload, plan.config.prefetch
        plan.express("offload.host_kv_bytes")
        if off.disk_kv_bytes:
            plan.instead("offload.disk_kv_bytes", "no disk tier", "the reference gives TensorRT-LLM's "
                         "disk_cache_size neither a unit nor a release")
        else:
            plan.express("offload.disk_kv_bytes")
        plan.fixed("offload.write_policy", "write_back", "TensorRT-LLM copies a block to the host pool when the "
                   "GPU evicts it")
        plan.fixed("offload.demote_first", "cached_prefix", "TensorRT-LLM's host pool keeps reusable blocks")
        if pf.enabled and "prefetch.enabled" in plan.relevant:
            plan.instead("prefetch.enabled", "no prefetch (host blocks onboarded when reused)", "TensorRT-LLM has "
                         "no prefetch setting", related=("prefetch.depth", "prefetch.unit"))
        else:
            plan.express("prefetch.enabled")
        if not off.host_kv_bytes:
            return {}
        tiers: dict[str, Any] = {"host_cache_size": off.host_kv_bytes}
        if version["onboard_blocks"]:
            tiers["onboard_blocks"] = True
        return tiers

    def _batching(self, plan: Plan) -> dict[str, Any]:
        b = plan.config.batching
        plan.express("batching.max_num_seqs", "batching.max_num_batched_tokens", "batching.chunked_prefill")
        if b.chunked_prefill and b.chunk_size != b.max_num_batched_tokens:
            plan.instead("batching.chunk_size", f"chunks up to max_num_tokens ({b.max_num_batched_tokens})",
                         "TensorRT-LLM has no per-sequence prefill-chunk cap")
        else:
            plan.express("batching.chunk_size")
        return {"max_batch_size": b.max_num_seqs, "max_num_tokens": b.max_num_batched_tokens,
                "enable_chunked_prefill": b.chunked_prefill}

    def _scheduler(self, plan: Plan) -> dict[str, Any]:
        plan.fixed("batching.policy", "fcfs", "TensorRT-LLM's context chunking is first-come-first-served or "
                   "equal-progress; it has no longest-prefix or deadline order", written="FIRST_COME_FIRST_SERVED")
        plan.fixed("batching.preemption", "recompute", "TensorRT-LLM has no KV swap; with GUARANTEED_NO_EVICT a "
                   "request starts only when its KV is sure to fit, so running requests are never preempted",
                   written="capacity_scheduler_policy GUARANTEED_NO_EVICT (no preemption)")
        scheduler = {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"}
        if plan.config.batching.chunked_prefill:
            scheduler["context_chunking_policy"] = "FIRST_COME_FIRST_SERVED"
        return scheduler
