"""`skistune report`: what a study found, read back from its Optuna storage alone (the study holds the
recipe of its problem, every trial's figures and the last validation's replays).

    build_report(study_name, storage=...) -> Report   the best configs, the trade-off (Pareto) front, the
                                                        constraints that bind, predicted vs validated figures
                                                        and the knobs' importance (Optuna's fANOVA)
    report_tables(report) -> [rich Table]              the terminal view (and the HTML's tables)
    write_report(report, out_dir) -> {name: Path}       pareto.png, latency-cdf.png, memory-timeline.png and a
                                                        self-contained report.html (PNGs embedded in base64)

The latency CDFs and the memory timeline are simulated replays (the runtime keeps no per-step samples),
and say so. Nothing here writes to the study: `optuna-dashboard <storage-url>` reads the same storage.
Plots use matplotlib's object API (`Figure`, no pyplot): no backend or other global state is touched.
"""
from __future__ import annotations

import base64
import dataclasses
import html
import shlex
import itertools
import math
import os
import re
import tempfile
import textwrap
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from skistune.config import KVConfig
from skistune.display import significant
from skistune.objectives import structural_changes
from skistune.optimize import (CHOSEN_ATTR, REFINED_ATTR, VALIDATED_ATTR, completed, front_with, infeasibility,
                               nondominated, ranked, trial_counts, with_refined)
from skistune.plotting import log_axis, place_label, wants_log
from skistune.problem import Problem
from skistune.scoring import REFINE_PRECISION, Evaluation, score
from skistune.study_recipe import RECIPE_ATTR

DEFAULT_TOP_K = 5  # best configs shown
FILES = {"pareto": "pareto.png", "latency": "latency-cdf.png", "memory": "memory-timeline.png",
         "html": "report.html"}
LATENCY_METRICS = ("ttft", "tbt", "e2e")
_RATE_OBJECTIVES = ("capacity", "goodput")  # objectives in req/s: the plot's x axis when the study has one


# ---- loading ------------------------------------------------------------------------------------------------
def load_study(study_name: str, storage: Any = None) -> tuple[Any, Problem, str]:
    """The study (read only), its problem rebuilt from the stored recipe, and the storage's label (no
    password). ``storage`` None: ``skistune-<study>.db`` in this folder, as `skistune optimize` names it."""
    import optuna

    from skistune.study_recipe import problem_from_recipe
    from skistune.study_storage import _existing_sqlite, _storage_label, default_storage, open_storage

    storage = default_storage(study_name) if storage is None else storage
    _existing_sqlite(storage)  # opening a missing SQLite file would create an empty one
    try:
        study = optuna.load_study(study_name=study_name, storage=open_storage(storage))
    except KeyError:
        raise ValueError(f"study {study_name!r}: not in storage {_storage_label(storage)} (pass --storage, or "
                         "create it with skistune optimize --study NAME)") from None
    recipe = study.user_attrs.get(RECIPE_ATTR)
    if recipe is None:
        raise ValueError(f"study {study_name!r}: holds no skistune recipe (made by another tool or an older "
                         "skistune); optuna-dashboard can still show it")
    if "unsupported" in recipe:
        raise ValueError(f"study {study_name!r}: its problem is Python code the report cannot rebuild "
                         f"({recipe['unsupported'].split(';')[0]})")
    problem, _ = problem_from_recipe(recipe)
    return study, problem, _storage_label(storage)


# ---- the report's data --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Report:
    """What a study found. ``best``: feasible configs, best first objective first: the first ``refined`` as
    `skistune optimize` last refined and printed them (2% capacity precision), the rest trial figures (the
    search's precision) but for the baseline's config, refined as ``baseline`` is; ``evaluations``: every
    trial, those of refined configs with the refined figures (`optimize.with_refined`: one set of figures per
    config in every table and plot); ``pareto``: the feasible configs no other beats on the throughput axis,
    J/token, quality loss and the study's other objectives together, from ``evaluations``; ``front_ties``: configs that
    beat the written one there by less than the resolution and left the front for it (`optimize.front_with`);
    ``baseline``: the target
    engine's defaults (`baseline_label`), refined where optimize refined them; ``validated``: the last validation's
    records (`validation.validation_record`), winner first, baseline last; ``binding``/``closest``: trials each
    constraint ruled out, configs closest to feasible; ``importance``: each knob's share of the first objective's
    variance (empty with ``importance_note`` saying why); ``why``: why no config was feasible, where it can be told,
    as `skistune optimize` says it
    (`optimize_cli.why_no_rate_line` and `energy_line`)."""

    problem: Problem
    study: Any
    storage: str
    evaluations: tuple[Evaluation, ...]
    best: tuple[Evaluation, ...]
    pareto: tuple[Evaluation, ...]
    baseline: Evaluation
    validated: tuple[Mapping[str, Any], ...]
    binding: Mapping[str, int]
    closest: tuple[Evaluation, ...]
    importance: Mapping[str, float]
    importance_method: str
    importance_note: str | None = None
    why: str | None = None
    refined: int = 0
    front_ties: tuple[Evaluation, ...] = ()
    searched_trials: int = 0  # (the evaluations, less those of `simplifying_trials`: optimize's count)
    simplifying_trials: int = 0
    running_trials: int = 0  # trials running when the study was read, and what the report says of them
    running_note: str | None = None

    @property
    def feasible(self) -> bool:
        return bool(self.best)

    @property
    def name(self) -> str:
        return self.study.study_name


class StudySnapshot:
    """A study as read at one moment: its trials and attributes read once, the rest (name, directions) the
    study's. Every count of a report comes from it: read apart while `skistune optimize` still wrote the study,
    the title had said "15 trials" and the constraints table "0 of 7"."""

    def __init__(self, study) -> None:
        self._study = study
        self._trials = tuple(study.get_trials(deepcopy=False))
        self.user_attrs = study.user_attrs

    def get_trials(self, deepcopy: bool = True, states: Any = None) -> list:
        import copy

        trials = [t for t in self._trials if states is None or t.state in states]
        return copy.deepcopy(trials) if deepcopy else trials

    @property
    def trials(self) -> list:
        return self.get_trials()

    def __getattr__(self, name: str) -> Any:  # (study_name, directions, ...: fixed for a study's life)
        return getattr(self._study, name)


def running_note(study) -> str | None:
    """What a report of a study still searched should say: the trials running when it was read are not in it
    (nor any finished since): it is a snapshot. Trials a stopped process left running are said apart (the
    next run of the study retries them), as `search.running_notes` says them."""
    import optuna

    from skistune.search import _stopped_here
    from skistune.study_storage import HEARTBEAT_S

    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    if not running:
        return None
    left = [t.number for t in running if _stopped_here(t.user_attrs.get("worker"))]
    others = len(running) - len(left)
    parts = []
    if others:
        parts.append(f"another process is still running study {study.study_name} ({_count(others, 'trial')} "
                     f"running, or left by a process stopped less than {4 * HEARTBEAT_S} s ago): this report is a "
                     "snapshot of the trials finished when it was read; run it again when the search ends")
    if left:
        named = ", ".join(map(str, left[:5])) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        parts.append(f"trial{'s' * (len(left) != 1)} {named} left running by a stopped process, not in this report "
                     "(the next run of the study retries them)")
    return "; ".join(parts)


