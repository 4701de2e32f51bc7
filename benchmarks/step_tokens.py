"""The runtime's step time against the step's tokens: one-sequence prefill steps of each size, timed in
rounds over all sizes (this machine's speed drifts within seconds; a round sees every size at about the
same speed), the median per size. Shows the shape the step cost model has to follow at small steps,
where a CPU's BLAS cost depends on the rows in steps (`kernels/linear.py`). With ``--idle S`` each step is
also timed after the engine sat idle S seconds (as a replay's first step after a gap between arrivals),
side by side with the back-to-back one.

    python benchmarks/step_tokens.py [--model smollm2-135m] [--tokens 1 2 4 ...] [--rounds 5] [--idle S] [--json]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_args import nonnegative_float, positive_int, print_json
from skistune.config import KVConfig
from skistune.runtime.llm import Runtime
from skistune.runtime.presets import PRESETS
from skistune.runtime.request import Request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", choices=list(PRESETS))
    ap.add_argument("--tokens", type=positive_int, nargs="+",
                    default=[1, 2, 4, 5, 8, 9, 12, 16, 17, 24, 32, 37, 48, 64])
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--idle", type=nonnegative_float, default=0.0,
                    help="also time each step after the engine sat idle this many seconds")
    ap.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    args = ap.parse_args()
    rt = Runtime.from_preset(args.model, KVConfig())
    engine = rt.new_engine()
    gen = torch.Generator().manual_seed(0)
    vocab = rt.spec.vocab_size
    idles = [0.0] + ([args.idle] if args.idle > 0 else [])
    samples: dict[tuple[int, float], list[float]] = {(n, idle): [] for n in args.tokens for idle in idles}
    for r in range(args.rounds + 1):  # round 0 warms up
        for n in args.tokens:
            for idle in idles:
                prompt = torch.randint(1000, vocab, (n,), generator=gen).tolist()  # fresh tokens: no prefix hits
                engine.add_request(Request(f"r{r}-{n}-{idle}", prompt, 1))
                time.sleep(idle)
                t0 = time.perf_counter()
                engine.step()  # the prefill (and its one sampled token)
                if r:
                    samples[n, idle].append(time.perf_counter() - t0)
                engine.run_until_done()
    rows = [{"tokens": n, "idle_s": idle, "median_ms": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3,
             "max_ms": max(v) * 1e3} for (n, idle), v in samples.items()]
    print(f"{args.model}, torch threads {torch.get_num_threads()}: one-sequence prefill steps, {args.rounds} rounds")
    print(f"{'tokens':>6} {'idle s':>6} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for row in rows:
        print(f"{row['tokens']:>6} {row['idle_s']:>6.2f} {row['median_ms']:>10.1f} {row['min_ms']:>8.1f} "
              f"{row['max_ms']:>8.1f}")
    if args.json:
        print_json({"benchmark": "step_tokens", "model": args.model, "rounds": args.rounds, "idle_s": args.idle,
                    "rows": rows})


if __name__ == "__main__":
    main()
