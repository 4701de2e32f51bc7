"""The optimizer: search the knob space under SLO, energy and quality constraints with the simulator,
validate the winners on the real runtime, and write the tuned config.

    problem    the workload's requests, the simulation target, objectives and constraints, and the search
               space cut down to the knobs the simulator models (`simulator.MODELED_KNOBS`; the others stay
               at the baseline's values and are listed in the result's notes): `skistune.problem`
    search     an Optuna study in any storage (a SQLite file in the working directory by default): TPE
               (multivariate, seeded; constant liar with several workers) for one objective, NSGA-II for
               several, GP on request; constraints as Optuna constraints (<= 0 feasible). A trial scores
               one config (`skistune.scoring`): its capacity (binary search on the arrival rate, coarse
               precision) or its metrics at the workload's own rate. Every figure is stored with the trial, so
               a study resumes (``study_name``) and several worker processes share it (``n_jobs``):
               `skistune.search`; the storage: `skistune.study_storage`; workers that join a study from any
               machine: `skistune.study_recipe`
    refine     the top-k configs and the baseline again at 2% capacity precision, with full metrics (here)
    validate   the top-k on the real runtime (a short, length-capped slice of the workload, replayed at
               the rate the simulator chose for it); the winner is chosen by measurement: `skistune.validation`

    optimize(workload, slo=..., objective=..., ...) -> OptimizeResult   everything above, from raw inputs
    build_problem(...) -> Problem; solve(problem, ...) -> OptimizeResult  the same in two steps (the CLI
                                                                          checks every input first)
    result.best / .pareto / .baseline / .validated / .gain() / .to_yaml() / .write(path)
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from skistune import callable_module
from skistune.config import KVConfig, knob_fields
from skistune.objectives import DEFAULT_MAX_QUEUE_S, Objective
from skistune.paths import write_atomic
from skistune.problem import (DEFAULT_MODEL, DEFAULT_WORKLOAD, Problem, UnmeetableSLO, _baseline_params,
                              _check_counts, _value, baseline_config, build_problem, left_out_provenance,
                              sglang_baseline_config)
from skistune.scoring import (REFINE_PRECISION, SEARCH_PRECISION, Deadline, Evaluation, TimeUp, _deadline_of, beats,
                              beats_anywhere, scale_guess, score, score_at, with_deadline, without_deadline)
from skistune.search import (DEFAULT_TRIALS, ILP_ATTR, SAMPLERS, Progress, _run_parallel, _run_sequential,
                             _RunSampler, _first_new_trial, _study_unseeded, _tagged, _trial_function,
                             _worker_tag, default_study_name, make_sampler, open_study)
from skistune.searchspace import suggest_config
from skistune.study_recipe import store_recipe
from skistune.study_storage import StorageWriteError, _storage_label, default_storage, open_storage, storage_failures
from skistune.workloads.synthetic import check_workers_fit
from skistune.validation import (VALIDATE_MAX_INPUT, VALIDATE_MAX_OUTPUT, Validation, _speed_after_validation,
                                 deployable, load_runtime_in_background, same_schedule, untested_note, validate,
                                 validation_record, validation_unavailable)

# the API, as `optimize` and `solve` take and return it (the rest lives in the modules named above)
__all__ = ["DEFAULT_TOP_K", "DEFAULT_TRIALS", "Evaluation", "OptimizeResult", "Problem", "Progress",
           "StorageWriteError", "UnmeetableSLO", "Validation", "baseline_config", "build_problem", "optimize",
           "sglang_baseline_config", "solve"]

DEFAULT_TOP_K = 3
VALIDATED_ATTR = "skistune.validated"  # the last validation's replays, for `skistune report`
SIMPLIFIES_ATTR = "skistune.simplifies"  # on a trial that tries the best config with a knob group as the baseline's
CHOSEN_ATTR = "skistune.chosen"  # the config the last run ranked first (and wrote), for `skistune report`
REFINED_ATTR = "skistune.refined"  # ... the configs it printed and the baseline, as refined (`Evaluation.to_record`)


# ---- results ----------------------------------------------------------------------------------------------
def completed(study) -> list[Evaluation]:
    import optuna

    return [Evaluation.from_trial(t) for t in study.get_trials(deepcopy=False,
                                                                states=(optuna.trial.TrialState.COMPLETE,))
            if "config" in t.user_attrs]


def _distinct(evaluations: Sequence[Evaluation]) -> list[Evaluation]:
    """The first of each config that serves differently (`KVConfig.effective`: a quantization group size at 16
    bits does nothing, and two such configs had been listed as #1 and #2 with the same figures)."""
    seen: dict[KVConfig, Evaluation] = {}
    for e in evaluations:
        seen.setdefault(e.config.effective(), e)
    return list(seen.values())


def _sort_key(problem: Problem, e: Evaluation) -> tuple:
    """Best first objective first; ties (capacity comes in steps of the search precision) go to the config
    with less energy per token, then to the one that reserves less host memory and disk for KV tiers (a tier
    the workload never fills changes no figure, but a deployment still sets it aside), then the earlier trial
    (the baseline is trial 0). Both figures are compared as the front rule compares them (`_noise_free`): a
    J/token lower by float summation noise (1e-16) had ranked a config with an unused 8 GiB host tier before
    the baseline it equals."""
    first = -e.values[0] if problem.objectives[0].maximize else e.values[0]
    first, energy = _noise_free((first, e.figures.get("energy_j_per_token", 0.0)))
    offload = e.config.offload
    return (first, energy, offload.host_kv_bytes, offload.disk_kv_bytes, e.trial if e.trial is not None else -1)


def ranked(problem: Problem, evaluations: Sequence[Evaluation]) -> list[Evaluation]:
    """Feasible evaluations, distinct configs, best first (by the first objective)."""
    return sorted(_distinct([e for e in evaluations if e.feasible]), key=lambda e: _sort_key(problem, e))


def _noise_free(gains: Sequence[float]) -> tuple[float, ...]:
    """Gains rounded to 9 significant digits: two configs whose figures differ by float summation noise
    (1e-15 of a J/token, each the better on a different axis) are a tie, not two points of a front."""
    return tuple(float(f"{g:.9g}") for g in gains)


def nondominated(pool: Sequence[Evaluation], gains: Callable[[Evaluation], Sequence[float]]) -> list[Evaluation]:
    """The evaluations of ``pool`` (in its order) that no other beats on every axis of ``gains`` (each
    "higher is better"); of several with the same gains, only the first. The one front rule of `optimize`'s
    Pareto front and the report's trade-off front."""
    points = [_noise_free(gains(e)) for e in pool]
    firsts = {g: e for e, g in reversed(list(zip(pool, points)))}  # (the first in pool order wins a tie)

    def beaten(g: tuple) -> bool:
        return any(all(x >= y for x, y in zip(h, g)) and h != g for h in firsts)

    return [e for e, g in zip(pool, points) if firsts[g] is e and not beaten(g)]


def pareto_front(problem: Problem, evaluations: Sequence[Evaluation]) -> list[Evaluation]:
    """The feasible, non-dominated configs, best first objective first; of configs predicted the same values
    on every objective, only the first in `ranked`'s order (the one that sets aside less for KV tiers, then the
    earlier trial: the baseline before a config that equals it with a 128 GiB host tier)."""
    signs = [1 if o.maximize else -1 for o in problem.objectives]
    return nondominated(ranked(problem, evaluations), lambda e: [s * v for s, v in zip(signs, e.values)])


def with_refined(evaluations: Sequence[Evaluation], refined: Sequence[Evaluation]) -> list[Evaluation]:
    """The search's evaluations with those of the ``refined`` configs (same effective config) replaced by
    their refined figures, keeping the trial number: a front then shows one set of figures per config, the
    ones `optimize` printed (a config's search figure sat beside its refined one, and the refined baseline
    appeared to beat the front)."""
    finer = {e.config.effective(): e for e in refined}
    return [replace(finer[e.config.effective()], config=e.config, trial=e.trial)
            if e.config.effective() in finer else e for e in evaluations]


def infeasibility(evaluations: Sequence[Evaluation], k: int = 3) -> tuple[dict[str, int], list[Evaluation]]:
    """How many trials each constraint rules out, and the ``k`` configs closest to feasible: those that serve
    the most requests first, then the least total violation. (A config that serves none has every latency
    undefined, each counted as a violation of 1, which summed less than the large relative excess of one that
    serves all requests late: it was shown as the closest.)"""
    binding = {name: 0 for e in evaluations[:1] for name in e.violations}
    for e in evaluations:
        for name in e.binding:
            binding[name] = binding.get(name, 0) + 1
    closest = sorted(_distinct(evaluations), key=lambda e: (max(0.0, e.violations.get("served", 0.0)),
                                                             e.total_violation, e.trial or 0))[:k]
    return {name: n for name, n in binding.items() if n}, closest


# ---- the result -------------------------------------------------------------------------------------------
def _ratio(tuned: float, base: float, maximize: bool) -> float | None:
    """How many times better the tuned value is (> 1 better, either direction)."""
    if maximize:
        return tuned / base if base > 0 else (math.inf if tuned > 0 else None)
    return base / tuned if tuned > 0 else (math.inf if base > 0 else None)


@dataclass
class OptimizeResult:
    """``best``: the chosen config first (by measurement when validated), then the other top configs;
    ``pareto``: the feasible non-dominated configs; ``baseline``: the engine's defaults (`baseline_config`)
    scored the same way; ``validated``: runtime replays (candidates in measured order, then the baseline)."""

    problem: Problem
    study: Any
    storage: str
    best: list[Evaluation]
    pareto: list[Evaluation]
    baseline: Evaluation
    validated: list[Validation] = field(default_factory=list)
    binding: dict[str, int] = field(default_factory=dict)
    closest: list[Evaluation] = field(default_factory=list)
    trials: int = 0
    simplifying_trials: int = 0
    seed: int = 0
    sampler: str = "auto"
    # why the seed does not reproduce this run's proposals (worker processes, another process on the study)
    unseeded: str | None = None
    notes: list[str] = field(default_factory=list)
    # the command line's options that built the workload (`evaluate.workload_options`), for the tuned file:
    # `skistune evaluate` rebuilds the workload from them; None from the Python API (see `provenance`)
    workload_options: dict[str, Any] | None = None

    def __repr__(self) -> str:
        """A line a notebook can show: the dataclass's own repr printed the problem whole, every prompt's
        token ids included (half a megabyte)."""
        best = ", ".join(f"{o.name}={v:.4g}" for o, v in zip(self.problem.objectives, self.best[0].values)) \
            if self.best else "none feasible"
        return (f"OptimizeResult(study={self.study.study_name!r}, trials={self.trials}, best: {best}, "
                f"pareto={len(self.pareto)}, validated={len(self.validated)}, storage={self.storage!r})")

    @property
    def feasible(self) -> bool:
        """Predicted: some config met every constraint in the simulator (`measured_feasible` says whether the
        chosen one met them on the real runtime)."""
        return bool(self.best) and self.best[0].feasible

    @property
    def measured_feasible(self) -> bool | None:
        """Whether the chosen config held every constraint replayed on the real runtime (None: not validated).
        False means no validated config held them, and the search's best was kept (see ``notes``)."""
        return self.validated[0].holds if self.validated and self.best else None

    @property
    def config(self) -> KVConfig:
        if not self.best:
            raise ValueError("no config met every constraint; see result.binding and result.closest")
        return deployable(self.problem, self.best[0].config)  # the config the search scored, as deployed

    def gain(self) -> dict[str, float | None]:
        """Predicted improvement of the chosen config over the baseline, per objective (x times better)."""
        if not self.best:
            return {}
        return {o.name: _ratio(t, b, o.maximize) for o, t, b in
                zip(self.problem.objectives, self.best[0].values, self.baseline.values)}

    def measured_gain(self) -> dict[str, Any]:
        """The winner and the baseline replayed at the same rate: their measured objectives and whether each
        held every constraint (for capacity the rate is the winner's, so a baseline that breaks a constraint
        there is measured evidence of the gain, unless ``same_schedule``: the simulator predicts both to run
        the same steps of the slice, and what tells their replays apart is the machine's noise; or unless
        ``baseline_predicted_holds``: the simulator predicted the baseline to hold there too, so its break is
        the machine's noise or the simulator's error at the SLO's edge)."""
        if not self.validated or self.validated[-1].role != "baseline":
            return {}
        tuned, base = self.validated[0], self.validated[-1]
        out: dict[str, Any] = {"rate_rps": tuned.rate_rps, "tuned_holds": tuned.holds, "baseline_holds": base.holds,
                               "baseline_binding": base.broken,
                               "baseline_predicted_holds": base.predicted.feasible,
                               "is_baseline": tuned.config == base.config, "same_schedule": same_schedule(tuned, base)}
        for o, t, b in zip(self.problem.objectives, tuned.measured.values, base.measured.values):
            if o.name != "capacity":
                out[o.name] = _ratio(t, b, o.maximize)
        return out

    def provenance(self) -> dict[str, Any]:
        return provenance(self)

    def to_yaml(self) -> str:
        return self.config.to_yaml(provenance=self.provenance())

    def write(self, path: str | os.PathLike) -> Path:
        """Write the tuned config atomically (a temporary file in the same folder, then renamed)."""
        return write_atomic(Path(path), self.to_yaml())


# ---- provenance -------------------------------------------------------------------------------------------
EXACT_FIGURES = ("rate_scale",)  # figures written whole: a rounded one would not reproduce the prediction


def _clean(value: Any) -> Any:
    """Figures for a YAML file: floats to 4 significant digits, nested containers alike."""
    if isinstance(value, float):
        return value if not math.isfinite(value) else float(f"{value:.4g}")
    if isinstance(value, Mapping):
        return {k: v if k in EXACT_FIGURES else _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _scored(problem: Problem, e: Evaluation) -> dict[str, Any]:
    """The objectives and figures; byte counts as integers, exact as ``kv_peak_bytes`` beside them (`_clean`
    keeps 4 significant digits of a float: 51240960 bytes had read 51240000.0)."""
    def exact(o: Objective, v: float) -> float | int:
        return int(v) if o.unit == "bytes" and math.isfinite(v) and v == int(v) else v

    # rate_scale: the multiplier of the search workload's arrivals the figures were predicted at, exact (not
    # rounded by `_clean`): `skistune evaluate CONFIG --rate-scale X` replays the same arrivals (--rate draws others)
    return {"objectives": {o.name: exact(o, v) for o, v in zip(problem.objectives, e.values)}, **dict(e.figures),
            "rate_scale": e.rate_scale}


def replayed_as(result: OptimizeResult, v: Validation) -> dict[str, Any]:
    """Which ranked configs a replay stands for (``rank`` 1 is the written one; None for the baseline alone) and
    their trials: a run's ``role`` alone ("candidate") had left which config it was to the list's order."""
    rank = next((i for i, e in enumerate(result.best) if e.config == v.config), None)
    return {"rank": None, "trial": None} if rank is None else {"rank": rank + 1, "trial": result.best[rank].trial}


def _measured_provenance(result: OptimizeResult) -> dict[str, Any] | None:
    if not result.validated:
        return None
    p = result.problem
    runs = [{"role": v.role, **replayed_as(result, v), "rate_rps": v.rate_rps, "holds": v.holds,
             "binding": v.broken, "untested": v.untested, "replays": v.replays,
             "wall_s": v.wall_s, "kv_pool_cap_bytes": v.pool_cap_bytes, "predicted": _scored(p, v.predicted),
             "measured": _scored(p, v.measured), "same_schedule_not_replayed": len(v.twins)}
            for v in result.validated]
    return {"runtime": f"{p.model} on this machine (waits for arrivals skipped)",
            "requests": result.validated[0].measured.figures["requests"], "max_input": VALIDATE_MAX_INPUT,
            "max_output": VALIDATE_MAX_OUTPUT, "runs": runs, "gain_vs_baseline": result.measured_gain()}


def provenance(result: OptimizeResult) -> dict[str, Any]:
    """How the config was found: inputs (workload digest and the options that built it, profile fingerprint,
    space, seed), the search, and the predicted and measured figures of the winner and the baseline. The
    workload's options are the command line's (``result.workload_options``), which `skistune evaluate` rebuilds
    the workload from; from the Python API, a preset's when the workload is one untransformed
    (`evaluate.preset_options`), else none."""
    from datetime import datetime, timezone
    from importlib.metadata import PackageNotFoundError, version

    from skistune.evaluate import preset_options

    p = result.problem
    try:
        tool = f"skistune {version('skistune')}"
    except PackageNotFoundError:
        tool = "skistune"
    w = p.workload
    options = dict(result.workload_options) if result.workload_options is not None else preset_options(w)
    recorded = _clean({
        "tool": tool, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "objective": [o.name for o in p.objectives], "slo": [str(s) for s in p.slos],
        "constraints": [c.name for c in p.constraints],
        "workload": {"source": w.source, "digest": w.digest(), "requests": len(w), "transforms": list(w.transforms)},
        "model": p.model, "kv_memory": p.kv_memory,
        # (which measurements priced the lossy knobs: a 2-window quick profile's bounds are not the full grid's)
        **({"quality_profile": {"path": p.quality_profile.path, "digest": p.quality_profile.digest(),
                                "model": p.quality_profile.model,
                                "grid": (p.quality_profile.data.get("protocol") or {}).get("grid")}}
           if p.quality_profile is not None else {}),
        "profile": {"name": p.profile.name, "device": p.profile.device, "fingerprint": p.profile.fingerprint.key(),
                    "power": p.profile.power.source},
        "search_space": {"name": p.full_space.name, "source": p.full_space.source,
                         "searched": [q.name for q in p.space.params if not q.is_switch],
                         **left_out_provenance(p.left_out)},
        "search": {"study": result.study.study_name, "storage": result.storage, "sampler": result.sampler,
                   "seed": result.seed, "trials": result.trials, "simplifying_trials": result.simplifying_trials,
                   # (the seed reproduces a search that had the study to itself in one process)
                   "reproducible_from_seed": result.unseeded is None,
                   **({"not_reproducible": result.unseeded} if result.unseeded else {}),
                   # the figures recorded here (predicted, baseline) are the refined ones; the study's trials
                   # were searched coarser
                   "capacity_precision": REFINE_PRECISION, "trial_capacity_precision": SEARCH_PRECISION},
        "predicted": _scored(p, result.best[0]),
        "baseline": {"predicted": _scored(p, result.baseline), "gain": result.gain()},
        "measured": _measured_provenance(result),
        # (without the solve times, which differ run to run: two runs of one seed write the same file but its date)
        "notes": [ILP_TIMING.sub("", n) for n in result.notes],
    })
    if options is not None:  # (exact, not rounded by `_clean`: a rounded --rate would build other arrivals)
        recorded["workload"]["options"] = options
    return recorded


# ---- the main job -----------------------------------------------------------------------------------------
def _check_run(seed: Any, storage: Any) -> None:
    """`optimize`'s and `solve`'s own arguments, as the CLI checks its options: a type error named, before any
    work (``seed=-1`` had been taken, which --seed refuses; ``storage=5`` had failed with an AttributeError)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed: {seed!r} must be an integer >= 0")
    if storage is not None and not isinstance(storage, str) and not hasattr(storage, "create_new_study"):
        raise ValueError(f"storage: {storage!r} must be an Optuna storage URL (e.g. sqlite:///study.db), an Optuna "
                         "storage object, or None (a SQLite file here)")


def _refine(problem: Problem, evaluations: Sequence[Evaluation], cut: list[str] | None = None) -> list[Evaluation]:
    """Score again at `REFINE_PRECISION` with full metrics; feasible first, then best first. Those the run's
    deadline leaves no time for keep the search's figures, and ``cut`` gets a phrase saying so."""
    fine = []
    for i, e in enumerate(evaluations):
        try:
            fine.append(replace(score(problem, e.config, precision=REFINE_PRECISION, start_scale=e.rate_scale),
                                trial=e.trial))
        except TimeUp:
            fine += evaluations[i:]
            if cut is not None:
                cut.append(_unrefined(problem, f"{len(evaluations) - i} of the {len(evaluations)} top configs"))
            break
    return sorted(fine, key=lambda e: (not e.feasible, _sort_key(problem, e)))


def _unrefined(problem: Problem, what: str) -> str:
    """What the deadline left at the search's figures: ``capacity of X refined to 10% instead of 2%``."""
    if problem.at_capacity:
        return f"capacity of {what} refined to {SEARCH_PRECISION:.0%} instead of {REFINE_PRECISION:.0%}"
    return f"{what} not scored again with full metrics (the search's figures stand)"


def _baseline_as_trial(baseline: Evaluation, evaluations: Sequence[Evaluation]) -> Evaluation | None:
    """The baseline's refined evaluation as the trial that ran it in this space (the enqueued first trial),
    with that trial's config: the same as the baseline's but for knobs that do nothing (`KVConfig.effective`:
    a space may fix a prefetch depth with prefetch off). None when no trial ran it."""
    target = baseline.config.effective()
    trial = next((e for e in evaluations if e.config.effective() == target), None)
    return None if trial is None else replace(baseline, config=trial.config, trial=trial.trial)


def _with_baseline(problem: Problem, refined: list[Evaluation], baseline: Evaluation,
                   evaluations: Sequence[Evaluation]) -> list[Evaluation]:
    """The refined top configs, with the baseline among them when it was a trial of this space and, at the
    finer precision, beats one of them: the result is never predicted worse than the defaults."""
    as_trial = _baseline_as_trial(baseline, evaluations)
    if as_trial is None or not baseline.feasible or any(e.config == as_trial.config for e in refined):
        return refined
    if len(problem.objectives) > 1 or _sort_key(problem, baseline)[0] >= _sort_key(problem, refined[-1])[0]:
        return refined
    merged = sorted([*refined, as_trial], key=lambda e: (not e.feasible, _sort_key(problem, e)))
    return merged[:len(refined)]


def _chosen(refined: list[Evaluation], validated: list[Validation]) -> tuple[list[Evaluation], list[str]]:
    """The refined top configs, the one chosen by measurement first."""
    if not validated:
        return refined, []
    winner = validated[0]
    notes = [] if winner.holds else [(f"no validated config held every constraint on the real runtime "
                                      f"({', '.join(winner.broken)} broke); the search's best is kept: "
                                      "the simulator is optimistic for this machine now (`skistune evaluate --mode "
                                      "compare` tells its drift from the model's error)")]
    first = [e for e in refined if e.config == winner.config]
    return first + [e for e in refined if e.config != winner.config], notes


ILP_TIMING = re.compile(r", \d+ ms each on average")  # the part of `ilp_note` that is a timing


def ilp_note(study) -> str | None:
    """How often the integer programs ran inside the study's trials, and their solve times."""
    import optuna

    runs: dict[str, list] = {}
    trials = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    for t in trials:
        for program, r in t.user_attrs.get(ILP_ATTR, {}).items():
            runs.setdefault(program, []).append((r["calls"], r["solve_s"]))
    parts = []
    for program, rs in runs.items():
        calls, total = sum(c for c, _ in rs), sum(s for _, s in rs)
        parts.append(f"{program} integer program solved {calls} times in {len(rs)} of {len(trials)} trials, "
                     f"{1e3 * total / calls:.0f} ms each on average")
    return "; ".join(parts) or None


def baseline_outside_space(problem: Problem) -> dict[str, Any]:
    """The baseline's knobs (and values) that the search space cannot express (a range or a list of choices
    without its value, a fixed other value): empty when the baseline is a point of the space, as trial 0.
    Outside it, the baseline never runs as a trial and cannot rank first on a tie (`_baseline_on_ties`)."""
    import optuna

    first = {p.name: p.choices[0] if p.kind == "choices" else p.low for p in problem.space.params
             if p.kind in ("choices", "int", "float")}  # (as build_problem's check of trial 0)
    nearest = suggest_config(optuna.trial.FixedTrial({**first, **_baseline_params(problem)}), problem.space,
                             problem.base).effective()
    base = problem.base.effective()
    return {name: _value(base, name) for name in knob_fields() if _value(base, name) != _value(nearest, name)}


def _values_text(problem: Problem, a: Evaluation, b: Evaluation) -> str:
    """``capacity 0.4995 vs 0.4995, energy 0.6735 vs 0.6735``: each objective of ``a`` against ``b``."""
    return ", ".join(f"{o.name} {x:.4g} vs {y:.4g}" for o, x, y in zip(problem.objectives, a.values, b.values))


def _baseline_on_ties(problem: Problem, refined: list[Evaluation], baseline: Evaluation,
                      evaluations: Sequence[Evaluation]) -> tuple[list[Evaluation], list[str]]:
    """When the baseline (a trial of this space) ties with the best config (`beats`: with several objectives,
    the best beats it on none), it goes first, so that nothing is changed for a gain below the resolution.
    Returns the refined list and a note saying so."""
    if not refined:
        return refined, []
    as_trial = _baseline_as_trial(baseline, evaluations)
    best = refined[0]
    if as_trial is None or not baseline.feasible or best.config == as_trial.config or not best.feasible:
        return refined, []
    if beats_anywhere(problem, best, baseline):
        return refined, []
    rest = [e for e in refined if e.config != as_trial.config]
    if len(problem.objectives) == 1:
        note = (f"the best config's predicted {problem.objectives[0].name} ({best.values[0]:.4g} vs "
                f"{baseline.values[0]:.4g}) is within {REFINE_PRECISION:.0%} of the baseline's: a tie, so the "
                "baseline is ranked first")
    else:
        note = (f"the best config (trial {best.trial}) is predicted better than the baseline by no more than "
                f"{REFINE_PRECISION:.0%} on every objective ({_values_text(problem, best, baseline)}): a tie, so "
                "the baseline is ranked first")
    return [as_trial, *rest][:len(refined)], [note]


def _ties_and_simpler(problem: Problem, study, refined: list[Evaluation], baseline: Evaluation,
                      evaluations: Sequence[Evaluation], stage: Callable[[str], None]
                      ) -> tuple[list[Evaluation], list[str]]:
    """The baseline first on a tie (`_baseline_on_ties`), else the best config simplified (`_simplify`), and
    the tie rule again on what that leaves: a winner 2.2% over the baseline simplified to one 1.1% over it is
    a tie, and the baseline goes first (a second run of one study had written such a config, its own output
    calling it a tie with the defaults)."""
    refined, notes = _baseline_on_ties(problem, refined, baseline, evaluations)
    refined, simpler = _simplify(problem, study, refined, stage)
    if simpler:
        refined, again = _baseline_on_ties(problem, refined, baseline, evaluations)
        notes += simpler + again
    return refined, notes


# Knob groups that the best config's predicted gain may not need, tried back at the baseline's values in this
# order: what a deployment pays for first (host memory and disk set aside for KV tiers), then the lossy knobs,
# then the rest. (A search rarely samples a group's defaults exactly: a 128 GiB host tier that the workload
# never fills changes no figure, and won ties on noise-level differences of the objective.)
SIMPLIFY_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("KV tiers", ("offload.host_kv_bytes", "offload.disk_kv_bytes", "offload.demote_first", "offload.write_policy",
                  "prefetch.", "batching.preemption")),
    ("eviction", ("eviction.",)),
    ("KV bits", ("bitwidth.", "mixed_precision")),
    ("prefix reuse", ("prefix_reuse.",)),
    ("batching", ("batching.", "offload.device_memory_fraction")),
)


def _trial(study, number: int):
    """A trial of the study by number, without deep copies of every trial (`study.trials`)."""
    return study.get_trials(deepcopy=False)[number]


def _simplify(problem: Problem, study, refined: list[Evaluation],
              stage: Callable[[str], None]) -> tuple[list[Evaluation], list[str]]:
    """The best config with each of `SIMPLIFY_GROUPS` back at the baseline's values where the space can
    express them, each kept only if the config stays feasible and the best beats it on no objective
    (`beats_anywhere`: within a tie on each). Each try is a trial of the study (enqueued, so `skistune report`
    sees it), then refined as the top configs were. With several objectives the best is the one written (#1).
    The problem's deadline (`with_deadline`) stops the tries, and a note says which were not made."""
    if not refined or not refined[0].feasible or refined[0].trial is None \
            or refined[0].config.effective() == problem.base.effective():
        return refined, []
    stopped: list[str] = []  # the knob group the deadline stopped it at
    try:
        out, notes = _simplified(problem, study, refined, stage, stopped)
    except TimeUp:
        out, notes = refined, []
        stopped.append(SIMPLIFY_GROUPS[0][0])
    if stopped:
        notes += _cut_notes(problem, ["the best config not simplified (its knob groups not tried at the defaults)"
                                      if stopped[0] == SIMPLIFY_GROUPS[0][0] else
                                      f"simplifying the best config stopped before its {stopped[0]} knobs"])
    return out, notes


def _running_trial(study, params: Mapping[str, Any], user_attrs: Mapping[str, Any]):
    """A new trial of the study, already running, whose suggestions return ``params``: what `enqueue_trial`
    then `ask` give, without the queue. `Study.ask` takes any waiting trial of the study, this process's or one
    enqueued by another process sharing it, and two commands simplifying at once took each other's (a tester:
    7 of 26 pairs crashed, a trial told twice or read before it had values)."""
    import optuna

    template = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING,
                                         system_attrs={"fixed_params": dict(params)}, user_attrs=dict(user_attrs))
    return optuna.Trial(study, study._storage.create_new_trial(study._study_id, template_trial=template))


