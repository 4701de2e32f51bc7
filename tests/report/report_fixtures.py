"""A small study for the report tests (4 trials of 16 chat requests: a few seconds), and validation records
shaped like `validation.validation_record`'s, made from simulated replays instead of the slow real model."""
from __future__ import annotations

import warnings
from pathlib import Path

import skistune
from skistune.scoring import score, score_at
from skistune.validation import validation_requests
from skistune.profile import load_profile
from skistune.workloads import load_workload

SHIPPED_PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json"
LATENCY_KEYS = ("ttft_p99_s", "tbt_p99_s", "e2e_p99_s", "tpot_p99_s")


def shipped_profile():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_profile(SHIPPED_PROFILE)


def make_study(folder: Path, name: str = "t", n_trials: int = 4, workload_seed: int = 0, **options):
    """`skistune.optimize` without validation into ``folder/s.db``, on 16 chat requests drawn with
    ``workload_seed``; returns (result, storage URL)."""
    storage = f"sqlite:///{folder / 's.db'}"
    options = {"slo": "p99=200ms", **options}
    result = skistune.optimize(load_workload("chat", requests=16, seed=workload_seed), n_trials=n_trials, validate=0,
                               profile=shipped_profile(), storage=storage, study_name=name, **options)
    return result, storage


def _record(role: str, predicted, slowdown: float) -> dict:
    """A validation record whose "measured" latencies are the predicted ones times ``slowdown``."""
    measured = {**predicted.figures, **{k: predicted.figures[k] * slowdown for k in LATENCY_KEYS}}
    return {"role": role, "config": predicted.config.to_dict(), "rate_rps": predicted.figures["rate_rps"],
            "holds": role == "candidate", "binding": [] if role == "candidate" else ["tbt:p99<=200ms"],
            "wall_s": 1.0, "predicted": dict(predicted.figures), "measured": measured}


def fake_validation(problem, config) -> list[dict]:
    """``config`` and the baseline on the validation slice, at ``config``'s capacity there."""
    requests = validation_requests(problem)
    candidate = score(problem, config, requests)
    baseline = score_at(problem, problem.base, requests, candidate.rate_scale)
    return [_record("candidate", candidate, 1.1), _record("baseline", baseline, 1.3)]
