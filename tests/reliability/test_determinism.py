"""Same seed, workload and profile give the same best config: `skistune optimize` run twice as separate
processes, with different Python hash seeds (set and dict order must not leak into the search), writes
the same tuned knobs after the same sequence of trials. (test_optimize_api covers one process.)"""
import json
import subprocess

import optuna
import pytest
from reliability_helpers import PROFILE, SLO, skistune_cmd, subprocess_env

from skistune.config import load_config
from skistune.optimize import open_storage


@pytest.mark.slow
def test_same_seed_workload_and_profile_give_the_same_best_config(tmp_path):
    procs = []
    for hash_seed in ("1", "2"):
        out = tmp_path / f"tuned-{hash_seed}.yaml"
        cmd = skistune_cmd("optimize", "--slo", SLO, "--requests", "16", "--trials", "6", "--seed", "7",
                           "--validate", "0", "--profile", str(PROFILE), "--storage",
                           f"sqlite:///{tmp_path / f'run-{hash_seed}.db'}", "--study", "same", "--out", str(out),
                           "--json")
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**subprocess_env(), "PYTHONHASHSEED": hash_seed}))
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    a, b = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert a["best"]["config"] == b["best"]["config"] and a["best"]["values"] == b["best"]["values"]
    tuned = [load_config(str(tmp_path / f"tuned-{s}.yaml")).to_dict() for s in ("1", "2")]
    assert tuned[0] == tuned[1] == a["best"]["config"]
    searched = [[t.params for t in optuna.load_study(study_name="same", storage=open_storage(
        f"sqlite:///{tmp_path / f'run-{s}.db'}")).get_trials()] for s in ("1", "2")]
    assert searched[0] == searched[1]


def test_a_study_searched_in_two_runs_does_not_claim_its_seed_reproduces_it(tmp_path, profile):
    """Each run seeds its sampler anew: 10 trials then 10 more sample otherwise than 20 in one run, and a tester's
    two-run study (seed 5, trials 20, reproducible_from_seed: true) found another winner than one run of 20."""
    import skistune.optimize as opt
    from skistune.workloads import load_workload

    url = f"sqlite:///{tmp_path / 's.db'}"
    problem = opt.build_problem(load_workload("chat", requests=12, seed=0), slo="p99=200ms", profile=profile)
    first = opt.provenance(opt.solve(problem, n_trials=2, storage=url, study_name="two", validate=0, seed=5))
    assert first["search"]["reproducible_from_seed"] is True
    second = opt.provenance(opt.solve(problem, n_trials=2, storage=url, study_name="two", validate=0, seed=5))
    assert second["search"]["reproducible_from_seed"] is False
    assert second["search"]["not_reproducible"].startswith("the study was searched in more than one run (")
    assert "the seed reproduces it only as the same runs in turn" in second["search"]["not_reproducible"]
