"""The runtime's step time against the step's tokens: one-sequence prefill steps of each size, timed in
rounds over all sizes (this machine's speed drifts within seconds; a round sees every size at about the
same speed), the median per size. Shows the shape the step cost model has to follow at small steps,
where a CPU's BLAS cost depends on the rows in steps (`kernels/linear.py`). With ``--idle S`` each step is
also timed after the engine sat idle S seconds (as a replay's first step after a gap between arrivals),
side by side with the back-to-back one. ``SKISTUNE_OMP_WAIT=spin`` times them with spinning OpenMP threads
(past 32,768 elements PyTorch splits an elementwise op across threads, which wakes sleeping ones:
`cost.parallel_rows`). Chunked prefill is off and the step budget holds the largest size: every size is one
step of that many tokens (sizes up to the model's context, less the sampled token). With ``--decodes 0 1 4``
each prefill is also timed beside that many decoding sequences (one step runs their decodes and the whole
prompt: both attention paths, `cost.MIXED_FEATURES`), ``--bits 16 4`` times each step with the KV (keys and
values) stored at each of those bits, in the same rounds, and ``--profile P`` prints what P predicts for each.

    python benchmarks/step_tokens.py [--model smollm2-135m] [--tokens 1 2 4 ...] [--rounds 5] [--idle S]
                                     [--decodes 0 1 ...] [--bits 16 ...] [--profile P] [--json]
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench_args import (add_json, check_runtime, description, fail, hardware_profile, nonnegative_float,
                        nonnegative_int, positive_int, print_json)

import torch

from skistune import openmp_wait
from skistune.config import KV_BITS, KVConfig
from skistune.profile import load_profile
from skistune.profile.cost import step_shape, typical_wake_s
from skistune.runtime.engine import Engine
from skistune.runtime.kv_layout import kv_traffic
from skistune.runtime.llm import Runtime
from skistune.runtime.presets import PRESETS
from skistune.runtime.request import Request


def one_step_prefill(tokens: int, decodes: int = 0, bits: int = 16) -> KVConfig:
    """The default config with chunked prefill off and a step budget of ``tokens``, the one sampled token and
    ``decodes`` decoding sequences at least: a prompt of up to ``tokens`` is then computed in one step, beside
    every decode (the default's chunks of 512 had made every size above it a 512-token step); its KV stored at
    ``bits``."""
    budget = max(KVConfig().batching.max_num_batched_tokens, tokens + 1 + decodes)
    return KVConfig().with_knobs({"batching.chunked_prefill": False, "batching.max_num_batched_tokens": budget,
                                  "bitwidth.key_bits": bits, "bitwidth.value_bits": bits})


def with_decoders(runtime: Runtime, decodes: int, steps: int, gen: torch.Generator, prompt: int = 32) -> Engine:
    """An engine whose ``decodes`` sequences (prompts of ``prompt`` tokens) are past their prefill and decode
    for ``steps`` more steps at least: each step of it that takes a prompt runs their decodes beside it."""
    engine = runtime.new_engine()
    for i in range(decodes):
        engine.add_request(Request(f"decoder-{i}", torch.randint(1000, runtime.spec.vocab_size, (prompt,),
                                                                 generator=gen).tolist(), steps + 4))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or len(engine.scheduler.waiting):
        engine.step()
    return engine


def recorded_steps(engine: Engine) -> list:
    """The scheduler outputs ``engine`` executes from now on, in order."""
    outs, execute = [], engine.executor.execute

    def recording(out, kv):
        outs.append(out)
        return execute(out, kv)

    engine.executor.execute = recording
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--model", default="smollm2-135m", choices=list(PRESETS))
    ap.add_argument("--tokens", type=positive_int, nargs="+",
                    default=[1, 2, 4, 5, 8, 9, 12, 16, 17, 24, 32, 37, 48, 64])
    ap.add_argument("--rounds", type=positive_int, default=5)
    ap.add_argument("--idle", type=nonnegative_float, default=0.0,
                    help="also time each step after the engine sat idle this many seconds")
    ap.add_argument("--decodes", type=nonnegative_int, nargs="+", default=[0],
                    help="decoding sequences beside each prefill (0: the prefill alone)")
    ap.add_argument("--bits", type=int, choices=KV_BITS, nargs="+", default=[16],
                    help="bits of the KV cache (keys and values): each step is timed at each")
    ap.add_argument("--profile", type=hardware_profile, default=None,
                    help="also print this profile's prediction of each step")
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
    rt = Runtime.from_preset(args.model, one_step_prefill(max(args.tokens), max(args.decodes)))
    profile = None
    if args.profile is not None:
        profile = load_profile(args.profile, check_fingerprint=False)
        profile.run_as_measured(rt)  # (its projections as the profile's steps computed them)
    bits = list(dict.fromkeys(args.bits))
    # the same model (its weights loaded once) over a KV store at each of the bits
    stores = {b: rt.with_config(one_step_prefill(max(args.tokens), max(args.decodes), b)) for b in bits}
    probe = rt.new_engine()  # (never run: it only asks each size whether it would be served)
    for n in sorted(set(args.tokens)):  # a size the KV pool cannot hold is refused, not queued for ever
        reason = probe.add_request(Request(f"probe-{n}", [1000] * n, 1)).rejected_reason
        if reason is not None:
            fail(f"--tokens {n}: {reason}")
    gen = torch.Generator().manual_seed(0)
    vocab = rt.spec.vocab_size
    idles = [0.0] + ([args.idle] if args.idle > 0 else [])
    decodes = list(dict.fromkeys(args.decodes))
    steps_each = (args.rounds + 1) * len(args.tokens) * len(idles)
    engines = {(d, b): with_decoders(stores[b], d, steps_each, gen) for d in decodes for b in bits}
    executed = {key: recorded_steps(engine) for key, engine in engines.items()}
    traffic = {b: kv_traffic(store.config, rt.spec, rt.store.dtype.itemsize) for b, store in stores.items()}
    keys = [(n, idle, d, b) for n in args.tokens for idle in idles for d in decodes for b in bits]
    samples: dict[tuple[int, float, int, int], list[float]] = {key: [] for key in keys}
    shapes = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for n, idle, d, b in keys:
            engine = engines[d, b]
            prompt = torch.randint(1000, vocab, (n,), generator=gen).tolist()  # fresh tokens: no prefix hits
            engine.add_request(Request(f"r{r}-{n}-{idle}-{d}-{b}", prompt, 1))
            time.sleep(idle)
            t0 = time.perf_counter()
            finished = engine.step()  # the prefill (and its one sampled token), beside the d decodes
            if r:
                samples[n, idle, d, b].append(time.perf_counter() - t0)
            if len(finished) != 1 or len(executed[d, b][-1].scheduled) != d + 1:
                raise RuntimeError(f"the {n}-token prefill did not run in one step beside {d} decodes")
            shapes[n, idle, d, b] = step_shape(executed[d, b][-1], traffic[b])
            if not d:
                engine.run_until_done()
    rows = []
    for (n, idle, d, b), v in samples.items():
        row = {"tokens": n, "idle_s": idle, "decodes": d, "bits": b, "median_ms": statistics.median(v) * 1e3,
               "min_ms": min(v) * 1e3, "max_ms": max(v) * 1e3}
        if profile is not None:
            row["predicted_ms"] = (profile.step_cost.predict_s(shapes[n, idle, d, b])
                                   + typical_wake_s(profile.idle_wake, idle)) * 1e3
        rows.append(row)
    print(f"{args.model}, torch threads {torch.get_num_threads()}, OpenMP threads {openmp_wait()} while waiting: "
          f"one-sequence prefill steps, {args.rounds} rounds" + (f"; predicted by {args.profile}" if profile else ""))
    print(f"{'tokens':>6} {'decodes':>7} {'bits':>4} {'idle s':>6} {'median ms':>10} {'min ms':>8} {'max ms':>8}"
          + (f" {'predicted':>10} {'error':>7}" if profile else ""))
    for row in rows:
        print(f"{row['tokens']:>6} {row['decodes']:>7} {row['bits']:>4} {row['idle_s']:>6.2f} {row['median_ms']:>10.1f} "
              f"{row['min_ms']:>8.1f} {row['max_ms']:>8.1f}"
              + (f" {row['predicted_ms']:>10.1f} {row['predicted_ms'] / row['median_ms'] - 1:>+7.1%}" if profile else ""))
    if args.json:
        print_json({"benchmark": "step_tokens", "model": args.model, "rounds": args.rounds, "idle_s": args.idle,
                    "decodes": decodes, "bits": bits, "profile": args.profile, "openmp_wait": openmp_wait(),
                    "rows": rows})


if __name__ == "__main__":
    main()
