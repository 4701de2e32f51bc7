"""Capacity of the tuned config against the baseline (vLLM's defaults), predicted and measured.

For each workload (chat, long-context, and the prefix-heavy agent preset), `skistune.optimize` searches as a
user's run does (``--trials`` trials under ``--slo``, the quality floor ``--quality`` so that eviction and KV
bits are searched too, its own validation of the top configs on the real runtime) and returns its chosen
config. Then both configs are scored side by side:

- predicted: capacity (the highest arrival rate at which every SLO and the queueing guard hold) on the
  search workload (``--requests`` requests), the gain tuned / baseline, and whether the baseline at its
  capacity is memory-bound (KV peak >= 90% of its pool, or preemptions);
- measured: the same capacity search on the real runtime (SmolLM2-135M) over a slice of the workload
  (``--slice`` requests, prompts capped at ``--max-input`` tokens and outputs at ``--max-output``: a CPU
  replays a few short requests in seconds, not the whole trace). Starting from the tuned config's predicted
  rate on the slice, each config's rate is doubled while it holds (halved while it does not), then one
  geometric midpoint is tried between the last rate that held and the first that broke: the measured
  capacity is resolved to a factor of sqrt(2), and so is the measured gain (``--midpoints 2``: 2**(1/4), 1.19).

``--search-capped`` searches on the preset with the slice's caps as well, so that the config measured was
tuned for the requests it replays: with a small ``--kv-memory`` this is a memory-bound case that a CPU
replays in minutes (uncapped prompts take minutes per replay here).

Hardware timings come from ``--profile`` (default: this machine's quick profile, measured once and cached):
the measured half needs a quiet machine (nothing else on its cores). ``--measure 0`` skips it.

    python benchmarks/tuned_vs_default.py [--workloads chat,long-context,agent] [--trials 40] [--json]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from importlib.metadata import version
from pathlib import Path

import optuna
from rich.console import Console
from rich.table import Table

from bench_args import (add_json, console as table_console, description, fail, hardware_profile, nonnegative_int,
                        positive_int, print_json)
from skistune.optimize import Problem, build_problem, solve
from skistune.optimize_cli import _diff
from skistune.problem import DEFAULT_REQUESTS, RequestSet
from skistune.scoring import score, score_at
from skistune.validation import _measure, load_runtime, validation_requests
from skistune.workloads import PRESETS, load_workload

MEMORY_BOUND_FILL = 0.9  # KV peak over the pool at which a config counts as memory-bound


def memory_bound(figures: dict) -> bool:
    """Whether a config at its capacity is held back by KV memory: its pool nearly full, or preempting."""
    pool = figures.get("kv_capacity_bytes") or 0
    return bool(figures.get("preemptions")) or (pool > 0 and figures["kv_peak_bytes"] >= MEMORY_BOUND_FILL * pool)


def ratio(tuned: float, base: float) -> float | None:
    if base > 0:
        return tuned / base
    return math.inf if tuned > 0 else None


def measured_capacity(problem: Problem, runtime, config, requests: RequestSet, start_scale: float,
                      max_moves: int = 3, midpoints: int = 1) -> dict:
    """The highest rate scale (of the slice's own rate) at which the runtime's replay holds every
    constraint: doubling or halving from ``start_scale``, then ``midpoints`` geometric midpoints; resolved to
    2 ** (1 / 2 ** midpoints) (sqrt(2) for one)."""
    held: dict[float, bool] = {}
    trace: list[dict] = []  # every replay: rate, whether it held, what broke, measured TBT p99

    def holds(scale: float) -> bool:
        if scale not in held:
            predicted = score_at(problem, config, requests, scale)
            v = _measure(problem, runtime, predicted, requests, "candidate")
            # every constraint the replay broke: not `v.holds`, which leaves out those the prediction at this
            # rate breaks too (validation's "untested"), and so held above the predicted capacity whatever broke
            held[scale] = not v.measured.binding
            trace.append({"rate_rps": scale * requests.base_rps, "holds": held[scale], "binding": v.measured.binding,
                          "tbt_p99_ms": v.measured.figures["tbt_p99_s"] * 1e3, "wall_s": round(v.wall_s, 1)})
            print(f"replayed {trace[-1]}", file=sys.stderr, flush=True)  # an hour's run shows where it is
        return held[scale]

    scale = start_scale
    if holds(scale):
        for _ in range(max_moves):
            if not holds(scale * 2):
                break
            scale *= 2
    else:
        for _ in range(max_moves):
            scale /= 2
            if holds(scale):
                break
        else:
            return {"capacity_rps": 0.0, "replays": trace, "bounded": False}
    for _ in range(midpoints):  # each geometric midpoint halves the log-interval: sqrt(2), 2**(1/4), ...
        best = max(s for s, h in held.items() if h)
        broke = [s for s, h in held.items() if not h and s > best]
        if not broke:
            break
        holds(math.sqrt(best * min(broke)))
    best = max(s for s, h in held.items() if h)
    # bounded: a rate above the result broke, so the result is a capacity, not a lower bound
    return {"capacity_rps": best * requests.base_rps, "replays": trace,
            "bounded": any(not h and s > best for s, h in held.items())}


def workload_names(text: str) -> list[str]:
    """``--workloads``: comma-separated workload presets or trace files."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in PRESETS and not Path(n).is_file()]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(map(repr, bad)) or 'nothing'}: not a workload preset "
                                         f"({', '.join(PRESETS)}) or a trace file")
    return names


