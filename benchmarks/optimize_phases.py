"""Where the wall time of the default `skistune optimize --slo p99=200ms` goes: the same call through the
Python API, each phase timed by wrapping it (building the problem, the search, the refine, the validation
and its real replays, the model's load in the background), then each validated replay's wall time.
    python benchmarks/optimize_phases.py [--slo p99=200ms] [--json]
"""
from __future__ import annotations

import argparse
import functools
import time

from bench_args import fail, print_json, slo_text

PHASES = ("build_problem", "_run_sequential", "_refine", "validate", "_measure", "load_runtime")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slo", type=slo_text, default="p99=200ms")
    ap.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    args = ap.parse_args()
    started = time.perf_counter()
    import skistune.optimize as opt

    spent: dict[str, float] = {}

    def timed(name: str):
        inner = getattr(opt, name)

        @functools.wraps(inner)
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        setattr(opt, name, wrapper)

    for name in PHASES:
        timed(name)
    try:
        result = opt.optimize(slo=[args.slo], storage=None, study_name=f"phases-{time.time():.0f}")
    except opt.UnmeetableSLO as exc:  # (no config can meet it on this profile: nothing to time)
        fail(f"--slo {args.slo}: {exc}")
    total = time.perf_counter() - started
    replays = [{"role": v.role, "wall_s": v.wall_s, "holds": v.holds} for v in result.validated]
    print(f"total {total:.1f} s (imports included)")
    labels = {"build_problem": "build the problem (profile, workload)", "_run_sequential": "search",
              "_refine": "refine the top configs", "validate": "validation", "_measure": "... its real replays",
              "load_runtime": "model load (in the background, during the search)"}
    for name in PHASES:
        print(f"  {labels[name]:<52} {spent.get(name, 0.0):6.1f} s")
    for r in replays:
        print(f"  replay ({r['role']}): {r['wall_s']:.1f} s, {'holds' if r['holds'] else 'breaks'}")
    if args.json:
        print_json({"benchmark": "optimize_phases", "slo": args.slo, "total_s": total,
                    "phases_s": {labels[n]: spent.get(n, 0.0) for n in PHASES}, "replays": replays})


if __name__ == "__main__":
    main()
