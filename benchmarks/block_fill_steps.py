"""Decode steps that complete a KV block against those that do not, at each KV bitwidth: with quantized KV the
runtime packs a block when a step completes it (`kernels.attention._append_quantized`), so one decode step in
a block's worth of them does more work. ``--batch`` sequences with prompts of ``--prompt`` tokens decode
``--steps`` steps together (their blocks fill at the same steps); every step is timed, and the medians of
the two kinds are printed side by side, with ``--profile P``'s prediction of each kind (its step model
prices a step by its tokens, whichever kind it is).

    python benchmarks/block_fill_steps.py [--model smollm2-135m] [--bits 16 4] [--batch 1] [--prompt 40]
                                          [--steps 64] [--profile P] [--json]
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench_args import add_json, check_runtime, description, fail, hardware_profile, positive_int, print_json
from step_tokens import recorded_steps, with_decoders

import torch

from skistune import openmp_wait
from skistune.config import KV_BITS, KVConfig
from skistune.profile import load_profile
from skistune.profile.cost import step_shape
from skistune.runtime.kv_layout import kv_traffic
from skistune.runtime.llm import Runtime
from skistune.runtime.presets import PRESETS


def timed_decodes(runtime: Runtime, batch: int, prompt: int, steps: int) -> list[tuple[float, bool, object]]:
    """(seconds, whether the step completed a block, its scheduler output) of ``steps`` decode steps of
    ``batch`` sequences, after their prefill."""
    engine = with_decoders(runtime, batch, steps, torch.Generator().manual_seed(0), prompt)
    outs = recorded_steps(engine)
    block = runtime.store.block_size
    timed = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t0
        out = outs[-1]
        if len(out.scheduled) != batch or out.num_batched_tokens != batch:
            raise RuntimeError(f"step {len(timed)} was not a decode of all {batch} sequences")
        fills = any((s.kv_start + 1) % block == 0 for s in out.scheduled)  # its token is a block's last
        timed.append((elapsed, fills, out))
    return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--model", default="smollm2-135m", choices=list(PRESETS))
    ap.add_argument("--bits", type=int, choices=KV_BITS, nargs="+", default=[16, 4])
    ap.add_argument("--batch", type=positive_int, default=1)
    ap.add_argument("--prompt", type=positive_int, default=40)
    ap.add_argument("--steps", type=positive_int, default=64)
    ap.add_argument("--profile", type=hardware_profile, default=None,
                    help="also print this profile's prediction of each kind of step")
    add_json(ap)
    args = ap.parse_args()
    if args.prompt + args.steps + 4 > PRESETS[args.model].max_context:
        fail(f"--prompt {args.prompt} --steps {args.steps}: more tokens than {args.model}'s context of "
             f"{PRESETS[args.model].max_context}")
    check_runtime(args.model, "cpu")
    base = Runtime.from_preset(args.model, KVConfig())
    profile = None
    if args.profile is not None:
        profile = load_profile(args.profile, check_fingerprint=False)
        profile.run_as_measured(base)
    block = base.store.block_size
    if args.steps < block:
        fail(f"--steps {args.steps}: fewer than a block ({block} tokens): no step might complete one")
    rows = []
    print(f"{args.model}, OpenMP threads {openmp_wait()} while waiting: {args.steps} decode steps of "
          f"{args.batch} sequence(s) after {args.prompt}-token prompts, {block}-token blocks"
          + (f"; predicted by {args.profile}" if profile else ""))
    print(f"{'bits':>4} {'kind':<20} {'steps':>5} {'median ms':>10} {'max ms':>8}" + (f" {'predicted':>10}" if profile else ""))
    for bits in dict.fromkeys(args.bits):
        config = KVConfig().with_knobs({"bitwidth.key_bits": bits, "bitwidth.value_bits": bits})
        runtime = base.with_config(config)
        timed = timed_decodes(runtime, args.batch, args.prompt, args.steps)
        traffic = kv_traffic(config, runtime.spec, runtime.store.dtype.itemsize)
        for fills, kind in ((True, "completes a block"), (False, "completes none")):
            part = [(t, out) for t, f, out in timed if f == fills]
            row = {"bits": bits, "kind": kind, "steps": len(part),
                   "median_ms": statistics.median(t for t, _ in part) * 1e3, "max_ms": max(t for t, _ in part) * 1e3}
            if profile is not None:
                row["predicted_ms"] = statistics.median(profile.step_cost.predict_s(step_shape(out, traffic))
                                                        for _, out in part) * 1e3
            rows.append(row)
            print(f"{bits:>4} {kind:<20} {row['steps']:>5} {row['median_ms']:>10.1f} {row['max_ms']:>8.1f}"
                  + (f" {row['predicted_ms']:>10.1f}" if profile else ""))
        del runtime
    if args.json:
        print_json({"benchmark": "block_fill_steps", "model": args.model, "batch": args.batch, "prompt": args.prompt,
                    "steps": args.steps, "profile": args.profile, "openmp_wait": openmp_wait(), "rows": rows})


if __name__ == "__main__":
    main()
