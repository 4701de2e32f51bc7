"""The runtime's step time against the step's tokens: one-sequence prefill steps of each size, timed in
rounds over all sizes (this machine's speed drifts within seconds; a round sees every size at about the
same speed), the median per size. Shows the shape the step cost model has to follow at small steps,
where a CPU's BLAS cost depends on the rows in steps (`kernels/linear.py`). With ``--idle S`` each step is
also timed after the engine sat idle S seconds (as a replay's first step after a gap between arrivals),
side by side with the back-to-back one. ``SKISTUNE_OMP_WAIT=spin`` times them with spinning OpenMP threads
(past 32,768 elements PyTorch splits an elementwise op across threads, which wakes sleeping ones:
`cost.parallel_rows`). Chunked prefill is off and the step budget holds the largest size: every size is one
step of that many tokens (sizes up to the model's context, less the sampled token).

    python benchmarks/step_tokens.py [--model smollm2-135m] [--tokens 1 2 4 ...] [--rounds 5] [--idle S] [--json]
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench_args import add_json, check_runtime, description, fail, nonnegative_float, positive_int, print_json

import torch

from skistune import openmp_wait
from skistune.config import KVConfig
from skistune.runtime.llm import Runtime
from skistune.runtime.presets import PRESETS
from skistune.runtime.request import Request


def one_step_prefill(tokens: int) -> KVConfig:
    """The default config with chunked prefill off and a step budget of ``tokens`` and the one sampled token at
    least: a prompt of up to ``tokens`` is then computed in one step (the default's chunks of 512 had made
    every size above it a 512-token step)."""
    budget = max(KVConfig().batching.max_num_batched_tokens, tokens + 1)
    return KVConfig().with_knobs({"batching.chunked_prefill": False, "batching.max_num_batched_tokens": budget})


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--model", default="smollm2-135m", choices=list(PRESETS))
    ap.add_argument("--tokens", type=positive_int, nargs="+",
                    default=[1, 2, 4, 5, 8, 9, 12, 16, 17, 24, 32, 37, 48, 64])
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--idle", type=nonnegative_float, default=0.0,
                    help="also time each step after the engine sat idle this many seconds")
    add_json(ap)
    args = ap.parse_args()
    # a prompt of n tokens and its one sampled token: the model's context must hold both (8,192 tokens had
    # been queued, rejected, and then ended in "scheduler made no progress")
    context = PRESETS[args.model].max_context
    too_long = [n for n in args.tokens if n + 1 > context]
    if too_long:
        fail(f"--tokens {' '.join(map(str, too_long))}: a prefill of at most {context - 1} tokens fits "
             f"{args.model}'s context of {context} (with its one sampled token)")
    check_runtime(args.model, "cpu")
    rt = Runtime.from_preset(args.model, one_step_prefill(max(args.tokens)))
    engine = rt.new_engine()
    probe = rt.new_engine()  # (never run: it only asks each size whether it would be served)
    for n in sorted(set(args.tokens)):  # a size the KV pool cannot hold is refused, not queued for ever
        reason = probe.add_request(Request(f"probe-{n}", [1000] * n, 1)).rejected_reason
        if reason is not None:
            fail(f"--tokens {n}: {reason}")
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
                finished = engine.step()  # the prefill (and its one sampled token)
                if r:
                    samples[n, idle].append(time.perf_counter() - t0)
                if not finished:  # (the request asks one token: a step that ran the whole prompt finishes it)
                    raise RuntimeError(f"the {n}-token prefill did not run in one step")
                engine.run_until_done()
    rows = [{"tokens": n, "idle_s": idle, "median_ms": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3,
             "max_ms": max(v) * 1e3} for (n, idle), v in samples.items()]
    print(f"{args.model}, torch threads {torch.get_num_threads()}, OpenMP threads {openmp_wait()} while waiting: "
          f"one-sequence prefill steps, {args.rounds} rounds")
    print(f"{'tokens':>6} {'idle s':>6} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for row in rows:
        print(f"{row['tokens']:>6} {row['idle_s']:>6.2f} {row['median_ms']:>10.1f} {row['min_ms']:>8.1f} "
              f"{row['max_ms']:>8.1f}")
    if args.json:
        print_json({"benchmark": "step_tokens", "model": args.model, "rounds": args.rounds, "idle_s": args.idle,
                    "openmp_wait": openmp_wait(), "rows": rows})


if __name__ == "__main__":
    main()
