"""The problem a search solves, built once from raw inputs (`build_problem`: every input checked before anything
runs): the workload's requests, the simulation target, the objectives and constraints, and the search space cut
down to the knobs the simulator models (`simulator.MODELED_KNOBS`; the others stay at the baseline's values and
are listed in the problem's notes). Also what every search is compared with (`baseline_config`: an engine's
defaults) and what the profiled machine can give a config (`fit_machine`, `check_slo_floor`).
"""
from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from skistune.config import FAMILIES, KVConfig, format_bytes, knob_fields, layer_bits_text, shown
from skistune.objectives import (DEFAULT_MAX_QUEUE_S, Constraint, EnergyBudget, Objective, QualityFloor,
                                 context_tokens_p90, parse_energy, parse_objectives, parse_quality, queue_constraint,
                                 queue_name, served_constraint, slo_constraint, user_constraint)
from skistune.runtime.request import Request
from skistune.searchspace import SearchSpace, cap_knob, load_space, param_refs, suggest_config
from skistune.slo import SLO, as_slos

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_WORKLOAD = "chat"
DEFAULT_REQUESTS = 100  # requests of a preset workload: ~1 s per capacity search here
ENGINE_TARGETS = ("vllm", "sglang")  # engines with a shipped space of what their flags can deploy


# ---- baseline and search space ----------------------------------------------------------------------------
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}  # the engines whose defaults a baseline can be


def baseline_engine(space: SearchSpace) -> str:
    """The engine whose defaults the search is compared with: SGLang's in SGLang's space (``--target
    sglang``), else vLLM's."""
    return "sglang" if space.name == "sglang" else "vllm"


def baseline_config(engine: str = "vllm") -> KVConfig:
    """What a vLLM user gets by default (shared/reference/engines-and-algorithms.md §1, vLLM arg_utils.py,
    config/cache.py, config/scheduler.py): 16-bit KV (--kv-cache-dtype auto), no eviction, no KV offload
    (--kv-offloading-size None), prefix caching on, --block-size 16, --max-num-seqs 256 and
    --max-num-batched-tokens 2048 (server defaults on GPUs under 70 GiB), chunked prefill on with
    --long-prefill-token-threshold 0 (no per-request cap: a chunk may fill the step's token budget), fcfs,
    --gpu-memory-utilization 0.9 (v0.11, the version our vLLM space targets; the newest default is 0.92).
    ``engine="sglang"``: what an SGLang user gets (`sglang_baseline_config`)."""
    if engine == "sglang":
        return sglang_baseline_config()
    if engine != "vllm":
        raise ValueError(f"baseline engine {engine!r}: use {' or '.join(ENGINE_NAMES)}")
    return KVConfig().with_knobs({
        "batching.max_num_seqs": 256, "batching.max_num_batched_tokens": 2048, "batching.chunked_prefill": True,
        "batching.chunk_size": 2048, "batching.policy": "fcfs", "batching.preemption": "recompute",
        "prefix_reuse.enabled": True, "prefix_reuse.block_size": 16, "offload.device_memory_fraction": 0.9,
    })


def sglang_baseline_config() -> KVConfig:
    """What an SGLang user gets by default (shared/reference/engines-and-algorithms.md §2, server_args.py;
    knob -> flag as in searchspace/sglang.yaml): 16-bit KV (--kv-cache-dtype auto), no eviction, no HiCache
    host tier, the radix cache on with --page-size 1 (automatic: 1 for the usual attention backends),
    --max-prefill-tokens 16384 and --chunked-prefill-size 8192 (automatic: SGLang's value on GPUs of 35-160
    GiB, A100 to H200; 2048 below), fcfs, retraction by recompute, --mem-fraction-static 0.9 (automatic:
    "about 0.9" in its docs). --max-running-requests is automatic too: the pool's tokens / 2, capped by the
    request pool of 2048-4096 slots, so 2048 wherever the KV pool holds 4096 tokens or more. SGLang takes each
    request's chunk from what is left of --chunked-prefill-size in the batch, so a step prefills at most
    8192 tokens: a budget of 8192 and a chunk of 8192 here (a budget of 16384 had let the simulator prefill
    twice what SGLang does)."""
    return KVConfig().with_knobs({
        "batching.max_num_seqs": 2048, "batching.max_num_batched_tokens": 8192, "batching.chunked_prefill": True,
        "batching.chunk_size": 8192, "batching.policy": "fcfs", "batching.preemption": "recompute",
        "prefix_reuse.enabled": True, "prefix_reuse.block_size": 1, "offload.device_memory_fraction": 0.9,
    })


