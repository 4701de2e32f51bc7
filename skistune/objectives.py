"""What the optimizer maximises or minimises, and what every config must satisfy.

Objectives (by name, or any callable of the predicted `Metrics` and the config):

    capacity   highest arrival rate (req/s) at which every SLO holds and queues stay bounded   maximize
    goodput    requests per second whose own latencies meet every SLO, at the workload's rate   maximize
    energy     joules per generated token (the profile's power model: measured or "modeled")   minimize
    memory     peak KV-cache bytes: blocks held at the peak + full-precision rings (quantized)   minimize
    quality    predicted quality loss (relative perplexity increase, mean window)               minimize

Constraints are values where ``<= 0`` is feasible (Optuna's convention): every SLO, the queueing guard,
an energy budget (``--energy 0.5J/token``), quality floors (``--quality ppl+1%``, ``worst:ppl+3%``,
``needle>=0.95``), memory capacity (``served``: every request served within the KV pool and the step's
token budget), and any callables.

Every knob with behaviour today (batching, prefix reuse, device KV size) leaves the model's outputs
unchanged, so their predicted quality loss is exactly 0. A config that changes a structural knob
(eviction, KV bits) needs a quality profile to predict its loss; without one, asking for its quality
raises ``ValueError``.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import math
import re
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from skistune.config import KVConfig, did_you_mean, shown
from skistune.runtime.metrics import Metrics
from skistune.runtime.request import RequestRecord
from skistune.slo import SLO, TIME_UNITS

MAXIMIZE, MINIMIZE = "maximize", "minimize"


# ---- what is known about a config at its operating point ------------------------------------------------
@dataclass(frozen=True)
class QualityLoss:
    """Predicted loss against the full-precision, no-eviction cache: relative perplexity increase over
    the mean and the worst text window, and the share of long-context retrieval accuracy kept.
    ``ppl_mean_bound`` is the one-sided 95% upper bound of the mean from the spread between the profile's
    windows (what a mean-window floor is checked against: the floor must hold on text the profile did not
    see); None where the loss is itself a measurement (held-out validation) or exact."""

    ppl_mean: float
    ppl_worst: float
    needle_retained: float | None  # None: not measured (a held-out validation runs passkeys for a needle floor only)
    basis: str = "measured"  # "exact" (nothing lossy), "measured", "proxy: <model>" or why it is unknown
    ppl_mean_bound: float | None = None
    ppl_worst_bound: float | None = None  # one-sided 95% prediction bound for a window not in the profile

    @property
    def guarded_mean(self) -> float:
        return self.ppl_mean if self.ppl_mean_bound is None else self.ppl_mean_bound

    @property
    def guarded_worst(self) -> float:
        return self.ppl_worst if self.ppl_worst_bound is None else max(self.ppl_worst, self.ppl_worst_bound)


NO_LOSS = QualityLoss(0.0, 0.0, 1.0, basis="exact")


@dataclass(frozen=True)
class Point:
    """A config served at one arrival rate: the predicted (or measured) metrics and what follows from them.
    ``quality`` is None where no quality profile can predict it; ``queue_reference_s`` is the TTFT p99
    of the same requests served one at a time (what the queueing guard compares against)."""

    config: KVConfig
    metrics: Metrics
    rate_rps: float
    energy_j_per_token: float
    goodput_rps: float
    quality: QualityLoss | None
    queue_reference_s: float


def energy_j_per_token(metrics: Metrics, power) -> float:
    """Energy of the run (busy at full power, idle at idle power) per generated token."""
    if metrics.output_tokens == 0:
        return math.inf
    idle_s = max(0.0, metrics.duration_s - metrics.busy_s)
    return power.energy_j(metrics.busy_s, idle_s) / metrics.output_tokens


def _request_latency_s(record: RequestRecord, slo: SLO) -> float:
    """The SLO's metric for one request: its TTFT, E2E, TPOT, or the percentile of its own token gaps."""
    times = record.token_times_s
    if slo.metric == "ttft":
        return times[0] - record.arrival_s
    if slo.metric == "e2e":
        return record.finish_s - record.arrival_s
    if len(times) < 2:
        return 0.0
    if slo.metric == "tpot":
        return (times[-1] - times[0]) / (len(times) - 1)
    gaps = np.diff(times)
    if slo.percentile in ("max", "mean"):
        return float(getattr(gaps, slo.percentile)())
    return float(np.percentile(gaps, float(slo.percentile[1:])))  # (p99.9 too)


