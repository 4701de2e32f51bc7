"""Capacity search speed: `simulator.capacity` with replays cut where they are certain to miss an SLO, against
every replay run to its end, side by side on the same configs and workloads (the answers must be identical).

The optimizer scores each config by its capacity (`scoring.score`): a search over arrival-rate scales whose
replays past capacity, where queues grow and sequences are preempted, are the slowest. `CertainMiss` stops such
a replay once a TTFT or E2E percentile (or the queueing guard) already breaks on lower bounds of every request's
value. Each case is timed cut, then whole, then cut and whole again; the figures are the medians. Each of those
searches starts with no step predicted (`StepCostModel.predicted` emptied), as in a fresh process.

Then every case's cut search again, in passes over all cases: each search with no step predicted, against one
pass in which the predictions stay from one search to the next (as the optimizer's trials keep them: capacity
searches on one workload repeat step shapes), alternating, twice each.

    python benchmarks/capacity_speed.py [--profile profiles/cpu-smollm2-135m.json] [--requests 2000]
                                        [--slo p99=200ms ...] [--json]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench_args import add_json, description, fail, hardware_profile, positive_int, print_json, slo_text
from skistune.config import KVConfig
from skistune.evaluate import sim_target, workload_requests
from skistune.simulator import capacity
from skistune.workloads import load_workload

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / ".." / "shared" / "traces"
MODEL = "smollm2-135m"
CONFIGS = {  # a few of the search space's corners
    "default": {},
    "seqs16": {"batching.max_num_seqs": 16},
    "chunk256": {"batching.chunk_size": 256, "batching.max_num_batched_tokens": 1024},
    "int8": {"bitwidth.key_bits": 8, "bitwidth.value_bits": 8},
    "h2o-50": {"eviction.policy": "h2o", "eviction.budget_fraction": 0.5},
}


def workloads(requests: int) -> dict[str, dict]:
    return {"chat": dict(spec="chat", requests=requests, seed=0),
            "azure-conv": dict(spec=TRACES / "azure_llm_2023_conv" / "AzureLLMInferenceTrace_conv.csv",
                               first=requests),
            "mooncake-conv": dict(spec=TRACES / "mooncake_conversation" / "conversation_trace.head.jsonl",
                                  first=requests)}


def timed(config: KVConfig, requests, target, slos, stop_early: bool, cold: bool = True):
    if cold:
        target.step_cost.predicted.clear()
    t0 = time.perf_counter()
    found = capacity(config, requests, target, slos, stop_early=stop_early)
    return time.perf_counter() - t0, found


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--profile", type=hardware_profile, default=str(ROOT / "profiles" / "cpu-smollm2-135m.json"))
    ap.add_argument("--requests", type=positive_int, default=2000, help="the workloads' first N requests")
    ap.add_argument("--slo", type=slo_text, nargs="+", default=["p99=200ms"],
                    help="SLOs, as skistune optimize takes them (its queueing guard, 5 s, is added)")
    add_json(ap)
    args = ap.parse_args()
    target = sim_target(MODEL, args.profile)
    rows = []
    print(f"{'workload':<14} {'config':<9} {'capacity x':>11} {'evals':>6} {'cut s':>7} {'whole s':>8} {'ratio':>6}")
    cases = [(name, workload_requests(load_workload(**spec), MODEL), label, KVConfig().with_knobs(knobs))
             for name, spec in workloads(args.requests).items() for label, knobs in CONFIGS.items()]
    for name, requests, label, config in cases:
        cut, whole = [], []
        for _ in range(2):  # alternating: a drift of the machine's speed falls on both
            t, found_cut = timed(config, requests, target, args.slo, True)
            cut.append(t)
            t, found_whole = timed(config, requests, target, args.slo, False)
            whole.append(t)
            if found_cut != found_whole:
                fail(f"{name} {label}: capacity {found_cut.rate_scale:g} cut against {found_whole.rate_scale:g} "
                     "whole: cutting replays changed the answer")
        row = {"workload": name, "config": label, "rate_scale": found_cut.rate_scale,
               "evaluations": found_cut.evaluations, "cut_s": statistics.median(cut),
               "whole_s": statistics.median(whole)}
        row["ratio"] = row["whole_s"] / row["cut_s"]
        rows.append(row)
        print(f"{name:<14} {label:<9} {row['rate_scale']:>11.4g} {row['evaluations']:>6} {row['cut_s']:>7.2f} "
              f"{row['whole_s']:>8.2f} {row['ratio']:>5.2f}x", flush=True)
    total_cut, total_whole = sum(r["cut_s"] for r in rows), sum(r["whole_s"] for r in rows)
    print(f"all {len(rows)} searches: {total_cut:.1f} s cut, {total_whole:.1f} s whole: "
          f"x{total_whole / total_cut:.2f} faster, the same capacities")
    passes: dict[str, list[float]] = {"cold": [], "kept": []}
    for _ in range(2):
        for mode in passes:
            target.step_cost.predicted.clear()
            passes[mode].append(sum(timed(config, requests, target, args.slo, True, cold=mode == "cold")[0]
                                    for _, requests, _, config in cases))
    cold_s, kept_s = statistics.median(passes["cold"]), statistics.median(passes["kept"])
    print(f"the {len(rows)} cut searches in one pass: {cold_s:.1f} s with no step predicted before each, "
          f"{kept_s:.1f} s with the predictions kept from one to the next: x{cold_s / kept_s:.2f} faster")
    if args.json:
        print_json({"benchmark": "capacity_speed", "model": MODEL, "slos": args.slo, "requests": args.requests,
                    "rows": rows, "cut_s": total_cut, "whole_s": total_whole, "speedup": total_whole / total_cut,
                    "pass_cold_s": cold_s, "pass_kept_s": kept_s, "kept_speedup": cold_s / kept_s})


if __name__ == "__main__":
    main()