def modeled_space(space: SearchSpace, base: KVConfig,
                  modeled: frozenset[str] | None = None) -> tuple[SearchSpace, tuple[str, ...]]:
    """The space cut down to the knobs the simulator models (``simulator.MODELED_KNOBS`` by default, read
    at call time so the search grows with it); the others keep ``base``'s values. Returns the cut space
    and the knobs left out (searched or fixed to another value by the space)."""
    if modeled is None:
        from skistune import simulator

        modeled = simulator.MODELED_KNOBS
    keep = {p.name for p in space.params if not p.is_switch and p.name in modeled}
    changed = True
    while changed:  # switches that kept knobs (or kept switches) read
        reads = {r for p in space.params if p.name in keep for r in param_refs(p)}
        changed = bool({p.name for p in space.params if p.is_switch and p.name in reads} - keep)
        keep |= {p.name for p in space.params if p.is_switch and p.name in reads}
    params = tuple(p for p in space.params if p.name in keep)
    fixed = {k: v for k, v in space.fixed.items() if k in modeled}
    for ref in {r for p in params for r in param_refs(p)} - keep - set(fixed):
        if "." in ref:  # a left-out knob a condition or bound reads: pinned at the base value
            family, _, name = ref.partition(".")
            fixed[ref] = getattr(getattr(base, family), name)
    left_out = {p.name for p in space.params if not p.is_switch and p.name not in modeled}
    left_out |= {k for k, v in space.fixed.items() if k not in modeled and v != _value(base, k)}
    return replace(space, params=params, fixed=MappingProxyType(fixed)), tuple(sorted(left_out))


def _check_fixed_lossy(space: SearchSpace, base: KVConfig, searchable: frozenset[str]) -> None:
    """A space that fixes a lossy knob (eviction, KV bits) away from the baseline asks for a config whose
    outputs differ from the model's: without a quality floor to price it, refused, not quietly reset."""
    from skistune import simulator
    from skistune.objectives import structural_changes

    lossy = {k: v for k, v in space.fixed.items()
             if k in simulator.LOSSY_KNOBS and k not in searchable and v != _value(base, k)}
    try:  # (per-layer bits of 16 everywhere change nothing)
        lossless = not structural_changes(base.with_knobs(lossy))
    except ValueError:  # (not a config alone, e.g. a policy whose budget the space fixes apart: checked later)
        lossless = False
    fixed = [] if lossless else [f"{k}: {layer_bits_text(v)}" for k, v in lossy.items()]  # (thirty pairs: by count)
    if fixed:
        raise ValueError(f"space {space.name}: fixes {', '.join(fixed)}, which changes the model's outputs: give a "
                         "quality floor (--quality ppl+1%) to price it, or leave it out of fixed:")


LAYER_BITS_SOLVER = "layer_bits"  # the per-layer bits integer program (`layer_bits_solvers`)
SOLVERS = (LAYER_BITS_SOLVER,)  # the programs a space's `solver:` may name


def _check_solvers(space: SearchSpace) -> None:
    """A `solver:` the optimizer has none of would leave its knob at the baseline's value in every trial, silently
    (a typo turned per-layer bits off)."""
    for p in space.params:
        if p.kind == "solver" and p.solver not in SOLVERS:
            raise ValueError(f"space {space.name}: {p.name}: solver {p.solver!r} is not one of skistune's "
                             f"({', '.join(SOLVERS)})")


def _check_layer_count(problem: Problem, first: KVConfig) -> None:
    """Per-layer bits fixed, or listed as choices, for another number of layers than the model's: bad input now,
    not an error after the study was created (its file was left behind)."""
    from skistune.runtime.kv_layout import layer_bits

    listed = [first] + [problem.base.with_knobs({p.name: c}) for p in problem.space.params
                        if p.name == "bitwidth.layer_bits" and p.kind == "choices" for c in p.choices if c is not None]
    for config in listed:
        try:
            layer_bits(config, problem.target.spec)
        except ValueError as exc:
            raise ValueError(f"space {problem.full_space.name} for {problem.model}: {exc}") from None


def _check_quality_objective(objectives: Sequence[Objective], space: SearchSpace,
                             floors: Sequence[QualityFloor]) -> None:
    """A quality objective over a space that varies no lossy knob (eviction, KV bits) is the same for every
    config: refused, as an objective named twice is. (Per-layer bits come from their solver only under a
    perplexity floor.)"""
    from skistune import simulator

    if not any(o.name == "quality" for o in objectives):
        return
    ppl_floor = any(f.metric == "ppl" for f in floors)
    varied = [q.name for q in space.params if not q.is_switch and q.name in simulator.LOSSY_KNOBS
              and (q.kind != "solver" or ppl_floor)]
    if not varied:
        raise ValueError(f"objective quality: the {space.name} space varies no knob that changes the model's "
                         "outputs (eviction.*, bitwidth.*), so every config's predicted quality loss is the same and "
                         "the objective cannot tell configs apart: drop quality from the objectives, or search a "
                         "space with eviction or KV bits (e.g. default)")


