"""Workers that join a study: `skistune worker --storage URL --study NAME` gets nothing but those two. The study
itself holds what its creator used (`problem_recipe`, stored when the study is created), workload and profile
included, so a worker on another machine needs neither file: `join_study` rebuilds the problem, checked against
the study's stored identity like any resume, and `run_worker` runs its trials. `skistune report` rebuilds a
study's problem the same way (`problem_from_recipe`).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from skistune.objectives import NAMED, EnergyBudget, QualityFloor
from skistune.problem import Problem, _check_counts, _constraint_specs, build_problem
from skistune.scoring import Deadline, with_deadline
from skistune.search import (DEFAULT_TRIALS, Progress, _first_new_trial, _optimize, _progress_of, _random_seed,
                             ProblemMismatch, _StopsInsideTrials, _tagged, _trial_function, _worker_tag, make_sampler,
                             open_study)
from skistune.searchspace import SearchSpace
from skistune.slo import SLO
from skistune.study_storage import _existing_sqlite, _pack, _storage_label, _unpack, open_storage, storage_failures

RECIPE_ATTR = "skistune.recipe"
RECIPE_VERSION = 1
_WORKLOAD_ARRAYS = ("arrival_s", "input_tokens", "output_tokens", "block_offsets", "block_ids", "session_ids",
                    "request_ids")


def _workload_record(w) -> dict[str, Any]:
    """The workload's arrays (exact: npz) and metadata; its digest is part of the study's identity."""
    import io

    import numpy as np

    buf = io.BytesIO()
    np.savez(buf, **{name: getattr(w, name) for name in _WORKLOAD_ARRAYS})
    return {"name": w.name, "block_tokens": w.block_tokens, "source": w.source,
            "generated_arrivals": w.generated_arrivals, "transforms": list(w.transforms), "notes": list(w.notes),
            "arrays": _pack(buf.getvalue())}


def _workload_from_record(record: Mapping[str, Any]):
    import io

    import numpy as np

    from skistune.workloads import Workload

    with np.load(io.BytesIO(_unpack(record["arrays"])), allow_pickle=False) as arrays:
        columns = {name: arrays[name] for name in _WORKLOAD_ARRAYS}
    return Workload(name=record["name"], block_tokens=record["block_tokens"], source=record["source"],
                    generated_arrivals=record["generated_arrivals"], transforms=tuple(record["transforms"]),
                    notes=tuple(record["notes"]), **columns)


def _space_text(space: SearchSpace) -> str | None:
    """The YAML the space was parsed from: its file, else the shipped space of its name, whichever parses
    to exactly this space (None when neither does, e.g. a space built in Python)."""
    from skistune.searchspace import _read_space, parse_space

    for spec in (space.source, space.name):
        try:
            text, source = _read_space(spec)
            if parse_space(text, source=source) == space:
                return text
        except ValueError:
            continue
    return None


def problem_recipe(problem: Problem, *, sampler: str, seed: int, n_trials: int = DEFAULT_TRIALS) -> dict[str, Any]:
    """What a worker needs to rebuild ``problem`` (JSON-ready), or ``{"unsupported": why}`` when part of it
    is Python code (a callable objective or constraint, a space built in Python) that no file can carry."""
    energy, floors, custom = _constraint_specs(problem)
    custom += [o.name for o in problem.objectives if NAMED.get(o.name) is not o]
    space_text = _space_text(problem.full_space)
    if custom or space_text is None:
        what = f"Python callables ({', '.join(custom)})" if custom else "a search space built in Python"
        return {"version": RECIPE_VERSION, "unsupported": f"the study's problem uses {what}; run more workers "
                "from Python with skistune.optimize(..., storage=..., study_name=...)"}
    return {"version": RECIPE_VERSION, "model": problem.model, "objective": [o.name for o in problem.objectives],
            "slo": [[s.metric, s.percentile, s.limit_s] for s in problem.slos], "energy": energy,
            "quality": floors, "max_queue_s": problem.max_queue_s, "kv_memory": problem.kv_memory,
            "space": {"source": problem.full_space.source, "yaml": space_text},
            "workload": _workload_record(problem.workload),
            "profile": _pack(json.dumps(problem.profile.to_dict()).encode()),
            "quality_profile": None if problem.quality_profile is None
            else _pack(json.dumps(problem.quality_profile.data).encode()),
            "search": {"sampler": sampler, "seed": seed, "n_trials": n_trials}}


def problem_from_recipe(recipe: Mapping[str, Any]) -> tuple[Problem, dict[str, Any]]:
    """The problem a study's creator stored (`problem_recipe`), and its search settings (sampler, seed,
    n_trials: the creator's, which sizes NSGA-II's population)."""
    if recipe.get("version") != RECIPE_VERSION:
        raise ValueError(f"study recipe version {recipe.get('version')!r}: this skistune reads version "
                         f"{RECIPE_VERSION}; run workers with the skistune version that created the study")
    if "unsupported" in recipe:
        raise ValueError(recipe["unsupported"])
    try:
        return _rebuild(recipe)
    except (KeyError, TypeError) as exc:  # a recipe edited by hand, or cut short
        raise ValueError(f"study recipe: incomplete or damaged ({type(exc).__name__}: {exc})") from None


def _rebuild(recipe: Mapping[str, Any]) -> tuple[Problem, dict[str, Any]]:
    from skistune.profile import HardwareProfile
    from skistune.quality import QualityProfile
    from skistune.searchspace import parse_space

    packed_quality = recipe.get("quality_profile")
    problem = build_problem(
        _workload_from_record(recipe["workload"]), model=recipe["model"], objective=",".join(recipe["objective"]),
        slo=[SLO(*s) for s in recipe["slo"]], quality=[QualityFloor(*q) for q in recipe["quality"]],
        energy=None if recipe["energy"] is None else EnergyBudget(recipe["energy"]),
        profile=HardwareProfile.from_dict(json.loads(_unpack(recipe["profile"]))),
        space=parse_space(recipe["space"]["yaml"], source=recipe["space"]["source"]),
        max_queue_s=recipe["max_queue_s"], kv_memory=recipe.get("kv_memory"),
        quality_profile=None if packed_quality is None else QualityProfile(json.loads(_unpack(packed_quality))))
    return problem, dict(recipe["search"])


def store_recipe(study, problem: Problem, *, sampler: str, seed: int, n_trials: int) -> None:
    """Store the recipe once, when the study is created (or first resumed by a version that writes it)."""
    if RECIPE_ATTR not in study.user_attrs:
        study.set_user_attr(RECIPE_ATTR, problem_recipe(problem, sampler=sampler, seed=seed, n_trials=n_trials))


def stored_profile(storage: Any, study_name: str):
    """The hardware profile an existing study was created with (its recipe's), or None where the storage or
    the study does not exist yet or holds no recipe: a resume without --profile takes it, so that a cached
    quick profile measured again since does not make the same problem another one."""
    import optuna

    from skistune.profile import HardwareProfile

    try:
        _existing_sqlite(storage)
        study = optuna.load_study(study_name=study_name, storage=open_storage(storage, create=False))
    except (ValueError, KeyError):  # (no such file, tables or study: it is created as usual)
        return None
    recipe = study.user_attrs.get(RECIPE_ATTR)
    if recipe is None or "profile" not in recipe:
        return None
    return HardwareProfile.from_dict(json.loads(_unpack(recipe["profile"])))


@dataclass(frozen=True)
class WorkerJob:
    """An existing study joined as one more worker: the creator's problem, the study with this worker's
    sampler, and the worker's tag (host, pid, seed) recorded with each of its trials."""

    problem: Problem
    study: Any
    seed: int
    tag: Mapping[str, Any]


@dataclass(frozen=True)
class WorkerRun:
    """What `run_worker` did: the trials it finished or saw fail, and the study's complete trials after."""

    job: WorkerJob
    finished: int
    failed: int
    complete_in_study: int


def join_study(storage: Any, study_name: str, *, seed: int | None = None) -> WorkerJob:
    """Check and load everything a worker needs before any trial runs: the study (never created here), its
    recipe, the rebuilt problem (checked against the study's identity like any resume), this worker's
    sampler. ``seed`` None draws a random one, so that workers started at once propose different configs."""
    import optuna

    _existing_sqlite(storage)
    opened = open_storage(storage, create=False)  # (a database without Optuna's tables stays untouched)
    try:
        study = optuna.load_study(study_name=study_name, storage=opened)
    except KeyError:
        raise ValueError(f"study {study_name!r}: not in storage {_storage_label(storage)}; create it first with "
                         f"skistune optimize --storage URL --study {study_name}") from None
    recipe = study.user_attrs.get(RECIPE_ATTR)
    if recipe is None:
        raise ValueError(f"study {study_name!r}: holds no skistune recipe (made by another tool or an older "
                         "skistune); resume it once with skistune optimize to store one")
    problem, search = problem_from_recipe(recipe)
    try:
        with storage_failures(storage, study_name):
            study = open_study(problem, opened, study_name, sampler=None)
    except ProblemMismatch as exc:  # (the problem is the study's own recipe: only another skistune differs)
        raise ValueError(f"study {study_name!r} was made by an earlier skistune: this one rebuilds its problem from "
                         f"its recipe and describes it differently (differs in: {exc.differs}), so its workers "
                         "cannot add to it; add trials with the skistune that made it, or start a new study with "
                         "skistune optimize") from None
    seed = _random_seed() if seed is None else seed
    study.sampler = make_sampler(search["sampler"], seed=seed, problem=problem, parallel=True,
                                 n_trials=search["n_trials"])
    return WorkerJob(problem, study, seed, MappingProxyType(_worker_tag(seed, unseeded=True)))


def run_worker(job: WorkerJob, *, n_trials: int, timeout: float | None = None,
               progress: Callable[[Progress], None] | None = None, storage: Any = None) -> WorkerRun:
    """Run ``n_trials`` trials of the joined study (`join_study`); each records its worker's tag. ``timeout``
    stops the trial it falls in too (at most one simulation late; that trial is stored pruned). A failure of
    the storage raises `StorageWriteError` (``storage``: the URL the study was joined with, to name it)."""
    import optuna

    _check_counts(n_trials, 1, 0, timeout)
    tag = dict(job.tag)
    first, pids = _first_new_trial(job.study), {tag["pid"]}
    callbacks = [lambda s, t: progress(_progress_of(job.problem, s, first, n_trials, pids))] if progress else []
    problem = with_deadline(job.problem, Deadline.after(timeout))
    with storage_failures(job.study._storage if storage is None else storage, job.study.study_name), \
            _StopsInsideTrials() as gate:
        _optimize(job.study, _tagged(gate.wrap(_trial_function(problem, job.study)), lambda: tag),
                  n_trials=n_trials, timeout=timeout, callbacks=[*callbacks, gate.stop_after_trial])
    mine = [t for t in job.study.get_trials(deepcopy=False) if t.user_attrs.get("worker") == tag]
    states = optuna.trial.TrialState
    return WorkerRun(job, sum(t.state == states.COMPLETE for t in mine), sum(t.state == states.FAIL for t in mine),
                     len(job.study.get_trials(deepcopy=False, states=(states.COMPLETE,))))
