"""Sampler settings side by side on the search-efficiency scenarios: trials each setting takes to get within
0.99 of a scenario's exhaustive optimum, over many seeds, through the optimizer's own trial path (the baseline
enqueued first, the per-layer bits solver) with only `make_sampler` swapped. It reads the tables that
`benchmarks/search_efficiency.py` scored and cached (the same code and profile), scoring any missing first.

    python benchmarks/sampler_variants.py [--seeds 20] [--scenarios NAME ...] [--variants NAME ...] [--code DIGEST]
                                          [--json]
"""
from __future__ import annotations

import argparse
import functools
import math
import statistics
import time

import search_efficiency as se
from bench_args import add_json, console as table_console, description, nonempty, positive_int, print_json

BUDGET = 200


VARIANTS = {  # name: (TPE settings, local-move settings) over `make_sampler`'s own
    "current": ({}, {}),  # skistune.search.make_sampler as it is
    "tpe-only": ({}, {"share": 0.0}),  # no local moves (skistune's sampler before they existed)
    "local15": ({}, {"share": 0.15}),
    "local50": ({}, {"share": 0.5}),
    "local-one-knob": ({}, {"two_knob_share": 0.0}),
    "independent": ({"multivariate": False, "group": False}, {"share": 0.0}),
    "ei96": ({"n_ei_candidates": 96}, {"share": 0.0}),
    "startup5": ({"n_startup_trials": 5}, {"share": 0.0}),
    "startup20": ({"n_startup_trials": 20}, {"share": 0.0}),
    # deprecated in Optuna 4.9, removed in 6.0: a measurement, not a setting to ship
    "prior2": ({"prior_weight": 2.0}, {"share": 0.0}),
    # Optuna's GP sampler (`skistune optimize --sampler gp`), alone: the issue asks where it helps
    "gp": "gp",
}


def _named(make_sampler, name: str, _asked: str, **options):
    return make_sampler(name, **options)


def sampler_for(variant: str):
    """`make_sampler` with the variant's settings."""
    import skistune.search as search

    if VARIANTS[variant] == "gp":
        return functools.partial(_named, search.make_sampler, "gp")
    tpe, local = VARIANTS[variant]
    return functools.partial(search.make_sampler, tpe_options=tpe, local_options=local)


def main() -> None:
    import optuna
    from rich.progress import Progress

    import skistune.search as search

    ap = argparse.ArgumentParser(description=description(__doc__))
    names = [s.name for s in se.SCENARIOS]
    ap.add_argument("--seeds", type=positive_int, default=20)
    ap.add_argument("--scenarios", nargs="+", default=names, choices=names, metavar="NAME",
                    help="scenarios (default all): " + ", ".join(names))
    ap.add_argument("--variants", nargs="+", default=["current", "tpe-only"], choices=list(VARIANTS), metavar="NAME",
                    help="sampler settings (default current, tpe-only): " + ", ".join(VARIANTS))
    ap.add_argument("--code", metavar="DIGEST", type=nonempty,
                    help="read the tables cached for this skistune source digest (the `code` that "
                         "search_efficiency.py --json prints) instead of this source's: every variant is compared on "
                         "one table, and a source edited since need not be scored again")
    add_json(ap)
    args = ap.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    console = table_console()
    code = args.code or se.code_digest()
    scenarios = [s for s in se.SCENARIOS if s.name in args.scenarios]
    if args.code:
        se.check_cached(code, scenarios, se.DEFAULT_CACHE)
    real = search.make_sampler
    rows = []
    for scenario in scenarios:
        problem = scenario.problem()
        maximize = problem.objectives[0].maximize
        cache = se.cache_path(scenario, problem, code, se.DEFAULT_CACHE)
        with Progress(console=console, transient=True) as progress:
            table = se.exhaustive(scenario, problem, cache, 2, progress)
        optimum, _ = table.optimum(maximize)
        share = math.ceil(se.GRID_SHARE * len(table.rows))
        for variant in args.variants:
            search.make_sampler = sampler_for(variant)
            started, to_goal = time.perf_counter(), []
            try:
                for seed in range(args.seeds):
                    trials, _ = se.run_search("skistune", problem, table, seed, BUDGET, se.SearchStats())
                    to_goal.append(se.trials_to_goal(trials, optimum, maximize))
            finally:
                search.make_sampler = real
            reached = [n for n in to_goal if n is not None]
            row = {"scenario": scenario.name, "variant": variant, "seeds": args.seeds, "trials_to_goal": to_goal,
                   "median": statistics.median(reached) if reached else None, "max": max(reached, default=None),
                   "not_reached": to_goal.count(None), "grid_share_trials": share,
                   "over_grid_share": sum(n is None or n > share for n in to_goal),
                   "seconds": time.perf_counter() - started}
            rows.append(row)
            console.print(f"{scenario.name:<20} {variant:<12} median {row['median']!s:>5}  max {row['max']!s:>4}  "
                          f"not within {BUDGET}: {row['not_reached']:>2}/{args.seeds}  over 2% of the grid "
                          f"({share} trials): {row['over_grid_share']:>2}/{args.seeds}", highlight=False)
    if args.json:
        print_json({"benchmark": "sampler_variants", "budget": BUDGET, "code": code, "rows": rows})


if __name__ == "__main__":
    main()