def goodput_rps(records: Sequence[RequestRecord], duration_s: float, slos: Sequence[SLO]) -> float:
    """Requests per second that finished with every SLO met by their own latencies (DistServe's goodput;
    a TBT SLO ``pXX`` is checked against the percentile of each request's own token gaps)."""
    if duration_s <= 0:
        return 0.0
    good = sum(1 for r in records if r.finish_s is not None
               and all(_request_latency_s(r, s) <= s.limit_s for s in slos))
    return good / duration_s


# ---- quality ---------------------------------------------------------------------------------------------
def structural_changes(config: KVConfig) -> list[str]:
    """The knobs of ``config`` that change the model's outputs (eviction, fewer than 16 KV bits)."""
    changes = []
    if config.eviction.policy != "none":
        changes.append(f"eviction.policy={config.eviction.policy}")
    return changes + quantized_changes(config)


def quantized_changes(config: KVConfig) -> list[str]:
    """The bitwidth knobs of ``config`` that quantize some KV (fewer than 16 bits on a side)."""
    changes = []
    bits = config.effective().bitwidth  # (uniform bits that per-layer bits override change nothing)
    if (bits.key_bits, bits.value_bits) != (16, 16):
        changes.append(f"bitwidth {bits.key_bits}/{bits.value_bits}")
    if bits.layer_bits is not None and any(tuple(pair) != (16, 16) for pair in bits.layer_bits):
        changes.append("bitwidth.layer_bits")
    return changes


def context_tokens_p90(requests) -> int:
    """The 90th percentile of the requests' contexts (prompt plus output tokens): what a token eviction budget is
    a fraction of, for the quality prediction (0 for no requests)."""
    lengths = [len(r.prompt_token_ids) + r.max_new_tokens for r in requests]
    return int(np.percentile(lengths, 90)) if lengths else 0


def predict_quality(config: KVConfig, quality_profile: Any = None, model: str | None = None,
                    context_tokens: int | None = None) -> QualityLoss | None:
    """Exactly no loss when no structural knob changes; otherwise the quality profile's prediction (a proxy
    when ``model`` is not the profile's; token budgets over ``context_tokens``), or None when there is no
    quality profile."""
    if not structural_changes(config):
        return NO_LOSS
    if quality_profile is None:
        return None
    return quality_profile.predict(config, model, context_tokens)


def _known_quality(point: Point) -> QualityLoss:
    if point.quality is None:
        changes = ", ".join(structural_changes(point.config))
        raise ValueError(f"quality: {changes} changes the model's outputs and no quality profile exists to "
                         "predict by how much; keep eviction.policy none and 16-bit KV, or drop --quality")
    return point.quality


@dataclass(frozen=True)
class QualityFloor:
    """``ppl+1%`` (mean-window perplexity at most 1% above the full cache, checked against the predicted
    mean's 95% upper bound), ``worst:ppl+3%`` (the worst profile window or the 95% prediction bound for a
    window the profile did not see, whichever is larger), ``needle>=0.95`` (at least 95% of the full
    cache's long-context retrieval accuracy kept)."""

    metric: str  # "ppl" or "needle"
    window: str  # "mean" or "worst" (ppl only)
    limit: float  # ppl: largest relative increase; needle: smallest share kept

    def violation(self, point: Point) -> float:
        """Relative excess over the floor, as every other constraint's (it had been the absolute one: -0.01 for
        a lossless config under ppl+1%, beside -0.75 for a TBT at a quarter of its limit, and the closest configs
        summed them as if alike); a ppl+0% floor is read against 0.1 percentage point."""
        loss = _known_quality(point)
        if self.metric == "needle":
            return (self.limit - loss.needle_retained) / self.limit
        ppl = loss.guarded_worst if self.window == "worst" else loss.guarded_mean
        return (ppl - self.limit) / max(self.limit, ZERO_PPL_FLOOR)

    def __str__(self) -> str:
        if self.metric == "needle":
            return f"needle>={self.limit:g}"
        return f"{'worst:' if self.window == 'worst' else ''}ppl+{self.limit * 100:g}%"


