"""How closely each synthetic preset follows the trace it is fitted to: the Kolmogorov-Smirnov distance between a
preset's token lengths and the trace sample's in ../shared/traces, their percentiles side by side, and how their
arrivals' rate swings over minutes (the CV of requests per minute, the correlation of neighbouring minutes, the
busiest minute over the mean; the gaps' CV).

    python benchmarks/preset_fit.py [--requests 20000] [--seed 0] [--json]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench_args import add_json, description, nonnegative_int, positive_int, print_json
from skistune.workloads import load_workload
from skistune.workloads.stats import burstiness, ks_distance, rate_swings

TRACES = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
PRESET_TRACES = {  # the trace each preset follows (skistune/workloads/synthetic.py: PRESETS)
    "chat": TRACES / "azure_llm_2023_conv" / "AzureLLMInferenceTrace_conv.csv",
    "code": TRACES / "azure_llm_2023_code" / "AzureLLMInferenceTrace_code.csv",
    "long-context": TRACES / "mooncake_conversation" / "conversation_trace.head.jsonl",
    "agent": TRACES / "mooncake_synthetic" / "synthetic_trace.jsonl",
}
SHOWN = (10, 25, 50, 75, 90, 95, 99)
JITTER_S = {"long-context": 3.0}  # (Mooncake's timestamps come in 3-s steps: spread within them, as its preset is)


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--requests", type=positive_int, default=20000, help="requests drawn from each preset")
    ap.add_argument("--seed", type=nonnegative_int, default=0)
    add_json(ap)
    args = ap.parse_args()
    rows = []
    print(f"{'preset':<13} {'side':<7} {'KS':>6} {'mean':>15}  " + "  ".join(f"{'p' + str(p):>13}" for p in SHOWN)
          + "   (preset / trace)")
    arrivals = []
    for name, path in PRESET_TRACES.items():
        made, trace = load_workload(name, requests=args.requests, seed=args.seed), load_workload(path)
        timed = load_workload(path, jitter_s=JITTER_S.get(name))
        swings = [rate_swings(w.arrival_s) for w in (made, timed)]
        arrivals.append({"preset": name, "gap_cv": [burstiness(made.arrival_s), burstiness(timed.arrival_s)],
                         **{key: [s[key] for s in swings] for key in ("rate_cv", "lag1", "peak_over_mean")}})
        for side in ("input", "output"):
            a, b = getattr(made, f"{side}_tokens"), getattr(trace, f"{side}_tokens")
            row = {"preset": name, "side": side, "ks": ks_distance(a, b), "mean": [float(a.mean()), float(b.mean())],
                   "percentiles": {str(p): [float(x), float(y)] for p, x, y in
                                   zip(SHOWN, np.percentile(a, SHOWN), np.percentile(b, SHOWN))}}
            rows.append(row)
            print(f"{name:<13} {side:<7} {row['ks']:>6.3f} {a.mean():>7.0f}/{b.mean():<7.0f}  "
                  + "  ".join(f"{x:>6.0f}/{y:<6.0f}" for x, y in row["percentiles"].values()), flush=True)
    print(f"\n{'preset':<13} {'gap CV':>13} {'rate CV / min':>14} {'neighbours':>13} {'busiest':>13}   (preset / trace)")
    for a in arrivals:
        print(f"{a['preset']:<13} " + " ".join(f"{x:>6.2f}/{y:<6.2f}" for x, y in
                                          (a[key] for key in ("gap_cv", "rate_cv", "lag1", "peak_over_mean"))))
    if args.json:
        print_json({"benchmark": "preset_fit", "requests": args.requests, "seed": args.seed, "rows": rows,
                    "arrivals": arrivals})


if __name__ == "__main__":
    main()