def _simplified(problem: Problem, study, refined: list[Evaluation], stage: Callable[[str], None],
                stopped: list[str]) -> tuple[list[Evaluation], list[str]]:
    import optuna

    _deadline_of(problem).check()
    first = best = refined[0]
    params = dict(_trial(study, best.trial).params)
    base_params = _baseline_params(problem)
    scoring = _trial_function(problem, study)
    run = _tagged(scoring, lambda: _worker_tag(None))  # (enqueued: no sampler, no seed)
    stage("simplifying the best config")
    reverted = []
    # the tries already made for this best config (a resumed study): read back, not run again; one that is still
    # running (another command simplifying the same config) has no values yet, so is made again here
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    tries = {t.user_attrs[SIMPLIFIES_ATTR]: t for t in study.get_trials(deepcopy=False, states=finished)
             if t.user_attrs.get(SIMPLIFIES_ATTR, "").startswith(f"{first.trial}:")}
    def simpler(label: str, prefixes: tuple[str, ...]) -> Evaluation | None:
        """The best config so far with the group's knobs at the baseline's values, refined, if it stays feasible
        and the first best beats it on no objective; None if not (or nothing to set back). The deadline appends
        the group to ``stopped``."""
        candidate = {**params, **{n: v for n, v in base_params.items() if n.startswith(prefixes)}}
        key = f"{first.trial}:{label}:{json.dumps(candidate, sort_keys=True, default=str)}"
        if candidate == params:
            return None
        trial = tries.get(key)
        if trial is None:
            with warnings.catch_warnings():  # (a storage with heartbeats warns that ask and tell don't send them)
                warnings.filterwarnings("ignore", message="Heartbeat of storage")
                trial = _running_trial(study, candidate, {SIMPLIFIES_ATTR: key})
                try:
                    values = run(trial)
                except optuna.TrialPruned:  # a user's callable failed on this config (its error, once), or
                    study.tell(trial, state=optuna.trial.TrialState.PRUNED)  # the deadline passed
                    if scoring.timed_out:
                        stopped.append(label)
                        return None
                    raise run.failures[0] from None
                study.tell(trial, values)
            trial = _trial(study, trial.number)
        if "config" not in trial.user_attrs:
            return None
        tried = Evaluation.from_trial(trial)
        if tried.config == best.config or not tried.feasible:
            return None
        try:
            fine = replace(score(problem, tried.config, precision=REFINE_PRECISION, start_scale=tried.rate_scale),
                           trial=tried.trial)
        except TimeUp:
            stopped.append(label)
            return None
        return fine if fine.feasible and not beats_anywhere(problem, first, fine) else None

    # Passes until one sets nothing back: a group kept only because of another (a 128 GiB host tier that 8-bit KV
    # without prefix reuse needed, a tester's vLLM winner) goes once that other group has gone back.
    pending = list(SIMPLIFY_GROUPS)
    while pending and not stopped:
        kept = []
        for label, prefixes in pending:
            fine = simpler(label, prefixes)
            if stopped:
                break
            if fine is None:
                kept.append((label, prefixes))
            else:
                best, params = fine, dict(_trial(study, fine.trial).params)
                reverted.append(label)
        if len(kept) == len(pending):
            break
        pending = kept
    if best is first:
        return refined, []
    name = problem.objectives[0].name
    compared = "better on its" if beats(problem, best.values[0], first.values[0]) else \
        f"within {REFINE_PRECISION:.0%} of its"  # (the refined figures may favour the simpler config outright)
    within = f"{compared} {name} ({best.values[0]:.4g} vs {first.values[0]:.4g})" \
        if len(problem.objectives) == 1 else \
        f"no more than {REFINE_PRECISION:.0%} worse on any objective ({_values_text(problem, best, first)})"
    # (the new trial is named first: "... as the baseline's (trial 41)" had read as if trial 41 were the baseline)
    note = (f"trial {best.trial}, trial {first.trial} with its {', '.join(reverted)} set back to the baseline's, is "
            f"predicted {within}: the simpler config is ranked first")
    return [best] + [e for e in refined if e.config != best.config][:len(refined) - 1], [note]