def run_workload(workload: str, problem: Problem, args, runtime, console: Console) -> dict:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    started = time.perf_counter()
    result = solve(problem, n_trials=args.trials, validate=args.validate, seed=args.seed, runtime=runtime,
                   storage=optuna.storages.InMemoryStorage())
    search_s = time.perf_counter() - started
    row: dict = {"workload": workload, "search_capped": args.search_capped, "kv_memory": problem.kv_memory,
                 "slo": args.slo, "quality": args.quality, "trials": args.trials, "search_s": round(search_s, 1),
                 "feasible": result.feasible}
    base = result.baseline
    row["baseline"] = {"capacity_rps": base.values[0], "memory_bound": memory_bound(base.figures),
                       "kv_fill": base.figures["kv_peak_bytes"] / max(base.figures.get("kv_capacity_bytes") or 1, 1),
                       "preemptions": base.figures["preemptions"]}
    if not result.feasible:
        console.print(f"{workload}: no config met every constraint", style="yellow")
        return row
    tuned = result.best[0]
    names = [q.name for q in problem.space.params if not q.is_switch]
    row["tuned"] = {"capacity_rps": tuned.values[0], "config": tuned.config.to_dict(),
                    "is_baseline": tuned.config == problem.base, "changed": _diff(tuned.config, problem.base, names),
                    "quality_loss": tuned.figures.get("quality_loss"), "quality_bound": tuned.figures.get("quality_bound")}
    row["predicted_gain"] = ratio(tuned.values[0], base.values[0])
    # the slice predicted (seconds), then measured: a slice too short to fill the baseline's pool is no
    # longer memory-bound, which its row says
    requests = validation_requests(problem, args.slice, args.max_input, args.max_output)
    slice_tuned = score(problem, tuned.config, requests)
    slice_base = score(problem, problem.base, requests)
    p_tuned, p_base = slice_tuned.values[0], slice_base.values[0]
    row["slice"] = {"requests": len(requests.requests), "max_input": args.max_input, "max_output": args.max_output,
                    "predicted": {"tuned_rps": p_tuned, "baseline_rps": p_base, "gain": ratio(p_tuned, p_base),
                                  "baseline_memory_bound": memory_bound(slice_base.figures)}}
    if args.measure:
        start = slice_tuned.rate_scale or 1.0
        m_tuned = measured_capacity(problem, runtime, tuned.config, requests, start, midpoints=args.midpoints)
        m_base = m_tuned if tuned.config == problem.base else \
            measured_capacity(problem, runtime, problem.base, requests, start, midpoints=args.midpoints)
        row["slice"]["measured"] = {"tuned_rps": m_tuned["capacity_rps"], "baseline_rps": m_base["capacity_rps"],
                                    "gain": ratio(m_tuned["capacity_rps"], m_base["capacity_rps"]),
                                    "tuned_replays": m_tuned["replays"], "baseline_replays": m_base["replays"],
                                    "bounded": m_tuned["bounded"] and m_base["bounded"],
                                    "resolution": 2 ** (1 / 2 ** args.midpoints)}
    return row


def fmt(x, digits=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{digits}g}"