def build_report(study_name: str, *, storage: Any = None, top_k: int = DEFAULT_TOP_K) -> Report:
    """Load the study and gather the report's data (scores the baseline once: about a second), every count
    from one reading of its trials (`StudySnapshot`)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k: {top_k!r} must be an integer >= 1")
    study, problem, label = load_study(study_name, storage)
    import optuna

    study = StudySnapshot(study)
    evaluations = completed(study)
    binding = infeasibility(evaluations)[0]  # (trials as the search scored them: "trials violating it")
    importance, method, note = knob_importance(study, problem)
    validated = tuple(study.user_attrs.get(VALIDATED_ATTR, ()))
    refined = study.user_attrs.get(REFINED_ATTR)
    first, baseline = [], None
    if refined is not None:  # the figures optimize printed, not the search's coarser ones for the same configs
        first = [Evaluation.from_record(r) for r in refined["best"]]
        baseline = Evaluation.from_record(refined["baseline"])
    # one set of figures per config: trial 0 (the baseline's config) ranked below the first ones had kept its
    # search figure (0.06662 req/s) beside the refined baseline row's (0.0711)
    # (and the front optimize showed, refined whole: `optimize._refined_front`)
    front_figures = [] if refined is None else [Evaluation.from_record(r) for r in refined.get("front", ())]
    pool = evaluations if refined is None else with_refined(evaluations, [*front_figures, *first, baseline])
    # the configs closest to feasible with those figures too, as optimize printed them: trial 0's column had shown
    # the search's +0.523 over an energy budget beside the refined baseline's +0.478 (the same config)
    closest = infeasibility(pool)[1]
    best = _winner_first(ranked(problem, pool), study.user_attrs.get(CHOSEN_ATTR), validated)
    best = first + [e for e in best if e.config not in {f.config for f in first}]
    best = tuple(best[:top_k])
    why = None
    baseline = baseline or score(problem, problem.base)
    if not best:  # as optimize explains it (simulates the closest config alone: once, for terminal, HTML and JSON)
        from types import SimpleNamespace

        from skistune.optimize_cli import energy_line, why_no_rate_line

        seen = SimpleNamespace(problem=problem, binding=binding, closest=closest, trials=len(evaluations),
                               baseline=baseline)
        why = " ".join(filter(None, (why_no_rate_line(problem, closest), energy_line(seen)))) or None
    front = raw = tradeoff_front(problem, pool)
    if refined is not None and best:  # the written config on the front, as optimize shows it (a tie it won)
        front = front_with(problem, front, best[0], gains=lambda e: _gains(problem, e))
    return Report(problem, study, label, tuple(pool), best, tuple(front),
                  baseline, validated, binding, tuple(closest), importance, method,
                  note, why, refined=0 if refined is None else len(refined["best"]),
                  front_ties=tuple(e for e in raw if e not in front), running_trials=len(study.get_trials(
                      deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))), running_note=running_note(study),
                  **dict(zip(
                      ("searched_trials", "simplifying_trials"), trial_counts(study))))


def _winner_first(ranked_evaluations: list[Evaluation], chosen: dict | None,
                  validated: Sequence[dict]) -> list[Evaluation]:
    """The configs in the search's order, except that the one `skistune optimize` ranked first and wrote
    (``chosen``; in a study from before it was recorded, the first validated candidate) comes first: at the
    search's precision several configs often tie, a tie goes to the baseline or the simpler config, and
    validation chooses by measurement, so the report must not call another one #1."""
    if chosen is None:
        chosen = next((v["config"] for v in validated if v.get("role") == "candidate"), None)
    first = [e for e in ranked_evaluations if chosen is not None and e.config.to_dict() == chosen]
    return first[:1] + [e for e in ranked_evaluations if not first or e is not first[0]]


def _rate_index(problem: Problem) -> int | None:
    """The study's capacity or goodput objective (the first one), if it has one."""
    return next((i for i, o in enumerate(problem.objectives) if o.name in _RATE_OBJECTIVES), None)


def throughput_axis(problem: Problem) -> tuple[str, Callable[[Evaluation], float]]:
    """The front's and the plot's rate axis: the study's capacity or goodput objective, else the rate each
    config was scored at."""
    i = _rate_index(problem)
    if i is None:
        return "rate (req/s)", lambda e: e.figures.get("rate_rps", 0.0)
    return f"{problem.objectives[i].name} (req/s)", lambda e: e.values[i]


def quality_loss(e: Evaluation) -> float:
    """Predicted mean-window loss: 0 for lossless configs (or no quality profile), inf outside the profile."""
    loss = e.figures.get("quality_loss")
    if loss is not None:
        return loss
    return 0.0 if e.figures.get("quality_basis") in (None, "exact") else math.inf


def _other_objectives(problem: Problem) -> list[int]:
    """The study's objectives the front adds to the rate, J/token and quality loss axes (e.g. memory)."""
    return [i for i, o in enumerate(problem.objectives)
            if i != _rate_index(problem) and o.name not in ("energy", "quality")]


def _gains(problem: Problem, e: Evaluation) -> tuple[float, ...]:
    """The front's axes, each as "higher is better": throughput, -J/token, -quality loss, then the study's
    other objectives."""
    _, rate = throughput_axis(problem)
    others = [e.values[i] if problem.objectives[i].maximize else -e.values[i] for i in _other_objectives(problem)]
    return (rate(e), -e.figures.get("energy_j_per_token", math.inf), -quality_loss(e), *others)


def front_axes(problem: Problem) -> list[str]:
    """The names of `_gains`' axes, with the better direction."""
    others = [problem.objectives[i] for i in _other_objectives(problem)]
    return [f"{throughput_axis(problem)[0]} ↑", "J/token ↓", "quality loss ↓",
            *(f"{o.name} {'↑' if o.maximize else '↓'}" for o in others)]


def tradeoff_front(problem: Problem, evaluations: Sequence[Evaluation]) -> list[Evaluation]:
    """The feasible, distinct configs that no other beats on every axis of `_gains`, best first objective
    first (a superset of the study's own Pareto front; of configs with the same figures, the first)."""
    return nondominated(ranked(problem, evaluations), lambda e: _gains(problem, e))


def knob_importance(study, problem: Problem) -> tuple[dict[str, float], str, str | None]:
    """Each searched knob's importance for the first objective over the complete trials: fANOVA (Optuna's,
    random forests from scikit-learn) or, without scikit-learn, PED-ANOVA. Knobs that only some trials
    have (conditional ones) are left out, as Optuna does. Returns (importances, method, note)."""
    from importlib.util import find_spec

    import optuna

    fanova = find_spec("sklearn") is not None
    evaluator = optuna.importance.FanovaImportanceEvaluator(seed=0) if fanova else \
        optuna.importance.PedAnovaImportanceEvaluator()
    method = "fANOVA" if fanova else "PED-ANOVA (no scikit-learn for fANOVA)"
    if len(completed(study)) < 2:
        return {}, method, "knob importance: not computed (fewer than 2 complete trials)"
    first = problem.objectives[0]
    values = [e.values[0] for e in completed(study) if math.isfinite(e.values[0])]
    if values and max(values) - min(values) <= REFINE_PRECISION * max(abs(v) for v in values):
        # (a spread of 0.009% over every trial had been ranked as if it were signal: below what the search
        # resolves, no knob moved the objective)
        return {}, method, (f"knob importance: not computed ({first.name} varies by at most "
                            f"{REFINE_PRECISION:.0%} over the trials, below what the search resolves)")
    sign = -1.0 if first.maximize and not fanova else 1.0  # PED-ANOVA ranks low values as good
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = optuna.importance.get_param_importances(study, evaluator=evaluator,
                                                            target=lambda t: sign * t.values[0])
    except (ValueError, ZeroDivisionError) as exc:  # e.g. no knob that every trial has
        return {}, method, f"knob importance: not computed ({str(exc).strip() or type(exc).__name__})"
    except RuntimeError:  # fANOVA's "zero total variance"
        found = {}
    found = {k: float(v) for k, v in found.items()}
    if not any(v > 0 for v in found.values()):
        return {}, method, (f"knob importance: not computed ({first.name} does not vary over the trials that "
                            "share their knobs; run more trials)")
    return found, method, None


# ---- simulated replays ----------------------------------------------------------------------------------------
def latency_samples(report: Report, replays: "Replays | None" = None) -> dict[str, dict[str, np.ndarray]] | None:
    """TTFT, TBT (every gap between tokens) and E2E of each request, simulated for the best config and the
    baseline on the search's requests at the best config's operating rate (None: no feasible config).
    ``replays``: replays of the same report already run (`Replays`), reused."""
    if not report.best:
        return None
    replays = replays if replays is not None else Replays(report.problem.target)
    best = report.best[0]
    return {label: replays.latencies(config, report.problem.search.requests, best.rate_scale)
            for label, config in (("best (#1)", best.config),
                                  (f"baseline ({baseline_label(report)})", report.problem.base))}