def front_with(problem: Problem, front: list[Evaluation], chosen: Evaluation,
               gains: Callable[[Evaluation], Sequence[float]] | None = None) -> list[Evaluation]:
    """The front with the chosen (written) config on it. It is missing where it ranks first on a tie with a
    config that beats it by less than the resolution (`_baseline_on_ties`, `_simplify`): those configs are
    the same point as it, as the front rule keeps one of equal points, and leave the front for it. ``gains``:
    the front's axes where they are more than the objectives (the report's J/token and quality loss, "higher
    is better"): a config that beats the chosen one there by more than the resolution stays (a tester saw a
    config at the chosen one's capacity and 2.8% less energy left off the report's front)."""
    if not chosen.feasible or any(e.config == chosen.config for e in front):
        return front

    def beats_on_gains(e: Evaluation) -> bool:
        return gains is not None and any(x > y + REFINE_PRECISION * abs(y) for x, y in zip(gains(e), gains(chosen)))

    return [chosen] + [e for e in front if beats_anywhere(problem, e, chosen) or beats_on_gains(e)]


def _search_trials(study) -> int:
    """The study's finished trials, less those that tried a best config's knob groups at the baseline's."""
    return trial_counts(study)[0]


def trial_counts(study) -> tuple[int, int]:
    """(searched, simplifying): the study's finished trials that the search proposed, and those that tried a
    best config's knob groups at the baseline's values (`_simplify`). Optimize and report count both alike."""
    import optuna

    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    simplifying = sum(SIMPLIFIES_ATTR in t.user_attrs for t in done)
    return len(done) - simplifying, simplifying


