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
more; it is printed beside the errors, and a second table predicts every replay again with the profile's
steps at the speed the checks timed (per kind, the geometric mean of before and after), which takes it out
of them. ``--no-speed-check`` skips both. With ``--check-each`` the steps are also timed between replays
(about 7 s each on a 2-core CPU), and each replay is predicted at the speed of the checks just before and
after it: on a host whose speed moves within minutes, the checks at the run's two ends had missed a replay's
speed by 20% and more (the measured TBT p50 of the same decode work ran 50.6-71.0 ms from one replay to the
next, BENCHMARKS.md).

On a GPU (``--device cuda --model llama-3-8b``, random weights: timing only) the same configs and workloads
run at ``--rate-scale`` times their rates (the GPU serves the 8B model faster than two CPU cores serve
SmolLM2), the tight pools keep their size in blocks, and each config is replayed once on two requests
first, so that Triton's compilations are not timed.

``--measured RUN.json`` predicts a recorded run's replays again (its ``--json`` output, from any machine) with
another profile, serving nothing: a GPU run re-scored on a CPU (`benchmarks/results/`).

    python benchmarks/fidelity.py [--model smollm2-135m] [--device cpu] [--profile profiles/DEVICE-MODEL.json]
                                  [--requests 16] [--rate-scale 1] [--configs ...] [--no-speed-check]
                                  [--check-each] [--json]
    python benchmarks/fidelity.py --measured RUN.json [--profile P] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench_args import (add_json, check_runtime, description, existing_file, fail, hardware_profile, positive_float,
                        positive_int, print_json)

import numpy as np
import torch

from skistune.config import KVConfig
from skistune.evaluate import FIDELITY_FIGURES, relative_error, sim_target, workload_requests
from skistune.profile import load_profile
from skistune.profile.measure import DTYPES
from skistune.runtime.kv_layout import kv_block_bytes
from skistune.runtime.llm import Runtime
from skistune.runtime.presets import PRESETS, get_preset
from skistune.simulator import simulate
from skistune.workloads import load_workload
from skistune.workloads.load import rate_out_of_range

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / ".." / "shared" / "traces"
TIGHT_BLOCKS = 96  # the tight device pool: 96 blocks of 16 tokens (4.4 blocks per request of the workloads)
HOST_BLOCKS = 728  # the host tier of the prefetch configs (512 MiB of SmolLM2's float32 KV)


def configs(block_bytes: int) -> dict[str, dict]:
    """The configs, the tight pools sized in blocks of ``block_bytes`` (a 16-token block of the model's 16-bit
    KV at the runtime's dtype), so that they bind alike on every model."""
    tight = TIGHT_BLOCKS * block_bytes
    return {
        "default": {},
        "seqs4": {"batching.max_num_seqs": 4},
        "chunk32": {"batching.chunk_size": 32, "batching.max_num_batched_tokens": 64},
        "no-chunking": {"batching.chunked_prefill": False, "batching.max_num_batched_tokens": 512,
                        "batching.chunk_size": 512},
        "no-prefix": {"prefix_reuse.enabled": False},
        "tight-kv-edf": {"offload.device_kv_bytes": tight, "batching.policy": "edf"},
        "int8": {"bitwidth.key_bits": 8, "bitwidth.value_bits": 8},
        "int4": {"bitwidth.key_bits": 4, "bitwidth.value_bits": 4},
        "int4-tight-kv": {"bitwidth.key_bits": 4, "bitwidth.value_bits": 4, "batching.max_num_seqs": 16,
                          "offload.device_kv_bytes": tight},
        "h2o-50": {"eviction.policy": "h2o", "eviction.budget_fraction": 0.5},
        "snapkv-30-pyramid": {"eviction.policy": "snapkv", "eviction.budget_fraction": 0.3,
                              "eviction.layer_schedule": "pyramid"},
        # the tight device pool with a host tier: prefixes demoted and promoted, blocks ahead or layer by layer
        "host-prefetch-blocks": {"offload.device_kv_bytes": tight, "offload.host_kv_bytes": HOST_BLOCKS * block_bytes,
                                 "prefetch.enabled": True, "prefetch.depth": 8},
        "host-prefetch-layers": {"offload.device_kv_bytes": tight, "offload.host_kv_bytes": HOST_BLOCKS * block_bytes,
                                 "prefetch.enabled": True, "prefetch.unit": "layers", "prefetch.depth": 2},
    }


