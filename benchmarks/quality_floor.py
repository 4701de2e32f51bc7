"""Quality floors hold on text the quality profile never saw: the configs the optimizer recommends under a
floor, measured on held-out windows with the real model.

For each scenario (a workload and a floor), `skistune.optimize` searches with the quality profile pricing
eviction and KV bits (no runtime validation: this benchmark measures the quality side only), and the top
``--top`` configs it recommends are scored on the corpus's held-out windows (odd-numbered 1,024-token
windows of standard-library docstrings, never used to build a profile; SmolLM2-135M through the runtime's
own KV path; `skistune.quality.measure.measure_quality`). Prints, per config, the knobs that cost
quality, the predicted and the measured loss (mean window / worst window), and whether the measured loss
is within the floor; the summary counts violations. Hardware timings come from the shipped CPU profile,
so the search, and so the configs, are the same on any machine.

    python benchmarks/quality_floor.py [--trials 40] [--top 3] [--windows 4] [--quality-profile FILE] [--json]
"""
from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import optuna

import skistune
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


def search(workload: str, floor: str, trials: int, quality_profile, hw: str) -> list[KVConfig]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    w = load_workload(workload, requests=100, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the shipped profile's fingerprint is not this machine's
        result = skistune.optimize(w, slo="p99=200ms", quality=floor, quality_profile=quality_profile, profile=hw,
                                   n_trials=trials, validate=0, storage=optuna.storages.InMemoryStorage())
    return [e.config for e in result.best] if result.feasible else []


def within(floor: str, measured: dict) -> bool:
    limit = float(floor.split("+")[1].rstrip("%")) / 100
    return (measured["ppl_worst"] if floor.startswith("worst:") else measured["ppl_mean"]) <= limit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--windows", type=int, default=4, help="held-out windows per config")
    ap.add_argument("--quality-profile", default=None, help="default: the shipped SmolLM2 profile")
    ap.add_argument("--profile", default=str(ROOT / "profiles" / "cpu-smollm2-135m.json"))
    ap.add_argument("--json", action="store_true", help="also print one JSON object on the last line")
    args = ap.parse_args()
    started = time.perf_counter()
    picks = {(w, f): search(w, f, args.trials, args.quality_profile, args.profile)[:args.top] for w, f in SCENARIOS}
    from skistune.optimize import build_problem  # the predicted losses, from the same profile

    qp = build_problem("chat", slo="p99=200ms", quality="ppl+1%", quality_profile=args.quality_profile,
                       profile=args.profile).quality_profile
    lossy = list(dict.fromkeys(c for cs in picks.values() for c in cs if structural_changes(c)))
    runtime = Runtime.from_preset("smollm2-135m", KVConfig().with_knobs({"offload.device_kv_bytes": SCORING_KV_BYTES}))
    measured = dict(zip(lossy, measure_quality(runtime, lossy, windows=args.windows)))
    rows, violations = [], 0
    print("| workload | floor | # | knobs that cost quality | predicted Δppl mean (95% bound) / worst "
          "| held-out Δppl mean / worst | within floor |")
    print("|---|---|---:|---|---:|---:|:---:|")
    for (workload, floor), configs in picks.items():
        for rank, config in enumerate(configs, start=1):
            pred = qp.predict(config)
            meas = measured.get(config, {"ppl_mean": 0.0, "ppl_worst": 0.0})
            ok = within(floor, meas)
            violations += not ok
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
    print(f"{violations} of {total} recommended configs exceed their floor on held-out text "
          f"({len(lossy)} lossy, {args.windows} held-out windows each; {time.perf_counter() - started:.0f} s)")
    if args.json:
        print(json.dumps({"violations": violations, "configs": total, "lossy": len(lossy), "windows": args.windows,
                          "trials": args.trials, "rows": rows}))


if __name__ == "__main__":
    main()
