"""The two orientations of a projection on this CPU, side by side: ``x @ w.T`` (``F.linear``) and
``w @ x.T`` transposed back to rows (what `skistune.kernels.linear` runs for steps in `CPU_FLIP_TOKENS`),
for the projections of a model preset at several step sizes; prints the median time of each, the median
of their ratios over alternating rounds (above 1: the flipped product is faster) and the largest
difference between their results.

    python benchmarks/cpu_linear.py [--model smollm2-135m] [--tokens 1 2 8 16 ...] [--repeats 10] [--rounds 5] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from skistune.kernels.linear import CPU_FLIP_TOKENS, CPU_FLIP_TOKENS_TALL, TALL
from skistune.runtime.presets import get_preset


def projections(model: str) -> dict[str, tuple[int, int]]:
    """``name: (out, in)`` of a layer's fused projections and the LM head, as the runtime stores them."""
    s = get_preset(model)
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    return {"qkv": (q + 2 * kv, s.hidden), "o": (s.hidden, q),
            "gate_up": (2 * s.ffn_hidden, s.hidden), "down": (s.hidden, s.ffn_hidden),
            "lm_head": (s.vocab_size, s.hidden)}


def median_s(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 8, 16, 17, 32, 37, 48, 63, 64, 128, 512])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of both orientations (median ratio)")
    ap.add_argument("--json", action="store_true", help="end with one JSON object on the last line")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    print(f"torch threads {torch.get_num_threads()}, fp32, {args.model}; the runtime flips at "
          f"{', '.join(map(str, CPU_FLIP_TOKENS))} tokens ({CPU_FLIP_TOKENS_TALL.start}-"
          f"{CPU_FLIP_TOKENS_TALL.stop - 1} for a weight {TALL}x taller than wide: the LM head)")
    print(f"{'projection':>10} {'tokens':>6} {'x @ w.T ms':>11} {'w @ x.T ms':>11} {'ratio':>6} {'max diff':>9}")
    for name, (n_out, n_in) in projections(args.model).items():
        w = torch.randn(n_out, n_in) * n_in ** -0.5
        for t in args.tokens:
            x = torch.randn(t, n_in)
            # alternating rounds: this machine's speed drifts within seconds, a ratio within a round does not
            rounds = [(median_s(lambda: F.linear(x, w), args.repeats),
                       median_s(lambda: torch.mm(w, x.t()).t().contiguous(), args.repeats)) for _ in range(args.rounds)]
            plain, flipped = (statistics.median(r[k] for r in rounds) for k in (0, 1))
            diff = (F.linear(x, w) - torch.mm(w, x.t()).t()).abs().max().item()
            row = dict(projection=name, tokens=t, plain_ms=plain * 1e3, flipped_ms=flipped * 1e3,
                       ratio=statistics.median(p / f for p, f in rounds), max_abs_diff=diff)
            rows.append(row)
            print(f"{name:>10} {t:>6} {row['plain_ms']:>11.3f} {row['flipped_ms']:>11.3f} {row['ratio']:>6.2f} "
                  f"{diff:>9.1e}")
    if args.json:
        print(json.dumps({"benchmark": "cpu_linear", "model": args.model, "torch_threads": torch.get_num_threads(),
                          "flip_tokens": list(CPU_FLIP_TOKENS),
                          "flip_tokens_tall": [CPU_FLIP_TOKENS_TALL.start, CPU_FLIP_TOKENS_TALL.stop - 1],
                          "rows": rows}))


if __name__ == "__main__":
    main()
