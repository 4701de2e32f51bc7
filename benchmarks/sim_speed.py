"""Simulator speed: simulated requests per second of wall time on the real trace samples.

The runtime replays a workload in real time, so it needs at least the workload's served duration; the
simulator predicts that duration. The ratio of the two is how much faster than real time a prediction is.
Each workload is replayed twice: the first replay hashes every prompt's blocks and predicts every step shape,
the second finds them memoized (`block_manager.PROMPT_HASHES`, `StepCostModel.predicted`), as a search's every
trial after its first does.

    python benchmarks/sim_speed.py [--profile profiles/cpu-smollm2-135m.json] [--json]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench_args import add_json, description, hardware_profile, positive_float, print_json
from skistune.config import KVConfig
from skistune.evaluate import sim_target, workload_requests
from skistune.simulator import build_engine, with_rate_scale
from skistune.workloads import load_workload

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / ".." / "shared" / "traces"
MODEL = "smollm2-135m"
WORKLOADS = {
    "azure-conv": TRACES / "azure_llm_2023_conv" / "AzureLLMInferenceTrace_conv.csv",
    "mooncake-conv": TRACES / "mooncake_conversation" / "conversation_trace.head.jsonl",
}


def time_simulation(requests, target) -> dict:
    walls = []
    target.step_cost.predicted.clear()  # the first replay predicts every step shape (none kept from other workloads)
    for _ in range(2):  # first replay, then a repeat with the prompts' block hashes and step shapes memoized
        engine, executor = build_engine(KVConfig(), target)
        t0 = time.perf_counter()
        metrics = engine.replay(requests)
        walls.append(time.perf_counter() - t0)
    wall_s, repeat_s = walls
    return {"requests": len(requests), "wall_s": wall_s, "sim_req_per_s": len(requests) / wall_s,
            "repeat_wall_s": repeat_s, "repeat_req_per_s": len(requests) / repeat_s,
            "simulated_duration_s": metrics.duration_s, "faster_than_real_time": metrics.duration_s / wall_s,
            "steps": executor.num_steps, "scheduled_steps": executor.num_scheduled,
            "fast_forwards": executor.num_fast_forwards, "preemptions": metrics.preemptions}


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--profile", type=hardware_profile, default=str(ROOT / "profiles" / "cpu-smollm2-135m.json"))
    ap.add_argument("--rate-scales", type=positive_float, nargs="+", default=[1.0, 0.01],
                    help="arrival-rate scales: 1 = the trace's own rate (overloads the small CPU model)")
    add_json(ap)
    args = ap.parse_args()
    target = sim_target(MODEL, args.profile)
    rows = []
    print(f"{'workload':<14} {'rate x':>7} {'requests':>9} {'wall s':>8} {'sim req/s':>10} {'repeat':>8} "
          f"{'x real time':>12} {'steps':>9} {'scheduled':>9} {'fast-fwd':>9}")
    for name, path in WORKLOADS.items():
        t0 = time.perf_counter()
        requests = workload_requests(load_workload(path), MODEL)
        prep_s = time.perf_counter() - t0
        for scale in args.rate_scales:
            row = {"workload": name, "rate_scale": scale, "prepare_s": prep_s,
                   **time_simulation(with_rate_scale(requests, scale), target)}
            rows.append(row)
            print(f"{name:<14} {scale:>7g} {row['requests']:>9,} {row['wall_s']:>8.2f} {row['sim_req_per_s']:>10,.0f} "
                  f"{row['repeat_req_per_s']:>8,.0f} {row['faster_than_real_time']:>12,.0f} {row['steps']:>9,} "
                  f"{row['scheduled_steps']:>9,} {row['fast_forwards']:>9,}", flush=True)
    if args.json:
        print_json({"benchmark": "sim_speed", "model": MODEL, "rows": rows})


if __name__ == "__main__":
    main()
