"""Simulator fidelity step by step: one fidelity workload x config served by the real runtime, each real
step's time against the hardware profile's prediction for the same step's shape (with what the simulator adds
to the steps after an idle engine, as medians: `cost.typical_wake_s`), by kind of step (pure decode, one
prefill, prefill with decodes), and for the steps that follow an idle gap apart from the rest (and from the
replay's first step, which follows nothing). Shows where `benchmarks/fidelity.py`'s latency errors come from.
    python benchmarks/fidelity_steps.py [--model smollm2-135m] [--device cpu] [--profile P]
                                        [--workload mooncake-prefix] [--config default] [--rate-scale 1]
                                        [--replays 2] [--json]
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

from bench_args import add_json, description, positive_float, positive_int, print_json
from fidelity import (add_replay_args, add_target_args, base_runtime, block_bytes, configs, profile_path,
                      simulation_target, workloads)

from skistune.config import KVConfig
from skistune.evaluate import workload_requests
from skistune.profile.cost import IDLE_WAKE_GAP_S, step_kind, step_shape, typical_wake_s
from skistune.runtime.engine import Engine
from skistune.runtime.kv_layout import kv_traffic

KINDS = tuple(k + c for c in ("", "+compaction") for k in ("decode", "prefill", "mixed"))
IDLE_GAP_S = 0.05  # a step that starts this long after the previous one ended follows an idle engine


def timed_steps(engine: Engine, log: list) -> None:
    """Make ``engine.step`` record (shape-ready scheduler output, execute seconds, start, end) per step."""
    def step():
        t0 = time.perf_counter()
        out = engine.scheduler.schedule()
        if not out and out.dropped:  # (requests that can never be served were given up: no step ran)
            return []
        t1 = time.perf_counter()
        sampled = engine.executor.execute(out, engine.kv)
        t2 = time.perf_counter()
        engine.busy_s += t2 - t1
        finished = engine.scheduler.update(out, sampled, engine.clock.now(), engine.eos_token_id)
        log.append((out, t2 - t1, t0, time.perf_counter()))
        return finished
    engine.step = step


def kind(shape) -> str:
    """decode, prefill or mixed (`cost.step_kind`); "+compaction" when eviction compacts a sequence after the step."""
    return step_kind(shape) + ("+compaction" if shape.compactions else "")


def summary(errors: list[float]) -> dict:
    errors = sorted(errors)
    return {"steps": len(errors), "median": statistics.median(errors), "p10": errors[len(errors) // 10],
            "p90": errors[len(errors) * 9 // 10]}


def step_groups(rows: list[dict]) -> dict[str, dict]:
    """The replay's steps summarized by kind, then again by what came before each: the first step of the
    replay follows nothing (it is neither after a gap nor back to back, and had been in no group: the groups'
    counts fell a step short of the replay's), the others an idle gap or the previous step."""
    def errors(part):
        return [r["predicted_s"] / r["measured_s"] - 1 for r in part]

    groups = {k: summary(errors([r for r in rows if r["kind"] == k]))
              for k in KINDS if any(r["kind"] == k for r in rows)}
    for label, part in (("first step", rows[:1]), ("after an idle gap", [r for r in rows[1:] if r["after_idle"]]),
                        ("back to back", [r for r in rows[1:] if not r["after_idle"]])):
        if part:
            groups[label] = summary(errors(part))
    return groups


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    add_target_args(ap)
    add_replay_args(ap)
    ap.add_argument("--rate-scale", type=positive_float, default=1.0,
                    help="multiply the workload's arrival rate (as fidelity.py's --rate-scale)")
    ap.add_argument("--replays", type=positive_int, default=2)
    add_json(ap)
    args = ap.parse_args()
    args.profile = profile_path(args)
    target = simulation_target(args.model, args.profile)
    workload = workloads(args.requests, args.rate_scale, args.traces, [args.workload])[args.workload]
    runtime = base_runtime(args.model, args.device, args.profile)
    requests = workload_requests(workload, args.model)
    config = KVConfig().with_knobs(configs(block_bytes(args.model, args.device))[args.config])
    traffic = kv_traffic(config, target.spec, target.kv_itemsize)
    replays = []
    print(f"{args.workload} x {args.config}: predicted / measured - 1 per real step (profile {args.profile})")
    for replay in range(args.replays):
        engine = runtime.with_config(config).new_engine()
        log: list = []
        timed_steps(engine, log)
        engine.replay(requests)
        rows, previous_end, woken, since_wake = [], None, 0.0, 0
        for out, measured_s, start, end in log:
            shape = step_shape(out, traffic)
            # (with what the simulator adds to the steps after an idle engine, as medians: the first follows one)
            idle_s = math.inf if previous_end is None else start - previous_end
            if idle_s >= IDLE_WAKE_GAP_S:
                woken, since_wake = idle_s, 0
            else:
                since_wake += 1
            rows.append({"kind": kind(shape), "tokens": shape.num_tokens, "seqs": shape.num_seqs,
                         "measured_s": measured_s,
                         "predicted_s": target.step_cost.predict_s(shape)
                         + typical_wake_s(target.idle_wake, woken, since_wake),
                         "after_idle": previous_end is not None and idle_s > IDLE_GAP_S})
            previous_end = end
        groups = step_groups(rows)
        replays.append({"steps": len(rows), "groups": groups})
        print(f"replay {replay + 1}: {len(rows)} steps")
        for label, g in groups.items():
            print(f"  {label:<18} {g['steps']:>4} steps  median {g['median']:+.1%}  p10 {g['p10']:+.1%}  p90 {g['p90']:+.1%}")
    if args.json:
        print_json({"benchmark": "fidelity_steps", "model": args.model, "device": args.device,
                    "workload": args.workload, "config": args.config, "profile": args.profile,
                    "rate_scale": args.rate_scale, "replays": replays})


if __name__ == "__main__":
    main()
