"""Whether a profile's machine held still while it was measured: the step points it shares with a reference
profile of the same machine, in the order it measured them, as the ratio of its median to the reference's,
per run of points. A profile's own drift figure re-times its first decode and prefill points at the end only:
a slowdown in the last minute flags a run whose grid held still, and one that came and went mid-run goes
unseen. Here each run of ``--every`` points says how fast the machine ran then, against the reference (a
point whose runtime code changed between the two measurements shows that change too).

    python benchmarks/profile_drift.py PROFILE --reference cpu-smollm2-135m [--every 8] [--json]
"""
from __future__ import annotations

import argparse
import statistics

from bench_args import add_json, description, fail, hardware_profile, positive_int, print_json

from skistune.profile import load_profile
from skistune.profile.records import kv_bits


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("profile", type=hardware_profile, help="the profile whose measurement is looked at")
    ap.add_argument("--reference", type=hardware_profile, required=True,
                    help="a profile of the same machine and model to compare its step points with")
    ap.add_argument("--every", type=positive_int, default=8, help="points per run (a median each)")
    add_json(ap)
    args = ap.parse_args()
    profile, reference = (load_profile(p, check_fingerprint=False) for p in (args.profile, args.reference))
    if (profile.model, profile.device) != (reference.model, reference.device):
        fail(f"{args.reference} is a profile of {reference.model} on {reference.device}, "
             f"not of {profile.model} on {profile.device}")
    then = {(p.kind, tuple(sorted(p.grid.items()))): p.timing.median_s for p in reference.steps}
    shared = [(p.kind, kv_bits(p.grid), p.timing.median_s / then[key]) for p in profile.steps
              if (key := (p.kind, tuple(sorted(p.grid.items())))) in then]
    if not shared:
        fail(f"{args.profile} and {args.reference} share no step point (different grids)")
    runs = []
    for start in range(0, len(shared), args.every):
        part = shared[start:start + args.every]
        runs.append({"points": f"{start + 1}-{start + len(part)}",
                     "kinds": " ".join(dict.fromkeys(f"{k}" + ("" if b == 16 else f"@{b}") for k, b, _ in part)),
                     "ratio": statistics.median(r for _, _, r in part)})
    ratios = [r["ratio"] for r in runs]
    print(f"{args.profile} against {args.reference}: {len(shared)} shared step points, in the order measured "
          f"(its time / the reference's, median per {args.every})")
    print(f"{'points':>9} {'ratio':>6}  kinds")
    for r in runs:
        print(f"{r['points']:>9} {r['ratio']:>6.3f}  {r['kinds']}")
    print(f"runs from x{min(ratios):.3f} to x{max(ratios):.3f} (spread {max(ratios) / min(ratios):.3f})")
    if args.json:
        print_json({"benchmark": "profile_drift", "profile": args.profile, "reference": args.reference,
                    "shared_points": len(shared), "every": args.every, "runs": runs,
                    "min_ratio": min(ratios), "max_ratio": max(ratios)})


if __name__ == "__main__":
    main()