def trials_text(searched: int, simplifying: int) -> str:
    """``42 trials``, or ``42 trials and 2 simplifying a winner`` (trial numbers run past the first count)."""
    text = f"{searched} trial{'s' * (searched != 1)}"
    return f"{text} and {simplifying} simplifying a winner" if simplifying else text


def finish(problem: Problem, study, *, top_k: int = DEFAULT_TOP_K, runtime=None,
           on_stage: Callable[[str], None] | None = None, deadline: Deadline | None = None) -> dict[str, Any]:
    """After the search: the baseline, the Pareto front, the refined top-k, their validation (``top_k`` 0
    skips it), or the infeasibility report. Returns the fields of an `OptimizeResult`. ``deadline`` (or the
    problem's own, `with_deadline`): each stage stops when it passes, and a note says what was cut short."""
    stage = on_stage or (lambda message: None)
    problem = with_deadline(problem, deadline) if deadline is not None else problem
    cut: list[str] = []  # what the deadline cut short, for the note
    evaluations = completed(study)
    stage("refining the top configs")
    baseline = _refined_baseline(problem, evaluations, cut)
    front = pareto_front(problem, evaluations)
    if not front and problem.at_capacity:
        # every trial was judged at the search's coarser capacity, where J/token is higher (idle power over fewer
        # tokens): an energy budget that the refined capacity meets had ended the run infeasible (a tester's budget
        # of 1.27 J/token, which the run without it had met at 1.251)
        near = [e for e in infeasibility(evaluations)[1] if e.violations.get("served", 0.0) <= 0]
        if near:
            stage("refining the configs closest to feasibility")
            evaluations = with_refined(evaluations, [*_refine(problem, near, cut), baseline])
            front = pareto_front(problem, evaluations)
    if not front:
        binding, closest = infeasibility(evaluations)
        # (the report then reads the baseline optimize printed, and says why as optimize said it)
        study.set_user_attr(REFINED_ATTR, {"best": [], "baseline": baseline.to_record()})
        return {"best": [], "pareto": [], "baseline": baseline, "binding": binding, "closest": closest,
                "trials": _search_trials(study), "simplifying_trials": trial_counts(study)[1],
                "notes": _cut_notes(problem, cut)}
    pool = front if len(problem.objectives) > 1 else ranked(problem, evaluations)
    # (the same candidates whatever the validation count: a user validating one still sees the top three)
    refined = _with_baseline(problem, _refine(problem, pool[:max(top_k, DEFAULT_TOP_K)], cut), baseline, evaluations)
    refined, tie_notes = _ties_and_simpler(problem, study, refined, baseline, evaluations, stage)
    validated = _validated(problem, refined, top_k, runtime, stage, cut)
    best, notes = _chosen(refined, validated)
    if validated and validated[0].untested:
        notes.append(untested_note(validated[0]))
    if validated and not validated[0].holds:
        if _deadline_of(problem).passed:
            cut.append("the machine's speed not timed again after the replays broke a constraint")
        else:
            notes += _speed_after_validation(problem, runtime, stage)
    best, baseline = _with_limits(problem, best, baseline, cut)
    if validated:
        study.set_user_attr(VALIDATED_ATTR, [validation_record(v) for v in validated])
    study.set_user_attr(CHOSEN_ATTR, best[0].config.to_dict())
    # (read again: the trials that simplified the best config are the study's too, and may be on its front)
    pareto = front_with(problem, _refined_front(problem, completed(study), [*refined, baseline], cut), best[0])
    study.set_user_attr(REFINED_ATTR, {"best": [e.to_record() for e in best], "baseline": baseline.to_record(),
                                       "front": [e.to_record() for e in pareto]})
    notes += [n for n in (ilp_note(study), ceiling_note(problem, best[0])) if n]
    return {"best": best, "pareto": pareto, "baseline": baseline, "validated": validated,
            "trials": _search_trials(study), "simplifying_trials": trial_counts(study)[1],
            "notes": tie_notes + notes + _cut_notes(problem, cut)}