CONFIG_NAMES = list(configs(1))


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


RATES = {"azure-conv": 0.8, "mooncake-prefix": 0.6, "bursty-chat": 1.0}  # req/s before --rate-scale
WORKLOAD_NAMES = list(RATES)


def workloads(n: int, rate_scale: float = 1.0, traces: Path = TRACES, names=WORKLOAD_NAMES) -> dict:
    """Scaled to what the small model serves on 2 CPU cores in real time (about a minute per run), their
    rates times ``rate_scale``; the Azure and Mooncake samples read from ``traces``. Only ``names`` are built
    (the synthetic one needs no trace). Bad input ends the script with a one-line error."""
    build = {
        "azure-conv": lambda rate: load_workload(
            _trace(traces, "azure_llm_2023_conv/AzureLLMInferenceTrace_conv.csv"), first=n, length_scale=0.1,
            max_input=256, max_output=24, rate_rps=rate),
        "mooncake-prefix": lambda rate: load_workload(
            prefix_sharing(load_workload(_trace(traces, "mooncake_conversation/conversation_trace.head.jsonl")), n),
            length_scale=1 / 32, max_input=384, max_output=24, rate_rps=rate),
        "bursty-chat": lambda rate: load_workload("chat", requests=n, burstiness=4.0, length_scale=0.1,
                                                  max_input=256, max_output=24, rate_rps=rate, seed=1),
    }
    for name in names:
        if rate_out_of_range(RATES[name] * rate_scale):
            fail(f"--rate-scale {rate_scale:g}: {name}'s {RATES[name]:g} req/s becomes "
                 f"{RATES[name] * rate_scale:g} req/s, {rate_out_of_range(RATES[name] * rate_scale)}")
    return {name: build[name](RATES[name] * rate_scale) for name in names}


def _trace(traces: Path, relative: str) -> Path:
    path = Path(traces) / relative
    if not path.is_file():
        fail(f"--traces {traces}: no {relative} there (the public trace samples; default ../shared/traces beside "
             "the checkout)")
    return path


METRICS = [(name, f) for name, _, f in FIDELITY_FIGURES]  # (the figures `skistune evaluate --mode compare` prints)
UNITS = {name: unit for name, unit, _ in FIDELITY_FIGURES}
SCALE = {"ms": 1e3, "MiB": 2 ** -20, "tok/s": 1.0}  # seconds and bytes as printed (the JSON keeps s and bytes)
CELL = 20


def heading(name: str) -> str:
    """A figure's column heading: its name and unit (once, where the name is the unit: tok/s)."""
    return name if name.endswith(UNITS[name]) else f"{name} {UNITS[name]}"


def cell(name: str, predicted: float, measured: float, error: float) -> str:
    """predicted/measured in the figure's unit (ms, tok/s, MiB) and the relative error, CELL wide."""
    k = SCALE[UNITS[name]]
    return f"{_num(predicted * k)}/{_num(measured * k)} {error:+.0%}".rjust(CELL)


