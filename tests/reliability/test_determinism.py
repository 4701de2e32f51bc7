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