def record_latencies(records) -> dict[str, np.ndarray]:
    """TTFT, TBT (every gap between two tokens of a request), E2E and TPOT of the finished ``records``, as float64
    arrays; the token times gathered into one array first (a 20,000-request trace has 4 million gaps: one
    ``np.diff`` per request and a concatenation had taken seconds)."""
    done = [r for r in records if r.finish_s is not None]
    counts = np.fromiter((len(r.token_times_s) for r in done), dtype=np.int64, count=len(done))
    times = np.fromiter(itertools.chain.from_iterable(r.token_times_s for r in done), dtype=np.float64,
                        count=int(counts.sum()))
    gaps = np.diff(times)
    starts = np.cumsum(counts) - counts  # [requests]: each request's first token in ``times``
    within = np.ones(gaps.size, dtype=bool)
    within[starts[1:] - 1] = False  # (the gap from one request's last token to the next's first)
    arrivals = np.fromiter((r.arrival_s for r in done), dtype=np.float64, count=len(done))
    finishes = np.fromiter((r.finish_s for r in done), dtype=np.float64, count=len(done))
    several = counts > 1  # TPOT, as `runtime.metrics` has it: of requests with two tokens or more
    tpot = (finishes - times[starts])[several] / (counts[several] - 1)
    return {"ttft": times[starts] - arrivals, "tbt": gaps[within], "e2e": finishes - arrivals, "tpot": tpot}


class Replays:
    """The simulated replays behind a report's plots, each run once: without a validation the memory timeline
    replays #1 on the search's requests at its rate, as its latency CDF does, and #1 is often the baseline's
    config itself (three simulations of a 20,000-request trace had been one, run three times). Keeps each
    replay's latencies (`record_latencies`) and, when sampled, its `Timeline`, not its engine."""

    def __init__(self, target) -> None:
        self.target = target
        self._runs: dict[tuple, tuple[dict[str, np.ndarray], Timeline | None]] = {}

    def _key(self, config: KVConfig, requests, rate_scale: float) -> tuple:
        return config, id(requests), rate_scale

    def latencies(self, config: KVConfig, requests, rate_scale: float) -> dict[str, np.ndarray]:
        key = self._key(config, requests, rate_scale)
        if key not in self._runs:
            from skistune.simulator import build_engine, with_rate_scale

            engine, _ = build_engine(config, self.target)
            engine.replay(with_rate_scale(requests, rate_scale))
            self._runs[key] = (record_latencies(engine.records), None)
        return self._runs[key][0]

    def timeline(self, config: KVConfig, requests, rate_scale: float, label: str) -> Timeline:
        key = self._key(config, requests, rate_scale)
        if key not in self._runs or self._runs[key][1] is None:
            timeline, engine = _sampled_run(config, requests, self.target, rate_scale, label)
            self._runs[key] = (record_latencies(engine.records), timeline)
        return dataclasses.replace(self._runs[key][1], label=label)


@dataclass(frozen=True)
class Timeline:
    """KV bytes in use per tier (device: blocks held by sequences; host and disk: cached prefix blocks and
    swapped sequences) sampled around each engine step (`sampled_replay`), with each tier's capacity."""

    label: str
    time_s: np.ndarray  # [samples]
    used_bytes: Mapping[str, np.ndarray]  # tier -> [samples]
    capacity_bytes: Mapping[str, int]


def sampled_replay(config: KVConfig, requests, target, rate_scale: float, label: str) -> Timeline:
    """Simulate ``requests`` at ``rate_scale`` and sample the tiers before and after every step and after
    every fast-forwarded run of steps (and the most blocks each held, so that the device line peaks where
    `Metrics.kv_peak_bytes` does), by wrapping this engine's ``step`` and ``fast_forward`` (the runtime's loop is
    unchanged). Lines between the samples are then flat through idle waits and steady through runs."""
    return _sampled_run(config, requests, target, rate_scale, label)[0]


def _sampled_run(config: KVConfig, requests, target, rate_scale: float, label: str) -> tuple[Timeline, Any]:
    """`sampled_replay`'s timeline and the engine that served it (its records: the same as an unsampled
    replay's, since the samples only read the engine)."""
    from skistune.simulator import build_engine, with_rate_scale

    engine, _ = build_engine(config, target)
    kv, samples = engine.kv, [(0.0, 0, 0, 0)]

    def sample() -> None:
        lower = (kv.tiers.host.num_used(), kv.tiers.disk.num_used()) if kv.tiers is not None else (0, 0)
        samples.append((engine.clock.now(), kv.pool.num_used(), *lower))

    step, fast_forward = engine.step, engine.fast_forward

    def with_peak(run: Callable[[], Any], peak_at_end: bool) -> Any:
        """``run()``, then a sample of the most blocks it held, if more than it left held: a step allocates
        as it schedules and frees finished sequences at its end (so it holds its peak throughout), a run of
        decode steps grows to its peak at its end; sampled only between them, the device line had missed
        the peak the tables show (49.9 MiB plotted against 54.8 MiB)."""
        start_s, overall_peak = engine.clock.now(), kv.peak_used_blocks
        kv.peak_used_blocks = kv.pool.num_used()  # (the engine's own peak, restored below, for its metrics)
        result = run()
        run_peak = kv.peak_used_blocks
        kv.peak_used_blocks = max(overall_peak, run_peak)
        if run_peak > kv.pool.num_used():
            samples.append((engine.clock.now() if peak_at_end else start_s, run_peak, *samples[-1][2:]))
        sample()
        return result

    def sampled_step():
        sample()  # at the step's start: the blocks held through any idle wait before it
        return with_peak(step, peak_at_end=False)

    def sampled_fast_forward(eng, next_arrival_s: float) -> None:
        with_peak(lambda: fast_forward(eng, next_arrival_s), peak_at_end=True)

    engine.step = sampled_step
    engine.fast_forward = sampled_fast_forward if fast_forward is not None else None
    engine.replay(with_rate_scale(requests, rate_scale))
    data = np.array(samples, dtype=np.float64)  # [samples, 4]: time, device, host, disk blocks
    lower = (kv.tiers.host.capacity, kv.tiers.disk.capacity) if kv.tiers is not None else (0, 0)
    capacity = dict(zip(("device", "host", "disk"), (kv.pool.num_blocks, *lower)))
    used = {tier: data[:, i + 1] * engine.block_bytes for i, tier in enumerate(capacity) if capacity[tier]}
    return Timeline(label, data[:, 0], used, {t: n * engine.block_bytes for t, n in capacity.items() if n}), engine


def memory_timeline(report: Report, replays: Replays | None = None) -> Timeline | None:
    """The validated winner replayed (simulated) on the validation slice at its validated rate, with the KV
    pools the runtime replay used (`validation.replay_config`); without a validation stored, the best config
    on the search's requests at its operating rate. None: no feasible config and no validation.
    ``replays``: replays of the same report already run (`Replays`), reused."""
    from skistune.scoring import score_at
    from skistune.validation import replay_config, validation_requests
    from skistune.runtime.kv_layout import KVPoolTooSmall

    p = report.problem
    replays = replays if replays is not None else Replays(p.target)
    winner = next((v for v in report.validated if v["role"] == "candidate"), None)
    if winner is not None:
        requests = validation_requests(p)
        scale = winner["rate_rps"] / requests.base_rps
        predicted = score_at(p, KVConfig.from_dict(winner["config"]), requests, scale)
        label = (f"simulated replay of the validation slice ({requests_at(requests.requests, winner['rate_rps'])}), "
                 + ("validated winner" if winner["holds"] else "winner (its runtime replay broke a constraint)"))
        try:
            config = replay_config(p, predicted, requests)
        except KVPoolTooSmall:  # the capped pool cannot hold the config's full-precision rings: uncapped
            config = predicted.config
        capped = [f"{tier} {_mib(getattr(config.offload, f'{tier}_kv_bytes'))} of the config's "
                  f"{_mib(getattr(predicted.config.offload, f'{tier}_kv_bytes'))}" for tier in ("host", "disk")
                  if getattr(config.offload, f"{tier}_kv_bytes") != getattr(predicted.config.offload, f"{tier}_kv_bytes")]
        if capped:  # (the plot's pools are the replay's, not the tuned file's)
            label += f"; pools capped for the replay as the runtime's were: {', '.join(capped)}"
        return replays.timeline(config, requests.requests, scale, label)
    if not report.best:
        return None
    best = report.best[0]
    label = (f"simulated replay of the search workload ({requests_at(p.search.requests, best.figures['rate_rps'])}),"
             " best config #1; no validated run in the study")
    return replays.timeline(best.config, p.search.requests, best.rate_scale, label)


# ---- tables -------------------------------------------------------------------------------------------------
def _view(report: Report, rows: Sequence[Evaluation]) -> Any:
    """What `optimize_cli`'s tables read from a result: the problem, the rows, the baseline."""
    from types import SimpleNamespace

    return SimpleNamespace(problem=report.problem, best=list(rows), baseline=report.baseline)


