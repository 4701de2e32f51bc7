"""Where the wall time of the default `skistune optimize --slo p99=200ms` goes: the same call through the
Python API, each phase timed by wrapping it (building the problem, the search, the refine, the validation
and its real replays, the model's load in the background), then each validated replay's wall time.
The study is stored as the default stores it (a SQLite file), in a temporary folder removed at the end.
    python benchmarks/optimize_phases.py [--slo p99=200ms] [--json]
"""
from __future__ import annotations

import argparse
import functools
import importlib
import tempfile
import time
from pathlib import Path

from bench_args import add_json, description, fail, print_json, slo_text

# each phase: the function timed, and the module whose calls of it are timed (a module calls what it imported)
PHASES = {"build_problem": "skistune.optimize", "_run_sequential": "skistune.optimize", "_refine": "skistune.optimize",
          "validate": "skistune.optimize", "_measure": "skistune.validation", "load_runtime": "skistune.validation"}


def replay_rows(validated) -> list[dict]:
    """Each validation's replay: its role, wall time and verdict, and whether it is a candidate's replay reused
    (`skistune.validation.validate` returns the baseline as a copy of its candidate's validation when the baseline
    was among the candidates at the winner's rate: the same replay, not a third one)."""
    rows = []
    for v in validated:
        source = None
        if v.role == "baseline":
            source = next((i for i, c in enumerate(validated, start=1) if c.role == "candidate"
                           and c.config == v.config and c.wall_s == v.wall_s), None)
        rows.append({"role": v.role, "wall_s": v.wall_s, "holds": v.holds, "reused_from_candidate": source})
    return rows


def replay_line(row: dict) -> str:
    verdict = "holds" if row["holds"] else "breaks"
    if row["reused_from_candidate"] is not None:
        return (f"  replay ({row['role']}): candidate {row['reused_from_candidate']}'s replay reused "
                f"({row['wall_s']:.1f} s, not replayed again), {verdict}")
    return f"  replay ({row['role']}): {row['wall_s']:.1f} s, {verdict}"


def main() -> None:
    ap = argparse.ArgumentParser(description=description(__doc__))
    ap.add_argument("--slo", type=slo_text, default="p99=200ms")
    add_json(ap)
    args = ap.parse_args()
    started = time.perf_counter()
    import skistune.optimize as opt

    spent: dict[str, float] = {}

    def timed(name: str, module) -> None:
        inner = getattr(module, name)

        @functools.wraps(inner)
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        setattr(module, name, wrapper)

    for name, module in PHASES.items():
        timed(name, importlib.import_module(module))
    # the default storage is a SQLite file in the working folder: the same kind of file, in a folder of its own
    # (the run had left skistune-phases-<n>.db behind)
    with tempfile.TemporaryDirectory(prefix="skistune-phases-") as tmp:
        storage = f"sqlite:///{Path(tmp) / 'study.db'}"
        try:
            result = opt.optimize(slo=[args.slo], storage=storage, study_name=f"phases-{time.time():.0f}")
        except opt.UnmeetableSLO as exc:  # (no config can meet it on this profile: nothing to time)
            fail(f"--slo {args.slo}: {exc}")
    total = time.perf_counter() - started
    replays = replay_rows(result.validated)
    print(f"total {total:.1f} s (imports included)")
    labels = {"build_problem": "build the problem (profile, workload)", "_run_sequential": "search",
              "_refine": "refine the top configs", "validate": "validation", "_measure": "... its real replays",
              "load_runtime": "model load (in the background, during the search)"}
    for name in PHASES:
        print(f"  {labels[name]:<52} {spent.get(name, 0.0):6.1f} s")
    for r in replays:
        print(replay_line(r))
    if replays and not any(r["role"] == "baseline" for r in replays):
        print("  replay (baseline): none (the simulator predicts it the winner's schedule of the slice)")
    if args.json:
        print_json({"benchmark": "optimize_phases", "slo": args.slo, "total_s": total,
                    "phases_s": {labels[n]: spent.get(n, 0.0) for n in PHASES}, "replays": replays})


if __name__ == "__main__":
    main()
