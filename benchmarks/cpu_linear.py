"""The orientations of a step's projections on this CPU, side by side: ``x @ w.T`` (``F.linear``), ``w @ x.T``
transposed back to rows, and the same with the rows padded with zeros to a multiple of 16, for every
layer's projections of a model preset at several step sizes (tokens); prints the median time of one pass
over all layers in each orientation, the median ratio of each to the plain product over alternating
rounds (above 1: faster than plain), which orientation the runtime runs at that size (this machine's
rule, `skistune.kernels.linear.machine_rule`: measured, or read from its cache), and the largest
difference between the results.

The weights are those of a whole model (distinct tensors per layer, random values), streamed from memory
once per pass as a step streams them: timing one projection over and over keeps its weight in the cache
and gives the opposite answer at many sizes (``--weights hot`` shows it). The LM head (one per step, its
rows are the sampled sequences) is timed separately.

    python benchmarks/cpu_linear.py [--model smollm2-135m] [--tokens 1 2 8 ...] [--rounds 5] [--weights streamed|hot] [--json]
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench_args import add_json, description, positive_int, print_json

import torch
import torch.nn.functional as F

from skistune.kernels.linear import machine_rule, oriented_product
from skistune.runtime.presets import PRESETS, get_preset

ORIENTATIONS = ("plain", "flipped", "padded")


def projections(model: str) -> dict[str, tuple[int, int]]:
    """``name: (out, in)`` of a layer's fused projections, as the runtime stores them."""
    s = get_preset(model)
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    return {"qkv": (q + 2 * kv, s.hidden), "o": (s.hidden, q),
            "gate_up": (2 * s.ffn_hidden, s.hidden), "down": (s.hidden, s.ffn_hidden)}


def pass_s(orientation: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    t0 = time.perf_counter()
    for x, w in pairs:
        oriented_product(x, w, orientation)
    return time.perf_counter() - t0


def compare(pairs, rounds: int) -> dict:
    """Median pass time per orientation and median ratio plain / orientation, over alternating rounds
    (this machine's speed drifts within seconds; a ratio within a round does not)."""
    for o in ORIENTATIONS:
        pass_s(o, pairs)  # warm-up
    samples = [{o: pass_s(o, pairs) for o in ORIENTATIONS} for _ in range(rounds)]
    return {"ms": {o: statistics.median(s[o] for s in samples) * 1e3 for o in ORIENTATIONS},
            "speedup": {o: statistics.median(s["plain"] / s[o] for s in samples) for o in ORIENTATIONS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--model", default="smollm2-135m", choices=list(PRESETS))
    ap.add_argument("--tokens", type=positive_int, nargs="+",
                    default=[1, 2, 4, 7, 9, 13, 16, 17, 24, 32, 37, 47, 63, 64, 96, 131, 192, 256, 512])
    ap.add_argument("--rounds", type=positive_int, default=5, help="alternating rounds of the orientations (median ratio)")
    ap.add_argument("--weights", choices=["streamed", "hot"], default="streamed",
                    help="streamed: every layer's own weights, as a step reads them; hot: one layer's, reused")
    add_json(ap)
    args = ap.parse_args()
    torch.manual_seed(0)
    spec = get_preset(args.model)
    layers = spec.n_layers if args.weights == "streamed" else 1
    weights = [[torch.randn(o, i) * i ** -0.5 for o, i in projections(args.model).values()] for _ in range(layers)]
    lm_head = torch.randn(spec.vocab_size, spec.hidden) * spec.hidden ** -0.5
    mb = sum(w.numel() for ws in weights for w in ws) * 4 / 2 ** 20
    rule = machine_rule([w for ws in weights for w in ws] + [lm_head], args.model) if args.weights == "streamed" \
        else None
    if rule is not None:
        print(f"this machine's rule for {args.model}: {rule}")
    print(f"torch threads {torch.get_num_threads()}, fp32, {args.model}: {layers} layer(s) of projections "
          f"({mb:.0f} MiB, {args.weights}) per pass, and the LM head; speedup = plain / orientation")
    print(f"{'part':>8} {'tokens':>6} {'plain ms':>9} {'flipped ms':>11} {'padded ms':>10} "
          f"{'flipped':>8} {'padded':>7} {'runtime':>8} {'max diff':>9}")
    rows = []
    for part in ("layers", "lm_head"):
        for t in args.tokens:
            ws = [w for ws in weights for w in ws] if part == "layers" else [lm_head]
            pairs = [(torch.randn(t, w.shape[1]), w) for w in ws]
            r = compare(pairs, args.rounds)
            x, w = pairs[0]
            diff = max((oriented_product(x, w, o) - F.linear(x, w)).abs().max().item() for o in ORIENTATIONS[1:])
            runtime = rule.orientation(t) if rule is not None else "-"
            rows.append({"part": part, "tokens": t, **{f"{o}_ms": r["ms"][o] for o in ORIENTATIONS},
                         **{f"{o}_speedup": r["speedup"][o] for o in ORIENTATIONS[1:]},
                         "runtime": runtime, "max_abs_diff": diff})
            print(f"{part:>8} {t:>6} {r['ms']['plain']:>9.1f} {r['ms']['flipped']:>11.1f} {r['ms']['padded']:>10.1f} "
                  f"{r['speedup']['flipped']:>8.2f} {r['speedup']['padded']:>7.2f} {runtime:>8} {diff:>9.1e}", flush=True)
    if args.json:
        print_json({"benchmark": "cpu_linear", "model": args.model, "torch_threads": torch.get_num_threads(),
                    "weights": args.weights, "rule": rule.to_dict() if rule else None, "rows": rows})


if __name__ == "__main__":
    main()
