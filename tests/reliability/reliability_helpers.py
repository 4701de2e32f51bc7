"""Helpers shared by the reliability tests and benchmarks/reliability.py: the CLI as separate processes
(workers as on other machines), a small study, a worker killed mid-trial and the study resumed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import optuna

import skistune
import skistune.optimize as opt
import skistune.study_recipe as study_recipe
import skistune.study_storage as study_storage
from skistune.workloads import load_workload

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "profiles" / "cpu-smollm2-135m.json"
SLO = "p99=200ms"
COMPLETE, RUNNING = optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING


def skistune_cmd(*args: str) -> list[str]:
    """The CLI as a separate process (what a worker on another machine runs)."""
    return [sys.executable, "-m", "skistune", *args]


def subprocess_env() -> dict[str, str]:
    """No colours or animation from rich; the repository importable even without an install."""
    env = {**os.environ, "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "200"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def create_study(url: str, name: str, profile, *, requests: int = 16, n_trials: int = 1, seed: int = 0):
    """What `skistune optimize --storage URL --study NAME` does first: create the study (its recipe
    included) and run its first trials (the baseline first), without validation on the real model."""
    return skistune.optimize(load_workload("chat", requests=requests), slo=SLO, profile=profile, storage=url,
                             study_name=name, n_trials=n_trials, validate=0, seed=seed)


def stored_trials(url: str, name: str) -> list[optuna.trial.FrozenTrial]:
    """Every trial of the study, read through skistune's own storage (PostgreSQL driver resolved)."""
    return optuna.load_study(study_name=name, storage=opt.open_storage(url)).get_trials(deepcopy=False)


def finished(trials) -> dict[int, tuple]:
    """COMPLETE trials by number: what must never change once written."""
    return {t.number: (t.params, t.values, t.user_attrs.get("figures")) for t in trials if t.state == COMPLETE}


def wait_for(predicate, timeout_s: float, every_s: float = 0.02):
    """Poll until ``predicate()`` returns something truthy (returned); TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise TimeoutError(f"nothing after {timeout_s} s waiting for {getattr(predicate, '__name__', 'a condition')}")


def run_workers(url: str, study: str, workers: int, trials: int) -> list[dict]:
    """``workers`` `skistune worker` processes started together, ``trials`` each; their JSON reports."""
    procs = [subprocess.Popen(skistune_cmd("worker", "--storage", url, "--study", study, "--trials", str(trials),
                                           "--json"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
             for _ in range(workers)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"a worker exited with {p.returncode}: {err.strip()[-2000:]}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def kill_mid_trial(url: str, study_name: str, after: int = 3) -> list[optuna.trial.FrozenTrial]:
    """Start a worker and SIGKILL it just after a trial starts (once ``after`` of its trials finished);
    the trials as they were at the kill."""
    study = optuna.load_study(study_name=study_name, storage=opt.open_storage(url))  # one connection to poll
    proc = subprocess.Popen(skistune_cmd("worker", "--storage", url, "--study", study_name, "--trials", "100",
                                         "--seed", "1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=subprocess_env())
    try:
        def just_started():
            trials = study.get_trials(deepcopy=False)
            done = sum(t.state == COMPLETE and t.user_attrs.get("worker", {}).get("pid") == proc.pid
                       for t in trials)  # (the worker's own: not the creator's baseline)
            return done >= after and [t for t in trials if t.state == RUNNING and t.params
                                      and (datetime.now() - t.datetime_start).total_seconds() < 0.15]

        wait_for(just_started, timeout_s=300, every_s=0.05)  # generous: a loaded 2-core machine starts workers slowly
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()  # only when waiting failed: the test fails anyway, no orphan worker left behind
        proc.wait(timeout=30)
    if proc.returncode != -signal.SIGKILL:
        raise RuntimeError(f"the worker ended by itself (exit code {proc.returncode}) before it was killed")
    return stored_trials(url, study_name)


def resume_after_kill(url: str, study_name: str, n_trials: int, heartbeat_s: int = 1) -> study_recipe.WorkerRun:
    """Another worker on the study once the dead worker's trial is stale. The product's heartbeat is
    `HEARTBEAT_S` (5 s; stale after 4 beats); the resuming worker here beats every ``heartbeat_s`` so that
    the dead trial is stale after 4 x ``heartbeat_s`` instead of 20 s. SQLite's clock (``CURRENT_TIMESTAMP``)
    has whole seconds: a beat at 3.0 s and a check at 7.9 s read 3 and 7, not yet past a 4 s grace, so the
    wait is a second longer than the grace (0.3 s more failed on a host where trials ran fast)."""
    product = study_storage.HEARTBEAT_S
    study_storage.HEARTBEAT_S = heartbeat_s
    try:
        time.sleep(4 * heartbeat_s + 1.3)
        return study_recipe.run_worker(study_recipe.join_study(url, study_name, seed=2), n_trials=n_trials)
    finally:
        study_storage.HEARTBEAT_S = product


def running_server(name: str, unavailable: str | None, make):
    """A fixture's body for a database server: ``make()``'s server started, stopped and removed afterwards. Where
    it cannot run (``unavailable``: why), the test fails with the reason and the install step (.ci/run's): a skip
    would prove nothing, and CI must never pass a storage it did not test."""
    import pytest

    if unavailable is not None:
        pytest.fail(f"{name} tests cannot run: {unavailable} (.ci/run installs the server and its driver)")
    server = make()
    try:
        yield server.start()
    finally:
        server.stop()