def _num(x: float) -> str:
    """Three significant digits, without an exponent from 100 up (1234 ms, not 1.23e+03)."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    add_target_args(ap)
    ap.add_argument("--requests", type=positive_int, default=16)
    ap.add_argument("--traces", type=Path, default=TRACES,
                    help="the folder of the trace samples (default ../shared/traces beside the checkout)")
    ap.add_argument("--rate-scale", type=positive_float, default=1.0,
                    help="multiply the workloads' arrival rates (made for SmolLM2 on 2 CPU cores)")
    ap.add_argument("--configs", nargs="+", default=CONFIG_NAMES, choices=CONFIG_NAMES, metavar="CONFIG",
                    help="configs to run (default all): " + ", ".join(CONFIG_NAMES))
    ap.add_argument("--measured", type=existing_file, metavar="JSON",
                    help="a recorded run (this script's --json output, from any machine): predict its replays "
                         "again with --profile instead of serving them; its model, device, requests, rate scale "
                         "and configs replace those options")
    ap.add_argument("--no-speed-check", dest="speed_check", action="store_false",
                    help="do not time the profile's own steps again before and after the replays")
    ap.add_argument("--check-each", action="store_true",
                    help="also time them between replays, and predict each replay at the speed of the checks "
                         "around it")
    add_json(ap)
    args = ap.parse_args()
    if args.check_each and not args.speed_check:
        fail("--check-each times the profile's steps between replays: it needs the speed checks "
             "(drop --no-speed-check)")
    recorded, recorded_run = read_recorded(args) if args.measured else (None, {})
    profile = profile_path(args, serving=recorded is None)
    target = simulation_target(args.model, profile)
    runs = workloads(args.requests, args.rate_scale, args.traces)  # (bad input found before the model loads)
    rt = base_runtime(args.model, args.device, profile) if recorded is None else None
    table = configs(block_bytes(args.model, args.device))
    if rt is not None and args.device == "cuda":  # Triton compiles each config's kernels on first use
        warm = workload_requests(next(iter(runs.values())), args.model)[:2]  # (not inside a timed replay)
        for cname in args.configs:
            try:
                replay(rt, KVConfig().with_knobs(table[cname]), warm)
            except Exception as exc:  # (its timed replays fail too, and say so)
                print(f"warm-up of {cname} failed: {exc!r}", flush=True)
    speed = [machine_speed(profile, rt, "before")] if args.speed_check and rt is not None else []
    rows, failed, served = [], [], {}
    print_heading("predicted/measured")
    for wname, w in runs.items():
        reqs = served[wname] = workload_requests(w, args.model)
        for cname in args.configs:
            if recorded is not None and (wname, cname) not in recorded:
                continue
            cfg = KVConfig().with_knobs(table[cname])
            try:
                p = simulate(cfg, reqs, target)
                predicted = {n: f(p) for n, f in METRICS}
                checks = None
                if recorded is None:
                    if args.check_each and speed:
                        if rows or failed:  # (the first replay follows the "before" check)
                            speed.append(machine_speed(profile, rt, f"before {wname} {cname}", quiet=True))
                        checks = [len(speed) - 1, len(speed)]  # (the next check, or the last, follows it)
                    m = replay(rt, cfg, reqs)
                    measured, preemptions = {n: f(m) for n, f in METRICS}, [p.preemptions, m.preemptions]
                else:
                    measured = recorded[wname, cname]["measured"]
                    preemptions = [p.preemptions, recorded[wname, cname]["preemptions"][1]]
                    checks = recorded[wname, cname].get("checks")
            except Exception as exc:  # one broken config must not cost the others' figures (a GPU run is short)
                failed.append({"workload": wname, "config": cname, "error": repr(exc)})
                print(f"{wname:<16} {cname:<20} FAILED: {exc!r}", flush=True)
                continue
            errors = {n: relative_error(predicted[n], measured[n]) or 0.0 for n, _ in METRICS}
            rows.append({"workload": wname, "config": cname, "errors": errors, "predicted": predicted,
                         "measured": measured, "preemptions": preemptions,
                         **({"checks": checks} if checks is not None else {})})
            print(f"{wname:<16} {cname:<20} " + " ".join(
                cell(n, predicted[n], measured[n], errors[n]) for n, _ in METRICS), flush=True)
    if speed:
        speed.append(machine_speed(profile, rt, "after"))
    if not rows:
        sys.exit("every replay failed")
    summary = summarize(rows, "errors")
    print(f"median |error| {summary['median_abs_error']:.1%}, max {summary['max_abs_error']:.1%}, "
          f"latency percentiles within 10%: {summary['latency_within_10pct']:.0%} of {summary['latency_figures']}")
    if recorded_run and _same_file(recorded_run.get("profile"), profile):  # (another profile's checks say nothing here)
        speed = recorded_run.get("machine_speed") or []
    at_speed = predict_at_speed(rows, served, table, target, speed) if speed else None
    if args.json:
        print_json({"benchmark": "fidelity", "model": args.model, "device": args.device, "profile": profile,
                    "requests": args.requests, "rate_scale": args.rate_scale, "measured_in": args.measured,
                    **summary, "machine_speed": speed, "at_checked_speed": at_speed, "rows": rows, "failed": failed})
    if failed:
        sys.exit(f"{len(failed)} of {len(failed) + len(rows)} replays failed")


def _same_file(a: str | None, b: str) -> bool:
    return a is not None and Path(a).resolve() == Path(b).resolve()


def print_heading(below: str) -> None:
    print(f"{'workload':<16} {'config':<20} " + " ".join(f"{heading(name):>{CELL}}" for name, _ in METRICS))
    print(f"{'':<16} {'':<20} " + " ".join(f"{below:>{CELL}}" for _ in METRICS))


def summarize(rows: list[dict], key: str) -> dict:
    """Median and max |error| over every figure of ``rows`` (their ``key``: "errors" or "errors_at_speed"),
    and the share of latency percentiles within 10%."""
    abs_err = [abs(e) for r in rows for e in r[key].values()]
    latency_err = [abs(r[key][n]) for r in rows for n, _ in METRICS[:6]]
    return {"median_abs_error": statistics.median(abs_err), "max_abs_error": max(abs_err),
            "latency_within_10pct": sum(e <= 0.10 for e in latency_err) / len(latency_err),
            "latency_figures": len(latency_err), "runs": len(rows)}


def predict_at_speed(rows: list[dict], served: dict, table: dict, target, speed: list[dict]) -> dict:
    """Each row predicted again with the profile's steps at the speed the run's checks timed (per kind, the
    geometric mean of before and after: `check.cost_at_speed`; a row of a ``--check-each`` run, of the checks
    just before and after its replay), its errors added to the row as "errors_at_speed": what is left once the
    machine's drift since the profile is taken out, the simulator's own error (approximately: the machine's
    speed may have moved between the checks). Printed as a second table, its summary returned."""
    from dataclasses import replace

    from skistune.profile.check import cost_at_speed

    scaled = replace(target, step_cost=cost_at_speed(target.step_cost, [speed[0], speed[-1]]))
    factors = ", ".join(f"{k} x{f:.3f}" for k, f in scaled.step_cost.factors)
    each = any("checks" in r for r in rows)
    print("\nthe same replays predicted with the profile's steps at the speed its checks timed "
          + (f"around each replay (from {len(speed)} checks; the run's ends: {factors}):" if each
             else f"({factors}):"))
    print_heading("at speed/measured")
    for r in rows:
        around = [speed[i] for i in r.get("checks", ()) if 0 <= i < len(speed)]
        cost = replace(target, step_cost=cost_at_speed(target.step_cost, around)) if around else scaled
        p = simulate(KVConfig().with_knobs(table[r["config"]]), served[r["workload"]], cost)
        predicted = r["predicted_at_speed"] = {n: f(p) for n, f in METRICS}
        r["errors_at_speed"] = {n: relative_error(predicted[n], r["measured"][n]) or 0.0 for n, _ in METRICS}
        print(f"{r['workload']:<16} {r['config']:<20} " + " ".join(
            cell(n, predicted[n], r["measured"][n], r["errors_at_speed"][n]) for n, _ in METRICS), flush=True)
    summary = summarize(rows, "errors_at_speed")
    print(f"at the checked speed: median |error| {summary['median_abs_error']:.1%}, max "
          f"{summary['max_abs_error']:.1%}, latency percentiles within 10%: {summary['latency_within_10pct']:.0%} "
          f"of {summary['latency_figures']}")
    return {"factors": dict(scaled.step_cost.factors), "other": scaled.step_cost.other, **summary}


def read_recorded(args) -> tuple[dict[tuple[str, str], dict], dict]:
    """``--measured``: the recorded rows by (workload, config), and the run; the run's model, device, requests,
    rate scale and configs go into ``args`` (runs recorded before the JSON named its requests served 12)."""
    if not Path(args.measured).is_file():
        fail(f"--measured {args.measured}: not a file")
    try:
        lines = Path(args.measured).read_text().strip().splitlines()
        run = json.loads(lines[-1]) if lines else None
        if not isinstance(run, dict) or "rows" not in run:
            raise ValueError("its last line is no JSON object with rows" if lines else "the file is empty")
        rows = {(r["workload"], r["config"]): r for r in run["rows"]}
        args.model, args.device, args.rate_scale = run["model"], run["device"], float(run["rate_scale"])
        args.requests = int(run.get("requests", RECORDED_REQUESTS))
    except KeyError as exc:
        fail(f"--measured {args.measured}: not a fidelity run's --json output (no {exc.args[0]!r})")
    except (OSError, ValueError, TypeError) as exc:
        fail(f"--measured {args.measured}: not a fidelity run's --json output ({exc})")
    unknown = sorted({c for _, c in rows} - set(CONFIG_NAMES)) + sorted({w for w, _ in rows} - set(WORKLOAD_NAMES))
    if unknown or args.model not in PRESETS or args.device not in DTYPES or args.requests < 1:
        fail(f"--measured {args.measured}: a run of workloads, configs, a model, device or request count this "
             f"script does not know ({', '.join(unknown) or f'{args.model} on {args.device}, {args.requests} requests'})")
    args.configs = [c for c in CONFIG_NAMES if any(c == rc for _, rc in rows)]
    return rows, run


RECORDED_REQUESTS = 12  # the H200 run of 2026-12-04 (benchmarks/gpu_session.sh), recorded before "requests" was


def add_target_args(ap: argparse.ArgumentParser) -> None:
    """--model, --device and --profile: what runs, where, and the profile the simulator reads."""
    ap.add_argument("--model", default="smollm2-135m", choices=list(PRESETS))
    ap.add_argument("--device", default="cpu", choices=list(DTYPES))
    ap.add_argument("--profile", type=hardware_profile,
                    help="the hardware profile the simulator reads (default profiles/DEVICE-MODEL.json)")


def add_replay_args(ap: argparse.ArgumentParser) -> None:
    """--workload, --config, --requests and --traces: the one replay a step-by-step script serves and predicts."""
    ap.add_argument("--workload", default="mooncake-prefix", choices=WORKLOAD_NAMES)
    ap.add_argument("--config", default="default", choices=CONFIG_NAMES)
    ap.add_argument("--requests", type=positive_int, default=12)
    ap.add_argument("--traces", type=Path, default=TRACES,
                    help="the folder of the trace samples (default ../shared/traces beside the checkout)")


def profile_path(args, serving: bool = True) -> str:
    """``--profile``, else the profile shipped for ``--device`` and ``--model``, which must load. When the
    script will serve requests, first: can this machine run the model there (else a one-line error, not the
    kernel's out-of-memory kill)?"""
    if serving:
        check_runtime(args.model, args.device)
    if args.profile is not None:
        return args.profile
    path = ROOT / "profiles" / f"{args.device}-{args.model}.json"
    if not path.is_file():
        fail(f"no profile of {args.model} on {args.device} ships in profiles/: give one with --profile")
    try:
        return hardware_profile(str(path))
    except argparse.ArgumentTypeError as exc:
        fail(f"--profile not given, and the default one {exc}")


def simulation_target(model: str, profile: str):
    """`sim_target`, or the script's end with its one-line reason (a profile of another model)."""
    try:
        return sim_target(model, profile)
    except ValueError as exc:
        fail(str(exc))


def base_runtime(model: str, device: str, profile: str) -> Runtime:
    """The model at the dtype the runtime serves with on ``device``, over a small pool of its own: each
    config builds its store (`Runtime.with_config`), sized from the memory left; its projections computed as
    ``profile``'s steps were (`HardwareProfile.run_as_measured`), whose predictions its replays check."""
    runtime = Runtime.from_preset(model, KVConfig().with_knobs({"offload.device_kv_bytes": 64 << 20}),
                                  device=device, dtype=DTYPES[device])
    load_profile(profile, check_fingerprint=False).run_as_measured(runtime)
    return runtime


def block_bytes(model: str, device: str) -> int:
    """A 16-token block of ``model``'s 16-bit KV at the dtype the runtime serves with on ``device`` (what
    `configs` sizes pools in)."""
    return kv_block_bytes(get_preset(model), KVConfig().prefix_reuse.block_size, DTYPES[device].itemsize)


def replay(runtime: Runtime, config: KVConfig, requests):
    """The measured metrics of ``requests`` served under ``config``; on a GPU the config's KV store is
    handed back to the driver after it, so that the next config's default pool is sized as it would be
    alone (torch's allocator would otherwise keep it, and the next pool would see that memory as used)."""
    other = runtime.with_config(config)
    try:
        return other.replay(requests)
    finally:
        del other
        if runtime.model.device.type == "cuda":
            torch.cuda.empty_cache()


def machine_speed(profile_path: str, runtime, when: str, quiet: bool = False) -> dict:
    """The profile's own steps timed again now (`skistune.profile.check`): now / then, median; printed unless
    ``quiet`` (the checks between replays would split the table)."""
    from skistune.profile import load_profile
    from skistune.profile.check import speed_check
    check = speed_check(load_profile(profile_path, check_fingerprint=False), runtime)
    if not quiet:
        print(f"{when} the replays, {check.summary_line()}", flush=True)
    return {"when": when, **check.to_dict()}


if __name__ == "__main__":
    main()