def _refined_front(problem: Problem, evaluations: Sequence[Evaluation], refined: Sequence[Evaluation],
                   cut: list[str]) -> list[Evaluation]:
    """The front optimize shows: the trials that no other beats at the search's figures (one precision for all),
    each with refined figures (those not refined yet are refined now, as far as the deadline lets), less those that
    another then beats. A front of refined configs beside others' search figures had shown dominated configs and
    one config twice: refining a config raises its capacity, and with it its memory and energy at capacity."""
    front = pareto_front(problem, evaluations)
    done = {e.config.effective() for e in refined}
    fresh = _refine(problem, [e for e in front if e.config.effective() not in done], cut)
    return pareto_front(problem, with_refined(front, [*refined, *fresh]))


def _refined_baseline(problem: Problem, evaluations: Sequence[Evaluation], cut: list[str]) -> Evaluation:
    """The baseline scored at `REFINE_PRECISION`; past the deadline, its trial's figures (the search's). A
    baseline the space cannot express was never a trial: it is scored at the search's precision then, past the
    deadline by one capacity search, and ``cut`` says so."""
    searched = [e for e in evaluations if e.config == problem.base]
    try:
        return score(problem, problem.base, precision=REFINE_PRECISION,
                     start_scale=scale_guess(searched or evaluations))
    except TimeUp:
        pass
    if searched:
        cut.append(_unrefined(problem, "the baseline"))
        return replace(searched[0], trial=None)
    cut.append(f"the baseline, never a trial (the space cannot express it), scored after the deadline at the "
               f"search's {SEARCH_PRECISION:.0%} precision")
    return score(without_deadline(problem), problem.base, start_scale=scale_guess(evaluations))


