"""A worker killed with SIGKILL in the middle of a trial, then the study resumed by another worker: every
finished trial is still there unchanged, the killed trial is marked FAIL (its heartbeat stopped) and
retried once with the same params, and the study ends with every requested trial complete.

The same holds for the default storage, a local SQLite file: skistune opens it through the same Optuna
RDB storage, heartbeat and retry included (parametrized below)."""
import warnings

import optuna
import pytest
from reliability_helpers import (
    COMPLETE,
    RUNNING,
    create_study,
    finished,
    kill_mid_trial,
    resume_after_kill,
    stored_trials,
)

from skistune.optimize import finish

FAIL = optuna.trial.TrialState.FAIL
REQUESTS = 48  # about 0.4 s a trial here: a kill right after a trial starts lands inside it
RESUMED = 2


def retried_from(trials, number: int) -> list:
    """The trials that retry trial ``number`` (the storage's heartbeat callback queued them)."""
    callback = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None) or \
        optuna.storages.RetryFailedTrialCallback
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return [t for t in trials if callback.retried_trial_number(t) == number]


@pytest.fixture(params=["sqlite", "postgresql"])
def storage_url(request, tmp_path):
    return f"sqlite:///{tmp_path / 'crash.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")


@pytest.mark.slow
def test_sigkill_mid_trial_then_resume_loses_nothing(storage_url, profile):
    create_study(storage_url, "crash", profile, requests=REQUESTS)
    at_kill = kill_mid_trial(storage_url, "crash")
    in_flight = [t for t in at_kill if t.state == RUNNING]
    assert len(in_flight) == 1, [t.state for t in at_kill]
    killed, kept = in_flight[0], finished(at_kill)

    run = resume_after_kill(storage_url, "crash", RESUMED)
    trials = stored_trials(storage_url, "crash")
    after = finished(trials)
    assert {n: after[n] for n in kept} == kept  # every finished trial still there, unchanged
    assert trials[killed.number].state == FAIL  # the in-flight one: failed by the heartbeat check ...
    retried = retried_from(trials, killed.number)
    assert len(retried) == 1 and retried[0].state == COMPLETE  # ... and run again, once
    assert retried[0].params.items() >= killed.params.items()
    assert run.finished == RESUMED and len(after) == len(kept) + RESUMED  # the result is complete
    assert not [t for t in trials if t.state not in (COMPLETE, FAIL)]
    final = finish(run.job.problem, run.job.study, top_k=0)
    assert final["best"] and final["trials"] == len(after)
