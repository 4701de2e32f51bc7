"""Scoring one config with the simulator (`score`): at its capacity (the highest arrival-rate scale at which every
SLO and the queueing guard hold, by binary search) or at the workload's own rate, as an `Evaluation` (objective
values, constraint values where <= 0 is feasible, and JSON-ready figures); the run's deadline, which stops
simulations (`Deadline`, `with_deadline`); and the resolution below which two scores are a tie (`beats`).
"""
from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from skistune.config import KVConfig
from skistune.objectives import (Constraint, Objective, Point, QueueGuard, energy_j_per_token, goodput_rps,
                                 objective_value, predict_quality)
from skistune.problem import Problem, RequestSet
from skistune.runtime.metrics import Metrics
from skistune.runtime.request import Request

SEARCH_PRECISION = 0.10  # relative precision of the capacity search inside a trial
REFINE_PRECISION = 0.02  # ... and of the top-k and the baseline afterwards
MIN_RATE_SCALE = 1 / 1024  # `simulator.capacity`'s lowest scale: metrics of configs that meet no rate


# ---- the run's deadline -----------------------------------------------------------------------------------
class TimeUp(Exception):
    """The run's timeout ran out before a simulation could start (`Deadline`, `with_deadline`)."""


@dataclass(frozen=True)
class Deadline:
    """When a run must end: ``at`` in `time.monotonic` seconds (shared by the processes of a machine), from its
    ``timeout_s``; both None: never."""

    at: float | None = None
    timeout_s: float | None = None

    @classmethod
    def after(cls, timeout_s: float | None, started: float | None = None) -> Deadline:
        """``timeout_s`` from ``started`` (a `time.monotonic` reading; default now)."""
        if timeout_s is None:
            return cls()
        return cls((time.monotonic() if started is None else started) + timeout_s, timeout_s)

    def left(self) -> float | None:
        return None if self.at is None else self.at - time.monotonic()

    @property
    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def check(self) -> None:
        if self.passed:
            raise TimeUp(f"the timeout ({self.timeout_s:g} s) ran out")


@functools.cache
def _timed_target_class():
    from skistune.simulator import SimTarget

    @dataclass(frozen=True)
    class TimedTarget(SimTarget):
        """A simulation target that raises `TimeUp` when a simulation starts after its deadline: every
        simulation (`simulator.build_engine`, inside `simulator.capacity`'s search too) reads the model's
        ``spec`` before it simulates anything, so a run stops at most one simulation past its deadline."""

        deadline: Deadline = Deadline()

        def __getattribute__(self, name: str) -> Any:
            if name == "spec":
                object.__getattribute__(self, "deadline").check()
            return object.__getattribute__(self, name)

    return TimedTarget


def with_deadline(problem: Problem, deadline: Deadline) -> Problem:
    """``problem`` whose simulations stop at ``deadline`` (`TimeUp`); itself when there is none."""
    base = without_deadline(problem)
    if deadline.at is None:
        return base
    fields_ = {k: v for k, v in vars(base.target).items() if k != "deadline"}
    return replace(base, target=_timed_target_class()(**fields_, deadline=deadline))


def without_deadline(problem: Problem) -> Problem:
    """``problem`` with no deadline on its simulations (what a result carries: displays simulate after the run)."""
    if not isinstance(problem.target, _timed_target_class()):
        return problem
    from skistune.simulator import SimTarget

    fields_ = {k: v for k, v in vars(problem.target).items() if k != "deadline"}
    return replace(problem, target=SimTarget(**fields_))


def _deadline_of(problem: Problem) -> Deadline:
    return getattr(problem.target, "deadline", None) or Deadline()


# ---- scoring one config -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Evaluation:
    """One config scored at its operating point: objective values, constraint values (<= 0 feasible) and
    figures (all JSON-ready, so they are stored with the trial); ``metrics`` where kept in memory."""

    config: KVConfig
    rate_scale: float
    values: tuple[float, ...]
    violations: Mapping[str, float]
    figures: Mapping[str, Any]
    metrics: Metrics | None = None
    trial: int | None = None

    @property
    def feasible(self) -> bool:
        return all(v <= 0 for v in self.violations.values())

    @property
    def total_violation(self) -> float:
        return sum(max(0.0, v) for v in self.violations.values())

    @property
    def binding(self) -> list[str]:
        return [name for name, v in self.violations.items() if v > 0]

    def to_attrs(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "rate_scale": self.rate_scale,
                "violations": dict(self.violations), "figures": dict(self.figures)}

    @classmethod
    def from_trial(cls, trial) -> Evaluation:
        return cls.from_attrs(trial.user_attrs, trial.values, trial.number)

    @classmethod
    def from_attrs(cls, a: Mapping[str, Any], values: Sequence[float], trial: int | None) -> Evaluation:
        return cls(KVConfig.from_dict(a["config"]), a["rate_scale"], tuple(values), a["violations"], a["figures"],
                   trial=trial)

    def to_record(self) -> dict[str, Any]:
        """`to_attrs` with the objective values and the trial: an evaluation made outside a trial (refined)."""
        return {**self.to_attrs(), "values": list(self.values), "trial": self.trial}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Evaluation:
        return cls.from_attrs(record, record["values"], record["trial"])