def _validated(problem: Problem, refined: list[Evaluation], top_k: int, runtime, stage: Callable[[str], None],
               cut: list[str]) -> list[Validation]:
    """The top ``top_k`` refined configs validated on the real runtime (`validate`), as far as the deadline lets."""
    if not top_k:
        return []
    configs = [e.config for e in refined if e.feasible][:top_k] or [refined[0].config]
    if _deadline_of(problem).passed:
        cut.append(f"not validated on the real runtime ({len(configs)} config{'s' * (len(configs) != 1)} asked)")
        return []
    validated = validate(problem, configs, runtime=runtime,
                         progress=lambda m: stage(f"validating {m} on the real runtime"))
    if getattr(validated, "cut_short", None):
        cut.append(validated.cut_short)
    return list(validated)


def _with_limits(problem: Problem, best: list[Evaluation], baseline: Evaluation,
                 cut: list[str]) -> tuple[list[Evaluation], Evaluation]:
    """`with_limit` of each best config and the baseline, as far as the deadline lets (the others keep no
    ``limited_by``, which the table shows as "not refined")."""
    out, skipped = [], 0
    for e in [*best, baseline]:
        try:
            out.append(with_limit(problem, e))
        except TimeUp:
            out.append(e)
            skipped += 1
    if skipped:
        cut.append(f"what sets the capacity of {skipped} of the {len(out)} configs shown not checked one step above it")
    return out[:-1], out[-1]


