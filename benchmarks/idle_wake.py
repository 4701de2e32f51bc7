"""The steps after an idle engine: one request (a ``--prompt``-token prompt, then decodes: ``--steps`` steps in
all) served alone, back to back and after each of ``--idles`` seconds of idle, in ``--rounds`` rounds (each
round takes every idle once), as the profiler times them (`StepBench.after_idle`). Prints each step's extra over
the median back to back, per round and as medians: how far the wake-up reaches past the first step, and how
often.

    python benchmarks/idle_wake.py [--model smollm2-135m] [--prompt 32] [--steps 6] [--idles 0.25 2]
                                   [--rounds 8] [--json]
"""
from __future__ import annotations

import argparse

from bench_args import add_json, check_runtime, description, positive_float, positive_int, print_json

import numpy as np

from skistune.profile.measure import IDLE_WAKE_GAPS_S
from skistune.profile.steps import StepBench, fill_kv
from skistune.runtime.llm import Runtime
from skistune.runtime.presets import PRESETS


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--model", default="smollm2-135m", choices=list(PRESETS))
    ap.add_argument("--prompt", type=positive_int, default=32)
    ap.add_argument("--steps", type=positive_int, default=6)
    ap.add_argument("--idles", type=positive_float, nargs="+", default=list(IDLE_WAKE_GAPS_S))
    ap.add_argument("--rounds", type=positive_int, default=8)
    add_json(ap)
    args = ap.parse_args()
    check_runtime(args.model, "cpu")
    runtime = Runtime.from_preset(args.model)
    fill_kv(runtime)
    idles = tuple(sorted(set(args.idles)))
    bench = StepBench(runtime, warmup=2, repeats=1, max_repeats=1, min_time_s=0.0)
    times_s = bench.after_idle(args.prompt, args.steps, (0.0,) + idles, args.rounds)
    back = np.median(times_s[0], axis=0)
    print(f"{args.model}: a {args.prompt}-token request's {args.steps} steps; back to back (median of "
          f"{args.rounds}): " + " / ".join(f"{x * 1e3:.1f}" for x in back) + " ms")
    rows = []
    for idle, rounds in zip(idles, times_s[1:] - back):
        medians = np.median(rounds, axis=0)
        rows.append({"idle_s": idle, "median_extra_s": medians.tolist(), "rounds_extra_s": rounds.tolist()})
        print(f"after {idle:g} s idle, extra ms by step (median): " + " / ".join(f"{x * 1e3:+.1f}" for x in medians))
        for r, extra in enumerate(rounds):
            print(f"   round {r + 1:>2}: " + " / ".join(f"{x * 1e3:+6.1f}" for x in extra))
    if args.json:
        print_json({"benchmark": "idle_wake", "model": args.model, "prompt": args.prompt, "steps": args.steps,
                    "rounds": args.rounds, "back_to_back_s": back.tolist(), "idles": rows})


if __name__ == "__main__":
    main()
