"""Simulator fidelity: predicted vs measured metrics for configs x workloads, side by side.

For each workload and config, the real runtime serves the workload on the real model (SmolLM2-135M on
this CPU, in real time) and the simulator predicts it from the hardware profile. Prints p50/p99 of TTFT,
TBT and E2E, throughput and peak KV memory, predicted and measured, with relative errors.

The configs cover batching, chunking, prefix reuse, a tight KV pool, and quantized KV (int8, int4, and
int4 in the tight pool's bytes: more blocks at fewer bits, less the full-precision rings, whose size
follows max_num_seqs). A profile measured without quantized-KV points predicts the quantized configs
by extrapolation and says so in the notes (`HardwareProfile.quantized_kv_note`).

Before the first replay and after the last, a few of the profile's own step points are timed again
(`skistune.profile.check`): how much slower (or faster) the machine runs the profile's steps during the
run than when the profile was measured. On a shared host that drift alone moves every error by 10% or
more; it is printed beside the errors, not taken out of them. ``--no-speed-check`` skips it.

    python benchmarks/fidelity.py [--profile profiles/cpu-smollm2-135m.json] [--requests 16] [--no-speed-check]
                                  [--json]
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

from bench_args import hardware_profile, positive_int, print_json
from skistune.config import KVConfig
from skistune.evaluate import FIDELITY_FIGURES, compare_metrics, sim_target, workload_requests
from skistune.runtime.llm import Runtime
from skistune.simulator import simulate
from skistune.workloads import load_workload

TRACES = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
MODEL = "smollm2-135m"

CONFIGS = {
    "default": {},
    "seqs4": {"batching.max_num_seqs": 4},
    "chunk32": {"batching.chunk_size": 32, "batching.max_num_batched_tokens": 64},
    "no-chunking": {"batching.chunked_prefill": False, "batching.max_num_batched_tokens": 512,
                    "batching.chunk_size": 512},
    "no-prefix": {"prefix_reuse.enabled": False},
    "tight-kv-edf": {"offload.device_kv_bytes": 96 * 16 * 46080, "batching.policy": "edf"},
    "int8": {"bitwidth.key_bits": 8, "bitwidth.value_bits": 8},
    "int4": {"bitwidth.key_bits": 4, "bitwidth.value_bits": 4},
    "int4-tight-kv": {"bitwidth.key_bits": 4, "bitwidth.value_bits": 4, "batching.max_num_seqs": 16,
                      "offload.device_kv_bytes": 96 * 16 * 46080},
    "h2o-50": {"eviction.policy": "h2o", "eviction.budget_fraction": 0.5},
    "snapkv-30-pyramid": {"eviction.policy": "snapkv", "eviction.budget_fraction": 0.3,
                          "eviction.layer_schedule": "pyramid"},
    # the tight device pool with a host tier: prefixes demoted and promoted, blocks ahead or layer by layer
    "host-prefetch-blocks": {"offload.device_kv_bytes": 96 * 16 * 46080, "offload.host_kv_bytes": 512 << 20,
                             "prefetch.enabled": True, "prefetch.depth": 8},
    "host-prefetch-layers": {"offload.device_kv_bytes": 96 * 16 * 46080, "offload.host_kv_bytes": 512 << 20,
                             "prefetch.enabled": True, "prefetch.unit": "layers", "prefetch.depth": 2},
}


def prefix_sharing(w, n: int):
    """n requests of the trace that reuse at least half their prefix blocks, with the requests that
    first had those blocks: Mooncake's own prefix structure, concentrated (in the trace, reuse appears
    only over long windows)."""
    first_seen: dict[int, int] = {}
    keep: set[int] = set()
    for i in range(len(w)):
        blocks = w.blocks(i).tolist()
        lead = next((k for k, b in enumerate(blocks) if b not in first_seen), len(blocks))
        if blocks and lead >= len(blocks) / 2:
            keep.update({i, first_seen[blocks[0]], first_seen[blocks[lead - 1]]})
        for b in blocks:
            first_seen.setdefault(b, i)
        if len(keep) >= n:
            break
    return w.take(np.array(sorted(keep)[:n]))


def workloads(n: int) -> dict:
    """Scaled to what the small model serves on 2 CPU cores in real time (about a minute per run)."""
    return {
        "azure-conv": load_workload(TRACES / "azure_llm_2023_conv" / "AzureLLMInferenceTrace_conv.csv", first=n,
                                    length_scale=0.1, max_input=256, max_output=24, rate_rps=0.8),
        "mooncake-prefix": load_workload(prefix_sharing(load_workload(TRACES / "mooncake_conversation" /
                                                                      "conversation_trace.head.jsonl"), n),
                                         length_scale=1 / 32, max_input=384, max_output=24, rate_rps=0.6),
        "bursty-chat": load_workload("chat", requests=n, burstiness=4.0, length_scale=0.1, max_input=256,
                                     max_output=24, rate_rps=1.0, seed=1),
    }


METRICS = [(name, f) for name, _, f in FIDELITY_FIGURES]  # (the figures `skistune evaluate --mode compare` prints)
UNITS = {name: unit for name, unit, _ in FIDELITY_FIGURES}
SCALE = {"ms": 1e3, "MiB": 2 ** -20, "tok/s": 1.0}  # seconds and bytes as printed (the JSON keeps s and bytes)
CELL = 20


def cell(name: str, predicted: float, measured: float, error: float) -> str:
    """predicted/measured in the figure's unit (ms, tok/s, MiB) and the relative error, CELL wide."""
    k = SCALE[UNITS[name]]
    return f"{_num(predicted * k)}/{_num(measured * k)} {error:+.0%}".rjust(CELL)