def _cut_notes(problem: Problem, cut: Sequence[str]) -> list[str]:
    """One note on what the run's deadline cut short after the search (none when nothing was)."""
    if not cut:
        return []
    return [f"{'; '.join(cut)}: the timeout ({_deadline_of(problem).timeout_s:g} s) was reached (a longer --timeout, "
            "or the same command again on the same study, does the rest)"]


def with_limit(problem: Problem, e: Evaluation) -> Evaluation:
    """``e`` with ``figures["limited_by"]``: the constraints its replay breaks one lattice step above its capacity
    (the capacity is the highest step at which all hold), so that a table can say what sets it: a TBT p99 at
    77 ms of a 200 ms SLO had left the queueing guard, which bound, unsaid. Empty at the search's ceiling."""
    from skistune.simulator import MAX_RATE_SCALE, lattice_step

    if not problem.at_capacity or not e.feasible or e.rate_scale <= 0 or e.rate_scale >= MAX_RATE_SCALE:
        return e
    above = score_at(problem, e.config, problem.search, e.rate_scale * 2 ** lattice_step(REFINE_PRECISION))
    return replace(e, figures={**e.figures, "limited_by": [n for n, v in above.violations.items() if v > 0]})


def ceiling_note(problem: Problem, best: Evaluation) -> str | None:
    """When the best config met every constraint at the highest rate the capacity search tries: its capacity
    is a lower bound, not a measurement of where a constraint starts to bind (a loose SLO had printed
    5,663 req/s, exactly 1024 x the workload's rate, as if it were a capacity)."""
    from skistune.simulator import MAX_RATE_SCALE

    if not problem.at_capacity or best.rate_scale < MAX_RATE_SCALE:
        return None
    return (f"capacity at least {best.figures['rate_rps']:.4g} req/s: every constraint held at {MAX_RATE_SCALE:g}x "
            "the workload's rate, the highest the search tries, so none binds there and the configs' capacities "
            "are not told apart; tighten the constraints, or raise the workload's own rate (--rate, --rate-scale) so the search "
            "reaches higher")


def optimize(workload: Any = DEFAULT_WORKLOAD, *, slo: Any = (), objective: Any = "capacity", direction: Any = None,
             constraints: Any = (), energy: Any = None, quality: Any = (), model: str = DEFAULT_MODEL,
             profile: Any = None, space: Any = None, target: str | None = None, n_trials: int = DEFAULT_TRIALS,
             timeout: float | None = None, storage: Any = None, study_name: str | None = None, n_jobs: int = 1,
             seed: int = 0, sampler: str = "auto", validate: int = DEFAULT_TOP_K,
             max_queue_s: float | None = DEFAULT_MAX_QUEUE_S, progress: Callable[[Progress], None] | None = None,
             on_stage: Callable[[str], None] | None = None, runtime: Any = None,
             quality_profile: Any = None, kv_memory: Any = None) -> OptimizeResult:
    """Search the knobs for the best config under the SLOs and constraints, validate the top ``validate``
    configs on the real runtime (0 skips it), and return the result (``result.write(path)`` saves it).

    ``workload``: a preset name (100 requests), a trace file or a `Workload`; ``slo``: one or more
    ``"p99=200ms"``/``"ttft:p90<=1s"`` strings; ``objective``: capacity (default), goodput, energy, memory,
    quality, comma-separated names (a Pareto front), or a callable of the `Metrics` (and the config),
    minimised unless ``direction="maximize"``; ``constraints``: callables of the metrics (and the config)
    returning values where <= 0 is feasible; ``energy``: a J/token budget (``"0.5J/token"``, or 0.5); ``quality``:
    floors (``"ppl+1%"``, ``"worst:ppl+3%"``, ``"needle>=0.95"``: eviction and KV bits are searched only under
    one, priced by ``quality_profile``, a `QualityProfile` or its file, default the shipped SmolLM2 one);
    ``max_queue_s``: the queueing guard (None: off); ``kv_memory``: the memory KV may use on the device
    (``"256MiB"``; default the device's own, 4 GiB on a CPU), of which ``offload.device_memory_fraction`` is
    taken (the tuned config then states its pool in bytes); ``storage``: an Optuna storage URL
    or object (default: a SQLite file ``skistune-<study>.db`` here); ``study_name``: resume or name the
    study (default: named after the problem); ``n_jobs``: worker processes; ``runtime``: a loaded
    `Runtime` to validate with. An infeasible problem is a result (``result.feasible`` False,
    ``result.binding``, ``result.closest``); bad input raises ``ValueError`` before any trial runs (a
    callable objective or constraint is checked against ``f(metrics)`` / ``f(metrics, config)`` then); one that
    returns something other than a finite number stops the search at that trial with a ``ValueError`` naming
    it, and one that raises stops it with its own exception.
    """
    _check_counts(n_trials, n_jobs, validate, timeout)
    _check_run(seed, storage)
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler {sampler!r}: use {', '.join(SAMPLERS)}")
    problem = build_problem(workload, slo=slo, objective=objective, direction=direction, constraints=constraints,
                            energy=energy, quality=quality, model=model, profile=profile, space=space,
                            target=target, max_queue_s=max_queue_s, quality_profile=quality_profile,
                            kv_memory=kv_memory)
    with _quiet_optuna():
        return solve(problem, n_trials=n_trials, timeout=timeout, storage=storage, study_name=study_name,
                     n_jobs=n_jobs, seed=seed, sampler=sampler, validate=validate, progress=progress,
                     on_stage=on_stage, runtime=runtime)