def _value(config: KVConfig, dotted: str) -> Any:
    family, _, name = dotted.partition(".")
    value = getattr(getattr(config, family), name)
    return [list(x) for x in value] if isinstance(value, tuple) else value


def _family_names(knobs: Sequence[str], searchable: frozenset[str]) -> list[str]:
    """Knobs as ``family.*`` where none of the family's knobs is searchable, else one by one."""
    names: list[str] = []
    for family in FAMILIES:
        mine = [k for k in knobs if k.startswith(family + ".")]
        searchable_here = [k for k in knob_fields() if k.startswith(family + ".") and k in searchable]
        names += [f"{family}.*"] if mine and not searchable_here else mine
    return names


def not_modeled_note(left_out: Sequence[str]) -> str | None:
    """What the search left at the baseline's values, and why: ``lossless search (no --quality floor) ...:
    eviction.*, bitwidth.*`` for the knobs that change the model's outputs, ``not modeled yet ...`` for the
    others (whole families by ``family.*`` when none of their knobs is searched)."""
    from skistune import simulator

    lossy = [k for k in left_out if k in simulator.LOSSY_KNOBS]
    other = [k for k in left_out if k not in simulator.LOSSY_KNOBS]
    parts = []
    if lossy:
        parts.append("lossless search (no --quality floor), left at defaults: "
                     + ", ".join(_family_names(lossy, frozenset())) + " (give --quality ppl+1% to search them)")
    if other:
        parts.append("not modeled yet, left at defaults: "
                     + ", ".join(_family_names(other, simulator.MODELED_KNOBS | simulator.LOSSY_KNOBS)))
    return "; ".join(parts) or None


def left_out_provenance(left_out: Sequence[str]) -> dict[str, list[str]]:
    """The knobs the search left at the baseline's values, for the tuned file, by why: ``not_modeled``
    (the simulator cannot price them) and ``not_searched_lossless`` (eviction and KV bits: the simulator
    models them, but a search without a quality floor leaves what changes the model's outputs alone)."""
    from skistune import simulator

    return {"not_modeled": [k for k in left_out if k not in simulator.MODELED_KNOBS | simulator.LOSSY_KNOBS],
            "not_searched_lossless": [k for k in left_out if k in simulator.LOSSY_KNOBS]}


def _baseline_params(problem: Problem) -> dict[str, Any]:
    """The baseline as a trial's parameters (those the space can express): the first trial of a study."""
    params = {}
    for p in problem.space.params:
        if p.is_switch and p.kind == "choices" and False in p.choices:
            params[p.name] = False  # a switch off: no solver fills knobs the baseline leaves at their values
            continue
        if p.is_switch or p.kind in ("same_as", "solver"):
            continue
        value = _value(problem.base, p.name)
        fits = value in p.choices if p.kind == "choices" else (
            value is not None and p.low is not None and p.low <= value <= p.high)
        if fits and p.at_most is not None:
            # its range ends at another knob's value: the baseline's, or one the search draws when the baseline's
            # lies outside that knob's range (chunks of 2048 under a budget searched in 512..1024 were enqueued
            # out of range, and the first trial was no valid config)
            searched = {q.name for q in problem.space.params}
            capped_by = {**problem.space.fixed, **params}
            fits = (p.at_most in capped_by or p.at_most not in searched) and \
                value <= (capped_by[p.at_most] if p.at_most in capped_by else _value(problem.base, p.at_most))
        if fits:
            params[p.name] = value
    return params


# ---- the problem ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestSet:
    """Requests at the workload's own rate, and the same requests served one at a time."""

    requests: tuple[Request, ...]
    isolated: tuple[Request, ...]

    @property
    def base_rps(self) -> float:
        return len(self.requests) / max(max(r.arrival_s for r in self.requests), 1e-9)


def request_set(requests: Sequence[Request]) -> RequestSet:
    from skistune.simulator import one_at_a_time

    return RequestSet(tuple(requests), tuple(one_at_a_time(requests)))