def _replay(config: KVConfig, requests: Sequence[Request], target, scale: float):
    """Simulate at an arrival-rate scale; the engine keeps per-request records (for goodput)."""
    from skistune.simulator import build_engine, with_rate_scale

    engine, _ = build_engine(config, target)
    metrics = engine.replay(with_rate_scale(requests, scale))
    return metrics, engine.records


def _isolated_ttft_p99(problem: Problem, config: KVConfig, requests: RequestSet) -> float:
    if problem.max_queue_s is None:
        return 0.0
    return served_alone(problem, config, requests)[0].ttft_s.p99


def served_alone(problem: Problem, config: KVConfig, requests: RequestSet | None = None) -> tuple[Metrics, list]:
    """Predicted metrics and per-request records of ``config`` with each request (the search's by default)
    served alone (no other request queued or batched with it): what no arrival rate, however low, improves on."""
    return _replay(config, (requests or problem.search).isolated, problem.target, 1.0)


def slos_broken_alone(problem: Problem, alone: Metrics) -> dict[str, float]:
    """The latency SLOs broken with each request served alone (`served_alone`), with the value each reaches
    then (seconds)."""
    return {str(s): s.value_s(alone) for s in problem.slos if not s.met(alone)}


def outlasting_gaps(problem: Problem, alone_records: Sequence, scale: float) -> tuple[int, float]:
    """At an arrival-rate ``scale``: how many of the search's requests, each served alone in the time
    `served_alone` predicts, would still run when the next one arrives; and the shortest gap between two
    arrivals then (seconds; inf with one request)."""
    served = {r.request_id: r.finish_s - r.arrival_s for r in alone_records if r.finish_s is not None}
    ordered = sorted(problem.search.requests, key=lambda r: r.arrival_s)
    gaps = [(b.arrival_s - a.arrival_s) / scale for a, b in zip(ordered, ordered[1:])]
    return (sum(served.get(a.request_id, 0.0) > gap for a, gap in zip(ordered, gaps)),
            min(gaps, default=math.inf))


def _capacity_scale(problem: Problem, config: KVConfig, requests: RequestSet, reference_s: float,
                    precision: float, start_scale: float | None = None) -> tuple[float, Metrics | None]:
    """The highest rate scale meeting every SLO and the queueing guard (0 and None when none does);
    ``start_scale``: a guess to search from (the answer does not depend on it, the time does)."""
    from skistune.simulator import capacity

    guards = [QueueGuard(reference_s, problem.max_queue_s)] if problem.max_queue_s is not None else []
    cap = capacity(config, requests.requests, problem.target, [*problem.slos, *guards], precision=precision,
                   start=start_scale, max_queue=None)  # (its own guard: the reference is computed once a config)
    return cap.rate_scale, cap.metrics


def point_of(problem: Problem, config: KVConfig, metrics: Metrics, records, rate_rps: float,
             reference_s: float) -> Point:
    """What the objectives and constraints read, from predicted or measured metrics alike."""
    return Point(config, metrics, rate_rps, energy_j_per_token(metrics, problem.profile.power),
                 goodput_rps(records, metrics.duration_s, problem.slos) if records is not None else math.nan,
                 predict_quality(config, problem.quality_profile, problem.model, problem.context_tokens), reference_s)


def figures_of(problem: Problem, point: Point) -> dict[str, Any]:
    m = point.metrics
    q = point.quality
    return {"rate_rps": point.rate_rps, "ttft_p99_s": m.ttft_s.p99, "tbt_p99_s": m.tbt_s.p99,
            "e2e_p99_s": m.e2e_s.p99, "tpot_p99_s": m.tpot_s.p99, "queue_p99_s": m.ttft_s.p99 - point.queue_reference_s,
            "slo_s": {str(s): s.value_s(m) for s in problem.slos}, "energy_j_per_token": point.energy_j_per_token,
            "goodput_rps": None if point.goodput_rps != point.goodput_rps else point.goodput_rps,  # NaN: not computed
            "kv_peak_bytes": m.kv_peak_bytes,
            "kv_capacity_bytes": m.kv_capacity_bytes, "preemptions": m.preemptions,
            "finished": m.num_finished, "requests": m.num_requests,
            "quality_loss": None if q is None else _finite(q.ppl_mean),
            "quality_bound": None if q is None else _finite(q.guarded_mean),
            "quality_worst": None if q is None else _finite(q.ppl_worst),
            "quality_worst_bound": None if q is None else _finite(q.guarded_worst),
            "needle_retained": None if q is None else q.needle_retained,
            "quality_basis": None if q is None else q.basis}


