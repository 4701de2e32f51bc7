"""Simulator identity check: the same predictions before and after a change to the simulator's speed.

Runs the simulator over a fixed set of workload x config cases (trace slices and scaled presets; prefix
reuse, chunking, every scheduling policy, preemption by recompute and swap under a small pool, every
eviction policy, 8/4/2-bit KV, host and disk tiers with both prefetch units) and writes a JSON digest of
every case's `Metrics` (latency percentiles, throughput, peak KV, preemptions, prefix hits, finishes, tier
figures), its energy per token, sums over the request records and the executor's step count; or compares
a run against such a digest, floats to a relative 1e-9, everything else exactly.

    python benchmarks/sim_identity.py --write /tmp/sim_ref.json     # before the change
    python benchmarks/sim_identity.py --check /tmp/sim_ref.json     # after it: exit 1 on a difference
    [--profile profiles/cpu-smollm2-135m.json] [--workloads NAME ...] [--configs NAME ...] [--full] [--json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import warnings
from pathlib import Path

from bench_args import add_json, description, existing_file, fail, hardware_profile, print_json
from skistune.config import KVConfig
from skistune.evaluate import sim_target, workload_requests
from skistune.objectives import energy_j_per_token
from skistune.profile import load_profile
from skistune.runtime.kv_layout import kv_block_bytes
from skistune.simulator import build_engine, with_rate_scale
from skistune.workloads import load_workload

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / ".." / "shared" / "traces"
MODEL = "smollm2-135m"
REL_TOL = 1e-9
# name -> (load_workload arguments, arrival-rate scale): ~300-500 requests each, loaded enough to queue
WORKLOADS = {
    "azure-conv-400": (dict(spec=TRACES / "azure_llm_2023_conv" / "AzureLLMInferenceTrace_conv.csv", first=400),
                       0.1),
    "mooncake-conv-300": (dict(spec=TRACES / "mooncake_conversation" / "conversation_trace.head.jsonl", first=300,
                               length_scale=0.25), 0.1),
    "chat-400": (dict(spec="chat", requests=400, length_scale=0.5), 0.05),
    "agent-300": (dict(spec="agent", requests=300, length_scale=0.1), 0.15),
}
# ``--full``: benchmarks/sim_speed.py's runs too (the whole samples at 1% of their rate, default config)
FULL_WORKLOADS = {
    "azure-conv-full": (dict(spec=TRACES / "azure_llm_2023_conv" / "AzureLLMInferenceTrace_conv.csv"), 0.01),
    "mooncake-conv-full": (dict(spec=TRACES / "mooncake_conversation" / "conversation_trace.head.jsonl"), 0.01),
}


def block_bytes(n: int) -> int:
    """Bytes of ``n`` 16-bit KV blocks of 16 tokens of the model, fp32 (the CPU profile's KV dtype)."""
    from skistune.runtime.presets import get_preset

    return n * kv_block_bytes(get_preset(MODEL), 16, 4)


TIGHT = {"offload.device_kv_bytes": block_bytes(640)}  # about two of the longest requests: preemption
CONFIGS: dict[str, dict] = {
    "default": {},
    "no-prefix": {"prefix_reuse.enabled": False},
    "no-chunking": {"batching.chunked_prefill": False, "batching.max_num_batched_tokens": 8192},
    "chunk32": {"batching.chunk_size": 32},
    "tokens256-seqs8": {"batching.max_num_batched_tokens": 256, "batching.chunk_size": 128,
                        "batching.max_num_seqs": 8},
    "block32": {"prefix_reuse.block_size": 32},
    "policy-prefix": {"batching.policy": "prefix"},
    "policy-edf": {"batching.policy": "edf"},
    "tight-recompute": TIGHT,
    "tight-edf": {**TIGHT, "batching.policy": "edf"},
    "tight-swap": {**TIGHT, "offload.host_kv_bytes": block_bytes(2000), "batching.preemption": "swap"},
    "streaming-256": {"eviction.policy": "streaming", "eviction.budget_tokens": 256},
    "h2o-50": {"eviction.policy": "h2o", "eviction.budget_fraction": 0.5},
    "h2o-tight": {**TIGHT, "eviction.policy": "h2o", "eviction.budget_tokens": 512},
    "snapkv-pyramid": {"eviction.policy": "snapkv", "eviction.budget_tokens": 384,
                       "eviction.layer_schedule": "pyramid"},
    "tova-30": {"eviction.policy": "tova", "eviction.budget_fraction": 0.3, "prefix_reuse.enabled": False},
    "int8": {"bitwidth.key_bits": 8, "bitwidth.value_bits": 8},
    "int4-window": {"bitwidth.key_bits": 4, "bitwidth.value_bits": 4, "bitwidth.full_precision_window": 64},
    "int2-tight": {**TIGHT, "bitwidth.key_bits": 2, "bitwidth.value_bits": 2, "bitwidth.group_size": 16},
    "host": {**TIGHT, "offload.host_kv_bytes": block_bytes(1500)},
    "host-prefetch-blocks": {**TIGHT, "offload.host_kv_bytes": block_bytes(1500), "prefetch.enabled": True,
                             "prefetch.unit": "blocks", "prefetch.depth": 8},
    "host-prefetch-layers": {**TIGHT, "offload.host_kv_bytes": block_bytes(1500), "prefetch.enabled": True,
                             "prefetch.unit": "layers", "prefetch.depth": 4},
    "disk-write-through": {**TIGHT, "offload.host_kv_bytes": block_bytes(300), "offload.disk_kv_bytes":
                           block_bytes(3000), "offload.write_policy": "write_through",
                           "offload.demote_first": "preempted"},
}


def with_deadlines(requests):
    """Deadlines 1-7 s after arrival in a fixed pattern (they order the ``edf`` policy only)."""
    return [dataclasses.replace(r, deadline_s=r.arrival_s + 1.0 + (i * 7919) % 7) for i, r in enumerate(requests)]


def load_requests(name: str):
    args, scale = {**WORKLOADS, **FULL_WORKLOADS}[name]
    args = dict(args)
    spec = args.pop("spec")
    return with_deadlines(with_rate_scale(workload_requests(load_workload(spec, **args), MODEL), scale))


def digest(config: KVConfig, requests, target, power) -> dict:
    """Every figure of one simulation that a speed-up must leave unchanged."""
    engine, executor = build_engine(config, target)
    metrics = engine.replay(requests)
    done = [r for r in engine.records if r.finish_s is not None]
    return json.loads(json.dumps({"metrics": metrics.to_dict(), "energy_j_per_token": energy_j_per_token(metrics, power),
            "steps": executor.num_steps,
            "records": {"finish_s_sum": sum(r.finish_s for r in done),
                        "first_token_s_sum": sum(r.token_times_s[0] for r in done),
                        "token_time_s_sum": sum(sum(r.token_times_s) for r in done),
                        "preemptions_max": max((r.preemptions for r in engine.records), default=0),
                        "prefix_hits_max": max((r.prefix_hit_tokens for r in engine.records), default=0)},
            "info": {"fast_forwards": executor.num_fast_forwards}}))  # (info may change: not compared; the
    # JSON round trip makes a fresh digest read as one loaded from a file: tuples as lists)


def compare(ref, new, path: str, diffs: list[str]) -> float:
    """Largest relative difference of the floats under ``path``; other differences go to ``diffs``."""
    if isinstance(ref, dict) and isinstance(new, dict):
        if set(ref) != set(new):
            diffs.append(f"{path}: keys {sorted(set(ref) ^ set(new))} differ")
        return max((compare(ref[k], new[k], f"{path}.{k}", diffs) for k in ref.keys() & new.keys()), default=0.0)
    if isinstance(ref, list) and isinstance(new, list):
        if len(ref) != len(new):
            diffs.append(f"{path}: {len(ref)} items != {len(new)}")
        return max((compare(a, b, f"{path}[{i}]", diffs) for i, (a, b) in enumerate(zip(ref, new))), default=0.0)
    if (isinstance(ref, float) or isinstance(new, float)) and None not in (ref, new):  # (None: a figure undefined)
        a, b = float(ref), float(new)
        if math.isnan(a) and math.isnan(b) or a == b:
            return 0.0
        rel = abs(a - b) / max(abs(a), abs(b))
        if rel > REL_TOL:
            diffs.append(f"{path}: {a!r} != {b!r} (relative {rel:.2e})")
        return rel
    if ref != new:
        diffs.append(f"{path}: {ref!r} != {new!r}")
    return 0.0


def read_digest(path: str) -> dict:
    """A digest written by ``--write``; a file that is not one ends the run with one ``error:`` line (exit 2)."""
    try:
        ref = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        fail(f"--check {path}: not a digest written by --write ({exc})")
    if not isinstance(ref, dict) or not all(isinstance(v, dict) for v in ref.values()):
        fail(f"--check {path}: not a digest written by --write (a JSON object of cases expected)")
    return ref


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="FILE", help="write the digest of every case")
    mode.add_argument("--check", metavar="FILE", type=existing_file, help="compare every case against this digest")
    ap.add_argument("--profile", type=hardware_profile, default=str(ROOT / "profiles" / "cpu-smollm2-135m.json"))
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--full", action="store_true", help="add sim_speed's two runs (default config; ~30 s)")
    add_json(ap)
    args = ap.parse_args()
    ref = read_digest(args.check) if args.check else None
    warnings.simplefilter("ignore")  # the shipped profile's fingerprint warning: timings are not the point here
    profile = load_profile(args.profile)
    target = sim_target(MODEL, profile)
    cases, sim_s = {}, 0.0
    for wname in args.workloads:
        requests = load_requests(wname)
        for cname in args.configs:
            t0 = time.perf_counter()
            cases[f"{wname}/{cname}"] = digest(KVConfig().with_knobs(CONFIGS[cname]), requests, target, profile.power)
            sim_s += time.perf_counter() - t0
    for wname in FULL_WORKLOADS if args.full else ():
        t0 = time.perf_counter()
        cases[f"{wname}/default"] = digest(KVConfig(), load_requests(wname), target, profile.power)
        sim_s += time.perf_counter() - t0
    summary = {"benchmark": "sim_identity", "cases": len(cases), "simulate_s": sim_s}
    if args.write:
        try:
            Path(args.write).write_text(json.dumps(cases, indent=1, sort_keys=True))
        except OSError as exc:
            fail(f"--write {args.write}: {exc.strerror or exc}")
        summary |= {"written": args.write}
        print(f"sim_identity: {len(cases)} cases written to {args.write} ({sim_s:.1f} s simulating)")
    else:
        diffs: list[str] = []
        missing = sorted(set(cases) - set(ref))
        max_rel = max((compare({k: v for k, v in ref[c].items() if k != "info"},
                               {k: v for k, v in cases[c].items() if k != "info"}, c, diffs)
                       for c in cases if c in ref), default=0.0)
        for line in diffs[:40]:
            print("  DIFF", line)
        ok = not diffs and not missing
        summary |= {"identical": ok, "max_rel_diff": max_rel, "differences": len(diffs), "missing": missing}
        print(f"sim_identity: {len(cases)} cases, {'identical' if ok else 'DIFFERENT'} "
              f"(max relative difference {max_rel:.1e}, {len(diffs)} differences, {len(missing)} not in the "
              f"reference; {sim_s:.1f} s simulating)")
    if args.json:
        print_json(summary)
    if args.check and not summary["identical"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
