"""Reliability figures: workers sharing one PostgreSQL study, trials lost when a worker is killed mid-trial
(PostgreSQL and the default SQLite file), the bad-input corpus, and requests lost under 3x KV overload
(recompute preemption; swap + host + disk tiers, with and without prefetch, a disk block corrupted on
purpose). The checks are the reliability suite's own (tests/reliability), run once and counted.

    python benchmarks/reliability.py [--json]

Needs the test extras and PostgreSQL (initdb, pg_ctl; psycopg2 from the postgres extra); without a
server the PostgreSQL figures say why they were not measured.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "reliability"))  # the suite's helpers: one definition of each check

import optuna
from bench_args import add_json, description, print_json
from bad_inputs import CASES, prepare, run_case
from overload import runtime_overload, simulator_overload, tiered_overload
from pg_server import PostgresServer, unavailable_reason
from reliability_helpers import (COMPLETE, PROFILE, RUNNING, SLO, create_study, finished, kill_mid_trial,
                                 resume_after_kill, run_workers, stored_trials)

WORKERS, PER_WORKER = 4, 4


def workers_figures(url: str, folder: Path, profile) -> dict:
    """4 worker processes on one study: trials requested, complete, lost, run twice; best vs a serial run."""
    import skistune
    from skistune.optimize import finish
    from skistune.study_storage import open_storage
    from skistune.workloads import load_workload

    created = create_study(url, "fleet", profile)
    run_workers(url, "fleet", WORKERS, PER_WORKER)
    trials = stored_trials(url, "fleet")
    requested = 1 + WORKERS * PER_WORKER
    complete = [t for t in trials if t.state == COMPLETE]
    serial = skistune.optimize(load_workload("chat", requests=16), slo=SLO, profile=profile, seed=0,
                               storage=f"sqlite:///{folder / 'serial.db'}", study_name="serial",
                               n_trials=requested, validate=0)
    fleet = finish(created.problem, optuna.load_study(study_name="fleet", storage=open_storage(url)), top_k=0)
    best, serial_best = fleet["best"][0].values[0], serial.best[0].values[0]
    return {"workers": WORKERS, "trials_requested": requested, "trials_complete": len(complete),
            "trials_lost": requested - len(complete),
            "trial_numbers_twice": len(trials) - len({t.number for t in trials}),
            "params_twice": len(trials) - len({json.dumps(t.params, sort_keys=True) for t in trials}),
            "best_capacity_rps": best, "serial_best_capacity_rps": serial_best,
            "best_vs_serial": best / serial_best - 1}


def crash_figures(url: str, profile) -> dict:
    """A worker SIGKILLed mid-trial, then another worker resumes: finished trials lost, the killed trial's
    fate, whether the study is complete."""
    create_study(url, "crash", profile, requests=48)
    at_kill = kill_mid_trial(url, "crash")
    kept = finished(at_kill)
    in_flight = [t.number for t in at_kill if t.state == RUNNING]
    run = resume_after_kill(url, "crash", 2)
    trials = stored_trials(url, "crash")
    after = finished(trials)
    return {"finished_before_kill": len(kept), "trials_lost": sum(after.get(n) != v for n, v in kept.items()),
            "in_flight": len(in_flight),
            "in_flight_state": [trials[n].state.name for n in in_flight],
            "retried_complete": sum(t.state == COMPLETE and t.system_attrs.get("failed_trial") in in_flight
                                    for t in trials),
            "complete_after_resume": len(after), "expected_after_resume": len(kept) + run.finished}


def bad_input_figures(folder: Path, profile) -> dict:
    paths = prepare(folder, profile)
    outcomes = [run_case(case, paths) for case in CASES]
    return {"tried": len(outcomes), "handled": sum(o.handled for o in outcomes),
            "kinds": sorted({c.kind for c in CASES}),
            "not_handled": [{"input": o.case.name, "exit_code": o.exit_code, "stderr": list(o.stderr_lines)}
                            for o in outcomes if not o.handled]}


def postgres_figures(folder: Path, profile) -> dict:
    reason = unavailable_reason()
    if reason is not None:
        return {"not_measured": reason}
    server = PostgresServer().start()
    try:
        return {"workers": workers_figures(server.database(), folder, profile),
                "crash": crash_figures(server.database(), profile)}
    finally:
        server.stop()


def tier_rows(name: str, t: dict) -> list[tuple]:
    """The rows of one tiered overload run (`overload.tiered_overload`)."""
    moved = ", ".join(f"{link} {n}" for link, n in t["blocks_moved_by_link"].items())
    return [(f"requests lost at 3x KV overload: runtime, {name}", f"{t['lost']} of {t['requests']}", "0"),
            (f"  {name}: runtime error", t["error"] or "none", "none"),
            (f"  {name}: requests completed, tokens as without pressure",
             f"{t['finished']}, {'yes' if t['tokens_as_without_pressure'] else 'no'}", f"{t['requests']}, yes"),
            (f"  {name}: sequences swapped out / in (fallbacks to recompute)",
             f"{t['swapped_out']} / {t['swapped_in']} ({t['swap_fallbacks']})", "-"),
            (f"  {name}: blocks offloaded / promoted / prefetched",
             f"{t['blocks_offloaded']} / {t['blocks_promoted']} / {t['blocks_prefetched']}", "-"),
            (f"  {name}: blocks moved", f"{t['blocks_moved']} ({moved})", "-"),
            (f"  {name}: corrupted disk block detected (of corrupted)",
             f"{int(t['corrupted_block_detected'])} of {t['disk_blocks_corrupted']}", "all"),
            (f"  {name}: checksum failures of blocks not corrupted", t["checksum_failures_not_corrupted"], "0"),
            (f"  {name}: block accounting balanced", "yes" if t["blocks_balanced"] else "no", "yes")]


def table(f: dict) -> str:
    pg, sq, bad, rt, sim = f["postgres"], f["crash_sqlite"], f["bad_inputs"], f["overload_runtime"], f["overload_sim"]
    w, c = pg.get("workers", {}), pg.get("crash", {})
    rows = [("workers run on one PostgreSQL study", w.get("workers", "-"), "-"),
            ("trials lost, 4 workers (of requested)",
             f"{w.get('trials_lost', '-')} of {w.get('trials_requested', '-')}", "0"),
            ("best vs serial run (capacity)", f"{w['best_vs_serial']:+.1%}" if w else "-", "within 2%"),
            ("finished trials lost, worker SIGKILLed (PostgreSQL)", c.get("trials_lost", "-"), "0"),
            ("finished trials lost, worker SIGKILLed (SQLite)", sq["trials_lost"], "0"),
            ("bad inputs handled (of tried)", f"{bad['handled']} of {bad['tried']}", "all"),
            ("requests lost at 3x KV overload: runtime, recompute", f"{rt['lost']} of {rt['requests']}", "0"),
            *tier_rows("swap + host + disk + prefetch", f["overload_runtime_tiers"]),
            *tier_rows("swap + host + disk, no prefetch", f["overload_runtime_tiers_no_prefetch"]),
            ("requests lost at 3x KV overload: simulator", f"{sim['lost']} of {sim['requests']}", "0")]
    return "\n".join(["| figure | value | goal |", "|---|---:|---:|"] + [f"| {a} | {b} | {g} |" for a, b, g in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=description(__doc__))
    add_json(parser)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the shipped profile's fingerprint note
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    from skistune.profile import load_profile

    profile = load_profile(PROFILE)
    with tempfile.TemporaryDirectory(prefix="skistune-reliability-") as tmp:
        folder = Path(tmp)
        figures = {"postgres": postgres_figures(folder, profile),
                   "crash_sqlite": crash_figures(f"sqlite:///{folder / 'crash.db'}", profile),
                   "bad_inputs": bad_input_figures(folder / "bad", profile),
                   "overload_runtime": runtime_overload(), "overload_runtime_tiers": tiered_overload(),
                   "overload_runtime_tiers_no_prefetch": tiered_overload(prefetch=False),
                   "overload_sim": simulator_overload(profile)}
    print(table(figures))
    if args.json:
        print_json({"benchmark": "reliability", **figures})


if __name__ == "__main__":
    main()
