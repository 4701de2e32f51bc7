"""Quality floors hold on text the quality profile never saw: the configs the optimizer recommends under a
floor, measured on held-out windows with the real model.

For each scenario (a workload and a floor), `skistune.optimize` searches with the quality profile pricing
eviction and KV bits and validates its top ``--top`` configs as it does for users (``--validate``: each is
replayed on the real model and its loss measured on 2 held-out windows; the one that holds and is best by
measurement is recommended, #1); then every one of those configs is scored on ``--windows`` held-out windows
(odd-numbered 1,024-token windows of standard-library docstrings, never used to build a profile, the first
2 being the validation's; SmolLM2-135M through the runtime's own KV path;
`skistune.quality.measure.measure_quality`). ``--validate 0`` measures the search's predicted best instead. Prints, per config, the knobs that cost
quality, the predicted and the measured loss (mean window / worst window), and whether the measured loss
is within the floor; the summary counts violations. Hardware timings come from the shipped CPU profile,
so the search, and so the configs, are the same on any machine.

    python benchmarks/quality_floor.py [--trials 40] [--top 3] [--validate 3] [--windows 4] [--quality-profile FILE]
                                       [--json]
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import optuna

import skistune
from bench_args import (add_json, description, hardware_profile, nonnegative_int, positive_int, print_json,
                        quality_profile)
from skistune.config import KVConfig
from skistune.objectives import structural_changes
from skistune.quality.measure import measure_quality
from skistune.quality.scoring import SCORING_KV_BYTES
from skistune.runtime.llm import Runtime
from skistune.workloads import load_workload

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = (("chat", "ppl+1%"), ("chat", "ppl+3%"), ("long-context", "ppl+1%"), ("long-context", "worst:ppl+5%"))


def lossy_knobs(config: KVConfig) -> str:
    ev, bw = config.eviction, config.bitwidth
    parts = []
    if ev.policy != "none":
        budget = f"{ev.budget_fraction:.2f}" if ev.budget_fraction is not None else f"{ev.budget_tokens} tok"
        parts.append(f"{ev.policy} {budget} sinks {ev.sink_tokens} recent {ev.recent_window} {ev.layer_schedule}")
    if bw.layer_bits is not None:
        parts.append("per-layer " + ",".join(f"{k}/{v}" for k, v in dict.fromkeys(map(tuple, bw.layer_bits))))
    elif (bw.key_bits, bw.value_bits) != (16, 16):
        parts.append(f"k{bw.key_bits} v{bw.value_bits}")
    if structural_changes(config) and (bw.layer_bits is not None or bw.key_bits < 16 or bw.value_bits < 16):
        parts.append(f"g{bw.group_size} fp{bw.full_precision_window}")
    return ", ".join(parts) or "lossless"


def search(workload: str, floor: str, args, runtime) -> list[KVConfig]:
    """The configs ``skistune.optimize`` recommends, the chosen one first."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    w = load_workload(workload, requests=100, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the shipped profile's fingerprint is not this machine's
        result = skistune.optimize(w, slo="p99=200ms", quality=floor, quality_profile=args.quality_profile,
                                   profile=args.profile, n_trials=args.trials, validate=args.validate,
                                   runtime=runtime, storage=optuna.storages.InMemoryStorage())
    print(f"{workload} {floor}: {'feasible' if result.feasible else 'infeasible'}", file=sys.stderr)
    return [e.config for e in result.best][:args.top] if result.feasible else []


def within(floor: str, measured: dict) -> bool:
    limit = float(floor.split("+")[1].rstrip("%")) / 100
    return (measured["ppl_worst"] if floor.startswith("worst:") else measured["ppl_mean"]) <= limit


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--trials", type=positive_int, default=40)
    ap.add_argument("--top", type=positive_int, default=3)
    ap.add_argument("--validate", type=nonnegative_int, default=3,
                    help="top configs validated on the runtime (0: none)")
    ap.add_argument("--windows", type=positive_int, default=4, help="held-out windows per config")
    ap.add_argument("--quality-profile", type=quality_profile, default=None,
                    help="default: the shipped SmolLM2 profile")
    ap.add_argument("--profile", type=hardware_profile, default=str(ROOT / "profiles" / "cpu-smollm2-135m.json"))
    add_json(ap)
    args = ap.parse_args()
    started = time.perf_counter()
    runtime = Runtime.from_preset("smollm2-135m", KVConfig().with_knobs({"offload.device_kv_bytes": SCORING_KV_BYTES}))
    picks = {(w, f): search(w, f, args, runtime) for w, f in SCENARIOS}
    from skistune.optimize import build_problem  # the predicted losses, from the same profile

    problems = {w: build_problem(load_workload(w, requests=100, seed=0), slo="p99=200ms", quality="ppl+1%",
                                 quality_profile=args.quality_profile, profile=args.profile) for w, _ in SCENARIOS}
    qp = problems["chat"].quality_profile
    contexts = {w: p.context_tokens for w, p in problems.items()}
    lossy = list(dict.fromkeys(c for cs in picks.values() for c in cs if structural_changes(c)))
    measured = dict(zip(lossy, measure_quality(runtime, lossy, windows=args.windows)))
    rows, violations, chosen_violations = [], 0, 0
    print("| workload | floor | # | knobs that cost quality | predicted Δppl mean (95% bound) / worst "
          "| held-out Δppl mean / worst | within floor |")
    print("|---|---|---:|---|---:|---:|:---:|")
    for (workload, floor), configs in picks.items():
        for rank, config in enumerate(configs, start=1):
            pred = qp.predict(config, context_tokens=contexts[workload])
            meas = measured.get(config, {"ppl_mean": 0.0, "ppl_worst": 0.0})
            ok = within(floor, meas)
            violations += not ok
            chosen_violations += rank == 1 and not ok
            rows.append({"workload": workload, "floor": floor, "rank": rank, "knobs": lossy_knobs(config),
                         "predicted": [pred.ppl_mean, pred.guarded_mean, pred.ppl_worst], "measured": [meas["ppl_mean"], meas["ppl_worst"]],
                         "within": ok, "config": config.to_dict()})
            print(f"| {workload} | {floor} | {rank} | {lossy_knobs(config)} | {100 * pred.ppl_mean:+.2f}% "
                  f"({100 * pred.guarded_mean:+.2f}%) / "
                  f"{100 * pred.ppl_worst:+.2f}% | {100 * meas['ppl_mean']:+.2f}% / {100 * meas['ppl_worst']:+.2f}% | "
                  f"{'yes' if ok else 'NO'} |")
        if not configs:
            print(f"| {workload} | {floor} | - | infeasible | | | |")
    total = sum(len(c) for c in picks.values())
    chosen = sum(1 for c in picks.values() if c)
    print(f"{chosen_violations} of {chosen} recommended (#1) configs and {violations} of {total} top configs exceed "
          f"their floor on held-out text ({len(lossy)} lossy, {args.windows} held-out windows each; validated: "
          f"{args.validate}; {time.perf_counter() - started:.0f} s)")
    if args.json:
        print_json({"benchmark": "quality_floor", "chosen_violations": chosen_violations, "chosen": chosen,
                    "violations": violations,
                    "configs": total, "lossy": len(lossy), "windows": args.windows, "trials": args.trials,
                    "validate": args.validate, "rows": rows})


if __name__ == "__main__":
    main()
