"""What eviction adds to a step: prefill chunks scored by attention and decode steps that compact, each against the
same step without eviction, timed as the profiler times steps (`skistune.profile.steps.StepBench`).

- prefill chunks of ``--tokens`` under ``--policy`` (one that scores by attention: its statistics make every
  prefill chunk run attention with its probabilities materialized) at a budget no prompt reaches, against the
  same chunks without eviction (`cost.SCORED_FEATURES`);
- decode steps of ``--batch`` sequences that are all compacted to ``--budgets`` slots, against decode steps of
  the same batch at the context they compact from: the difference over the batch is one compaction's time
  (`cost.EVICTION_FEATURES`, `cost.PARALLEL_COMPACTION_FEATURES`).

With ``--profile P`` each row also shows what P's step model adds for it.

    python benchmarks/eviction_steps.py [--policy h2o] [--tokens 32 128 256 512] [--budgets 32 64 128 160 176 256]
                                        [--batch 1] [--profile P] [--json]
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from bench_args import add_json, check_runtime, description, fail, hardware_profile, positive_int, print_json

from skistune.config import EVICTION_POLICIES, KVConfig
from skistune.profile import load_profile
from skistune.profile.measure import QUICK_GRID, compaction_pool, scoring_pool
from skistune.profile.steps import StepBench, fill_kv
from skistune.runtime.eviction_budget import SCORING_POLICIES
from skistune.runtime.kv_layout import kv_block_bytes
from skistune.runtime.llm import Runtime
from skistune.runtime.presets import PRESETS

MODEL = "smollm2-135m"


def bench(runtime: Runtime, grid) -> StepBench:
    return StepBench(runtime, warmup=grid.warmup, repeats=grid.repeats, max_repeats=grid.max_repeats,
                     min_time_s=grid.min_time_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--policy", default="h2o", choices=[p for p in EVICTION_POLICIES if p in SCORING_POLICIES])
    ap.add_argument("--tokens", type=positive_int, nargs="+", default=[32, 128, 256, 512])
    ap.add_argument("--budgets", type=positive_int, nargs="+", default=[32, 64, 128, 160, 176, 256])
    ap.add_argument("--batch", type=positive_int, default=1)
    ap.add_argument("--profile", type=hardware_profile, default=None,
                    help="also print what this profile's step model adds for each row")
    add_json(ap)
    args = ap.parse_args()
    grid = replace(QUICK_GRID, compaction_policy=args.policy, scored_prefill=tuple((n, 0) for n in args.tokens),
                   prefill=tuple((n, 0) for n in args.tokens))
    context, block = PRESETS[MODEL].max_context, KVConfig().prefix_reuse.block_size
    if max(args.tokens) >= context:
        fail(f"--tokens {max(args.tokens)}: a prefill of at most {context - 1} tokens fits {MODEL}'s context of "
             f"{context}")
    # (a compaction point decodes a block's worth of steps per measured one, from the budget on)
    grown = block * (grid.warmup + grid.max_repeats + 4)
    if max(args.budgets) + grown > context:
        fail(f"--budgets {max(args.budgets)}: at most {context - grown} ({MODEL}'s context of {context} less the "
             f"{grown} tokens a compaction point decodes)")
    check_runtime(MODEL, "cpu")
    tokens = max(2 * max(args.tokens), args.batch * (max(args.budgets) + grown))  # (the plain points' pool)
    base = Runtime.from_preset(MODEL, KVConfig().with_knobs(
        {"offload.device_kv_bytes": kv_block_bytes(PRESETS[MODEL], block, 4, KVConfig()) * (tokens // block + 64)}))
    model = None
    if args.profile is not None:
        profile = load_profile(args.profile, check_fingerprint=False)
        profile.run_as_measured(base)
        model = profile.step_cost
    plain = bench(base, grid)
    scoring = base.with_config(scoring_pool(base, grid))
    fill_kv(scoring)
    scored = bench(scoring, grid)
    prefills = []
    print(f"{MODEL}: prefill chunks under {args.policy} (no compaction) against none (ms, medians)"
          + (f"; added by {args.profile}" if model else ""))
    print(f"{'tokens':>7} {'none':>8} {args.policy:>8} {'added':>8}" + (f" {'predicted':>10}" if model else ""))
    for n in args.tokens:
        p, s = plain.prefill(n, 0), scored.prefill(n, 0, kind="scored")
        row = {"tokens": n, "plain_ms": p.timing.median_s * 1e3, "scored_ms": s.timing.median_s * 1e3}
        row["added_ms"] = row["scored_ms"] - row["plain_ms"]
        if model is not None:
            row["predicted_added_ms"] = (model.predict_s(s.shape) - model.predict_s(p.shape)) * 1e3
        prefills.append(row)
        print(f"{n:>7} {row['plain_ms']:>8.1f} {row['scored_ms']:>8.1f} {row['added_ms']:>+8.1f}"
              + (f" {row['predicted_added_ms']:>+10.1f}" if model else ""))
    del scoring, scored
    compactions = []
    print(f"decode steps of {args.batch} sequence(s) each compacted to a budget against plain decode steps from the "
          f"same context (ms, medians; one compaction = the difference / {args.batch})")
    print(f"{'budget':>7} {'slots':>6} {'decode':>8} {'compacting':>11} {'one':>7}"
          + (f" {'predicted':>10}" if model else ""))
    for budget in args.budgets:
        evicting = base.with_config(compaction_pool(base, replace(grid, compaction_policy=args.policy),
                                                    args.batch, budget))
        fill_kv(evicting)
        c = bench(evicting, grid).compaction(args.batch, budget)
        del evicting
        slots = c.shape.compacted_slots // args.batch
        d = plain.decode(args.batch, slots - 1)  # (reading ``slots`` KV slots a sequence, as the compacting step)
        row = {"budget": budget, "slots": slots, "decode_ms": d.timing.median_s * 1e3,
               "compacting_ms": c.timing.median_s * 1e3}
        row["one_ms"] = (row["compacting_ms"] - row["decode_ms"]) / args.batch
        if model is not None:
            row["predicted_one_ms"] = model.compaction_s(slots, budget) * 1e3
        compactions.append(row)
        print(f"{budget:>7} {slots:>6} {row['decode_ms']:>8.1f} {row['compacting_ms']:>11.1f} {row['one_ms']:>+7.1f}"
              + (f" {row['predicted_one_ms']:>+10.1f}" if model else ""))
    if args.json:
        print_json({"benchmark": "eviction_steps", "model": MODEL, "policy": args.policy, "batch": args.batch,
                    "block_size": block, "profile": args.profile, "prefills": prefills, "compactions": compactions})


if __name__ == "__main__":
    main()
