"""Four `skistune worker` processes on one PostgreSQL study: every requested trial is there once, no trial
ran twice, each worker proposed its own configs, and the best config matches a serial run's."""
import json
import os
from collections import Counter

import optuna
import pytest
from reliability_helpers import COMPLETE, SLO, create_study, run_workers, stored_trials

import skistune
from skistune.optimize import finish, open_storage
from skistune.workloads import load_workload

WORKERS = 4
PER_WORKER = 4


@pytest.mark.slow
def test_four_workers_share_one_postgres_study_and_lose_nothing(pg_url, profile, tmp_path):
    created = create_study(pg_url, "fleet", profile)  # the creator: 1 trial (the baseline)
    reports = run_workers(pg_url, "fleet", WORKERS, PER_WORKER)
    requested = 1 + WORKERS * PER_WORKER

    trials = stored_trials(pg_url, "fleet")
    assert [r["finished"] for r in reports] == [PER_WORKER] * WORKERS
    assert len(trials) == requested and all(t.state == COMPLETE for t in trials)  # none lost, failed or stuck
    assert sorted(t.number for t in trials) == list(range(requested))  # no trial number twice
    assert len({t._trial_id for t in trials}) == requested
    assert sum(t.user_attrs.get("enqueued") == "baseline" for t in trials) == 1  # the queued trial ran once
    tags = [t.user_attrs["worker"] for t in trials]  # every trial records the process that ran it ...
    assert [t.user_attrs.get("enqueued") for t in trials if tags[t.number]["pid"] == os.getpid()] == ["baseline"]
    seeds = Counter(tag["seed"] for tag in tags if tag["pid"] != os.getpid())  # ... the creator (here) ran one
    assert sorted(seeds.values()) == [PER_WORKER] * WORKERS and set(seeds) == {r["seed"] for r in reports}
    # the space has continuous knobs: equal params could only come from two workers sampling in lockstep
    assert len({json.dumps(t.params, sort_keys=True) for t in trials}) == requested

    # the same problem searched by one process with the same number of trials: the simulator is
    # deterministic, but four samplers seeing each other's trials in another order try other configs;
    # each capacity is a search to 2% precision, so two bests of equal merit can differ by more than 2%
    # (2.1% seen once the tiers joined the search): the fleet loses at most 5% against one process. It may
    # find better: with the AVX2 profile the fleet's 17 trials found a config 14% above the serial best.
    serial = skistune.optimize(load_workload("chat", requests=16), slo=SLO, profile=profile, seed=0,
                               storage=f"sqlite:///{tmp_path / 'serial.db'}", study_name="serial",
                               n_trials=requested, validate=0)
    study = optuna.load_study(study_name="fleet", storage=open_storage(pg_url))
    fleet = finish(created.problem, study, top_k=0)
    assert fleet["trials"] == requested and fleet["best"] and serial.feasible
    best, serial_best = fleet["best"][0].values[0], serial.best[0].values[0]
    assert best >= 0.95 * serial_best, (best, serial_best)