ZERO_PPL_FLOOR = 0.001  # a ppl+0% floor's excess is relative to this (0.1 percentage point)
_PPL = re.compile(r"^(?:(mean|worst):)?ppl\+([0-9]*\.?[0-9]+)%$")
_NEEDLE = re.compile(r"^needle>=([0-9]*\.?[0-9]+)(%?)$")


def parse_quality(text: str) -> QualityFloor:
    t = text.strip().lower().replace(" ", "")
    ppl, needle = _PPL.match(t), _NEEDLE.match(t)
    if ppl:
        return QualityFloor("ppl", ppl.group(1) or "mean", float(ppl.group(2)) / 100)
    if needle:
        share = float(needle.group(1)) / (100 if needle.group(2) else 1)
        if not 0 < share <= 1:
            raise ValueError(f"quality {text!r}: the retrieval accuracy kept must be in (0, 1] (e.g. needle>=0.95)")
        return QualityFloor("needle", "mean", share)
    raise ValueError(f"quality {text!r}: write ppl+1% (mean-window perplexity increase), worst:ppl+3% (worst "
                     "window) or needle>=0.95 (share of retrieval accuracy kept)")


# ---- energy ----------------------------------------------------------------------------------------------
_ENERGY = re.compile(r"^([-+]?[0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)(j|mj|uj)?(?:/(?:token|tok))?$")
# Budgets below this are refused: no hardware spends a picojoule on a token, and a subnormal budget had made every
# violation (J/token / budget - 1) infinite, so that the closest configs could not be ranked
MIN_ENERGY_J_PER_TOKEN = 1e-12
_JOULES = {"j": 1.0, "mj": 1e-3, "uj": 1e-6}


@dataclass(frozen=True)
class EnergyBudget:
    limit_j_per_token: float

    def violation(self, point: Point) -> float:
        return point.energy_j_per_token / self.limit_j_per_token - 1.0

    def __str__(self) -> str:
        return f"energy<={self.limit_j_per_token:g}J/token"


def parse_energy(text: str) -> EnergyBudget:
    m = _ENERGY.match(text.strip().lower().replace(" ", ""))
    if not m:
        raise ValueError(f"energy {shown(text)}: write joules per generated token, e.g. 0.5J/token or 300mJ/token")
    limit = float(m.group(1)) * _JOULES[m.group(2) or "j"]
    if limit <= 0:
        raise ValueError(f"energy {shown(text)}: the budget must be positive")
    if not m.group(2):  # refused, as a bare SLO is: 0.5 might have meant mJ, a budget a thousand times tighter
        raise ValueError(f"energy {shown(text)}: the budget needs a unit: write {shown(m.group(1))[1:-1]}J/token or "
                         f"{shown(m.group(1))[1:-1]}mJ/token (units: J, mJ, uJ per token)")
    if limit < MIN_ENERGY_J_PER_TOKEN:
        raise ValueError(f"energy {shown(text)}: below {MIN_ENERGY_J_PER_TOKEN:g} J/token, less than any hardware "
                         "spends on a token; give the budget in J/token, e.g. 0.5J/token")
    return EnergyBudget(limit)


# ---- constraints -----------------------------------------------------------------------------------------
DEFAULT_MAX_QUEUE_S = 5.0  # Vidur-Search's default P99 scheduling-delay SLO


