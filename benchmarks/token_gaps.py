"""Token gaps, real against predicted: one fidelity workload x config served by the real runtime and predicted by
the simulator, then every gap between a request's tokens (what TBT percentiles are taken over) side by side, by
request and token. Prints the slowest real gaps with their predictions, and the gaps' extra over the prediction
by token index (token 1's gap is the first decode step after the prompt's): a latency tail the simulator misses
shows where in a request it comes.

    python benchmarks/token_gaps.py [--model smollm2-135m] [--profile P] [--workload mooncake-prefix]
                                    [--config default] [--requests 12] [--top 8] [--json]
"""
from __future__ import annotations

import argparse
import statistics

from bench_args import add_json, description, positive_int, print_json
from fidelity import (add_replay_args, add_target_args, base_runtime, block_bytes, configs, profile_path,
                      simulation_target, workloads)

import numpy as np

from skistune.config import KVConfig
from skistune.evaluate import workload_requests
from skistune.simulator import build_engine


def token_gaps(records) -> dict[tuple[str, int], tuple[float, float]]:
    """(request id, token index) -> (gap s, when the gap began s): token i's gap follows token i-1."""
    out = {}
    for r in records:
        t = np.asarray(r.token_times_s, dtype=np.float64)
        for i, (gap, start) in enumerate(zip(np.diff(t).tolist(), t[:-1].tolist()), start=1):
            out[r.request_id, i] = (gap, start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    add_target_args(ap)
    add_replay_args(ap)
    ap.add_argument("--top", type=positive_int, default=8, help="how many of the slowest real gaps to list")
    add_json(ap)
    args = ap.parse_args()
    args.profile = profile_path(args)
    target = simulation_target(args.model, args.profile)
    requests = workload_requests(workloads(args.requests, 1.0, args.traces, [args.workload])[args.workload], args.model)
    config = KVConfig().with_knobs(configs(block_bytes(args.model, args.device))[args.config])
    simulated, _ = build_engine(config, target)
    simulated.replay(requests)
    served = base_runtime(args.model, args.device, args.profile).with_config(config).new_engine()
    served.replay(requests)
    real, predicted = token_gaps(served.records), token_gaps(simulated.records)
    both = sorted(((real[k][0], predicted[k][0], k, real[k][1]) for k in real if k in predicted), reverse=True)
    measured_gaps = [g for g, _, _, _ in both]
    predicted_gaps = [p for _, p, _, _ in both]
    print(f"{args.workload} x {args.config}, {len(both)} token gaps (profile {args.profile})")
    print(f"  p50 / p99 ms: measured {np.percentile(measured_gaps, 50) * 1e3:.1f} / "
          f"{np.percentile(measured_gaps, 99) * 1e3:.1f}, predicted {np.percentile(predicted_gaps, 50) * 1e3:.1f} / "
          f"{np.percentile(predicted_gaps, 99) * 1e3:.1f}")
    print(f"the {args.top} slowest real gaps:")
    slowest = []
    for g, p, (request, token), start in both[:args.top]:
        slowest.append({"request": request, "token": token, "measured_s": g, "predicted_s": p, "at_s": start})
        print(f"  request {request:<8} token {token:>3} at {start:7.2f} s: measured {g * 1e3:6.1f} ms, "
              f"predicted {p * 1e3:6.1f} ms")
    by_token: dict[int, list[float]] = {}
    for g, p, (_, token), _ in both:
        by_token.setdefault(token, []).append(g - p)
    rows = [{"token": t, "gaps": len(x), "median_extra_s": statistics.median(x), "max_extra_s": max(x)}
            for t, x in sorted(by_token.items())]
    print("measured - predicted by token index (ms):")
    for r in rows:
        print(f"  token {r['token']:>3}: {r['gaps']:>4} gaps, median {r['median_extra_s'] * 1e3:+6.1f}, "
              f"max {r['max_extra_s'] * 1e3:+6.1f}")
    if args.json:
        print_json({"benchmark": "token_gaps", "model": args.model, "device": args.device, "profile": args.profile,
                    "workload": args.workload, "config": args.config, "requests": args.requests,
                    "gaps": len(both), "slowest": slowest, "by_token": rows})


if __name__ == "__main__":
    main()