def _finite(x: float) -> float | None:
    """JSON has no infinity: a loss outside the quality profile's grid is stored as null."""
    return x if math.isfinite(x) else None


def _violation(constraint: Constraint, point: Point) -> float:
    """A constraint's value; not a number (a latency of no finished request) counts as violated."""
    value = float(constraint.value(point))
    return math.inf if value != value else value


def evaluation_of(problem: Problem, point: Point, scale: float) -> Evaluation:
    values = tuple(objective_value(o, point) for o in problem.objectives)
    violations = {c.name: _violation(c, point) for c in problem.constraints}
    return Evaluation(point.config, scale, values, violations, figures_of(problem, point), point.metrics)


def score_at(problem: Problem, config: KVConfig, requests: RequestSet, scale: float, *,
             reference_s: float | None = None, feasible_rate: bool = True) -> Evaluation:
    """Predicted metrics at one arrival-rate scale. ``feasible_rate`` False: the config meets no rate, so
    its capacity is 0 (the metrics, at the lowest scale, say by how much it misses)."""
    if reference_s is None:
        reference_s = _isolated_ttft_p99(problem, config, requests)
    metrics, records = _replay(config, requests.requests, problem.target, scale)
    rate = scale * requests.base_rps if feasible_rate else 0.0
    point = point_of(problem, config, metrics, records, rate, reference_s)
    return evaluation_of(problem, point, scale)


def unservable(problem: Problem, config: KVConfig, reason: str) -> Evaluation:
    """A config whose KV pool cannot even be laid out on this hardware (e.g. full-precision rings for every
    running sequence slot bigger than the pool): the worst objective values, and ``served`` violated."""
    values = tuple(0.0 if o.maximize else math.inf for o in problem.objectives)
    violations = {c.name: (math.inf if c.name == "served" else 0.0) for c in problem.constraints}
    return Evaluation(config, 0.0, values, violations, {"unservable": reason, "energy_j_per_token": math.inf})


def score(problem: Problem, config: KVConfig, requests: RequestSet | None = None, *,
          precision: float = SEARCH_PRECISION, start_scale: float | None = None) -> Evaluation:
    """A config at its operating point: its capacity (to ``precision``; searched from ``start_scale``, a
    guess such as similar configs' capacity) or the workload's own rate."""
    from skistune.runtime.kv_layout import KVPoolTooSmall

    try:
        return _score(problem, config, requests, precision, start_scale)
    except KVPoolTooSmall as exc:
        return unservable(problem, config, str(exc))


def _score(problem: Problem, config: KVConfig, requests: RequestSet | None, precision: float,
           start_scale: float | None) -> Evaluation:
    requests = requests or problem.search
    reference_s = _isolated_ttft_p99(problem, config, requests)
    if not problem.at_capacity:
        return score_at(problem, config, requests, 1.0, reference_s=reference_s)
    scale, metrics = _capacity_scale(problem, config, requests, reference_s, precision, start_scale)
    if scale <= 0:
        return score_at(problem, config, requests, MIN_RATE_SCALE, reference_s=reference_s, feasible_rate=False)
    if problem.needs_goodput or metrics is None:
        return score_at(problem, config, requests, scale, reference_s=reference_s)
    point = point_of(problem, config, metrics, None, scale * requests.base_rps, reference_s)
    return evaluation_of(problem, point, scale)


def scale_guess(evaluations: Iterable[Evaluation]) -> float | None:
    """Where to start a config's capacity search: the median rate scale of the configs scored so far
    (most configs of one problem land within a few lattice steps of each other)."""
    scales = sorted(e.rate_scale for e in evaluations if e.rate_scale > 0)
    return scales[len(scales) // 2] if scales else None


# ---- comparing scores -------------------------------------------------------------------------------------
def beats(problem: Problem, a: float, b: float, objective: Objective | None = None) -> bool:
    """Whether first-objective value ``a`` (or ``objective``'s) is better than ``b`` by more than
    `REFINE_PRECISION` (relative): a smaller difference is a tie the search cannot resolve (capacity comes in
    steps of its precision; other figures are predicted closer than the simulator's error on any machine)."""
    margin = REFINE_PRECISION * abs(b)
    return a > b + margin if (objective or problem.objectives[0]).maximize else a < b - margin


def tie(problem: Problem, objective: Objective, a: float, b: float) -> bool:
    """Whether neither value `beats` the other: a difference the search cannot resolve."""
    return not beats(problem, a, b, objective) and not beats(problem, b, a, objective)


def beats_anywhere(problem: Problem, a: Evaluation, b: Evaluation) -> bool:
    """Whether ``a`` `beats` ``b`` on some objective (by more than `REFINE_PRECISION`): where it does not,
    ``a`` gains nothing over ``b`` that the search can resolve."""
    return any(beats(problem, x, y, o) for o, x, y in zip(problem.objectives, a.values, b.values))