@dataclass(frozen=True)
class Problem:
    """Everything a trial needs, built once (and inherited by forked workers)."""

    workload: Any  # skistune.workloads.Workload
    model: str
    search: RequestSet
    target: Any  # simulator.SimTarget
    profile: Any  # skistune.profile.HardwareProfile
    slos: tuple[SLO, ...]
    objectives: tuple[Objective, ...]
    constraints: tuple[Constraint, ...]
    space: SearchSpace  # cut down to modeled knobs
    full_space: SearchSpace
    left_out: tuple[str, ...]
    base: KVConfig
    max_queue_s: float | None
    quality_profile: Any = None
    notes: tuple[str, ...] = ()
    kv_memory: int | None = None  # bytes the device pool's fraction applies to, when the user declares it

    @functools.cached_property
    def context_tokens(self) -> int:
        """The 90th percentile of the workload's request contexts (prompt plus output tokens): what a token
        eviction budget is a fraction of, for the quality prediction."""
        return context_tokens_p90(self.search.requests)

    @property
    def at_capacity(self) -> bool:
        """Scored at each config's capacity when ``capacity`` is an objective, else at the workload's rate."""
        return any(o.name == "capacity" for o in self.objectives)

    @property
    def baseline_engine(self) -> str:
        """Whose defaults the baseline is, for output: ``vLLM``, ``SGLang``."""
        return ENGINE_NAMES[baseline_engine(self.full_space)]

    @property
    def needs_goodput(self) -> bool:
        return any(o.name == "goodput" for o in self.objectives)

    @property
    def directions(self) -> list[str]:
        return [o.direction for o in self.objectives]

    def identity(self) -> dict[str, Any]:
        """What makes two studies comparable: stored with the study and checked when it resumes."""
        return {"objective": [o.name for o in self.objectives], "direction": self.directions,
                "slo": [str(s) for s in self.slos], "constraints": [c.name for c in self.constraints],
                "workload": self.workload.digest(), "model": self.model, "profile": self.profile.fingerprint.key(),
                "step_cost": list(self.target.step_cost.coef), "space": self.space.name,
                "knobs": [p.name for p in self.space.params],
                **({"quality_profile": self.quality_profile.digest()} if self.quality_profile is not None else {}),
                **({"kv_memory": self.kv_memory} if self.kv_memory is not None else {}),
                **({"callables": codes} if (codes := [x.code for x in (*self.objectives, *self.constraints)
                                                       if x.code is not None]) else {})}


def _constraints(slos, max_queue_s, energy, quality, custom) -> tuple[Constraint, ...]:
    out = [slo_constraint(s) for s in slos]
    if max_queue_s is not None:
        out.append(queue_constraint(max_queue_s))
    if energy is not None:
        out.append(Constraint(str(energy), energy.violation))
    out += [Constraint(str(q), q.violation) for q in quality]
    out.append(served_constraint())
    for i, fn in enumerate(custom, start=1):
        out.append(user_constraint(fn, i))
    names = [c.name for c in out]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        given = [str(s) for s in slos] + [str(q) for q in quality]
        if twice in given:  # (a repeated --slo or --quality: the user's words, not the API's)
            raise ValueError(f"{twice} is given twice; give each SLO and quality floor once")
        raise ValueError(f"constraints: two share the name {twice!r} ({', '.join(names)}); name your functions")
    return tuple(out)


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return [value] if isinstance(value, (str, SLO, EnergyBudget, QualityFloor)) or callable(value) else list(value)


def _parse_specs(slo, energy, quality) -> tuple[tuple[SLO, ...], EnergyBudget | None, tuple[QualityFloor, ...]]:
    slos = tuple(as_slos(slo))
    if isinstance(energy, (int, float)) and not isinstance(energy, bool):  # a Python number is J/token, as
        energy = f"{energy!r}J/token"  # ``max_queue_s`` is seconds: only text needs its unit (`parse_energy`)
    budget = energy if energy is None or isinstance(energy, EnergyBudget) else parse_energy(str(energy))
    if budget is not None and not math.isfinite(budget.limit_j_per_token):  # 1e999J/token parses as inf
        raise ValueError(f"energy {shown(energy)}: the budget must be a finite number of joules per token")
    floors = tuple(q if isinstance(q, QualityFloor) else parse_quality(q) for q in _as_list(quality))
    return slos, budget, floors


def _resolve_space(space, target) -> SearchSpace:
    if target is not None:
        if target not in ENGINE_TARGETS:
            raise ValueError(f"target {target!r}: use {' or '.join(ENGINE_TARGETS)}")
        if space is not None and load_space(space).name != target:
            raise ValueError(f"--space and --target {target}: give one (the target loads the space of what "
                             f"{target} can deploy)")
        return load_space(target)
    return load_space(space if space is not None else "default")