def refined_rows(report: Report) -> list[bool]:
    """Which of the best configs carry refined figures (2% capacity precision), by rank: the first ``refined``
    and the baseline's config, refined as the base row is (nothing where optimize never refined the study)."""
    base = report.baseline.config.effective()
    return [bool(report.refined) and (i < report.refined or e.config.effective() == base)
            for i, e in enumerate(report.best)]


def best_configs_table(report: Report):
    from skistune.scoring import REFINE_PRECISION
    from skistune.optimize_cli import best_table

    table = best_table(_view(report, report.best))
    p = report.problem
    # which rows carry refined figures, by rank: the baseline's config refined as the base row is, so that it
    # shows one figure (a trial-0 row at the search's 0.06662 req/s beside a base row's 0.0711 read as a
    # contradiction)
    fine = refined_rows(report)
    ranks = [f"#{i + 1}" for i, f in enumerate(fine) if f]
    coarse = [f"#{i + 1}" for i, f in enumerate(fine) if not f]
    precision = ("at the search's precision" if not report.refined else
                 f"{', '.join(ranks)} and base at {REFINE_PRECISION:.0%} precision as optimize printed them"
                 + (f", {', '.join(coarse)} at the search's" if coarse else ""))
    table.title = (f"Best configs of study {report.name} ({_trials(report)}), predicted on "
                   f"{_count(len(p.workload), 'request')} of {p.workload.name}, {precision}")
    return table


def pareto_table(report: Report):
    from skistune.display import Table

    from skistune.optimize_cli import _fmt, _quality_cell

    axis, rate = throughput_axis(report.problem)
    axes = front_axes(report.problem)
    t = Table(title=f"Pareto front: {_count(len(report.pareto), 'feasible config')} no other beats on "
                    f"{', '.join(axes[:-1])} and {axes[-1]} together, and the baseline (base) to compare",
              title_justify="left")
    # (the knobs are named under the tables, as the best configs' are: a column of them, folded to a terminal's
    # width, stood a dozen lines tall per row)
    energy = f"J/token ({report.problem.profile.power.source})"
    for col, justify in (("trial", "left"), ("config", "left"), (axis, "right"), (energy, "right"),
                         ("KV peak (MiB)", "right"), ("quality Δppl mean / worst", "right")):
        t.add_column(col, justify=justify, overflow="fold")
    for e in [*report.pareto, report.baseline]:
        t.add_row("base" if e is report.baseline else str(e.trial), _best_label(report, e), significant(rate(e), 4),
                  _fmt(e.figures["energy_j_per_token"], digits=3), _fmt(e.figures["kv_peak_bytes"], 2**-20),
                  _quality_cell(e.figures))
    return t


def baseline_label(report: Report) -> str:
    """The baseline's name, ``SGLang defaults`` in a study made with ``--target sglang``: the engine the footer's
    ``base:`` line names (`Problem.baseline_engine`), so no table or legend calls it another's."""
    return f"{report.problem.baseline_engine} defaults"


def _best_label(report: Report, e: Evaluation) -> str:
    """``#k`` where the config is the k-th best, `baseline_label` for the baseline, else its knob line below."""
    if e is report.baseline:
        return baseline_label(report)
    k = next((i for i, b in enumerate(report.best) if b.trial == e.trial), None)
    return f"#{k + 1}" if k is not None else f"trial {e.trial}, below"


def pareto_lines(report: Report) -> list[str]:
    """The knobs of the front's configs that are not among the best configs (those have a line already)."""
    from skistune.optimize_cli import _diff

    names = [q.name for q in report.problem.space.params if not q.is_switch]
    best = {b.trial for b in report.best}
    lines = [f"trial {e.trial} (Pareto front): {_diff(e.config, report.problem.base, names)}"
             for e in report.pareto if e.trial not in best]
    if report.front_ties:  # (a worker's later trial at the search's precision read as beating #1 on every axis)
        from skistune.scoring import REFINE_PRECISION

        trials = ", ".join(f"trial {e.trial}" for e in report.front_ties)
        lines.append(f"{trials}: within {REFINE_PRECISION:.0%} of #1 on every axis of the front (its figures at the "
                     "search's precision), so the same point as #1, which the front keeps for it")
    return lines


def violations_table(report: Report):
    """Per constraint: the trials it ruled out, and its value (<= 0 met) for #1 (or the config closest to
    feasible, when none is) and the baseline."""
    from skistune.display import Table

    first = report.best[0] if report.best else (report.closest[0] if report.closest else None)
    who = "#1" if report.best else f"closest (trial {first.trial})" if first is not None else "-"
    t = Table(title="Constraints: trials each ruled out, and each one's value (<= 0 is met: relative excess "
                    "over the limit)", title_justify="left")
    for col in ("constraint", "trials violating it", who, "baseline"):
        t.add_column(col, justify="left" if col == "constraint" else "right")
    for c in report.problem.constraints:
        values = [e.violations.get(c.name) if e is not None else None for e in (first, report.baseline)]
        t.add_row(c.name, f"{report.binding.get(c.name, 0)} of {len(report.evaluations)}",
                  *("-" if v is None else f"{v:+.3g}" for v in values))
    return t


_FIDELITY = (("TTFT p99 (ms)", "ttft_p99_s", 1e3), ("TBT p99 (ms)", "tbt_p99_s", 1e3),
             ("E2E p99 (ms)", "e2e_p99_s", 1e3), ("J/token", "energy_j_per_token", 1.0),
             ("KV peak (MiB)", "kv_peak_bytes", 2**-20))


def _versus(predicted: float | None, measured: float | None, scale: float) -> str:
    """``predicted / measured (error)``, the error of the prediction relative to the measurement."""
    if predicted is None or measured is None or not math.isfinite(predicted) or not math.isfinite(measured):
        return "-"
    error = f" ({(predicted - measured) / measured:+.0%})" if measured else ""
    return f"{_num(predicted * scale)} / {_num(measured * scale)}{error}"


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def validation_fidelity_table(report: Report):
    """Predicted vs measured figures of the last validation (the simulator's error in brackets)."""
    from skistune.display import Table

    first = report.validated[0]["measured"].get("requests")
    t = Table(title=f"Predicted vs validated on the real runtime ({first} requests, lengths capped, replayed "
                    "at the rate the simulator chose): predicted / measured (prediction error)",
              title_justify="left")
    power = report.problem.profile.power.source  # (J/token is predicted and measured with the profile's power)
    names = [f"{name} ({power})" if key == "energy_j_per_token" else name for name, key, _ in _FIDELITY]
    for col in ("config", "rate (req/s)", *names, "holds"):
        t.add_column(col, justify="left" if col == "config" else "right")
    labels = {e.config: f"#{i + 1}" for i, e in enumerate(report.best)}
    for v in report.validated:
        config = KVConfig.from_dict(v["config"])
        label = "base" if v["role"] == "baseline" else labels.get(config, "candidate")
        holds = "[green]yes[/]" if v["holds"] else f"[red]no[/] ({', '.join(v['binding'])})"
        t.add_row(label, significant(v['rate_rps']),
                  *(_versus(v["predicted"].get(key), v["measured"].get(key), scale) for _, key, scale in _FIDELITY),
                  holds)
    return t


def importance_table(report: Report):
    from skistune.display import Table

    trials = len(report.evaluations)
    t = Table(title=f"Knob importance for {report.problem.objectives[0].name} ({report.importance_method} over "
                    f"{trials} trials; knobs only some trials set are left out)", title_justify="left")
    for col, justify in (("knob", "left"), ("importance", "right"), ("", "left")):
        t.add_column(col, justify=justify)
    for knob, value in report.importance.items():  # (a switch, e.g. mixed_precision, is the space's, not a knob)
        t.add_row(knob if "." in knob else f"{knob} (search-space switch)", f"{value:.3f}", "█" * round(30 * value))
    return t


def report_tables(report: Report) -> list:
    """The report's tables in order; those without data (no feasible config, no validation, no importance)
    are left out."""
    tables = [best_configs_table(report), pareto_table(report)] if report.feasible else []
    tables.append(violations_table(report))
    if report.validated:
        tables.append(validation_fidelity_table(report))
    if report.importance:
        tables.append(importance_table(report))
    return tables