@contextlib.contextmanager
def _quiet_optuna():
    """Optuna's own INFO lines (one per trial, hundreds of characters each) off while it runs, as they were:
    the result carries what was found; a caller who set Optuna's verbosity lower keeps it."""
    import optuna

    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(max(level, optuna.logging.WARNING))
    try:
        yield
    finally:
        optuna.logging.set_verbosity(level)


def solve(problem: Problem, *, n_trials: int = DEFAULT_TRIALS, timeout: float | None = None, storage: Any = None,
          study_name: str | None = None, n_jobs: int = 1, seed: int = 0, sampler: str = "auto",
          validate: int = DEFAULT_TOP_K, progress: Callable[[Progress], None] | None = None,
          on_stage: Callable[[str], None] | None = None, runtime: Any = None,
          started: float | None = None) -> OptimizeResult:
    """`optimize` for a problem already built (`build_problem`), e.g. after checking every input first.
    ``timeout`` bounds the whole run, counted from ``started`` (a `time.monotonic` reading; default now): the
    search gets what is left of it, and each stage after the search (refining, simplifying, validating) stops
    when it is reached, at most one simulation or replay late, with a note saying what was cut short. A
    failure of the storage mid-run raises `StorageWriteError` (the finished trials stay in the study)."""
    _check_counts(n_trials, n_jobs, validate, timeout)
    _check_run(seed, storage)
    deadline = Deadline.after(timeout, started)
    name = study_name or default_study_name(problem)
    storage = default_storage(name) if storage is None else storage
    if n_jobs > 1 and not isinstance(storage, str):
        raise ValueError("n_jobs > 1 needs a storage URL that every worker process can open (e.g. sqlite:///s.db)")
    check_workers_fit(len(problem.search.requests), n_jobs)
    with storage_failures(storage, name):
        fields_, unseeded = _search_and_finish(with_deadline(problem, deadline), deadline, name, storage,
                                               n_trials=n_trials, n_jobs=n_jobs, seed=seed, sampler=sampler,
                                               validate=validate, progress=progress, on_stage=on_stage,
                                               runtime=runtime)
    return OptimizeResult(without_deadline(problem), fields_.pop("study"), _storage_label(storage), seed=seed,
                          sampler=sampler, unseeded=unseeded, **fields_)


def _search_and_finish(problem: Problem, deadline: Deadline, name: str, storage: Any, *, n_trials: int, n_jobs: int,
                       seed: int, sampler: str, validate: int, progress, on_stage, runtime) -> tuple[dict, str | None]:
    study = open_study(problem, open_storage(storage), name, sampler=None)
    store_recipe(study, problem, sampler=sampler, seed=seed, n_trials=n_trials)  # what `skistune worker` reads
    existing = len(study.get_trials(deepcopy=False))
    earlier = _first_new_trial(study)  # trials of earlier runs (a new study's queued baseline is this run's)
    sampling = _RunSampler(study, lambda s: make_sampler(sampler, seed=s, problem=problem, parallel=n_jobs > 1,
                                                         n_trials=n_trials), seed + existing)
    notes = list(problem.notes)
    if validate and runtime is None:
        blocked = validation_unavailable(problem)
        if blocked is not None:
            notes.append(blocked)
            validate = 0
    if validate and runtime is None and n_jobs == 1:
        runtime = load_runtime_in_background(problem)
    left = deadline.left()
    tag_of = lambda: _worker_tag(sampling.seed, unseeded=sampling.joined is not None)  # noqa: E731
    if left is not None and left <= 0:
        done = 0  # (the time went before the search: loading, checking)
    elif n_jobs == 1:
        done = _run_sequential(problem, study, n_trials, left, progress, tag_of)
    else:
        done, stopped = _run_parallel(problem, study, storage, sampler, n_trials, left, n_jobs, progress, tag_of,
                                      before_take_over=sampling.skip_to_now)
        notes += stopped
    if deadline.at is not None and done < n_trials:  # (nothing else ends a search early without an error)
        if not completed(study):
            raise ValueError(f"the timeout ({deadline.timeout_s:g} s) ran out before any trial finished (a trial "
                             "scores a config, in several simulations of the workload): give a longer --timeout "
                             f"(study {name} keeps what it had)")
        notes.append(f"the search stopped at its timeout ({deadline.timeout_s:g} s) after {done} of {n_trials} "
                     "trials; the same search again adds trials to the study")
    notes += [n for n in (sampling.note(),) if n]
    unseeded = (f"{n_jobs} worker processes sampled with random seeds" if n_jobs > 1 else
                f"another process searched the study at the same time: from trial {sampling.joined} this run "
                "sampled with a random seed" if sampling.joined is not None else
                "trials of this study were proposed with random seeds before this run (by workers of --jobs or "
                "skistune worker, or beside another process)" if _study_unseeded(study) else
                # (each run seeds its sampler anew: 10 trials and 10 more sample otherwise than 20 in one run)
                f"the study was searched in more than one run ({earlier} trials before this run's): the seed "
                "reproduces it only as the same runs in turn, each with its own --trials" if earlier else None)
    fields_ = finish(problem, study, top_k=validate, runtime=runtime, on_stage=on_stage)
    fields_["notes"] = notes + fields_["notes"]
    return {**fields_, "study": study}, unseeded


callable_module(__name__, optimize)  # ``skistune.optimize(...)`` runs `optimize`, however it was reached