def _load_profile(profile, model: str) -> tuple[Any, list[str]]:
    """The profile object and notes (a fingerprint mismatch becomes a note, not a warning)."""
    from skistune.profile import FingerprintWarning, HardwareProfile, default_profile, load_profile

    if isinstance(profile, HardwareProfile):
        return profile, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FingerprintWarning)
        prof = default_profile(model, "cpu") if profile is None else load_profile(os.fspath(profile), model=model)
    return prof, [str(w.message) for w in caught if issubclass(w.category, FingerprintWarning)]


def _load_workload(workload, model: str):
    from skistune.workloads import PRESETS, Workload, load_workload

    if isinstance(workload, Workload):
        return workload
    if not isinstance(workload, (str, os.PathLike)):
        raise ValueError(f"workload: {workload!r} ({type(workload).__name__}) is not a workload: give a preset name "
                         f"({', '.join(PRESETS)}), a trace file or a Workload (skistune.workloads.load_workload)")
    preset = str(workload) in PRESETS
    return load_workload(workload, requests=DEFAULT_REQUESTS if preset else None)


def _quality_setup(floors, objectives, quality_profile, model: str) -> tuple[Any, frozenset[str], list[str]]:
    """The quality profile, the knobs the search may vary, and notes. Lossy knobs (eviction, KV bits) are
    searched only under a quality floor or a quality objective: without one they would look free."""
    from skistune import simulator
    from skistune.quality import incomplete_notes, load_quality_profile

    if not floors and not any(o.name == "quality" for o in objectives):
        return None, simulator.MODELED_KNOBS, []
    qp = load_quality_profile(quality_profile)
    if qp is None:
        raise ValueError("quality: no quality profile to price eviction and KV bits; measure one with "
                         "`skistune quality` and pass it with --quality-profile")
    notes = []
    if not floors:  # (a quality objective asks for the trade: said, since a front then reaches any loss)
        first = objectives[0].name
        notes.append("quality is an objective and no --quality floor bounds it: eviction and KV bits are searched, and "
                     "the configs found may lose any amount of quality"
                     + ("" if first == "quality" else f"; #1 (the written config) is chosen on {first}, whatever its "
                        "quality loss")
                     + " (give --quality ppl+1% to bound the loss)")
    if model != qp.model:
        notes.append(f"quality: {model} has no weights here; its quality loss is predicted from the {qp.model} "
                     "profile (proxy)")
    notes += [f"quality profile {qp.path}: {line}" for line in incomplete_notes(qp)]  # (an interrupted run's file)
    return qp, simulator.MODELED_KNOBS | simulator.LOSSY_KNOBS, notes