@dataclass(frozen=True)
class QueueGuard:
    """Queues stay bounded: TTFT p99 at most ``limit_s`` above the same requests served one at a time.
    Without it a TBT-only SLO is met at any rate by serving one sequence at a time while the queue grows
    without end; Vidur-Search bounds the P99 scheduling delay the same way (5 s by default)."""

    reference_s: float
    limit_s: float
    # what it bounds: the queue shows in the TTFT tail (not named ``metric``: the report draws objects with one
    # as SLO limits)
    _BOUNDS: ClassVar[tuple[str, str]] = ("ttft", "p99")

    def value_s(self, metrics: Metrics) -> float:
        metric, percentile = self._BOUNDS
        return metrics.latency(metric).at(percentile) - self.reference_s

    def breaks_above(self) -> tuple[str, str, float]:
        """(metric, percentile, the value of it above which this breaks), as `SLO.breaks_above`."""
        return *self._BOUNDS, self.reference_s + self.limit_s

    def violation(self, metrics: Metrics) -> float:
        v = self.value_s(metrics)
        return 1.0 if v != v else v / self.limit_s - 1.0

    def met(self, metrics: Metrics) -> bool:  # read by `simulator.capacity` like an SLO
        return self.violation(metrics) <= 0


def queue_name(limit_s: float) -> str:
    return f"queue<={limit_s:g}s"


_QUEUE = re.compile(r"^([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)([^\W\d_]*)$")  # (any letters: to name a wrong unit)


def parse_max_queue(text: str) -> float | None:
    """``--max-queue``: the queueing guard's limit in seconds (``5s``, ``500ms``), or None for ``off``. A bare
    number is refused, as a bare SLO is: 5 was read as 5 s where 5 ms may have been meant."""
    t = text.strip().lower().replace(" ", "")
    if t == "off":
        return None
    m = _QUEUE.match(t)
    if not m:
        raise ValueError(f"--max-queue {text!r}: write a positive time such as 5s or 500ms, or off")
    value, unit = m.groups()
    if unit and unit not in TIME_UNITS:
        raise ValueError(f"--max-queue {text!r}: unknown unit {unit!r}: write the limit in s, ms or us (e.g. 5s), "
                         "or off")
    limit_s = float(value) * TIME_UNITS[unit or "s"]
    if not (limit_s > 0 and math.isfinite(limit_s)):
        raise ValueError(f"--max-queue {text!r}: the limit must be a positive, finite time such as 5s, or off")
    if not unit:
        raise ValueError(f"--max-queue {text!r}: the limit needs a unit: write {value}s or {value}ms "
                         "(units: s, ms, us), or off")
    return limit_s


@dataclass(frozen=True)
class Constraint:
    """One named ``<= 0 is feasible`` value of a point."""

    name: str
    value: Callable[[Point], float]
    code: str | None = None  # a user's callable: `code_digest`


def slo_constraint(slo: SLO) -> Constraint:
    return Constraint(str(slo), lambda p: slo.violation(p.metrics))


def queue_constraint(limit_s: float) -> Constraint:
    return Constraint(queue_name(limit_s), lambda p: QueueGuard(p.queue_reference_s, limit_s).violation(p.metrics))


def served_constraint() -> Constraint:
    """Memory capacity: every request served, none rejected (too long for the KV pool, or for the step's
    token budget with chunked prefill off) or left unfinished. The KV peak never exceeds the pool: the
    block manager allocates only what it holds and preempts otherwise."""
    return Constraint("served", lambda p: (p.metrics.num_requests - p.metrics.num_finished) / p.metrics.num_requests)


def user_constraint(fn: Callable, index: int) -> Constraint:
    """A callable ``f(metrics)`` or ``f(metrics, config)`` returning a value, or a sequence of values (all
    must be <= 0: their largest is kept), named after the function."""
    name = getattr(fn, "__name__", "") or ""
    name = name if name and name != "<lambda>" else f"constraint{index}"
    call = _metrics_call(fn, f"constraint {name}")
    return Constraint(name, lambda p: _one(call(p), name), code_digest(fn))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # (a repr with a memory address differs in every process)
