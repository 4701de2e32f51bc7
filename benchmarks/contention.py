"""Decode steps on a shared CPU: OpenMP threads that spin while they wait, that sleep, or that spin briefly then sleep.

skistune sets OMP_WAIT_POLICY=PASSIVE unless told otherwise (`skistune/__init__.py`; SKISTUNE_OMP_WAIT=spin
keeps OpenMP's default, which spins). This measures why, side by side in one run: the TBT p50 of one chat
request (SmolLM2-135M, real weights, 48 output tokens, replayed a few times) in a fresh process under each
policy, alone, beside a single-threaded busy loop, and beside a second process doing the same replays under
the same policy.

    python benchmarks/contention.py [--rounds 2] [--replays 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench_args import add_json, description, positive_int, print_json

POLICIES = {"spin": {"SKISTUNE_OMP_WAIT": "spin"}, "passive": {"SKISTUNE_OMP_WAIT": "passive"},
            # sleeping threads that first spin briefly (GOMP_SPINCOUNT iterations, tens of microseconds): the
            # waits between a step's parallel regions end before the spin does, the waits between steps sleep
            "brief-spin": {"SKISTUNE_OMP_WAIT": "passive", "GOMP_SPINCOUNT": "10000"}}
SCENARIOS = ("alone", "beside a busy loop", "beside a second replay")

# what each process runs: the measured one prints its TBT p50s (ms); a competitor replays until killed
REPLAY = """
import json, sys
from skistune.runtime.llm import Runtime
from skistune.workloads import load_workload, to_requests
rt = Runtime.from_preset("smollm2-135m")
reqs = to_requests(load_workload("chat", requests=1, max_input=256, max_output=48), vocab_size=rt.spec.vocab_size)
n = int(sys.argv[1])
while True:
    tbt = [rt.replay(reqs).tbt_s.p50 * 1e3 for _ in range(max(n, 1))]
    if n:
        print(json.dumps(tbt))
        break
"""
BUSY = "while True: pass"
WARM_S = 12.0  # a competitor's model load, before the measured process starts


def _env(policy: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return {**env, **POLICIES[policy]}


def measure(policy: str, scenario: str, replays: int) -> list[float]:
    competitor = None
    if scenario == "beside a busy loop":
        competitor = subprocess.Popen([sys.executable, "-c", BUSY])
    elif scenario == "beside a second replay":
        competitor = subprocess.Popen([sys.executable, "-c", REPLAY, "0"], env=_env(policy),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(WARM_S)
    try:
        out = subprocess.run([sys.executable, "-c", REPLAY, str(replays)], env=_env(policy), capture_output=True,
                             text=True, check=True)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--rounds", type=positive_int, default=2, help="alternations of the policies per scenario")
    ap.add_argument("--replays", type=positive_int, default=3, help="replays timed per process")
    add_json(ap)
    args = ap.parse_args()
    tbt: dict[str, dict[str, list[float]]] = {s: {p: [] for p in POLICIES} for s in SCENARIOS}
    for scenario in SCENARIOS:
        for _ in range(args.rounds):  # alternating: a slow spell of the host hits both policies
            for policy in POLICIES:
                tbt[scenario][policy] += measure(policy, scenario, args.replays)
        print(f"{scenario:<24} " + "  ".join(
            f"{p} TBT p50 {statistics.median(v):6.1f} ms (runs {min(v):.1f}-{max(v):.1f})"
            for p, v in tbt[scenario].items()), flush=True)
    alone = {p: statistics.median(tbt["alone"][p]) for p in POLICIES}
    rows = {s: {p: {"median_ms": statistics.median(v), "x_alone": statistics.median(v) / alone[p], "runs_ms": v}
                for p, v in by_policy.items()} for s, by_policy in tbt.items()}
    print("alone, against spin: " + ", ".join(f"{p} x{alone[p] / alone['spin']:.2f}" for p in POLICIES))
    for s in SCENARIOS[1:]:
        print(f"{s}: " + ", ".join(f"{p} x{rows[s][p]['x_alone']:.2f}" for p in POLICIES) + " of its time alone; "
              "against spin alone: " + ", ".join(f"{p} x{rows[s][p]['median_ms'] / alone['spin']:.2f}" for p in POLICIES))
    if args.json:
        print_json({"benchmark": "contention", "rounds": args.rounds, "replays": args.replays,
                    "policies": POLICIES, "alone_over_spin": {p: alone[p] / alone["spin"] for p in POLICIES},
                    "passive_over_spin_alone": alone["passive"] / alone["spin"], "scenarios": rows})


if __name__ == "__main__":
    main()