def build_problem(workload=DEFAULT_WORKLOAD, *, slo=(), objective="capacity", direction=None, constraints=(),
                  energy=None, quality=(), model=DEFAULT_MODEL, profile=None, space=None, target=None,
                  max_queue_s: float | None = DEFAULT_MAX_QUEUE_S, quality_profile=None, kv_memory=None) -> Problem:
    """Parse and load every input (raising ``ValueError`` on the first bad one) before anything runs.
    ``quality_profile``: a `QualityProfile` or its file (default: the one shipped for SmolLM2), read only
    when a quality floor or objective asks for it. ``profile``: a `HardwareProfile`, its file, None (this
    machine's cached quick profile) or a callable returning one of those, called once every other input has
    passed (the command measures a missing profile that way). ``kv_memory``: the memory (bytes, or a size such as
    ``"256MiB"``) that a config's ``offload.device_memory_fraction`` takes its pool from, in place of the
    profile's device (a GPU's memory; on a CPU the 4 GiB of `kv_layout.CPU_KV_SPACE_BYTES`): what a
    deployment gives KV, as vLLM's ``VLLM_CPU_KVCACHE_SPACE`` or a GPU shared with other work does."""
    import optuna

    from skistune.evaluate import fit_workload, workload_requests
    from skistune.simulator import spread_over_time, target_from_profile

    _check_inputs(profile, space, quality, quality_profile, max_queue_s)
    slos, budget, floors = _parse_specs(slo, energy, quality)
    objectives = parse_objectives(objective, direction)
    if max_queue_s is not None and not max_queue_s > 0:
        raise ValueError(f"max_queue_s: {max_queue_s!r} must be positive (None turns the queueing guard off)")
    full_space = _resolve_space(space, target)
    _check_solvers(full_space)
    base = baseline_config(baseline_engine(full_space))
    qp, searchable, quality_notes = _quality_setup(floors, objectives, quality_profile, model)
    cut, left_out = modeled_space(full_space, base, searchable)
    _check_fixed_lossy(full_space, base, searchable)
    _check_quality_objective(objectives, cut, floors)
    kv_bytes = parse_kv_memory(kv_memory)
    w = _load_workload(workload, model)
    fitted = fit_workload(w, model)  # (the provenance's digest stays the loaded workload's)
    fit_notes = list(fitted.notes[len(w.notes):])  # (prompts the model's context cut short)
    requests = workload_requests(fitted, model)
    if any(o.name == "capacity" for o in objectives) and not spread_over_time(requests):  # (not in trial 0)
        raise ValueError(f"workload {w.name}: capacity scales the workload's arrival rate, and "
                         + ("a single request has none" if len(requests) == 1 else
                            f"its {len(requests)} requests all arrive at once (at {requests[0].arrival_s:g} s)")
                         + ": give requests that arrive over time, or an objective at the workload's own rate "
                         "(goodput, energy, memory, quality)")
    # last: the profile may have to be measured first (a minute), which bad input elsewhere must not cost
    prof, notes = _load_profile(profile() if callable(profile) else profile, model)
    sim_target = target_from_profile(prof, model)
    notes = fit_notes + quality_notes + notes + list(sim_target.notes)  # (the profile's own, as evaluate shows them)
    if kv_bytes is not None:
        sim_target = replace(sim_target, device_free_bytes=kv_bytes)
    check_slo_floor(slos, sim_target)
    cut, machine_notes = fit_machine(cut, prof, sim_target)
    notes = notes + machine_notes + _capacity_point_note(objectives)
    problem = Problem(w, model, request_set(requests), sim_target, prof, slos, objectives,
                      _constraints(slos, max_queue_s, budget, floors, _as_list(constraints)), cut, full_space,
                      left_out, base, max_queue_s, qp, kv_memory=kv_bytes)
    # the study's first trial, checked now: a space whose fixed knobs clash with the baseline's values (a
    # chunk range over a fixed token budget) is bad input before the search, not a failed trial in it
    first = {p.name: p.choices[0] if p.kind == "choices" else p.low for p in problem.space.params
             if p.kind in ("choices", "int", "float")}  # (where the baseline's value is outside the space: any point)
    first_config = suggest_config(optuna.trial.FixedTrial({**first, **_baseline_params(problem)}), problem.space,
                                  problem.base)
    _check_layer_count(problem, first_config)
    return replace(problem, notes=tuple(n for n in (not_modeled_note(left_out), prof.power.modeled_note, *notes) if n))


def _constraint_specs(problem: Problem) -> tuple[float | None, list[list], list[str]]:
    """The energy budget and quality floors behind the problem's constraints (their bound methods), and the
    names of constraints no spec string can express (Python callables)."""
    energy, floors, custom = None, [], []
    known = {str(s) for s in problem.slos} | {"served"}
    if problem.max_queue_s is not None:
        known.add(queue_name(problem.max_queue_s))
    for c in problem.constraints:
        owner = getattr(c.value, "__self__", None)
        if isinstance(owner, EnergyBudget):
            energy = owner.limit_j_per_token
        elif isinstance(owner, QualityFloor):
            floors.append([owner.metric, owner.window, owner.limit])
        elif c.name not in known:
            custom.append(c.name)
    return energy, floors, custom


# ---- what the profiled machine can give a config ----------------------------------------------------------
HOST_TIER_SHARE = 0.7  # of a machine's memory, at most, for a host KV tier: vLLM refuses a larger CPU swap space
# of the free space of the disk the profile timed, at most, for a disk KV tier: its file fills as blocks are
# written (a write the full disk refuses loses its block: `runtime.disk_pool`), and the disk has other users
DISK_TIER_SHARE = 0.9


def host_tier_limit(profile, target) -> tuple[int | None, int | None]:
    """(the largest host KV tier the profiled machine can hold, its memory), or Nones where the profile does
    not record its memory and was measured on another machine. A host tier may take `HOST_TIER_SHARE` of the
    memory; on a CPU the model's weights and the device KV pool live in the same memory and come off it."""
    from skistune.profile.fingerprint import recorded_memory
    from skistune.simulator import DTYPE_BYTES

    memory = recorded_memory(profile.fingerprint, profile.device)
    if memory is None:
        return None, None
    limit = HOST_TIER_SHARE * memory
    if profile.device == "cpu":
        limit -= target.device_free_bytes + target.spec.param_count() * DTYPE_BYTES.get(profile.dtype, 4)
    return max(0, int(limit)), memory


def disk_tier_limit(profile) -> tuple[int | None, int | None]:
    """(the largest disk KV tier the profiled machine's disk can hold, its free space), or Nones where the
    profile does not record it and was measured on another machine (this machine's own profile without the
    record: the free space now, where the runtime's disk tier lives)."""
    from skistune.profile.fingerprint import is_this_machine
    from skistune.profile.transfers import disk_free_bytes

    free = profile.disk_free_bytes
    if free is None and is_this_machine(profile.fingerprint, profile.device):
        free = disk_free_bytes(None)
    return (None, None) if free is None else (int(DISK_TIER_SHARE * free), free)