_PLAIN = (int, float, str, bool, bytes, tuple, frozenset, type(None))


def code_digest(fn: Callable) -> str:
    """What a user's callable computes, as far as Python shows it: its code and constants, its defaults, the values
    its closure holds and the plain values (numbers, strings) of the globals it reads; a partial's arguments; a
    callable object's class and attributes. Studies record it, so that a study resumes only with the callables it
    was scored with (two lambdas both named ``custom`` had mixed objective values 100x apart in one study, and its
    winner broke the changed constraint)."""
    def code(c: types.CodeType) -> tuple:
        return (c.co_code, c.co_names, tuple(code(k) if isinstance(k, types.CodeType) else repr(k)
                                             for k in c.co_consts))

    def cells(f) -> list[str]:
        out = []
        for cell in f.__closure__ or ():
            try:
                out.append(repr(cell.cell_contents))
            except ValueError:  # (a cell not yet filled)
                out.append("<empty>")
        return out

    parts: list[Any] = []
    target = fn
    while isinstance(target, functools.partial):
        parts += [repr(target.args), repr(sorted(target.keywords.items()))]
        target = target.func
    f = getattr(target, "__func__", target)  # (a bound method: its function, and its object below)
    if hasattr(target, "__self__") and not isinstance(target.__self__, types.ModuleType):
        parts.append(repr(vars(target.__self__)) if hasattr(target.__self__, "__dict__") else "")
    if isinstance(f, types.FunctionType):
        parts += [code(f.__code__), repr(f.__defaults__), repr(f.__kwdefaults__), cells(f),
                  repr(sorted((n, f.__globals__[n]) for n in f.__code__.co_names
                              if isinstance(f.__globals__.get(n, ...), _PLAIN)))]
    else:  # a callable object (or a builtin)
        parts += [type(f).__qualname__, repr(vars(f)) if hasattr(f, "__dict__") else repr(f)]
        call = getattr(type(f), "__call__", None)
        if isinstance(call, types.FunctionType):
            parts.append(code(call.__code__))
    return hashlib.sha256(_ADDRESS.sub("", repr(parts)).encode()).hexdigest()[:16]


class ReturnValueError(ValueError):
    """A user's objective or constraint returned something that is not a finite number: the caller's bug,
    which stops the search at once (`optimize` raises it after the trial, not as a failed trial)."""


def _number(value: Any, what: str, hint: str = "") -> float:
    """``value`` as a finite float; anything else (None, a string, a complex, NaN, an infinity) is a
    `ReturnValueError` naming ``what`` returned it. (NaN cannot be ranked; an infinite objective has no gain
    over the baseline, and an infinite constraint says no more than any positive value: JSON holds neither.)"""
    if isinstance(value, (str, bytes, complex)) or value is None:
        raise ReturnValueError(f"{what}: returned {value!r}, not a number{hint}")
    if type(value).__name__ in ("bool", "bool_"):  # (numpy's too) float(True) is 1.0: a
        # constraint `m.kv_peak_bytes < LIMIT` would read as broken exactly when it holds
        raise ReturnValueError(f"{what}: returned {value!r}, a bool, not a number{hint}: return a margin instead, "
                               "e.g. `m.kv_peak_bytes - LIMIT` rather than `m.kv_peak_bytes < LIMIT`")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ReturnValueError(f"{what}: returned {value!r}, not a number{hint}") from None
    if not math.isfinite(number):
        why = " (e.g. a latency percentile of a run in which no request finished)" if number != number else ""
        raise ReturnValueError(f"{what}: returned {number}, not a finite number{why}{hint}")
    return number


CALLABLE_ATTR = "_skistune_callable"  # set on an exception a user's callable raised: which one raised it