def report_lines(report: Report) -> list[str]:
    """Notes under the tables: the best configs' knobs, the problem's notes, what is missing and why."""
    from skistune.optimize_cli import knob_lines

    lines = knob_lines(_view(report, report.best)) + pareto_lines(report) if report.feasible else [
        f"no config met every constraint in {_trials(report)}; see the constraints table",
        *filter(None, [report.why])]
    lines += [f"note: {n}" for n in report.problem.notes]
    if report.validated:  # the top configs the last validation did not replay, as optimize said
        from types import SimpleNamespace

        from skistune.optimize_cli import twin_lines
        replays = [SimpleNamespace(role=v["role"], config=KVConfig.from_dict(v["config"]),
                                   twins=tuple(KVConfig.from_dict(c) for c in v.get("twins", ())))
                   for v in report.validated]
        lines += twin_lines(SimpleNamespace(best=report.best, baseline=report.baseline, validated=replays))
    if not report.validated:
        lines.append("note: no validated run in the study (skistune optimize --validate K replays the top K on "
                     "the real runtime)")
    if report.importance_note:
        lines.append(f"note: {report.importance_note}")
    if report.running_note:
        lines.append(f"note: {report.running_note}")
    return lines


# ---- plots --------------------------------------------------------------------------------------------------
def _png(fig) -> bytes:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def _same_point_as_baseline(report: Report, rate: Callable[[Evaluation], float]) -> list[Evaluation]:
    """The trials of the baseline's config plotted where the baseline's star is (the report reads them with the
    refined baseline's figures, `optimize.with_refined`): drawn as the star alone, not also as a dot or a cross
    under it."""
    base = report.baseline
    at = (rate(base), base.figures.get("energy_j_per_token"))
    return [e for e in report.evaluations if e.config.effective() == base.config.effective()
            and (rate(e), e.figures.get("energy_j_per_token")) == at]


def _scatter_trials(ax, report: Report, rate: Callable[[Evaluation], float]):
    """Every scored trial but those drawn as the baseline's star: infeasible ones as grey crosses, feasible ones
    coloured by quality loss (%). Returns the feasible points' collection (None: none; for a colour bar) and
    whether any is lossy."""
    starred = {id(e) for e in _same_point_as_baseline(report, rate)}
    finite = [e for e in report.evaluations
              if math.isfinite(e.figures.get("energy_j_per_token", math.inf)) and id(e) not in starred]
    bad = [e for e in finite if not e.feasible]
    if bad:
        ax.scatter([rate(e) for e in bad], [e.figures["energy_j_per_token"] for e in bad], marker="x",
                   color="0.6", label=f"infeasible ({_count(len(bad), 'trial')})")
    good = ranked(report.problem, finite)
    if not good:
        return None, False
    # quality outside the profile's grid (no prediction) as rings of their own, not the colour of a 100% loss; the
    # others the least lossy on top: a lossless front config had been hidden under two unknown ones at its spot
    unknown = [e for e in good if not math.isfinite(quality_loss(e))]
    if unknown:
        ax.scatter([rate(e) for e in unknown], [e.figures["energy_j_per_token"] for e in unknown], s=30,
                   facecolors="none", edgecolors="0.45",
                   label=f"feasible, quality not predicted (outside the profile's grid; {_count(len(unknown), 'trial')})")
    good = sorted((e for e in good if math.isfinite(quality_loss(e))), key=lambda e: -quality_loss(e))
    if not good:
        return None, False
    losses = np.array([min(quality_loss(e), 1.0) * 100 for e in good])  # (the colour scale stops at 100%)
    # (a 4-bit config predicted +0.00% is lossy all the same: "all lossless" is said of configs that change no
    # output, not of losses that round to zero)
    lossy = bool(losses.max() > 0) or any(structural_changes(e.config) for e in good)
    label = "feasible" if lossy else "feasible (all lossless: quality loss 0)"
    points = ax.scatter([rate(e) for e in good], [e.figures["energy_j_per_token"] for e in good],
                        c=losses if lossy else "tab:blue", cmap="viridis" if lossy else None, s=30, label=label)
    return points, lossy


def _star_label(report: Report, rate: Callable[[Evaluation], float]) -> str:
    """The baseline's legend entry, naming the trials of its config drawn as the star (`_same_point_as_baseline`),
    and whether it is infeasible (a star had sat on a grey cross: the same config drawn twice)."""
    trials = [e.trial for e in _same_point_as_baseline(report, rate)]
    label = f"baseline ({baseline_label(report)}"
    if trials:
        label += f"; trial{'s' * (len(trials) > 1)} {', '.join(map(str, trials))}"
    return label + ("" if report.baseline.feasible else ", infeasible") + ")"


def energy_budget(report: Report) -> float | None:
    """The study's energy budget (J/token) where it binds (rules out a trial), else None: drawn on the Pareto
    plot, whose y axis is J/token, where it explains which configs are grey."""
    from skistune.objectives import EnergyBudget

    budgets = [c.value.__self__ for c in report.problem.constraints
               if isinstance(getattr(c.value, "__self__", None), EnergyBudget)]
    if not budgets or not report.binding.get(str(budgets[0])):
        return None
    return budgets[0].limit_j_per_token


def _ring_front(ax, report: Report, rate: Callable[[Evaluation], float], axis: str) -> None:
    """Ring the front's configs (their labels come last: `_label_front`, once the axes' limits are final)."""
    if not report.pareto:
        return
    points = [(rate(e), e.figures["energy_j_per_token"]) for e in report.pareto]
    off_plot = [o.name for o in report.problem.objectives if o.name != "energy" and not axis.startswith(o.name)]
    also = f"; also on {', '.join(off_plot)}, off the plot" if off_plot else ""  # (a ringed point may look beaten)
    ax.plot(*zip(*points), "o", mfc="none", mec="black", ms=12, mew=1.5, zorder=4,
            label=f"Pareto front ({_count(len(report.pareto), 'config')}{also})")


def _label_front(ax, report: Report, rate: Callable[[Evaluation], float]) -> None:
    """Label the front's configs (and #1, wherever it is), one label for configs within 2% of the axes' size of
    each other (e.g. configs that differ in an objective off the plot, such as memory). Called once the axes'
    scale and limits are final: placed before a zoom, the labels' clear spots were computed on other limits, and
    "#1 trial 24" landed on the baseline's star."""
    if not report.pareto:
        return
    ranks = {e.config: f"#{i + 1} " for i, e in enumerate(report.best)}
    marked = [(e, (rate(e), e.figures["energy_j_per_token"])) for e in report.pareto]
    if report.best and report.best[0].config not in {e.config for e in report.pareto}:  # what optimize wrote
        first = report.best[0]  # (off the front: the baseline after a tie, or a simpler config)
        marked.append((first, (rate(first), first.figures["energy_j_per_token"])))
    to_axes = ax.transData + ax.transAxes.inverted()  # (axes fractions: a log axis too is cut in even cells)
    labels: dict[tuple[int, int], tuple[tuple[float, float], list[str]]] = {}
    for e, (x, y) in marked:
        fx, fy = to_axes.transform((x, y))
        labels.setdefault((round(50 * fx), round(50 * fy)), ((x, y), []))[1].append(
            f"{ranks.get(e.config, '')}trial {e.trial}")
    # each label on a leader line from its own ring, clear of every other dot where one of the offsets is; #1's
    # placed first, so it gets the nearest clear spot
    dots = [(rate(e), e.figures.get("energy_j_per_token", math.nan)) for e in (*report.evaluations, report.baseline)]
    avoid, taken = ax.transData.transform([d for d in dots if all(map(math.isfinite, d))] or np.zeros((0, 2))), []
    for (x, y), names in sorted(labels.values(), key=lambda v: not any(n.startswith("#1 ") for n in v[1])):
        place_label(ax, ", ".join(names), (x, y), avoid, taken, fontsize=8, zorder=5)


def plot_x_axis(report: Report) -> tuple[str, Callable[[Evaluation], float]]:
    """The Pareto plot's x axis: the study's rate objective; without one, where every config that served was
    scored at the workload's own rate (a rate axis would stack every trial on one vertical line), its first
    objective other than energy (J/token is the y axis), else the KV peak. A trial that served nothing has no rate
    (read as 0): it does not make the rates vary (a study at --rate 0.1 had every point on x = 0.1)."""
    axis, rate = throughput_axis(report.problem)
    rates = {rate(e) for e in report.evaluations if rate(e) > 0 and math.isfinite(rate(e))}
    if _rate_index(report.problem) is not None or len(rates) > 1:
        return axis, rate
    problem = report.problem
    i = next((i for i, o in enumerate(problem.objectives) if o.name != "energy"), None)
    if i is None:
        return "KV peak (MiB)", lambda e: e.figures.get("kv_peak_bytes", math.nan) / 2**20
    o = problem.objectives[i]
    if o.name == "memory":
        return "memory: KV peak (MiB)", lambda e: e.values[i] / 2**20
    return f"{o.name}{f' ({o.unit})' if o.unit else ''}", lambda e: e.values[i]


