"""Local moves around the best configs: a share of a TPE search's trials spent on neighbours of the incumbent.

TPE models where good configs lie from the density of good trials, which serves the broad search well but can
settle on a plateau: where the objective moves in discrete steps (capacity doubles in steps of 2^(1/8)) a
whole region of configs ties, and the better region may differ from it in several knobs at once
(BENCHMARKS.md, "Search efficiency": chat-capacity's optimum needs four batching knobs right together). A
local move takes one of the best feasible trials so far, chosen at random among those that tie, and changes
one knob (sometimes two) to another value: ties are walked across instead of stuck on, and the last steps to
an optimum that TPE's density model blurs are taken directly, as a hill climber would. Moves already tried
are skipped.

`LocalMovesSampler` wraps the study's sampler: on a local trial it proposes the move's parameters itself (a
knob that only the move makes active, such as an eviction budget once a policy is switched on, is drawn at
random); on every other trial the wrapped sampler decides alone, and it sees every finished trial either way.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.trial import FrozenTrial, TrialState

LOCAL_SHARE = 0.3  # of the trials after the start-up ones (measured: benchmarks/sampler_variants.py)
START_AFTER = 10  # trials: TPE's own start-up (random) trials, so that the incumbent has rivals
TWO_KNOB_SHARE = 0.3  # of the local moves: two knobs change at once (one alone cannot leave some plateaus)
NUMERIC_STEP = 0.15  # a numeric knob's move: a normal step of this share of its (log) range
TIE = 1e-9  # relative: trials this close to the best value tie with it
ATTEMPTS = 64  # neighbours drawn before giving the trial back to the wrapped sampler (all tried already)
MOVE_ATTR = "skistune.local_move"  # on a local trial: the trial it moved from and the knobs it changed


class LocalMovesSampler(BaseSampler):
    """``base`` (single-objective), with a ``share`` of the trials from ``start_after`` on proposed as local
    moves from one of the best feasible trials so far. ``feasible(trial)`` tells a finished trial's feasibility
    (skistune stores its constraints' violations with the trial)."""

    def __init__(self, base: BaseSampler, *, seed: int | None, feasible: Callable[[FrozenTrial], bool],
                 share: float = LOCAL_SHARE, start_after: int = START_AFTER, two_knob_share: float = TWO_KNOB_SHARE):
        if not 0 <= share <= 1 or not 0 <= two_knob_share <= 1:
            raise ValueError(f"share {share} and two_knob_share {two_knob_share} must lie in [0, 1]")
        self.base, self.feasible = base, feasible
        self.share, self.start_after, self.two_knob_share = share, start_after, two_knob_share
        self._rng = random.Random(seed)
        self._random = RandomSampler(seed=None if seed is None else seed + 1)
        self._moves: dict[int, dict[str, Any]] = {}  # trial id -> the move's parameters

    # ---- choosing a move --------------------------------------------------------------------------------
    def _incumbents(self, study: optuna.Study, finished: list[FrozenTrial]) -> list[FrozenTrial]:
        """The feasible trials that tie for the best value (where a move starts)."""
        feasible = [t for t in finished if t.value is not None and math.isfinite(t.value) and self.feasible(t)]
        if not feasible:
            return []
        sign = 1.0 if study.direction == optuna.study.StudyDirection.MAXIMIZE else -1.0
        best = max(sign * t.value for t in feasible)
        return [t for t in feasible if sign * t.value >= best - TIE * max(abs(best), 1.0)]

    def _moved(self, distribution: BaseDistribution, value: Any) -> Any:
        """Another value of the knob (None when it has no other)."""
        if isinstance(distribution, CategoricalDistribution):
            others = [c for c in distribution.choices if c != value]
            return self._rng.choice(others) if others else None
        if not isinstance(distribution, (IntDistribution, FloatDistribution)) or distribution.low == distribution.high:
            return None
        low, high = distribution.low, distribution.high
        to, back = (math.log, math.exp) if distribution.log else (float, float)
        span = to(high) - to(low)
        for _ in range(8):
            x = to(value) + self._rng.gauss(0.0, NUMERIC_STEP) * span
            moved = min(high, max(low, back(min(to(high), max(to(low), x)))))
            step = distribution.step
            if step is not None:
                moved = low + round((moved - low) / step) * step
            if isinstance(distribution, IntDistribution):
                moved = int(round(moved))
            if moved != value and low <= moved <= high:
                return moved
        return None

    def _plan(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, Any] | None:
        if trial.number < self.start_after or "fixed_params" in trial.system_attrs:  # (an enqueued trial: its own)
            return None
        if self._rng.random() >= self.share:
            return None
        trials = study.get_trials(deepcopy=False)
        finished = [t for t in trials if t.state == TrialState.COMPLETE]
        incumbents = self._incumbents(study, finished)
        if not incumbents:
            return None
        # a move repeats a trial whose parameters it all holds: the same answers ask the same questions, so the
        # move's extra parameters (those of a knob it switched off) would never be asked
        tried = [t.params.items() for t in trials if t.params and t.number != trial.number]
        for _ in range(ATTEMPTS):
            start = self._rng.choice(incumbents)
            names = sorted(start.params)
            count = min(len(names), 2 if self._rng.random() < self.two_knob_share else 1)
            params = dict(start.params)
            changed = []
            for name in self._rng.sample(names, count):
                value = self._moved(start.distributions[name], params[name])
                if value is not None:
                    params[name] = value
                    changed.append(name)
            if changed and not any(earlier <= params.items() for earlier in tried):
                study._storage.set_trial_system_attr(trial._trial_id, MOVE_ATTR,
                                                     {"from": start.number, "knobs": sorted(changed)})
                return params
        return None

    # ---- the sampler interface ----------------------------------------------------------------------------
    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.base.before_trial(study, trial)
        plan = self._plan(study, trial)
        if plan is not None:
            self._moves[trial._trial_id] = plan

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        if trial._trial_id in self._moves:
            return {}
        return self.base.infer_relative_search_space(study, trial)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if trial._trial_id in self._moves:
            return {}
        return self.base.sample_relative(study, trial, search_space)

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        move = self._moves.get(trial._trial_id)
        if move is None:
            return self.base.sample_independent(study, trial, param_name, param_distribution)
        if param_name in move and _admits(param_distribution, move[param_name]):
            return move[param_name]
        # a knob the move made active (or whose range the move changed): drawn at random, as TPE's start-up does
        return self._random.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values) -> None:
        self._moves.pop(trial._trial_id, None)
        self.base.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.base.reseed_rng()
        self._random.reseed_rng()
        self._rng = random.Random()


def _admits(distribution: BaseDistribution, value: Any) -> bool:
    """Whether ``value`` is one of the distribution's values (a conditional range may differ from the
    incumbent's: `at_most` caps a range at another knob's value)."""
    if isinstance(distribution, CategoricalDistribution):
        return value in distribution.choices
    if isinstance(distribution, (IntDistribution, FloatDistribution)):
        return isinstance(value, (int, float)) and distribution.low <= value <= distribution.high
    return False