def raised_by(exc: BaseException) -> str | None:
    """Which user callable (``objective NAME``, ``constraint NAME``) raised ``exc``, or None for any other."""
    return getattr(exc, CALLABLE_ATTR, None)


def _one(value: Any, name: str) -> float:
    what, hint = f"constraint {name}", " (<= 0 is feasible)"
    if isinstance(value, np.ndarray) and value.ndim == 1:
        value = value.tolist()  # (a sequence of values, as a list is)
    if isinstance(value, (list, tuple)):
        if not value:  # (max over nothing had read as met)
            raise ReturnValueError(f"{what}: returned an empty {type(value).__name__}, no value to check{hint}")
        return max(_number(v, what, hint) for v in value)
    return _number(value, what, hint)


def _metrics_call(fn: Callable, what: str = "callable") -> Callable[[Point], Any]:
    """``fn(metrics, config)`` or ``fn(metrics)``: the first its signature accepts (`inspect.signature`).
    A callable that takes neither (three required arguments, a required keyword) raises ``ValueError``
    now, before any trial runs."""
    if not callable(fn):
        raise ValueError(f"{what}: {fn!r} is not callable; expected a function of the Metrics (and the config)")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # (some builtins have no signature: called with both, as before)
        return _marked(what, lambda p: fn(p.metrics, p.config))
    for n in (2, 1):
        try:
            sig.bind(*range(n))
        except TypeError:
            continue
        return _marked(what, (lambda p: fn(p.metrics, p.config)) if n == 2 else (lambda p: fn(p.metrics)))
    raise ValueError(f"{what}: takes {sig}, but is called as f(metrics) or f(metrics, config)")


def _marked(what: str, call: Callable[[Point], Any]) -> Callable[[Point], Any]:
    """``call``, marking any exception it raises as the user callable's (`raised_by`): the search stops with
    that exception, reported once, not as a failed trial with Optuna's traceback first."""
    def marked(point: Point) -> Any:
        try:
            return call(point)
        except Exception as exc:
            with contextlib.suppress(AttributeError, TypeError):  # (an exception type that takes no attributes)
                setattr(exc, CALLABLE_ATTR, what)
            raise
    return marked


# ---- objectives ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Objective:
    """One value of a point to maximise or minimise; ``unit`` is the value's as stored and printed in JSON."""

    name: str
    direction: str
    unit: str
    value: Callable[[Point], float]
    code: str | None = None  # a user's callable: `code_digest`

    @property
    def maximize(self) -> bool:
        return self.direction == MAXIMIZE


def _quality_value(point: Point) -> float:
    return _known_quality(point).ppl_mean


NAMED: dict[str, Objective] = {
    "capacity": Objective("capacity", MAXIMIZE, "req/s", lambda p: p.rate_rps),
    "goodput": Objective("goodput", MAXIMIZE, "req/s", lambda p: p.goodput_rps),
    "energy": Objective("energy", MINIMIZE, "J/token", lambda p: p.energy_j_per_token),
    # (`Metrics.kv_peak_bytes` counts the rings of quantized KV: allocated up front, they are memory it takes)
    "memory": Objective("memory", MINIMIZE, "bytes", lambda p: float(p.metrics.kv_peak_bytes)),
    "quality": Objective("quality", MINIMIZE, "relative ppl increase", _quality_value),
}


def _callable_objective(fn: Callable, directions: Sequence[str]) -> list[Objective]:
    name = getattr(fn, "__name__", "") or ""
    name = name if name and name != "<lambda>" else "custom"
    call = _metrics_call(fn, f"objective {name}")
    digest = code_digest(fn)
    if len(directions) == 1:
        return [Objective(name, directions[0], "", lambda p: _single(call(p), name), digest)]
    return [Objective(f"{name}[{i}]", d, "", lambda p, i=i: _pick(call(p), i, len(directions), name), digest)
            for i, d in enumerate(directions)]