@dataclass(frozen=True)
class ParetoView:
    """The Pareto plot's limits and y scale, from the points it shows: ``out_of_view`` trials met no rate (at
    x = 0, J/token far above the rest) and are zoomed out; ``undrawn`` trials have no finite figure (served no
    request) and have no point at all."""

    xlim: tuple[float, float]
    ylim: tuple[float, float]
    log_y: bool
    out_of_view: int = 0
    undrawn: int = 0


def _padded(low: float, high: float, log: bool = False) -> tuple[float, float]:
    """``low``..``high`` with a margin for the markers (the star is 16 pt across), kept >= 0 where they are."""
    if log:
        return low / 1.15, high * 1.15
    pad = 0.08 * (high - low) or 0.08 * abs(high) or 1.0
    return (max(0.0, low - pad) if low >= 0 else low - pad), high + pad


def pareto_view(report: Report, rate: Callable[[Evaluation], float], budget: float | None = None) -> ParetoView | None:
    """The limits of the Pareto plot and whether J/token is on a log axis, decided from the points in view (None:
    no point to show): where some trials meet no rate and others do, those at rate 0 are left out of view (scored
    at the lowest rate, idle power over hours of trace makes their J/token up to 100x the others': one such cross
    squashed every feasible point into a corner); the scale follows from what stays in view (decided before the
    zoom, from points out of view, it was a log axis over 0.28-0.95 J/token labelled "1" alone). ``budget``, an
    energy budget drawn as a line, stays in view too."""
    trials = [(rate(e), e.figures.get("energy_j_per_token", math.nan)) for e in report.evaluations]
    base = report.baseline
    drawn = [(x, y) for x, y in trials if math.isfinite(x) and math.isfinite(y) and y > 0]
    undrawn = len(trials) - len(drawn)
    star = (rate(base), base.figures.get("energy_j_per_token", math.nan))
    shown = drawn + ([star] if all(map(math.isfinite, star)) and star[1] > 0 else [])
    served = [(x, y) for x, y in shown if x > 0]
    out_of_view = sum(1 for x, _ in drawn if not x > 0) if served else 0
    shown = served if out_of_view else shown
    if not shown:
        return None
    xs, ys = [x for x, _ in shown], [y for _, y in shown] + ([budget] if budget else [])
    log = wants_log(min(ys), max(ys))
    return ParetoView(_padded(min(xs), max(xs)), _padded(min(ys), max(ys), log), log, out_of_view, undrawn)


def _view_note(view: ParetoView | None) -> str:
    """What the title says of the trials not shown."""
    if view is None:
        return ""
    parts = ([f"{_count(view.out_of_view, 'trial')} meeting no rate, at 0, out of view"] if view.out_of_view else []) \
        + ([f"{_count(view.undrawn, 'trial')} serving no request, not drawn"] if view.undrawn else [])
    return f" ({'; '.join(parts)})" if parts else ""


def plot_pareto(report: Report) -> bytes:
    """Throughput (capacity) vs J/token, quality loss as colour: the front ringed, the baseline a star, a binding
    energy budget a line. The labels are placed last, on the final axes."""
    from matplotlib.figure import Figure

    axis, rate = plot_x_axis(report)
    fig = Figure(figsize=(8.5, 5.5), dpi=110)
    ax = fig.add_subplot()
    points, lossy = _scatter_trials(ax, report, rate)
    if lossy:
        fig.colorbar(points, ax=ax, label="predicted quality loss, Δppl mean (%; 100 and above at the top)")
    base = report.baseline
    ax.plot([rate(base)], [base.figures["energy_j_per_token"]], "*", color="tab:red", ms=16, zorder=3,
            label=_star_label(report, rate))
    budget = energy_budget(report)
    if budget is not None:
        ax.axhline(budget, color="tab:red", ls="--", lw=1, label=f"energy budget ({budget:g} J/token)")
    _ring_front(ax, report, rate, axis)
    view = pareto_view(report, rate, budget)
    if view is not None:
        if view.log_y:
            log_axis(ax.yaxis, ax.set_yscale, *view.ylim)
        ax.set_xlim(*view.xlim)
        ax.set_ylim(*view.ylim)
    _label_front(ax, report, rate)
    ax.set_xlabel(axis)
    ax.set_ylabel(f"J/token ({report.problem.profile.power.source})")
    ax.set_title(f"Study {report.name}: {_trials(report)}, predicted by the simulator{_view_note(view)}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return _png(fig)


def _limit_text(value: float) -> str:
    """A limit in plain numbers, up to 4 significant digits, no trailing zeros (40, 0.15, 20,000)."""
    text = significant(value, 4)
    return text.rstrip("0").rstrip(".") if "." in text else text


def _slo_level(percentile: str) -> float | None:
    """The CDF level an SLO's statistic sits at (p99: 0.99, max: 1); None for the mean, which is no level."""
    if percentile == "mean":
        return None
    return 1.0 if percentile == "max" else float(percentile[1:]) / 100


def _slo_marks(ax, metric: str, slos, scale: float, unit: str, means: Mapping[str, float]) -> None:
    """The panel's SLO limits, in the axis's unit ("ttft:p99<=20000ms" had labelled an axis in seconds): a
    percentile (or max) limit as a dashed line with a marker at its level, where the CDF must be by then; a limit
    on the mean as a dotted line with each line's mean marked on the axis (the mean is no point of a CDF: drawn
    alike, it read as a percentile)."""
    for s in (s for s in slos if getattr(s, "metric", None) == metric):
        limit, level = s.limit_s * scale, _slo_level(s.percentile)
        text = f"{_limit_text(limit)} {unit}"
        if level is None:
            ax.axvline(limit, color="black", ls=":", lw=1.3, label=f"SLO: mean {metric.upper()} ≤ {text}")
            for (label, mean), color in zip(means.items(), ("tab:blue", "tab:red")):
                ax.plot([mean * scale], [0.0], marker="^", ms=9, color=color, ls="none", clip_on=False, zorder=5,
                        label=f"mean of {label.split(' (')[0]}")
            continue
        ax.axvline(limit, color="black", ls="--", lw=1, label=f"SLO: {s.percentile} {metric.upper()} ≤ {text}")
        ax.plot([limit], [level], marker="<", ms=7, color="black", ls="none", zorder=5,
                label=f"{s.percentile}: the CDF reaches {level:g} left of here")


def _tail_marks(ax, metric: str, slos, scale: float) -> list[float]:
    """The SLO limits on the upper-tail panel: the same lines, and for a percentile below the max the share of
    values it lets past the limit (p99: 0.01), marked at the limit, where the tail line must be at or below it.
    Returns those shares (the panel's bottom must show them)."""
    shares = []
    for s in (s for s in slos if getattr(s, "metric", None) == metric):
        limit, level = s.limit_s * scale, _slo_level(s.percentile)
        ax.axvline(limit, color="black", ls=":" if level is None else "--", lw=1.3 if level is None else 1)
        if level is not None and level < 1:
            ax.plot([limit], [1 - level], marker="<", ms=7, color="black", ls="none", zorder=5)
            ax.annotate(f"{s.percentile}: at most {1 - level:.3g} above", (limit, 1 - level), xytext=(-8, 6),
                        textcoords="offset points", ha="right", fontsize=7,
                        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})
            shares.append(1 - level)
    return shares


def _cdf_line(ax, values_s: np.ndarray, scale: float, color: str, label: str) -> None:
    """One empirical CDF, from 0 at its smallest value (a single value drew nothing as a step alone: its line
    now rises from 0 to 1 there, with a marker)."""
    x, y = cdf_points(values_s)
    if not x.size:
        return
    x, y = np.r_[x[0], x] * scale, np.r_[0.0, y]
    ax.step(x, y, where="post", color=color, label=label, marker="o" if x.size <= 2 else None, markevery=[-1])


