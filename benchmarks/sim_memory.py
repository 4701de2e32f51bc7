"""Simulator memory, two revisions side by side: the Python heap (tracemalloc) that building a workload's
requests and replaying them take, per request and per prompt token. A trace of 60,000 long prompts had taken
3.2 GB to simulate (a tester's finding); this prints what each revision allocates for the same requests.

Each revision (a git revision, or ``WT`` for the working tree) is laid out as the installed package in a
temporary folder (as `sim_instructions` does) and measured in a process of its own:

- ``requests``: the heap held by the built requests (`skistune.evaluate.workload_requests`);
- ``replay peak``: the heap's peak during one replay, over what was held before it (requests included);
- ``held after``: what the replay's metrics and memoized state keep once it has returned.

    python benchmarks/sim_memory.py --base HEAD~1 [--new WT] [--workload mooncake-conv] [--requests N] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_args import add_json, description, fail, positive_int, print_json
from sim_instructions import WORKLOADS, add_revision_args, check_revision_args, package_at

# run in the revision's process: builds the requests and replays them once, under tracemalloc
MEASURE = """
import json, os, sys, tracemalloc, warnings
warnings.simplefilter("ignore")
from skistune.config import KVConfig
from skistune.evaluate import sim_target, workload_requests
from skistune.simulator import build_engine, with_rate_scale
from skistune.workloads import load_workload
path, scale, n, profile = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
target = sim_target("smollm2-135m", profile)
workload = load_workload(path)
tracemalloc.start()
base = tracemalloc.get_traced_memory()[0]
requests = with_rate_scale(workload_requests(workload, "smollm2-135m")[:n], scale)
held = tracemalloc.get_traced_memory()[0] - base
tracemalloc.reset_peak()
before = tracemalloc.get_traced_memory()[0]
engine, _ = build_engine(KVConfig(), target)
metrics = engine.replay(requests)
peak = tracemalloc.get_traced_memory()[1] - before
del engine
after = tracemalloc.get_traced_memory()[0] - before
import skistune
assert skistune.__file__.startswith(os.environ["PYTHONPATH"]), skistune.__file__
print(json.dumps({"requests": len(requests), "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                  "output_tokens": metrics.output_tokens, "requests_bytes": held, "replay_peak_bytes": peak,
                  "held_after_bytes": after, "simulated_duration_s": metrics.duration_s}))
"""


def measure(rev: str, args, tmp: Path) -> dict:
    name = re.sub(r"\W", "_", rev)
    pythonpath = package_at(rev, tmp / name)
    run = subprocess.run([sys.executable, "-c", MEASURE, str(WORKLOADS[args.workload]), str(args.rate_scale),
                          str(args.requests), args.profile],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(pythonpath)}, cwd=tmp)
    if run.returncode:
        fail(f"{rev}: the measurement failed: {run.stderr.strip().splitlines()[-1:]}")
    return {"rev": rev, **json.loads(run.stdout.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    add_revision_args(ap, "mooncake-conv")
    ap.add_argument("--requests", type=positive_int, default=10**9, help="the workload's first N requests (default: all)")
    add_json(ap)
    args = ap.parse_args()
    check_revision_args(args)
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(2) as pool:
        rows = list(pool.map(lambda rev: measure(rev, args, Path(tmp)), [args.base, args.new]))
    first = rows[0]
    print(f"{args.workload}: {first['requests']:,} requests, {first['prompt_tokens']:,} prompt tokens, "
          f"{first['output_tokens']:,} output tokens, rate x{args.rate_scale:g}")
    print(f"  {'revision':<12} {'requests MB':>12} {'B/prompt tok':>13} {'replay peak MB':>15} {'held after MB':>14} "
          f"{'KB/request':>11}")
    for row in rows:
        total = row["requests_bytes"] + row["replay_peak_bytes"]
        row["peak_bytes_per_request"] = total / row["requests"]
        print(f"  {row['rev']:<12} {row['requests_bytes'] / 2**20:>12,.1f} "
              f"{row['requests_bytes'] / row['prompt_tokens']:>13.2f} {row['replay_peak_bytes'] / 2**20:>15,.1f} "
              f"{row['held_after_bytes'] / 2**20:>14,.1f} {total / row['requests'] / 1024:>11,.1f}")
    same = rows[0]["simulated_duration_s"] == rows[1]["simulated_duration_s"]
    ratio = rows[1]["peak_bytes_per_request"] / rows[0]["peak_bytes_per_request"]
    print(f"  {args.new} / {args.base}: x{ratio:.3f} the peak heap (requests + replay)"
          + ("" if same else "  (the two predicted different runs: not the same work)"))
    if args.json:
        print_json({"benchmark": "sim_memory", "workload": args.workload, "rate_scale": args.rate_scale,
                    "base": rows[0], "new": rows[1], "ratio": ratio, "same_prediction": same})


if __name__ == "__main__":
    main()