def _num(x: float) -> str:
    """Three significant digits, without an exponent from 100 up (1234 ms, not 1.23e+03)."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=hardware_profile,
                    default=str(Path(__file__).resolve().parents[1] / "profiles" / "cpu-smollm2-135m.json"))
    ap.add_argument("--requests", type=positive_int, default=16)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), metavar="CONFIG",
                    help="configs to run (default all): " + ", ".join(CONFIGS))
    ap.add_argument("--no-speed-check", dest="speed_check", action="store_false",
                    help="do not time the profile's own steps again before and after the replays")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    target = sim_target(MODEL, args.profile)
    rt = Runtime.from_preset(MODEL, KVConfig())
    speed = [machine_speed(args.profile, rt, "before")] if args.speed_check else []
    rows = []
    print(f"{'workload':<16} {'config':<20} " + " ".join(f"{name + ' ' + UNITS[name]:>{CELL}}" for name, _ in METRICS))
    print(f"{'':<16} {'':<20} " + " ".join(f"{'predicted/measured':>{CELL}}" for _ in METRICS))
    for wname, w in workloads(args.requests).items():
        reqs = workload_requests(w, MODEL)
        for cname in args.configs:
            cfg = KVConfig().with_knobs(CONFIGS[cname])
            predicted = simulate(cfg, reqs, target)
            measured = rt.with_config(cfg).replay(reqs)
            errors = {r["figure"]: r["error"] or 0.0 for r in compare_metrics(predicted, measured)}
            rows.append({"workload": wname, "config": cname, "errors": errors,
                         "predicted": {n: f(predicted) for n, f in METRICS},
                         "measured": {n: f(measured) for n, f in METRICS},
                         "preemptions": [predicted.preemptions, measured.preemptions]})
            print(f"{wname:<16} {cname:<20} " + " ".join(
                cell(n, f(predicted), f(measured), errors[n]) for n, f in METRICS), flush=True)
    if args.speed_check:
        speed.append(machine_speed(args.profile, rt, "after"))
    abs_err = [abs(e) for r in rows for n, e in r["errors"].items()]
    latency_err = [abs(r["errors"][n]) for r in rows for n, _ in METRICS[:6]]
    summary = {"median_abs_error": statistics.median(abs_err), "max_abs_error": max(abs_err),
               "latency_within_10pct": sum(e <= 0.10 for e in latency_err) / len(latency_err),
               "runs": len(rows)}
    print(f"median |error| {summary['median_abs_error']:.1%}, max {summary['max_abs_error']:.1%}, "
          f"latency percentiles within 10%: {summary['latency_within_10pct']:.0%} of {len(latency_err)}")
    if args.json:
        print_json({"benchmark": "fidelity", "model": MODEL, "profile": args.profile, **summary,
                    "machine_speed": speed, "rows": rows})


def machine_speed(profile_path: str, runtime, when: str) -> dict:
    """The profile's own steps timed again now (`skistune.profile.check`): now / then, median."""
    from skistune.profile import load_profile
    from skistune.profile.check import speed_check
    check = speed_check(load_profile(profile_path, check_fingerprint=False), runtime)
    print(f"{when} the replays, {check.summary_line()}", flush=True)
    return {"when": when, **check.to_dict()}


if __name__ == "__main__":
    main()