def _single(value: Any, name: str) -> float:
    if isinstance(value, (list, tuple)):
        raise ReturnValueError(f"objective {name}: returned {len(value)} values; a callable that returns several "
                               "is given alone, with direction=[...] holding one direction per value")
    return _number(value, f"objective {name}")


def _pick(value: Any, i: int, n: int, name: str) -> float:
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise ReturnValueError(f"objective {name}: expected a tuple of {n} values (one per direction), got {value!r}")
    return _number(value[i], f"objective {name}[{i}]")


def _check_directions(direction: str | Sequence[str] | None) -> tuple[str, ...]:
    directions = (direction,) if isinstance(direction, str) else tuple(direction or (MINIMIZE,))
    for d in directions:
        if d not in (MAXIMIZE, MINIMIZE):
            raise ValueError(f"direction {d!r}: use maximize or minimize")
    return directions


def parse_objectives(objective: str | Callable | Sequence[str | Callable],
                     direction: str | Sequence[str] | None = None) -> tuple[Objective, ...]:
    """A name, comma-separated names (a Pareto front), a callable, or a sequence of names and callables.
    Callables minimise unless ``direction`` says otherwise; one returning a tuple needs one direction
    per value."""
    if isinstance(objective, str):
        items = [s for s in objective.split(",") if s.strip()]
    elif callable(objective):
        items = [objective]
    elif isinstance(objective, (list, tuple)):
        items = list(objective)
    else:
        raise ValueError(f"objective: {objective!r} ({type(objective).__name__}) is not an objective: use "
                         f"{', '.join(NAMED)}, a comma-separated tuple of them, a callable of the metrics (and the "
                         "config), or a list of those")
    if not items:
        raise ValueError("objective: name at least one of " + ", ".join(NAMED))
    directions = _check_directions(direction)
    # Several objectives and a list of directions: one direction per objective, in order (a named one's must be its
    # own). `direction=["maximize", "minimize"]` for `["capacity", f]` had given f the first, maximize.
    per_item = len(items) > 1 and direction is not None and not isinstance(direction, str)
    if per_item and len(directions) != len(items):
        raise ValueError(f"direction: {len(directions)} given for {len(items)} objectives: give one per objective, "
                         "in order (a named objective's must be its own)")
    out: list[Objective] = []
    for i, item in enumerate(items):
        own = directions[i:i + 1] if per_item else directions if len(items) == 1 else directions[:1]
        if callable(item):
            out += _callable_objective(item, own)
        elif isinstance(item, str) and item.strip().lower() in NAMED:
            named = NAMED[item.strip().lower()]
            if per_item and own[0] != (MAXIMIZE if named.maximize else MINIMIZE):
                raise ValueError(f"direction: {named.name} has its own direction "
                                 f"({MAXIMIZE if named.maximize else MINIMIZE}), given {own[0]}")
            out.append(named)
        else:
            # (a callable only where one can be given: not in text, the command line's --objective)
            also = "" if isinstance(objective, str) else ", or a callable of the metrics"
            raise ValueError(f"objective {item!r}{did_you_mean(item, NAMED)}: use {', '.join(NAMED)} or a "
                             f"comma-separated tuple of them{also}")
    if len({o.name for o in out}) != len(out):
        raise ValueError(f"objective: {', '.join(o.name for o in out)} names one objective twice")
    if direction is not None and all(isinstance(item, str) for item in items):
        named = ["maximize" if o.maximize else "minimize" for o in out]
        if list(directions) != named:  # (directions that agree are harmless)
            have = "has its own direction" if len(out) == 1 else "have their own directions"
            raise ValueError(f"direction: {', '.join(o.name for o in out)} {have} ({', '.join(named)}); "
                             "direction applies to callable objectives")
    return tuple(out)


def objective_value(objective: Objective, point: Point) -> float:
    value = objective.value(point)
    if value != value:
        raise ReturnValueError(f"objective {objective.name}: the value is not a number (NaN)")
    return value