def report(rows: list[dict], console: Console) -> None:
    t = Table(title="Capacity under the SLOs: tuned vs baseline (vLLM defaults)", title_justify="left")
    for c in ("workload", "baseline memory-bound", "predicted (req/s)\ntuned / base", "gain",
              "slice predicted (req/s)\ntuned / base", "gain", "slice measured (req/s)\ntuned / base",
              "measured gain\n(± resolution)", "knobs changed"):
        t.add_column(c, justify="left" if c in ("workload", "knobs changed") else "right")
    for r in rows:
        b = r["baseline"]
        if not r["feasible"]:
            t.add_row(r["workload"], "yes" if b["memory_bound"] else "no", "infeasible", *["-"] * 6)
            continue
        s = r["slice"]
        p, m = s["predicted"], s.get("measured", {})
        knobs = "none (the baseline)" if r["tuned"]["is_baseline"] else r["tuned"]["changed"]
        name = r["workload"] + (f" ({r['kv_memory'] / 2**20:g} MiB of KV)" if r.get("kv_memory") else "")
        t.add_row(name, f"{'yes' if b['memory_bound'] else 'no'} (KV {b['kv_fill']:.0%})",
                  f"{fmt(r['tuned']['capacity_rps'])} / {fmt(b['capacity_rps'])}", f"x{fmt(r['predicted_gain'])}",
                  f"{fmt(p['tuned_rps'])} / {fmt(p['baseline_rps'])} "
                  f"({s['requests']} req., base {'' if p['baseline_memory_bound'] else 'not '}memory-bound)",
                  f"x{fmt(p['gain'])}",
                  f"{fmt(m.get('tuned_rps'))} / {fmt(m.get('baseline_rps'))}" if m else "-",
                  f"x{fmt(m.get('gain'))} (±x{m['resolution']:.3g})" if m else "-", knobs)
    console.print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--workloads", type=workload_names, default="chat,long-context,agent",
                    help="comma-separated workload presets or trace files")
    ap.add_argument("--slo", default="p99=200ms")
    ap.add_argument("--quality", default="ppl+1%", help="quality floor (eviction and KV bits are searched under it)")
    ap.add_argument("--trials", type=positive_int, default=40)
    ap.add_argument("--validate", type=nonnegative_int, default=3, help="the optimizer's own validation (top configs)")
    ap.add_argument("--profile", type=hardware_profile, default=None,
                    help="hardware profile JSON (default: this machine's quick profile)")
    ap.add_argument("--kv-memory", default=None, help="memory KV may use (e.g. 256MiB; default the device's own, "
                    "4 GiB on a CPU): a small one makes the workloads memory-bound")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--measure", type=int, choices=(0, 1), default=1,
                    help="1: measure capacity on the runtime; 0: predicted only")
    ap.add_argument("--slice", type=positive_int, default=12, help="requests replayed per measurement")
    ap.add_argument("--max-input", type=positive_int, default=512)
    ap.add_argument("--max-output", type=positive_int, default=32)
    ap.add_argument("--midpoints", type=positive_int, default=1,
                    help="geometric midpoints tried after doubling/halving: the measured capacity is resolved to "
                         "2**(1/2**N) (1: sqrt(2); 2: 1.19)")
    ap.add_argument("--search-capped", action="store_true",
                    help="search on the preset with the slice's caps too (--max-input, --max-output), so that the "
                         "config measured was tuned for the requests it replays")
    add_json(ap)
    args = ap.parse_args()

    console = table_console(stderr=args.json)  # (with --json the table goes to stderr: stdout ends in the JSON)

    def profile() -> str:
        """--profile, or this machine's quick profile: called by build_problem once every other input passed."""
        if args.profile is None:
            from skistune.profile import cached_profile_path, default_profile, machine_fingerprint
            with console.status("this machine's quick profile (measured once, then cached)"):
                default_profile("smollm2-135m", "cpu")
            args.profile = str(cached_profile_path("smollm2-135m", "cpu", machine_fingerprint("cpu")))
        return args.profile

    problems = {}
    for workload in args.workloads:  # every input checked before the first search: a bad one is one error line
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a profile from another machine warns; its name is in the output
                searched = workload
                if args.search_capped:
                    searched = load_workload(workload, requests=DEFAULT_REQUESTS if workload in PRESETS else None,
                                             max_input=args.max_input, max_output=args.max_output)
                problems[workload] = build_problem(searched, slo=args.slo, quality=args.quality, profile=profile,
                                                   kv_memory=args.kv_memory)
        except (ValueError, OSError) as exc:
            fail(f"{workload}: {exc}")
    started = time.perf_counter()
    runtime = None
    if args.validate or args.measure:
        with console.status("loading SmolLM2-135M"):
            runtime = load_runtime(next(iter(problems.values())))
    rows = []
    for workload, problem in problems.items():
        with console.status(f"{workload}: searching, validating, measuring"):
            rows.append(run_workload(workload, problem, args, runtime, console))
    report(rows, console)
    wall = time.perf_counter() - started
    console.print(f"profile: {args.profile}; {args.trials} trials per workload; wall {wall:.0f} s")
    if args.json:
        print_json({"benchmark": "tuned_vs_default", "rows": rows, "profile": args.profile, "wall_s": round(wall, 1),
                    "skistune": version("skistune")})


if __name__ == "__main__":
    main()