def tail_points(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The upper tail of ``values`` (1 - CDF: the share of values above each), drawn ``where="post"`` on a log
    axis: from 1 at the smallest value to 1/n up to the largest (0 past it: off a log axis)."""
    x, y = cdf_points(values)
    if not x.size:
        return x, y
    above = 1.0 - y
    keep = above > 1e-12
    last = above[keep][-1] if keep.any() else 1.0
    return np.r_[x[0], x[keep], x[-1]], np.r_[1.0, above[keep], last]


def _tail_panel(ax, metric: str, samples: Mapping[str, Mapping[str, np.ndarray]], slos, scale: float,
                unit: str) -> None:
    """The upper tail (1 - CDF) on a log axis, below the CDF: the last percent that decides a p99 SLO is a sliver
    at the top of a linear 0-1 axis; here p99, p99.9 and the max each have a decade."""
    for (label, values), color in zip(samples.items(), ("tab:blue", "tab:red")):
        x, y = tail_points(values[metric])
        if x.size:
            ax.step(x * scale, y, where="post", color=color, marker="o" if x.size <= 2 else None, markevery=[-1])
    shares = _tail_marks(ax, metric, slos, scale)
    most = max((v[metric].size for v in samples.values()), default=1)
    low = min([0.5 / max(most, 1), *(0.5 * s for s in shares)])
    log_axis(ax.yaxis, ax.set_yscale, low, 1.0)
    ax.set_ylim(low, 1.3)
    ax.set_xlabel(f"{metric.upper()} ({unit})")
    ax.set_ylabel("share above (log)")
    ax.grid(alpha=0.3, which="both")


def _cdf_panel(ax, metric: str, samples: Mapping[str, Mapping[str, np.ndarray]], slos, tail=None) -> None:
    """One metric's CDFs (ms, or s past 10 s, the SLO limits included; log scale when the values span over
    `plotting.LOG_AXIS_SPAN`, so that a tail of slow steps does not squash the body against the axis) with its
    SLOs, and on ``tail`` (an axes below, sharing x) its upper tail (`_tail_panel`). A line of one value says
    so in the panel."""
    positive = [v[metric][v[metric] > 0] for v in samples.values()]
    limits = [s.limit_s for s in slos if getattr(s, "metric", None) == metric]
    top_s = max((v.max() for v in positive if v.size), default=0.0)
    scale, unit = (1e3, "ms") if max([top_s, *limits]) < 10 else (1.0, "s")
    for (label, values), color in zip(samples.items(), ("tab:blue", "tab:red")):
        _cdf_line(ax, values[metric], scale, color, label)
    means = {label: float(v[metric].mean()) for label, v in samples.items() if v[metric].size}
    _slo_marks(ax, metric, slos, scale, unit, means)
    if all(v.size for v in positive) and wants_log(low_s := min(v.min() for v in positive), top_s):
        log_axis(ax.xaxis, ax.set_xscale, low_s, top_s)
    if {v[metric].size for v in samples.values()} == {1}:
        what = "token gap" if metric == "tbt" else "request"
        ax.text(0.03, 0.97, f"one {what}: each line is its one value", transform=ax.transAxes, va="top",
                fontsize=8, bbox={"facecolor": "white", "edgecolor": "0.7", "alpha": 0.9})
    ax.set_xlabel(f"{metric.upper()} ({unit})")
    ax.set_ylabel("fraction of token gaps" if metric == "tbt" else "fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    if tail is not None:
        ax.set_xlabel("")
        _tail_panel(tail, metric, samples, slos, scale, unit)


CDF_POINTS = 4000  # points a CDF line is drawn with at most: each step under 1/4000 of the axis, below a pixel


def cdf_points(values: np.ndarray, max_points: int = CDF_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """The empirical CDF of ``values`` as (sorted values, fraction at or below each), drawn ``where="post"``:
    every value when there are at most ``max_points``, else the values at ``max_points`` ranks spread evenly
    (the smallest and the largest among them), so that the drawn line is within about 1/``max_points`` of the CDF
    everywhere. Every one of a 20,000-request trace's 4 million token gaps had been drawn: 8 s and 1.4 GB."""
    x = np.sort(values)
    if x.size <= max_points:
        return x, np.arange(1, x.size + 1) / max(x.size, 1)
    ranks = np.unique(np.linspace(0, x.size - 1, max_points).round().astype(np.int64))
    return x[ranks], (ranks + 1) / x.size


def latency_metrics(slos) -> tuple[str, ...]:
    """The latency CDF's panels: TTFT, TBT and E2E, and TPOT where an SLO limits it (it can set the capacity: it
    had no panel)."""
    tpot = any(getattr(s, "metric", None) == "tpot" for s in slos)
    return LATENCY_METRICS[:2] + ("tpot",) * tpot + LATENCY_METRICS[2:]


def requests_at(requests, rate_rps: float, where: str = "") -> str:
    """``N requests at R req/s`` (``where`` after "at", e.g. "the best config's operating rate"), or, where the
    requests all arrive at once (one request, say), no rate: it would be one invented from a zero span (a
    1-request workload was said to run at 1,000,000,000 req/s)."""
    n = len(requests)
    if n == 1:
        return "1 request, alone: no arrival rate"
    if n == 0 or max(r.arrival_s for r in requests) == min(r.arrival_s for r in requests):
        return f"{n:,} requests arriving at once: no arrival rate"
    return f"{n:,} requests at {where + ' (' if where else ''}{significant(rate_rps)} req/s{')' if where else ''}"


def plot_latency_cdf(report: Report, samples: Mapping[str, Mapping[str, np.ndarray]]) -> bytes:
    """CDFs of TTFT, TBT and E2E (and TPOT under a TPOT SLO) of the best config and the baseline, with the SLO
    limits, and under each its upper tail on a log axis; one line where the best config is the baseline (its line
    had hidden the other)."""
    from matplotlib.figure import Figure

    best = report.best[0]
    if best.config.effective() == report.problem.base.effective() and len(samples) > 1:
        samples = {f"best (#1) = baseline ({baseline_label(report)})": next(iter(samples.values()))}
    metrics = latency_metrics(report.problem.slos)
    fig = Figure(figsize=(4.4 * len(metrics), 7.4), dpi=110, layout="constrained")  # (wide tick labels: no overlap)
    axes = fig.subplots(2, len(metrics), sharex="col", gridspec_kw={"height_ratios": (3, 2)}, squeeze=False)
    for ax, tail, metric in zip(axes[0], axes[1], metrics):
        _cdf_panel(ax, metric, samples, report.problem.slos, tail)
    at = requests_at(report.problem.search.requests, best.figures["rate_rps"], "the best config's operating rate")
    fig.suptitle(f"Latency CDFs, simulated on {at}", fontsize=10)
    return _png(fig)