def _tier_limits(profile, target) -> list[tuple[str, int | None, str, str, str]]:
    """(knob, the largest size the profiled machine can give it or None, the resource, the tier, why) for
    the host tier (`host_tier_limit`) and the disk tier (`disk_tier_limit`)."""
    host_limit, memory = host_tier_limit(profile, target)
    disk_limit, free = disk_tier_limit(profile)
    cpu = profile.device == "cpu"
    weights = ", less the model's weights and the device KV pool that share it on a CPU" if cpu else ""
    return [("offload.host_kv_bytes", host_limit, "memory", "a host tier",
             f"{HOST_TIER_SHARE:.0%} of its {format_bytes(memory or 0)} of memory, vLLM's limit for its CPU swap "
             f"space{weights}"),
            ("offload.disk_kv_bytes", disk_limit, "free disk space", "a disk tier",
             f"{DISK_TIER_SHARE:.0%} of the {format_bytes(free or 0)} free on the profiled disk")]


def _capacity_point_note(objectives) -> list[str]:
    """With capacity among several objectives, every config is scored at its own capacity: the others are
    judged there, each config at its own rate, not at the workload's (a user who set --rate expects that)."""
    # (predicted quality loss is the KV knobs' alone: the same at every rate)
    others = [o.name for o in objectives if o.name not in ("capacity", "quality")]
    if not any(o.name == "capacity" for o in objectives) or not others:
        return []
    names, them = ", ".join(others), "it" if len(others) == 1 else "them"
    return [f"{names}: judged at each config's capacity (the highest rate its constraints allow), so two configs' "
            f"figures are at two rates; optimize {names} without capacity to judge {them} at the workload's own "
            "rate (--rate sets it)"]


def oversized_tier_notes(config: KVConfig, profile, target) -> list[str]:
    """Notes for a config's tiers that are larger than the profiled machine can give them (the limits the
    search keeps to): a simulation prices them as configured, which no replay there could."""
    notes = []
    for knob, limit, _, tier, why in [*_tier_limits(profile, target), _device_pool_limit(profile, target)]:
        size = _value(config, knob)
        if limit is not None and size is not None and size > limit:
            notes.append(f"{knob}: {format_bytes(size)} is more than the {format_bytes(limit)} the profiled machine "
                         f"can give {tier} ({why}): simulated as configured, but a replay there would not hold it")
    return notes


def _device_pool_limit(profile, target) -> tuple[str, int | None, str, str, str]:
    """`_tier_limits`' entry for a device pool given in bytes: a GPU's memory less the weights, or on a CPU
    (where the runtime refuses a pool larger than the machine's memory) that memory."""
    if profile.device == "cuda":
        return ("offload.device_kv_bytes", target.device_free_bytes, "device memory", "its KV pool",
                "the GPU's memory less the model's weights")
    memory = host_tier_limit(profile, target)[1]
    return ("offload.device_kv_bytes", memory, "memory", "its KV pool",
            f"its {format_bytes(memory or 0)} of memory, where a CPU's KV pool lives")


def fit_machine(space: SearchSpace, profile, target) -> tuple[SearchSpace, list[str]]:
    """The space without host tiers larger than the profiled machine's memory can hold (`host_tier_limit`)
    or disk tiers larger than its disk (`disk_tier_limit`), and notes saying what was left out (or that the
    profile cannot tell)."""
    notes, unchecked = [], []
    for knob, limit, resource, tier, why in _tier_limits(profile, target):
        if knob not in space.knob_names():
            continue
        if limit is None:
            unchecked.append((knob, resource))
            continue
        space, dropped = cap_knob(space, knob, limit)
        if dropped:
            sizes = ", ".join(format_bytes(v) if isinstance(v, int) else str(v) for v in dropped)
            notes.append(f"{knob}: {sizes} left out of the search, more than the {format_bytes(limit)} the "
                         f"profiled machine can give {tier} ({why})")
    if unchecked:  # one note: a profile from elsewhere that predates both records misses both
        knobs, resources = (", ".join(x) for x in zip(*unchecked))
        notes.append(f"{knobs}: not checked against the profiled machine's {resources.replace(', ', ' and ')} "
                     "(the profile predates their record; measure it again with `skistune profile`)")
    return space, notes


