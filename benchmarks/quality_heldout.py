"""Quality model against the real model, config by config: the perplexity increase the quality profile
predicts (mean and its 95% bound, which `--quality ppl+X%` floors are checked against) beside the increase
measured with SmolLM2 on held-out windows (odd-numbered 1,024-token windows of standard-library
docstrings, never used to build a profile).

    python benchmarks/quality_heldout.py [--config KNOBS ...] [--windows 2] [--quality-profile FILE] [--json]

A config is written as comma-separated knob=value pairs, e.g. ``eviction.policy=snapkv,
eviction.budget_fraction=0.1,eviction.recent_window=17``. The defaults are the low-budget eviction configs a
tester found mispredicted (2026-12-05): SnapKV at 0.1 with windows 17, 32 and 64, and the like.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import yaml

from bench_args import add_json, description, fail, positive_int, print_json
from skistune.config import KVConfig
from skistune.quality.measure import measure_quality
from skistune.quality.model import QualityProfile
from skistune.quality.scoring import SCORING_KV_BYTES
from skistune.runtime.llm import Runtime

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = [
    "eviction.policy=snapkv,eviction.budget_fraction=0.1,eviction.recent_window=17",
    "eviction.policy=snapkv,eviction.budget_fraction=0.1,eviction.recent_window=32",
    "eviction.policy=snapkv,eviction.budget_fraction=0.1",
    "eviction.policy=snapkv,eviction.budget_fraction=0.2,eviction.recent_window=16",
    "eviction.policy=tova,eviction.budget_fraction=0.15,eviction.recent_window=16",
    "eviction.policy=h2o,eviction.budget_fraction=0.75,eviction.sink_tokens=0",
]


def parse_knobs(text: str) -> dict:
    """``knob=value,knob=value`` -> a knob dict (values read as YAML scalars: numbers, booleans, names)."""
    knobs = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"--config {text!r}: {part!r} is not knob=value")
        knobs[name.strip()] = yaml.safe_load(value.strip())
    return knobs


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--config", nargs="+", default=DEFAULT_CONFIGS, metavar="KNOBS",
                    help="configs as comma-separated knob=value pairs (default: low-budget eviction configs)")
    ap.add_argument("--windows", type=positive_int, default=2, help="held-out windows measured per config")
    ap.add_argument("--quality-profile", type=Path, default=ROOT / "profiles" / "quality-smollm2-135m.json")
    add_json(ap)
    args = ap.parse_args()
    try:
        knobs = [parse_knobs(c) for c in args.config]
        configs = [KVConfig().with_knobs(k) for k in knobs]
        profile = QualityProfile.load(args.quality_profile)
    except (ValueError, OSError) as e:
        fail(str(e))
    t0 = time.perf_counter()
    runtime = Runtime.from_preset("smollm2-135m", KVConfig().with_knobs({"offload.device_kv_bytes": SCORING_KV_BYTES}))
    measured = measure_quality(runtime, configs, windows=args.windows,
                               progress=lambda label, done, total: print(f"  {label}", flush=True))
    rows = []
    print(f"{'config':<78} {'predicted':>10} {'bound':>8} {'measured':>9} {'worst':>8}")
    for text, config, m in zip(args.config, configs, measured):
        p = profile.predict(config)
        rows.append({"config": text, "predicted_ppl_mean": p.ppl_mean, "predicted_ppl_mean_bound": p.ppl_mean_bound,
                     "measured_ppl_mean": m["ppl_mean"], "measured_ppl_worst": m["ppl_worst"]})
        print(f"{text:<78} {p.ppl_mean:>+10.2%} {p.ppl_mean_bound:>+8.2%} {m['ppl_mean']:>+9.2%} "
              f"{m['ppl_worst']:>+8.2%}")
    wall_s = time.perf_counter() - t0
    print(f"{len(rows)} configs, {args.windows} held-out windows each, {wall_s:.0f} s")
    if args.json:
        print_json({"benchmark": "quality_heldout", "windows": args.windows, "wall_s": wall_s, "rows": rows})


if __name__ == "__main__":
    main()