def _trials(report: Report) -> str:
    """The study's trials as optimize counts them (`optimize.trials_text`)."""
    from skistune.optimize import trials_text

    return trials_text(report.searched_trials, report.simplifying_trials)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _mib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def plot_memory_timeline(timeline: Timeline) -> bytes:
    """KV MiB in use per tier over (simulated) time; a tier's capacity is drawn where the line nears it."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.5), dpi=110)
    ax = fig.add_subplot()
    styles = {"device": ("tab:blue", "-"), "host": ("tab:orange", "--"), "disk": ("tab:green", ":")}
    for tier, used in timeline.used_bytes.items():
        capacity, (color, style) = timeline.capacity_bytes[tier], styles[tier]
        ax.plot(timeline.time_s, used / 2**20, color=color, ls=style, lw=1.4, drawstyle="steps-post",  # held between steps
                label=f"{tier} (pool {_mib(capacity)}, peak {_mib(used.max())})")
        if used.max() >= 0.2 * capacity:
            ax.axhline(capacity / 2**20, color=color, ls="-.", lw=1, label=f"{tier} pool capacity")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("KV in use (MiB)")
    ax.set_title("\n".join(textwrap.wrap(timeline.label, 100)), fontsize=9)  # (a long label ran off the figure)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: lines fill the axes
    return _png(fig)


def render_plots(report: Report) -> tuple[dict[str, bytes], list[str]]:
    """The PNGs by name (`FILES`), and a note for each plot left out."""
    images, missing = {}, []
    axis, rate = throughput_axis(report.problem)
    rates = {rate(e) for e in (*report.evaluations, report.baseline)}
    if report.feasible or len(rates) > 1:
        images["pareto"] = plot_pareto(report)
    else:  # every point on one vertical line (a capacity of 0 everywhere): the plot would say nothing
        missing.append(f"no Pareto plot: no config met every constraint, and every trial's {axis} is {rates.pop():g}")
    replays = Replays(report.problem.target)  # (the timeline first: its sampled replay serves #1's CDF too)
    timeline = memory_timeline(report, replays)
    samples = latency_samples(report, replays)
    if samples is None:
        missing.append("no latency CDF: no config met every constraint")
    else:
        images["latency"] = plot_latency_cdf(report, samples)
    del samples, replays  # (the latencies of a long trace are large: not kept through the last plot)
    if timeline is None:
        missing.append("no memory timeline: no config met every constraint and none was validated")
    else:
        images["memory"] = plot_memory_timeline(timeline)
    return images, missing


# ---- HTML and files -----------------------------------------------------------------------------------------
def _plain(cell: Any) -> str:
    """A rich cell as plain text (markup such as ``[green]yes[/]`` removed)."""
    from rich.errors import MarkupError
    from rich.text import Text

    if isinstance(cell, Text):
        return cell.plain
    try:
        return Text.from_markup(str(cell)).plain
    except MarkupError:
        return str(cell)


def table_html(table) -> str:
    """A rich `Table` as an HTML table (its title as the caption)."""
    columns = table.columns
    head = "".join(f"<th>{html.escape(_plain(c.header))}</th>" for c in columns)
    cells = [list(c.cells) for c in columns]
    rows = "".join("<tr>" + "".join(f"<td class='{c.justify}'>{html.escape(_plain(col[i]))}</td>"
                                    for c, col in zip(columns, cells)) + "</tr>"
                   for i in range(table.row_count))
    caption = f"<caption>{html.escape(_plain(table.title))}</caption>" if table.title else ""
    return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


_CSS = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px;color:#222}"
        "table{border-collapse:collapse;margin:1.5em 0;font-size:0.9em}"
        "caption{text-align:left;font-weight:600;padding:0.4em 0}"
        "th,td{border:1px solid #ccc;padding:0.25em 0.6em}th{background:#f0f0f0}td.right{text-align:right}"
        "img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}code{background:#f4f4f4;padding:0 0.3em}")
_TITLES = {"pareto": "Pareto front: rate vs J/token vs quality loss", "latency": "Latency CDFs: best vs baseline",
           "memory": "KV memory per tier over time"}


def report_html(report: Report, images: Mapping[str, bytes], notes: Sequence[str] = ()) -> str:
    """One self-contained page: the problem, the tables, the plots (base64 PNGs) and the notes."""
    p = report.problem
    facts = [f"storage <code>{html.escape(report.storage)}</code>",
             f"workload {html.escape(p.workload.name)} ({_count(len(p.workload), 'request')})",
             f"objectives {html.escape(', '.join(o.name for o in p.objectives))}",
             f"constraints {html.escape(', '.join(c.name for c in p.constraints))}",
             f"profile {html.escape(p.profile.name)}", f"{html.escape(_trials(report))} complete"]
    name = html.escape(report.name)
    head = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>skistune report: {name}</title>"
            f"<style>{_CSS}</style></head><body><h1>skistune report: study {name}</h1>")
    parts = [head, "<p>" + " · ".join(facts) + "</p>"]
    parts += [table_html(t) for t in report_tables(report)]
    parts.append("<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in [*report_lines(report), *notes])
                 + "</ul>")
    for name, png in images.items():
        parts.append(f"<h2>{_TITLES[name]}</h2><img alt='{name}' "
                     f"src='data:image/png;base64,{base64.b64encode(png).decode('ascii')}'>")
    parts.append(f"<p>Browse every trial: <code>optuna-dashboard {html.escape(shlex.quote(report.storage))}</code></p>"
                 "</body></html>")
    return "\n".join(parts)


_UNSAFE_IN_NAME = re.compile(r"[^\w.+=,@-]")  # (\w: letters and digits of any script, and _)


def default_out_dir(study_name: str) -> Path:
    """``skistune-report-STUDY`` in this folder, one folder whatever the name holds: a name with a character
    other than letters, digits and ``_.+=,@-`` (a ``/`` put the folder elsewhere: ``a/../../x`` wrote ``../x``;
    ``<script>...</script>`` made nested folders) has each such character as ``_`` and a hash of the whole name
    (two names alike once cleaned keep two folders), as a name longer than a file name may be has its start and
    the hash ("[Errno 36] File name too long" for a 240-character name)."""
    import hashlib

    from skistune.paths import _name_max

    safe = _UNSAFE_IN_NAME.sub("_", study_name)
    name, limit = f"skistune-report-{safe}", _name_max(Path.cwd())
    if safe == study_name and len(os.fsencode(name)) <= limit:
        return Path(name)
    digest = "-" + hashlib.sha256(study_name.encode("utf-8", "surrogateescape")).hexdigest()[:12]
    while len(os.fsencode(name + digest)) > limit:  # (whole characters: no half UTF-8 sequence)
        name = name[:-1]
    return Path(name + digest)


def check_out_dir(out_dir: str | Path) -> Path:
    """The output folder, checked before any work: it may exist, but not as a file, and it must be writable
    (or creatable: the closest existing folder above it writable), its name one the file system takes."""
    out = Path(out_dir)
    try:
        return _check_out_dir(out)
    except OSError as exc:  # (a name too long: stat fails on it, as creating it would)
        why = exc.strerror[:1].lower() + exc.strerror[1:] if exc.strerror else str(exc)
        raise ValueError(f"--out-dir {out}: {why} (give a shorter --out-dir)") from None


def _check_out_dir(out: Path) -> Path:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out-dir {out}: is a file; give a folder")
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    try:  # (a folder made and removed: permission bits say nothing for root, nor on /proc)
        os.rmdir(tempfile.mkdtemp(prefix=".skistune-probe-", dir=existing))
    except OSError as exc:
        raise ValueError(f"--out-dir {out}: cannot create a folder in {existing} ({exc.strerror})") from None
    return out


def write_report(report: Report, out_dir: str | Path) -> tuple[dict[str, Path], list[str]]:
    """Write the PNGs and report.html into ``out_dir`` (created if missing). Returns the files by name
    (`FILES`) and a note for each plot left out."""
    from skistune.paths import write_atomic

    out = check_out_dir(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images, missing = render_plots(report)
    files = {}
    for name, png in images.items():  # (each whole or not at all: a full disk had left a 0-byte plot)
        files[name] = out / FILES[name]
        write_atomic(files[name], png)
    missing += remove_stale_plots(out, images)
    files["html"] = write_atomic(out / FILES["html"], report_html(report, images, [f"note: {m}" for m in missing]))
    return files, missing


def remove_stale_plots(out: Path, images: Mapping[str, bytes]) -> list[str]:
    """Remove the plots of an earlier report in ``out`` that this one leaves out (`FILES` names only, nothing
    else of the folder): another study's pareto.png had stayed beside the new report.html, as if its plot.
    Returns a note for each file removed."""
    notes = []
    for name, file in FILES.items():
        path = out / file
        if name == "html" or name in images or not (path.is_file() or path.is_symlink()):
            continue
        path.unlink()
        notes.append(f"removed {path}, an earlier report's plot this report leaves out")
    return notes


def summary(report: Report, files: Mapping[str, Path]) -> dict[str, Any]:
    """The report as JSON: best configs, front, baseline, binding constraints, validation, importance, files."""
    from skistune.scoring import REFINE_PRECISION, SEARCH_PRECISION

    fine = {e.config.effective() for e, f in zip(report.best, refined_rows(report)) if f}
    if report.refined:
        fine.add(report.baseline.config.effective())

    def scored(e: Evaluation) -> dict[str, Any]:
        return {"trial": e.trial, "config": e.config.to_dict(), "values": list(e.values),
                "figures": dict(e.figures),
                "capacity_precision": REFINE_PRECISION if e.config.effective() in fine else SEARCH_PRECISION}

    return {"study": report.name, "storage": report.storage, "trials": report.searched_trials,
            "simplifying_trials": report.simplifying_trials,
            "feasible": report.feasible, "objectives": [o.name for o in report.problem.objectives],
            "power_source": report.problem.profile.power.source,  # (every J/token's basis: "modeled" without a meter)
            "best": [scored(e) for e in report.best], "pareto": [scored(e) for e in report.pareto],
            "baseline": scored(report.baseline), "binding": dict(report.binding),
            "validated": [dict(v) for v in report.validated], "importance": dict(report.importance),
            "front_ties": [e.trial for e in report.front_ties],
            "importance_method": report.importance_method, "why": report.why,
            "running_trials": report.running_trials, "running_note": report.running_note,
            "files": {k: str(v) for k, v in files.items()}}