class UnmeetableSLO(ValueError):
    """A latency SLO no config can meet on the profiled hardware (`slo_floor_s`): nothing to search. The
    command exits with the infeasible code (3), not the bad-input one. ``slo``: the SLO's name."""

    def __init__(self, message: str, slo: str = "") -> None:
        super().__init__(message)
        self.slo = slo


FLOOR_MAX_BATCH = 64  # decode batches the fastest step is looked for among (a CPU's BLAS can run 2 rows faster than 1)


def slo_floor_s(target) -> float:
    """The fastest step the profile predicts for any config: a few one-token decodes with no context, at 16
    bits (the cost terms are non-negative: bits, eviction and tiers only add). Every latency a request has
    (TTFT, each gap between tokens, hence TPOT and E2E) spans at least one step."""
    from skistune.profile.cost import decode_shape
    from skistune.runtime.kv_layout import kv_traffic

    kv = kv_traffic(KVConfig(), target.spec, target.kv_itemsize)
    return min(target.step_cost.predict_s(decode_shape(b, 0, kv)) for b in range(1, FLOOR_MAX_BATCH + 1))


def check_slo_floor(slos: Sequence[SLO], target) -> None:
    """Raise `UnmeetableSLO` for the first SLO below `slo_floor_s`."""
    floor_s = slo_floor_s(target)
    for s in slos:
        if s.limit_s < floor_s:
            raise UnmeetableSLO(f"{s}: no config can meet it on the profiled hardware: the fastest step the "
                                f"profile predicts (one-token decodes, no context) takes {floor_s * 1e3:.1f} ms, "
                                "and every latency spans at least one step", str(s))


def parse_kv_memory(kv_memory) -> int | None:
    """``kv_memory`` as bytes: an integer, a size string (``"256MiB"``, ``"2GB"``) or None (the device's own)."""
    from skistune.config import parse_bytes

    if kv_memory is None:
        return None
    if isinstance(kv_memory, bool) or not isinstance(kv_memory, (int, str)):
        raise ValueError(f"kv_memory: {kv_memory!r} is not a byte size (write e.g. 256MiB, 2GB or 268435456)")
    kv_bytes = kv_memory if isinstance(kv_memory, int) else parse_bytes("kv_memory", kv_memory)
    if kv_bytes < 1 << 20:
        raise ValueError(f"kv_memory: {kv_memory!r} is under 1 MiB; give the memory KV may use (e.g. 256MiB)")
    return kv_bytes


# ---- argument checks --------------------------------------------------------------------------------------
def _is_number(value: Any) -> bool:
    """A real number, not a bool (True > 0) nor text ("5", which Python will not compare with 0)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_counts(n_trials: int, n_jobs: int, validate: int, timeout: float | None) -> None:
    for name, value, low in (("n_trials", n_trials, 1), ("n_jobs", n_jobs, 1), ("validate", validate, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: {value!r} must be an integer >= {low}")
    if timeout is not None and not (_is_number(timeout) and timeout > 0):
        raise ValueError(f"timeout: {timeout!r} must be a positive number of seconds (or None: no limit)")


def _check_inputs(profile: Any, space: Any, quality: Any, quality_profile: Any, max_queue_s: Any) -> None:
    """`build_problem`'s arguments of the wrong type, named (they had failed deep inside: a path's TypeError for
    ``space={...}``, "'int' object is not iterable" for ``quality=1``, a comparison of text for ``max_queue_s="5s"``)."""
    from skistune.profile import HardwareProfile
    from skistune.quality import QualityProfile

    path = (str, os.PathLike)
    if profile is not None and not callable(profile) and not isinstance(profile, (*path, HardwareProfile)):
        raise ValueError(f"profile: {profile!r} must be a HardwareProfile, its JSON file, or None (this machine's)")
    if space is not None and not isinstance(space, (*path, SearchSpace)):
        raise ValueError(f"space: {space!r} must be a SearchSpace, a shipped space's name (default, vllm, ...) or a "
                         "YAML file")
    if quality_profile is not None and not isinstance(quality_profile, (*path, QualityProfile)):
        raise ValueError(f"quality_profile: {quality_profile!r} must be a QualityProfile, its JSON file, or None")
    floors = [quality] if isinstance(quality, (str, QualityFloor)) else quality
    if quality is not None and (isinstance(quality, Mapping) or not isinstance(floors, Iterable)
                                or not all(isinstance(q, (str, QualityFloor)) for q in floors)):
        raise ValueError(f"quality: {quality!r} must be a floor such as 'ppl+1%', 'worst:ppl+3%' or 'needle>=0.95', "
                         "or a list of them")
    if max_queue_s is not None and not _is_number(max_queue_s):
        raise ValueError(f"max_queue_s: {max_queue_s!r} must be a number of seconds (or None: the guard off)")
