"""The optimizer: search the knob space under SLO, energy and quality constraints with the simulator,
validate the winners on the real runtime, and write the tuned config.

    problem    the workload's requests, the simulation target, objectives and constraints, and the search
               space cut down to the knobs the simulator models (`simulator.MODELED_KNOBS`; the others stay
               at the baseline's values and are listed in the result's notes)
    search     an Optuna study in any storage (a SQLite file in the working directory by default): TPE
               (multivariate, seeded; constant liar with several workers) for one objective, NSGA-II for
               several, GP on request; constraints as Optuna constraints (<= 0 feasible). A trial scores
               one config: its capacity (binary search on the arrival rate, coarse precision) or its metrics
               at the workload's own rate. Every figure is stored with the trial, so a study resumes
               (``study_name``) and several worker processes share it (``n_jobs``).
    refine     the top-k configs and the baseline again at 2% capacity precision, with full metrics
    validate   the top-k on the real runtime (a short, length-capped slice of the workload, replayed at
               the rate the simulator chose for it); the winner is chosen by measurement

    optimize(workload, slo=..., objective=..., ...) -> OptimizeResult   everything above, from raw inputs
    build_problem(...) -> Problem; solve(problem, ...) -> OptimizeResult  the same in two steps (the CLI
                                                                          checks every input first)
    result.best / .pareto / .baseline / .validated / .gain() / .to_yaml() / .write(path)
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import re
import signal
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

from skistune import callable_module
from skistune.config import FAMILIES, KVConfig, format_bytes, knob_fields, layer_bits_text
from skistune.objectives import (DEFAULT_MAX_QUEUE_S, NAMED, Constraint, EnergyBudget, Objective, Point, QualityFloor, QueueGuard,
                                 ReturnValueError, energy_j_per_token, goodput_rps, objective_value, parse_energy,
                                 parse_objectives, parse_quality, predict_quality, queue_constraint, queue_name,
                                 raised_by, served_constraint, slo_constraint, user_constraint)
from skistune.runtime.metrics import Metrics
from skistune.runtime.request import Request
from skistune.paths import write_atomic
from skistune.searchspace import SearchSpace, cap_knob, load_space, param_refs, suggest_config
from skistune.slo import SLO, as_slos
from skistune.signals import Terminated, raise_terminated

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_WORKLOAD = "chat"
DEFAULT_REQUESTS = 100  # requests of a preset workload: ~1 s per capacity search here
DEFAULT_TRIALS = 20
DEFAULT_TOP_K = 3
SEARCH_PRECISION = 0.10  # relative precision of the capacity search inside a trial
REFINE_PRECISION = 0.02  # ... and of the top-k and the baseline afterwards
MIN_RATE_SCALE = 1 / 1024  # `simulator.capacity`'s lowest scale: metrics of configs that meet no rate
VALIDATE_REQUESTS = 6  # the slice of the workload replayed on the real runtime ...
VALIDATE_MAX_INPUT = 128  # ... with prompts and outputs capped: a replay takes ~5 s of SmolLM2 on 2 CPU cores
VALIDATE_MAX_OUTPUT = 16
VALIDATE_MIN_POOL_BYTES = 16 << 20  # the smallest KV pool a validation replay is given
# Replays per validated config at most, interleaved; the better one counts. A replay of a few short requests
# reads its p99 latencies off a handful of slow steps, so one stall of a shared machine (another process, the
# hypervisor) can break an SLO that the config itself holds: such a stall rarely hits both replays, while a
# config that is really too slow is slow in both. A config is replayed again only where that can change
# the outcome (`_replay_again`): a replay that held, under an objective read off the replay's rate, is final.
VALIDATE_REPEATS = 2
# objectives whose measured value does not depend on the replay's timing (capacity: the rate replayed at)
TIMING_FREE_OBJECTIVES = ("capacity", "quality")
ENGINE_TARGETS = ("vllm", "sglang")  # engines with a shipped space of what their flags can deploy
SAMPLERS = ("auto", "tpe", "gp", "nsga2", "random")
HEARTBEAT_S = 5  # RDB storages: a trial whose worker stopped beating this long x 4 is marked failed
PROBLEM_ATTR = "skistune.problem"
VALIDATED_ATTR = "skistune.validated"  # the last validation's replays, for `skistune report`
SIMPLIFIES_ATTR = "skistune.simplifies"  # on a trial that tries the best config with a knob group as the baseline's
CHOSEN_ATTR = "skistune.chosen"  # the config the last run ranked first (and wrote), for `skistune report`
ERROR_ATTR = "skistune.error"  # on a trial a user's callable failed: the error (the trial is stored as pruned)
REFINED_ATTR = "skistune.refined"  # ... the configs it printed and the baseline, as refined (`Evaluation.to_record`)
ILP_ATTR = "skistune.ilp"  # a trial's integer-program runs: {program: {calls, solve_s}}


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
        import numpy as np

        lengths = [len(r.prompt_token_ids) + r.max_new_tokens for r in self.search.requests]
        return int(np.percentile(lengths, 90)) if lengths else 0

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
                **({"kv_memory": self.kv_memory} if self.kv_memory is not None else {})}


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
        raise ValueError(f"energy {energy}: the budget must be a finite number of joules per token")
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
    from skistune.quality import load_quality_profile

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
                     + ("" if first == "quality" else f"; #1 (the written config) is the best on {first}, whatever its "
                        "quality loss")
                     + " (give --quality ppl+1% to bound the loss)")
    if model != qp.model:
        notes.append(f"quality: {model} has no weights here; its quality loss is predicted from the {qp.model} "
                     "profile (proxy)")
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
    others = [o.name for o in objectives if o.name != "capacity"]
    if len(others) == len(objectives) or not others:
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


# ---- the run's deadline -------------------------------------------------------------------------------------
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


# ---- scoring one config ---------------------------------------------------------------------------------
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


# ---- the study --------------------------------------------------------------------------------------------
def scale_guess(evaluations: Iterable[Evaluation]) -> float | None:
    """Where to start a config's capacity search: the median rate scale of the configs scored so far
    (most configs of one problem land within a few lattice steps of each other)."""
    scales = sorted(e.rate_scale for e in evaluations if e.rate_scale > 0)
    return scales[len(scales) // 2] if scales else None


def default_study_name(problem: Problem) -> str:
    """Named after the problem: the same command resumes its study, another problem gets its own."""
    digest = hashlib.sha256(json.dumps(problem.identity(), sort_keys=True).encode()).hexdigest()[:8]
    return f"optimize-{digest}"


STUDY_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def default_storage(study_name: str) -> str:
    """The SQLite file in this folder named after the study. A name that a file name or a URL would change is
    refused: 'x%41' made skistune-xA.db (another study's file), 'a/b' a raw sqlite error, 'r-a,b' a URL printed
    with %2C that named no file in sight."""
    if not STUDY_FILE_NAME.fullmatch(study_name):
        raise ValueError(f"study name {study_name!r}: the default storage is a file named after it "
                         "(skistune-NAME.db), so start it with a letter or digit and use only those, '.', '_' and '-', or give --storage "
                         "URL for any name")
    return f"sqlite:///{Path.cwd() / f'skistune-{study_name}.db'}"


class _NoStudies(Exception):
    """A database without Optuna's tables, opened not to create them."""


def _has_optuna_tables(url: str, engine_kwargs: dict) -> bool:
    import sqlalchemy

    engine = sqlalchemy.create_engine(url, **engine_kwargs)
    try:
        return sqlalchemy.inspect(engine).has_table("studies")
    finally:
        engine.dispose()


def open_storage(storage, create: bool = True):
    """An Optuna storage object: a URL (SQLite, PostgreSQL, MySQL; heartbeats on, so trials of killed
    workers are failed, and each such trial is retried once by the next worker) or any storage object.
    ``create`` False leaves a database without Optuna's tables as it is (a worker joins, never creates)."""
    import optuna
    import sqlalchemy.exc

    if not isinstance(storage, str):
        return storage
    if "://" not in storage:
        raise ValueError(f"storage {storage!r}: give an Optuna storage URL, e.g. sqlite:///study.db or "
                         "postgresql://user@host/db")
    url = _with_installed_driver(storage)
    _check_lasting(url, storage)
    # a wrong host or port should fail in seconds, not hang the command
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else \
        {"connect_args": {"connect_timeout": 10}} if url.startswith(("postgresql+psycopg", "mysql+pymysql")) else {}
    try:
        if not create and not _has_optuna_tables(url, engine_kwargs):
            raise _NoStudies
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return split_attr_storage_class()(url, engine_kwargs=engine_kwargs, heartbeat_interval=HEARTBEAT_S,
                                              grace_period=4 * HEARTBEAT_S, skip_table_creation=not create,
                                              **_retry_stale_trials())
    except _NoStudies:
        raise ValueError(f"storage {_storage_label(storage)}: holds no Optuna study; create the study first with "
                         "skistune optimize --storage URL --study NAME") from None
    except ImportError as exc:
        driver = exc.name or getattr(exc.__cause__, "name", None)  # (Optuna raises its own, from SQLAlchemy's)
        hint = f"{driver}: pip install {DRIVER_PACKAGES.get(driver, driver)}" if driver else exc
        raise ValueError(f"storage {_storage_label(storage)}: its database driver is not installed ({hint})") from None
    except sqlalchemy.exc.NoSuchModuleError:
        kind = storage.partition("://")[0]
        why = " (Optuna's journal files are not supported: with no heartbeat, a killed worker's trial would stay " \
              "running forever)" if kind.startswith("journal") else ""
        raise ValueError(f"storage {_storage_label(storage)}: cannot open ({kind!r} is not a database SQLAlchemy "
                         f"knows{why}); give {STORAGE_KINDS}") from None
    except (sqlalchemy.exc.SQLAlchemyError, ValueError) as exc:  # ValueError: e.g. a port that is no number
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"storage {_storage_label(storage)}: cannot open ({reason})") from None


# what `pip install` gets a missing database driver (by the module SQLAlchemy failed to import)
DRIVER_PACKAGES = {"psycopg2": "psycopg2-binary, the postgres extra of skistune", "psycopg": "'psycopg[binary]'",
                   "MySQLdb": "mysqlclient, or PyMySQL with a mysql+pymysql:// URL", "pymysql": "PyMySQL"}
# (Optuna's journal files are not among the storages: they have no heartbeat, so a killed worker's trial would
# stay running forever instead of being retried)
STORAGE_KINDS = "a SQLite file (sqlite:///study.db) or a server (postgresql://user@host/db, mysql://user@host/db)"


def _check_lasting(url: str, storage: str) -> None:
    """Refuse an in-memory SQLite URL: each connection opens its own empty database (the heartbeat thread's
    finds no tables), and it is gone when the command ends, so no worker can share it and nothing resumes."""
    import sqlalchemy.exc
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        return  # RDBStorage reports it
    database = parsed.database or ""
    in_memory = database in ("", ":memory:") or database.startswith("file::memory:") \
        or parsed.query.get("mode") == "memory"
    if parsed.get_backend_name() == "sqlite" and in_memory:
        raise ValueError(f"storage {storage}: an in-memory SQLite database can be neither shared with workers nor "
                         f"resumed; give {STORAGE_KINDS} (from Python, storage=optuna.storages.InMemoryStorage() "
                         "keeps a study in memory)")


def _retry_stale_trials() -> dict[str, Any]:
    """The storage option that queues a trial again, once, when its worker stopped beating (killed):
    ``heartbeat_stale_trial_callback`` from Optuna 4.9, ``failed_trial_callback`` before."""
    import optuna

    if hasattr(optuna.storages, "RetryHeartbeatStaleTrialCallback"):
        return {"heartbeat_stale_trial_callback": optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1)}
    return {"failed_trial_callback": optuna.storages.RetryFailedTrialCallback(max_retry=1)}


def fail_trials_that_never_beat(study, now: datetime | None = None) -> list[int]:
    """Fail, and retry once as a stale trial is, each running trial that never recorded a heartbeat and
    started more than the grace period ago; returns their numbers. Optuna's heartbeat thread records its
    first beat while the trial function already runs, and its stale check skips a trial with no beat: a
    worker killed in between would leave its trial running for ever. A live trial beats within its first
    interval, so one silent past the grace is dead (whatever host ran it). Reads Optuna's heartbeat table
    (no public call says whether a trial has a beat); on a storage without one, nothing is done."""
    import optuna
    import sqlalchemy.exc

    storage = study._storage
    backend = getattr(storage, "_backend", storage)  # (a study wraps an RDB storage in a cache)
    interval = getattr(backend, "heartbeat_interval", None)
    if not isinstance(backend, optuna.storages.RDBStorage) or interval is None:
        return []
    grace = backend.grace_period or 2 * interval
    now = now or datetime.now()  # (Optuna stamps a trial's start with its process's local time)
    old = {t._trial_id: t.number for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
           if t.datetime_start is not None and (now - t.datetime_start).total_seconds() > grace}
    if not old:
        return []
    try:
        from optuna.storages._rdb.models import TrialHeartbeatModel

        session = backend.scoped_session()
        try:
            beaten = {row[0] for row in session.query(TrialHeartbeatModel.trial_id)
                      .filter(TrialHeartbeatModel.trial_id.in_(list(old)))}
        finally:
            backend.scoped_session.remove()
    except (ImportError, AttributeError, sqlalchemy.exc.SQLAlchemyError):  # (another Optuna's tables, a lost
        return []  # connection: the heartbeat's own check stays)
    return [old[t] for t in _fail_and_retry(study, sorted(set(old) - beaten))]


def _fail_and_retry(study, trial_ids: Sequence[int]) -> list[int]:
    """Fail these running trials (by id) and queue each again once, as the storage's stale-trial callback
    does; returns the ids this call failed (another process may have ended one first)."""
    import copy

    import optuna

    storage = study._storage
    backend = getattr(storage, "_backend", storage)
    failed = []
    for trial_id in trial_ids:
        with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):  # (another process failed it first)
            if storage.set_trial_state_values(trial_id, state=optuna.trial.TrialState.FAIL):
                failed.append(trial_id)
    retry = getattr(backend, "get_heartbeat_stale_trial_callback", None) or getattr(
        backend, "get_failed_trial_callback", lambda: None)
    callback = retry()
    for trial_id in failed:
        if callback is not None:
            callback(study, copy.deepcopy(storage.get_trial(trial_id)))
    return failed


def _with_installed_driver(url: str) -> str:
    """A bare ``postgresql://`` URL with a driver that is installed: SQLAlchemy 2.0 defaults to psycopg2
    and 2.1 to psycopg (3); the ``[postgres]`` extra installs psycopg2-binary. (A bare ``mysql://`` stays
    SQLAlchemy's mysqlclient: the ``[mysql]`` extra's PyMySQL is named in the URL, ``mysql+pymysql://``.)"""
    from importlib.util import find_spec

    import sqlalchemy.exc
    from sqlalchemy.dialects import postgresql
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        return url  # RDBStorage reports it
    if parsed.drivername != "postgresql":
        return url
    found = next((d for d in (postgresql.dialect.driver, "psycopg2", "psycopg") if find_spec(d)), None)
    return url if found is None else parsed.set(drivername=f"postgresql+{found}").render_as_string(hide_password=False)


# ---- storage: study attributes of any size ----------------------------------------------------------------
# Optuna's RDB storage keeps each attribute's JSON in a TEXT column: 65,535 bytes on MySQL/MariaDB, where a study
# of a large trace had failed to store its recipe (550 KB of JSON for 8,000 Mooncake requests: "Data too long for
# column 'value_json'"). A study attribute whose JSON is longer than `ATTR_PART_CHARS` is stored compressed, in
# parts of at most that many characters, under keys ``KEY#a0``, ``KEY#a1``, ... and ``KEY`` itself holds a
# marker naming them (`SPLIT_MARK`), written last. The storages `open_storage` opens join them again, so every
# reader (optimize, worker, report) sees the whole value; a value stored whole (any older study) reads as it is.
ATTR_PART_CHARS = 50_000  # well under MySQL's 65,535 bytes (the JSON is ASCII: Optuna escapes the rest)
SPLIT_MARK = "skistune.parts"
_PART_KEY = re.compile(r"(?P<key>.+)#(?P<slot>[ab])(?P<index>\d+)")


def _split_marker(value: Any) -> Mapping[str, Any] | None:
    if isinstance(value, Mapping) and len(value) == 1 and isinstance(value.get(SPLIT_MARK), Mapping):
        return value[SPLIT_MARK]
    return None


def split_attr(key: str, value: Any, current: Any = None) -> list[tuple[str, Any]]:
    """The (key, value) rows that store ``value`` under ``key``: the value itself when its JSON fits one
    attribute, else its compressed parts, then the marker that names them. ``current``: what ``key`` holds now;
    the parts go to the other of two slots (a, b) than the ones it names, so that a run stopped between the rows
    leaves the value before it whole."""
    text = json.dumps(value)
    if len(text) <= ATTR_PART_CHARS:
        return [(key, value)]
    packed = _pack(text.encode())
    slot = "b" if (_split_marker(current) or {}).get("slot") == "a" else "a"
    parts = [packed[i:i + ATTR_PART_CHARS] for i in range(0, len(packed), ATTR_PART_CHARS)]
    marker = {"slot": slot, "parts": len(parts), "sha256": hashlib.sha256(packed.encode()).hexdigest()}
    return [(f"{key}#{slot}{i}", part) for i, part in enumerate(parts)] + [(key, {SPLIT_MARK: marker})]


def joined_attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Stored attributes with each split value (`split_attr`) whole again and its parts left out."""
    out = {}
    for key, value in attrs.items():
        part = _PART_KEY.fullmatch(key)
        if part is not None and part["key"] in attrs:
            continue
        marker = _split_marker(value)
        out[key] = value if marker is None else _joined(key, marker, attrs)
    return out


def _joined(key: str, marker: Mapping[str, Any], attrs: Mapping[str, Any]) -> Any:
    parts = [attrs.get(f"{key}#{marker.get('slot')}{i}") for i in range(int(marker.get("parts", 0)))]
    packed = "".join(p for p in parts if isinstance(p, str))
    if None in parts or hashlib.sha256(packed.encode()).hexdigest() != marker.get("sha256"):
        raise ValueError(f"study attribute {key}: its {len(parts)} stored parts are incomplete or damaged (edited "
                         "by hand?); start another study")
    return json.loads(_unpack(packed))


@functools.cache
def split_attr_storage_class():
    """Optuna's RDB storage, with study attributes of any size (`split_attr`, `joined_attrs`): the class
    `open_storage` opens URLs with (made on first use: Optuna is imported only when a study runs)."""
    import optuna

    class SplitAttrRDBStorage(optuna.storages.RDBStorage):
        __doc__ = split_attr_storage_class.__doc__

        def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
            current = super().get_study_user_attrs(study_id).get(key) if len(json.dumps(value)) > ATTR_PART_CHARS \
                else None
            for k, v in split_attr(key, value, current):
                super().set_study_user_attr(study_id, k, v)

        def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
            return joined_attrs(super().get_study_user_attrs(study_id))

        def get_all_studies(self) -> list:
            studies = super().get_all_studies()
            for s in studies:
                s.user_attrs = joined_attrs(s.user_attrs)
            return studies

    SplitAttrRDBStorage.__module__, SplitAttrRDBStorage.__qualname__ = __name__, "SplitAttrRDBStorage"
    return SplitAttrRDBStorage


def __getattr__(name: str) -> Any:
    if name == "SplitAttrRDBStorage":  # (where pickle looks the class up)
        return split_attr_storage_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- storage: a failure mid-run ---------------------------------------------------------------------------
class StorageWriteError(OSError):
    """The study's storage failed while a run used it (a full disk, a lost database server, a value the
    database refused). Every trial that finished before is in it. ``reason``: the database's own message;
    ``kept``: the study's finished trials (None when the storage could not even be read); `line` says it all
    in one line, with the command that resumes when the caller knows it."""

    def __init__(self, reason: str, *, writing: bool = True, storage: str | None = None,
                 study_name: str | None = None, kept: int | None = None):
        self.reason, self.writing, self.storage, self.study_name, self.kept = reason, writing, storage, study_name, kept
        super().__init__(self.line())

    def line(self, resume: str | None = None) -> str:
        where = f"the study's storage{f' {self.storage}' if self.storage else ''}"
        what = f"{where} could not write ({self.reason})" if self.writing else f"{where} failed ({self.reason})"
        if self.study_name is None:
            return what
        kept = "every trial finished before" if self.kept is None else \
            f"its {self.kept} finished trial{'s' * (self.kept != 1)}"
        full = any(w in self.reason.lower() for w in ("full", "no space", "quota"))
        when = "free space for it" if full else "once it works again"
        how = f"resume with: {resume}" if resume else \
            f"resume with study_name={self.study_name!r} and the same storage"
        return f"{what}; study {self.study_name} keeps {kept}; {when}, then {how}"


_WRITES = ("INSERT", "UPDATE", "DELETE", "COMMIT", "CREATE", "ALTER", "DROP")


def storage_failure(exc: BaseException) -> tuple[str, bool] | None:
    """The database's message and whether it failed writing, when ``exc`` is, or was caused by, a failure of
    the storage (a driver's error as SQLAlchemy wraps it, Optuna's wrapper of a failed commit, or a
    `StorageWriteError`); else None. Optuna's trial loop turns a failed write into "Should not reach": the
    failure is found in what that exception happened during."""
    import sqlite3

    import optuna
    import sqlalchemy.exc

    seen, found = set(), None
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, StorageWriteError):
            return exc.reason, exc.writing
        if isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.orig is not None:
            orig = exc.orig
            statement = (exc.statement or "").lstrip().upper()
            return _error_text(orig), not statement or statement.startswith(_WRITES)
        if isinstance(exc, sqlite3.Error):
            return _error_text(exc), True
        if found is None and isinstance(exc, (optuna.exceptions.StorageInternalError, sqlalchemy.exc.SQLAlchemyError)):
            found = (_error_text(exc), True)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return found


def _error_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    name = f"{type(exc).__module__.split('.')[0]}.{type(exc).__name__}"
    return f"{name}: {text}" if text else name


def _finished_in(storage: Any, study_name: str) -> int | None:
    """The finished trials of a study, read through a new connection (None where the storage cannot be read)."""
    import optuna

    try:
        opened = open_storage(storage, create=False) if isinstance(storage, str) else storage
        study = optuna.load_study(study_name=study_name, storage=opened)
        return len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))
    except Exception:  # (a storage that cannot be read now: the message says "every trial finished before")
        return None


@contextlib.contextmanager
def storage_failures(storage: Any, study_name: str):
    """A failure of the study's storage inside the block, however Optuna wrapped it, as one `StorageWriteError`
    that says what failed and how many finished trials the study keeps."""
    try:
        yield
    except Exception as exc:
        found = storage_failure(exc)
        if found is None:
            raise
        raise StorageWriteError(found[0], writing=found[1], storage=_storage_label(storage), study_name=study_name,
                                kept=_finished_in(storage, study_name)) from None


@contextlib.contextmanager
def _quiet_heartbeat_failures():
    """A heartbeat thread that fails to write (a full disk) ends without printing its traceback: the trial's own
    next write fails too, and `storage_failures` says it in one line."""
    import threading

    previous = threading.excepthook

    def hook(args) -> None:
        if not ("_record_heartbeat" in getattr(args.thread, "name", "") and args.exc_value is not None
                and storage_failure(args.exc_value) is not None):
            previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


def _uses_trial_constraints() -> bool:
    """Optuna 5 reads constraints set on the trial (``trial.set_constraint``); Optuna 4 needs a
    ``constraints_func`` on the sampler."""
    import optuna

    return hasattr(optuna.trial.Trial, "set_constraint")


def make_sampler(name: str, *, seed: int, problem: Problem, parallel: bool, n_trials: int,
                 tpe_options: Mapping[str, Any] | None = None, local_options: Mapping[str, Any] | None = None):
    """The study's sampler. A single-objective TPE search spends a share of its trials on local moves around
    the best configs (`skistune.local_moves`). ``tpe_options`` override the TPE settings, ``local_options``
    the local moves' (`LocalMovesSampler`'s keywords; ``share=0`` is TPE alone): `benchmarks/sampler_variants.py`."""
    import optuna

    from skistune.local_moves import LocalMovesSampler

    if name not in SAMPLERS:
        raise ValueError(f"sampler {name!r}: use {', '.join(SAMPLERS)}")
    n = len(problem.constraints)
    constraints = {} if _uses_trial_constraints() else {
        "constraints_func": lambda t: list(t.user_attrs.get("violations", {}).values()) or [1.0] * n}
    if name == "auto":
        name = "tpe" if len(problem.objectives) == 1 else "nsga2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if name == "tpe":
            settings = {"multivariate": True, "group": True, **(tpe_options or {})}
            tpe = optuna.samplers.TPESampler(seed=seed, constant_liar=parallel, **settings, **constraints)
            if len(problem.objectives) > 1:
                return tpe
            return LocalMovesSampler(tpe, seed=seed, feasible=_trial_feasible, **(local_options or {}))
        if name == "nsga2":
            population = max(4, min(50, n_trials // 4))
            return optuna.samplers.NSGAIISampler(seed=seed, population_size=population, **constraints)
        if name == "gp":
            # chunk_size's range depends on max_num_batched_tokens: GP samples it independently (at random)
            return optuna.samplers.GPSampler(seed=seed, deterministic_objective=True, warn_independent_sampling=False,
                                             **constraints)
        return optuna.samplers.RandomSampler(seed=seed)


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


def open_study(problem: Problem, storage, study_name: str, sampler):
    """Create the study, or resume it when it exists for the same problem."""
    import optuna

    study = optuna.create_study(storage=storage, study_name=study_name, directions=problem.directions,
                                sampler=sampler, load_if_exists=True)
    stored = study.user_attrs.get(PROBLEM_ATTR)
    identity = json.loads(json.dumps(problem.identity()))
    if stored is None:
        study.set_user_attr(PROBLEM_ATTR, identity)
        study.enqueue_trial(_baseline_params(problem), user_attrs={"enqueued": "baseline"})
    elif stored != identity:
        differs = ", ".join(k for k in identity if stored.get(k) != identity[k])
        raise ValueError(f"study {study_name!r} was created for another problem (differs in: {differs}); pass "
                         "another study name (--study, or study_name= in Python), or omit it")
    return study


def _ppl_budget(problem: Problem) -> float | None:
    """The tightest perplexity floor as a relative increase (None when no floor bounds perplexity)."""
    limits = [limit for metric, _, limit in _constraint_specs(problem)[1] if metric == "ppl"]
    return min(limits) if limits else None


LAYER_BITS_SOLVES = 5  # integer programs per config at most (see `layer_bits_solvers`)


def _ppl_excess(problem: Problem, config: KVConfig) -> float:
    """How far the config's predicted quality is above the tightest perplexity floor, in log-perplexity
    (<= 0: every ppl floor holds), reading the bounds the floors read (`QualityFloor.violation`)."""
    loss = predict_quality(config, problem.quality_profile, problem.model, problem.context_tokens)
    excess = -math.inf
    for metric, window, limit in _constraint_specs(problem)[1]:
        if metric == "ppl":
            guarded = loss.guarded_worst if window == "worst" else loss.guarded_mean
            excess = max(excess, math.log1p(guarded) - math.log1p(limit))
    return excess


def layer_bits_solvers(problem: Problem, stats=None) -> dict[str, Callable[[KVConfig], Any]] | None:
    """The ``layer_bits`` solver of the search space (where it asks for mixed precision): the integer program
    of `skistune.ilp` choosing each layer's (key, value) bits for the fewest KV bytes per token, within the
    perplexity floor left after the config's eviction, from the quality profile's per-layer sensitivities.
    The program budgets the predicted mean; the floors read 95% bounds above it (`QualityProfile.predict`),
    whose margin grows with the loss, so where the full budget's solution breaks a floor the budget is
    bisected (at most `LAYER_BITS_SOLVES` programs) for the largest one whose solution holds. An unreachable
    budget leaves the config's uniform bits (the floor then rejects or admits it). ``stats`` (`skistune.ilp.SolverStats`) counts the program's runs and solve times."""
    budget = _ppl_budget(problem)
    qp = problem.quality_profile
    if qp is None or budget is None:
        return None
    from skistune.ilp import DEFAULT_ALLOWED, solve_layer_bits
    from skistune.runtime.kv_layout import side_block_bytes, value_group

    spec, itemsize = problem.target.spec, problem.target.kv_itemsize

    def solve(config: KVConfig) -> list[list[int]] | None:
        block, group = config.prefix_reuse.block_size, value_group(config, spec)
        per_token = {(kb, vb): (side_block_bytes(spec, block, itemsize, kb, True, group)
                                + side_block_bytes(spec, block, itemsize, vb, False, group)) / block
                     for kb, vb in DEFAULT_ALLOWED}
        left = math.log1p(budget) - qp.evict_mean_delta(config, problem.context_tokens)
        sensitivity = qp.layer_sensitivity(config, spec.n_layers, DEFAULT_ALLOWED)
        if sensitivity is None:
            return None
        if left <= 0:
            return None
        # bisection on the mean's budget for the largest one whose solution also holds the floors' bounds
        best, low, high, budget_now = None, 0.0, left, left
        for _ in range(LAYER_BITS_SOLVES):
            solution = solve_layer_bits(sensitivity, per_token, budget_now, spec.n_layers, stats=stats)
            bits = [list(pair) for pair in solution.layer_bits] if solution.feasible else None
            if bits is not None and _ppl_excess(problem, config.with_knobs({"bitwidth.layer_bits": bits})) <= 0:
                best, low = bits, budget_now
                if budget_now == left:
                    break
            else:
                high = budget_now
            budget_now = (low + high) / 2
        return best

    return {LAYER_BITS_SOLVER: solve}


def _trial_function(problem: Problem, study) -> Callable:
    """The Optuna objective: suggest a config, score it (once per distinct config: a repeat, here or in
    the stored study, reuses the stored figures), store the figures with the trial."""
    import optuna

    cache = {Evaluation.from_trial(t).config: Evaluation.from_trial(t)
             for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
             if "config" in t.user_attrs}

    from skistune.ilp import SolverStats

    stats = SolverStats()
    solvers = layer_bits_solvers(without_deadline(problem), stats)  # (its programs simulate nothing)

    def run(trial):
        try:
            return scored(trial)
        except TimeUp:  # (stored PRUNED: its capacity search was cut short, so it has no figures)
            run.timed_out = True
            with contextlib.suppress(RuntimeError):  # (raised outside study.optimize: `_simplify`'s asked trial)
                trial.study.stop()
            raise optuna.TrialPruned(f"the timeout ({_deadline_of(problem).timeout_s:g} s) ran out inside this "
                                     "trial") from None

    def scored(trial):
        calls, solve_s = stats.calls, stats.total_s
        config = suggest_config(trial, problem.space, problem.base, solvers)
        if stats.calls > calls:  # stored with the trial: every worker's runs add up in the study
            trial.set_user_attr(ILP_ATTR, {"layer_bits": {"calls": stats.calls - calls,
                                                          "solve_s": stats.total_s - solve_s}})
        evaluation = cache.get(config)
        if evaluation is None:
            try:
                evaluation = cache[config] = score(problem, config, start_scale=scale_guess(cache.values()))
            except Exception as exc:  # the user's callable returned no number, or raised: no use trying others
                if not isinstance(exc, ReturnValueError) and raised_by(exc) is None:
                    raise
                run.failures.append(exc)
                # (stored PRUNED, not FAIL, so that Optuna logs no traceback of its own: the error says why)
                trial.set_user_attr(ERROR_ATTR, _capped(f"{type(exc).__name__}: {exc}"))
                with contextlib.suppress(RuntimeError):  # (raised outside study.optimize: an asked trial, `_simplify`)
                    trial.study.stop()
                raise optuna.TrialPruned(str(exc)) from None  # (a failed trial would log Optuna's traceback)
        for key, value in evaluation.to_attrs().items():
            trial.set_user_attr(key, value)
        if _uses_trial_constraints():
            for name, value in evaluation.violations.items():
                trial.set_constraint(name, value)
        return evaluation.values[0] if len(evaluation.values) == 1 else list(evaluation.values)

    run.failures = []  # what stopped the study: raised by `_optimize` once the trial is over
    run.timed_out = False  # whether the run's deadline cut a trial short (`with_deadline`)
    return run


ERROR_ATTR_CHARS = 2000  # of a user's error stored with its trial (a trial's attributes are not split: `split_attr`)


def _capped(text: str) -> str:
    cut = " ... (cut short)"
    return text if len(text) <= ERROR_ATTR_CHARS else text[:ERROR_ATTR_CHARS - len(cut)] + cut


def _optimize(study, trial_function: Callable, **kwargs: Any) -> None:
    """``study.optimize``, then the error of a user's objective or constraint that stopped it, if any. Trials
    left running by a worker killed before its first heartbeat are failed and queued again first."""
    fail_trials_that_never_beat(study)
    with _quiet_heartbeat_failures():
        study.optimize(trial_function, **kwargs)
    failures = getattr(trial_function, "failures", None)
    if failures:
        raise failures[0]


# ---- running the search ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Progress:
    """How far this run's search is: trials finished (of ``total``), feasible ones, the best first
    objective among them (None until one is feasible)."""

    done: int
    total: int
    feasible: int
    best: float | None


def _trial_feasible(trial) -> bool:
    violations = trial.user_attrs.get("violations")
    return violations is not None and all(v <= 0 for v in violations.values())


def _random_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _worker_tag(seed: int | None, unseeded: bool = False) -> dict[str, Any]:
    """What each trial records of the process that ran it (its ``worker`` attribute; no seed for a trial that
    no sampler proposed). ``unseeded``: proposed by a process searching beside others (a worker of --jobs or
    `skistune worker`, a run that switched to a random seed), which no seed reproduces (`UNSEEDED_TAG`)."""
    import socket

    tag = {"host": socket.gethostname(), "pid": os.getpid(), "seed": seed}
    return {**tag, UNSEEDED_TAG: True} if unseeded else tag


UNSEEDED_TAG = "unseeded"


def _study_unseeded(study) -> bool:
    """Whether a trial of the study was proposed by a process no seed reproduces (`_worker_tag`)."""
    return any(isinstance(t.user_attrs.get("worker"), Mapping) and t.user_attrs["worker"].get(UNSEEDED_TAG)
               for t in study.get_trials(deepcopy=False))


def _tagged(score_trial: Callable, tag_of: Callable[[], Mapping[str, Any]]) -> Callable:
    """The trial function, recording the tag of the process that runs it with each trial."""

    def objective(trial):
        trial.set_user_attr("worker", dict(tag_of()))
        return score_trial(trial)

    objective.failures = score_trial.failures
    return objective


def _ran_here(trial, pids: set[int]) -> bool:
    """Whether one of the processes ``pids`` of this host ran ``trial`` (by its tag)."""
    import socket

    tag = trial.user_attrs.get("worker")
    return isinstance(tag, Mapping) and tag.get("pid") in pids and tag.get("host") == socket.gethostname()


def _stopped_here(tag: Any) -> bool:
    """Whether a trial's tag names a process of this host that is gone (killed before it could end its trial)."""
    import socket

    if not isinstance(tag, Mapping) or not isinstance(tag.get("pid"), int) or tag.get("host") != socket.gethostname():
        return False
    try:
        os.kill(tag["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:  # (another user's process: alive)
        return False
    return False


def running_notes(study) -> list[str]:
    """What a run joining ``study`` should know of the trials running in it already: those a stopped process
    left (its tag names a process of this host that is gone), which the heartbeat fails and retries, and
    those of another process searching the study now."""
    import optuna

    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    left = [t.number for t in running if _stopped_here(t.user_attrs.get("worker"))]
    stopped = len(left)
    others, grace = len(running) - stopped, f"{4 * HEARTBEAT_S} s"
    notes = []
    if stopped:
        named = ", ".join(map(str, left[:5])) + (f" and {stopped - 5} more" if stopped > 5 else "")
        notes.append(f"trial{'s' * (stopped != 1)} {named} left running by a stopped process: retried once "
                     f"{'its' if stopped == 1 else 'their'} heartbeat is {grace} stale (by this run if it lasts "
                     "that long, else by the next)")
    if others:
        notes.append(f"another process is running study {study.study_name} ({others} trial{'s' * (others != 1)} "
                     f"running, or left by a process stopped less than {grace} ago): this run adds its trials to "
                     "the same study")
    return notes


def _progress_of(problem: Problem, study, first_trial: int, total: int, pids: set[int]) -> Progress:
    """This run's progress: the trials its processes (``pids``) finished, not another process's in the study."""
    import optuna

    trials = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
              if t.number >= first_trial and _ran_here(t, pids)]
    feasible = [t.values[0] for t in trials if _trial_feasible(t)]
    pick = max if problem.objectives[0].maximize else min
    return Progress(len(trials), total, len(feasible), pick(feasible) if feasible else None)


def _first_new_trial(study) -> int:
    """The number of the first trial this run will finish: after every trial already started (a queued
    one, such as the baseline of a new study, is this run's)."""
    import optuna

    started = [t.number for t in study.get_trials(deepcopy=False) if t.state != optuna.trial.TrialState.WAITING]
    return max(started, default=-1) + 1


class _RunSampler:
    """The sampler of a run's own process, seeded so that a search is reproducible. A second command searching
    the same study at once would be seeded alike (the same seed, the same study size) and propose the same
    configs in lockstep: the first trial number that skips past this run's next one (another process took it)
    switches this run to a new sampler with a random seed (``joined``: that trial's number)."""

    def __init__(self, study, make: Callable[[int], Any], seed: int):
        self.study, self.make, self.seed = study, make, seed
        self.next, self.joined = _first_new_trial(study), None
        study.sampler = self._watching(make(seed))

    def _watching(self, sampler):
        proceed = sampler.before_trial

        def before_trial(study, trial) -> None:  # Optuna calls it before the trial samples anything
            if trial.number > self.next and self.joined is None:
                self.joined, self.seed = trial.number, _random_seed()
                self.study.sampler = self._watching(self.make(self.seed))  # (a Trial samples from study.sampler)
                self.study.sampler.before_trial(study, trial)
            else:
                proceed(study, trial)
            self.next = max(self.next, trial.number + 1)  # (a queued trial popped may be numbered lower)

        sampler.before_trial = before_trial
        return sampler

    def skip_to_now(self) -> None:
        """Trials this run's own workers added are not another process's: from here on, a trial number past
        the study's current end means another process again (the parent runs a killed worker's share after
        the workers, whose trials took the numbers between)."""
        self.next = _first_new_trial(self.study)

    def note(self) -> str | None:
        if self.joined is None:
            return None
        return (f"another process searched study {self.study.study_name} at the same time (from trial "
                f"{self.joined}): this run sampled with a random seed ({self.seed}) from then on, so that the two do "
                "not propose the same configs (a search is reproducible from its seed with the study to itself)")


def _run_sequential(problem, study, n_trials, timeout, progress, tag_of) -> int:
    """The search in this process; how many trials it finished."""
    first, pids = _first_new_trial(study), {os.getpid()}
    callbacks = [lambda s, t: progress(_progress_of(problem, s, first, n_trials, pids))] if progress else []
    with _StopsInsideTrials() as gate:
        _optimize(study, _tagged(gate.wrap(_trial_function(problem, study)), tag_of), n_trials=n_trials,
                  timeout=timeout, callbacks=[*callbacks, gate.stop_after_trial])
    return _progress_of(problem, study, first, n_trials, pids).done


PR_SET_PDEATHSIG = 1  # Linux prctl(2): the signal a process gets when the thread that forked it ends


def _stop_with_parent(parent: int) -> None:
    """A forked worker stops (SIGTERM: `Terminated`) when the process that forked it dies, instead of searching
    on as an orphan: killed with SIGKILL, that process cannot stop it. On Linux the kernel sends the signal;
    elsewhere the worker checks between trials (`_orphaned`)."""
    import ctypes
    import sys

    import threading

    signal.signal(signal.SIGTERM, raise_terminated)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # (it died before the line above)
        raise Terminated
    # the last resort: a worker that SIGTERM did not stop within `STOP_WAIT_S` of its parent's death ends here
    # (the signal can land where Python drops the exception it raises; a test saw one search on for a minute,
    # about one run in ten); its running trial is then retried once its heartbeat goes stale, as a killed one's
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True, name="orphan-watch").start()


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    time.sleep(STOP_WAIT_S)  # (the SIGTERM's clean stop first: it fails the running trial)
    os._exit(143)


def _orphaned(parent: int) -> Callable:
    """An Optuna callback that stops the study once the process that forked this one is gone."""
    return lambda study, trial: study.stop() if os.getppid() != parent else None


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
RAISE_RETRY_S = 0.02  # a stop that came in the storage's code is raised again this much later (`_StopsInsideTrials`)
# code a stop must not be raised in: an exception there leaves SQLAlchemy's connection half closed ("Error closing
# cursor ... Cannot operate on a closed database", a traceback), or the SQLite file locked by a read never ended
_STORAGE_CODE = tuple(os.sep + os.path.join(*parts) + os.sep for parts in (("sqlalchemy",), ("optuna", "storages")))


def _in_storage_code(frame: Any) -> bool:
    """Whether ``frame`` (a signal handler's) or a caller of it runs the storage's code (SQLAlchemy, Optuna's)."""
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in _STORAGE_CODE):
            return True
        frame = frame.f_back
    return False


class _StopsInsideTrials:
    """While a search runs, Ctrl-C and SIGTERM (where they raise: Python's Ctrl-C, `sigterm_as_interrupt`, a
    forked worker) stop it inside a trial, where Optuna marks the trial failed: one that comes while Optuna
    creates a trial would leave it running with no heartbeat, so that no later run could see it stale and retry
    it. One that comes between trials stops the search after the trial (a callback: `stop_after_trial`), or
    when the next one starts; one that comes while a trial writes to the storage is raised ``RAISE_RETRY_S``
    later, out of it (SIGALRM), as is one that Python dropped (raised in a garbage collector's callback).
    ``raising=False`` only records the stop (``pending``), for a caller that checks it where stopping is safe;
    ``take_all`` takes both signals whatever their handler (a forked worker: its parent's handlers)."""

    def __init__(self, raising: bool = True, take_all: bool = False):
        self.inside, self.pending, self.previous, self.unraisable = False, None, {}, None
        self.raising, self.take_all, self.retry_armed = raising, take_all, False

    def __enter__(self):
        import sys
        import threading

        self.unraisable, sys.unraisablehook = sys.unraisablehook, self._unraisable
        if threading.current_thread() is threading.main_thread():  # (only there can handlers be set)
            raising = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: raise_terminated}
            self.previous = {s: signal.getsignal(s) for s, h in raising.items()
                             if self.take_all or signal.getsignal(s) is h}
            for s in self.previous:
                signal.signal(s, self._take)
            if self.raising and self.previous and signal.getsignal(signal.SIGALRM) is signal.SIG_DFL:
                self.previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._retry)
                self.retry_armed = True
        return self

    def _take(self, signum: int, frame: Any) -> None:
        self.pending = self.pending or (Terminated() if signum == signal.SIGTERM else KeyboardInterrupt())
        self._retry(signum, frame)

    def _retry(self, signum: int, frame: Any) -> None:
        """Raise the stop now if a trial runs and the storage's code does not, else try again a moment later."""
        if not (self.inside and self.raising and self.pending is not None):
            return  # (between trials: `stop_after_trial`, or the next trial's start)
        if _in_storage_code(frame):
            self._raise_later()
            return
        raise self.pending

    def _raise_later(self) -> None:
        if self.retry_armed:
            signal.setitimer(signal.ITIMER_REAL, RAISE_RETRY_S)

    def _unraisable(self, unraisable: Any) -> None:
        if unraisable.exc_value is not self.pending:  # (the stop, dropped there: pending, no traceback printed)
            self.unraisable(unraisable)
        else:
            self._raise_later()

    def stop_after_trial(self, study, trial) -> None:
        """An Optuna callback: a stop that came during the trial's last writes ends the search before another."""
        if self.pending is not None:
            study.stop()

    def wrap(self, objective: Callable) -> Callable:
        def run(trial):
            self.inside = True
            try:
                if self.pending is not None:
                    raise self.pending
                return objective(trial)
            finally:
                self.inside = False

        run.failures = objective.failures
        return run

    def __exit__(self, *exc_info) -> None:
        import sys

        sys.unraisablehook = self.unraisable
        if self.retry_armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        if self.pending is not None and exc_info[0] is None:
            raise self.pending


def _seconds_left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _worker(problem, storage_url, study_name, sampler_name, n_trials, deadline, parent, errors) -> None:
    """One forked worker process: its own storage connection and sampler, the shared study, until ``deadline``
    (`time.monotonic`, shared by the processes of a machine). Its seed is random, as `skistune worker`'s: the
    order of the workers' trials is the machine's, so no seed makes their search reproducible, and two runs
    started together must not propose the same configs; each trial records it."""
    import optuna

    seed = _random_seed()  # (Optuna's verbosity is the parent's: `_quiet_optuna`, or the CLI's)
    try:
        _stop_with_parent(parent)
        # Ctrl-C and SIGTERM are blocked from the fork to here (`_forked`): a stop that came meanwhile, before
        # any handler of this process, is delivered now, to the gate, and stops the worker before its first trial
        with _StopsInsideTrials(take_all=True) as gate:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
            left = _seconds_left(deadline)
            if gate.pending is not None or (left is not None and left <= 0):
                return
            sampler = make_sampler(sampler_name, seed=seed, problem=problem, parallel=True, n_trials=n_trials)
            study = optuna.load_study(study_name=study_name, storage=open_storage(storage_url), sampler=sampler)
            _optimize(study, _tagged(gate.wrap(_trial_function(problem, study)), lambda: _worker_tag(seed, unseeded=True)),
                      n_trials=n_trials, timeout=left, callbacks=[_orphaned(parent), gate.stop_after_trial])
    except TimeUp:  # (the deadline, met between trials: nothing to report)
        return
    except Exception as exc:
        failed = storage_failure(exc)
        if isinstance(exc, ReturnValueError) or raised_by(exc) is not None:  # the user's callable: its own error
            errors.put(_picklable(exc))
        elif failed is not None:  # (the parent says it, with the trials the study keeps)
            errors.put(StorageWriteError(failed[0], writing=failed[1]))
        elif isinstance(exc, (ValueError, OSError, KeyError)):
            errors.put(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        else:
            raise
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM, its parent gone: its trial failed, the parent reports
        raise SystemExit(130) from None
    finally:  # (a second signal while the process ends would print a traceback from multiprocessing's exit)
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)


def _picklable(exc: BaseException) -> BaseException | str:
    """A worker's error as its parent will raise it: the exception itself (its `raised_by` mark included) when
    it pickles, else its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return f"{raised_by(exc) or 'a callable'} raised {type(exc).__name__}: {exc}"
    return exc


def _shares(n_trials: int, n_jobs: int) -> list[int]:
    """Trials per worker: as even as possible, no worker without any."""
    shares = [n_trials // n_jobs + (i < n_trials % n_jobs) for i in range(n_jobs)]
    return [n for n in shares if n]


STOP_WAIT_S = 5.0  # how long a worker may take to stop once told (it marks its running trial failed)
POLL_S = 0.05  # how often the parent of forked workers looks for a stop, and for workers that ended
REPORT_S = 0.5  # ... and reads their progress from the storage


def _stop_workers(workers: Sequence, wait_s: float = 0.0) -> None:
    """No worker left running: those still running after ``wait_s`` get SIGTERM (each fails its running
    trial), then, still running `STOP_WAIT_S` later (the signal landed where Python drops exceptions), SIGKILL
    (the heartbeat fails and retries their trial)."""
    started = [w for w in workers if w.pid is not None]
    for stop in (None, "terminate", "kill"):
        for w in started:
            if stop and w.is_alive():
                getattr(w, stop)()
        deadline = time.monotonic() + (wait_s if stop is None else STOP_WAIT_S)
        for w in started:
            w.join(max(0.0, deadline - time.monotonic()))


def _tell_workers_to_stop(study, workers: Sequence, stop: KeyboardInterrupt) -> None:
    """Stop the workers as this process was stopped: each gets the signal (Ctrl-C reached them already from a
    terminal, `kill -INT` on this process did not; twice is once), fails its running trial and ends; one still
    running `STOP_WAIT_S` later is killed, and its running trial failed (and queued again) from here, so that the
    study is left with none running."""
    import optuna

    started = [w for w in workers if w.pid is not None]
    for w in started:
        with contextlib.suppress(ProcessLookupError):
            if w.is_alive():
                os.kill(w.pid, signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT)
    deadline = time.monotonic() + STOP_WAIT_S
    for w in started:
        w.join(max(0.0, deadline - time.monotonic()))
    killed = [w for w in started if w.is_alive()]
    for w in killed:
        w.kill()
        w.join()
    if killed:
        pids = {w.pid for w in killed}
        running = [t._trial_id for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
                   if _ran_here(t, pids)]
        _fail_and_retry(study, running)


def _start_forked(worker) -> None:
    """Start a forked worker with Ctrl-C and SIGTERM blocked in it until it has its own handlers (`_worker`): one
    that came as it started had raised in multiprocessing's start-up code (a traceback, exit code 1) or where
    Python drops it (the worker searched on), and the parent's handlers, which it inherits, only record a stop."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        worker.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _run_parallel(problem, study, storage_url, sampler_name, n_trials, timeout, n_jobs, progress,
                  tag_of, before_take_over: Callable[[], None] = lambda: None) -> tuple[int, list[str]]:
    """``n_jobs`` forked worker processes on one storage; this process reports progress from the storage.
    ``timeout`` bounds the whole search: the queued trials run here first, the workers get the time left.
    Returns how many trials they finished, and a note for each worker that stopped before its share.
    Ctrl-C or SIGTERM while the workers run is only recorded, then acted on between this process's reads of the
    storage: raised in one, it had left SQLite's file locked, so that no worker could fail its running trial."""
    import multiprocessing

    import optuna

    ctx = multiprocessing.get_context("fork")
    errors = ctx.Queue()
    deadline = None if timeout is None else time.monotonic() + timeout
    first, pids = _first_new_trial(study), {os.getpid()}
    report = (lambda *_: progress(_progress_of(problem, study, first, n_trials, pids))) if progress else None
    left = n_trials
    queued = len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)))
    if queued:
        # queued trials (the baseline) run here before the workers start: SQLite has no row locks, so two
        # processes may both pop one WAITING trial, and the second then fails to tell a trial already COMPLETE
        with _StopsInsideTrials() as gate:
            _optimize(study, _tagged(gate.wrap(_trial_function(problem, study)), tag_of), n_trials=min(queued, left),
                      timeout=timeout, callbacks=[*([report] if report else []), gate.stop_after_trial])
        left -= min(queued, left)
    shares = _shares(left, n_jobs)
    workers = [ctx.Process(target=_worker, args=(problem, storage_url, study.study_name, sampler_name, share,
                                                   deadline, os.getpid(), errors))
               for share in shares]
    try:
        with _StopsInsideTrials(raising=False) as gate:
            for w in workers:
                _start_forked(w)
                pids.add(w.pid)
            next_report = 0.0
            # (a worker stopped by an error stops the others: the user's callable would fail for them too)
            while gate.pending is None and any(w.is_alive() for w in workers) and \
                    not any(w.exitcode == 2 for w in workers):
                if report and time.monotonic() >= next_report:
                    report()
                    next_report = time.monotonic() + REPORT_S
                time.sleep(POLL_S)
            if gate.pending is not None:  # (raised by the gate's exit)
                _tell_workers_to_stop(study, workers, gate.pending)
    finally:  # (however this process stops, it leaves no worker running)
        _stop_workers(workers)
    if report:
        report()
    messages = [errors.get() for _ in range(sum(w.exitcode == 2 for w in workers))]
    if messages:
        raise messages[0] if isinstance(messages[0], BaseException) else ValueError(messages[0])
    before_take_over()
    notes = _take_over(problem, study, workers, shares, deadline, report, tag_of)
    return _progress_of(problem, study, first, n_trials, pids).done, notes


def _take_over(problem, study, workers: Sequence, shares: Sequence[int], deadline: float | None,
               report: Callable | None, tag_of: Callable) -> list[str]:
    """After the workers: for each that stopped before its share (killed, say by the kernel's OOM killer), fail
    the trial it left running at once (queued again, as its heartbeat would have 20 s later) and run the
    trials it did not, here, in the time left, so that the run adds the trials it was asked for. Returns a
    note for each such worker."""
    import optuna

    notes = []
    for i, (w, share) in enumerate(zip(workers, shares)):
        if w.exitcode == 0:
            continue
        mine = [t for t in study.get_trials(deepcopy=False) if _ran_here(t, {w.pid})]
        running = [t._trial_id for t in mine if t.state == optuna.trial.TrialState.RUNNING]
        _fail_and_retry(study, running)
        finished = len(mine) - len(running)
        short = share - finished  # (its running trial, failed now, runs again here: the first of these)
        left = _seconds_left(deadline)
        ran = 0
        if short > 0 and (left is None or left > 0):
            here = {os.getpid()}
            before = sum(_ran_here(t, here) for t in study.get_trials(deepcopy=False))
            with _StopsInsideTrials() as gate:
                _optimize(study, _tagged(gate.wrap(_trial_function(problem, study)), tag_of), n_trials=short,
                          timeout=left, callbacks=[*([report] if report else []), gate.stop_after_trial])
            ran = sum(_ran_here(t, here) for t in study.get_trials(deepcopy=False)) - before
        notes.append(f"worker {i + 1} stopped ({_exit_reason(w.exitcode)}) after {finished} of its {share} "
                     "trials; its finished trials are kept"
                     + (f", and this process ran {ran} of the {short} it left" if short > 0 else ""))
    return notes


def _exit_reason(code: int | None) -> str:
    return f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"


# ---- workers that join a study ------------------------------------------------------------------------------
# `skistune worker --storage URL --study NAME` gets nothing but those two: the study itself holds what its
# creator used (`problem_recipe`), workload and profile included, so a worker on another machine needs
# neither file. The rebuilt problem is checked against the stored identity like any resume.
RECIPE_ATTR = "skistune.recipe"
RECIPE_VERSION = 1
_WORKLOAD_ARRAYS = ("arrival_s", "input_tokens", "output_tokens", "block_offsets", "block_ids", "session_ids",
                    "request_ids")


def _pack(data: bytes) -> str:
    import base64
    import zlib

    return base64.b64encode(zlib.compress(data, 9)).decode("ascii")


def _unpack(text: str) -> bytes:
    import base64
    import zlib

    return zlib.decompress(base64.b64decode(text.encode("ascii")))


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


def _existing_sqlite(storage: Any) -> None:
    """Workers never create a storage: a SQLite URL must name a file that exists (opening one creates it)."""
    import sqlalchemy.exc
    from sqlalchemy.engine import make_url

    if not isinstance(storage, str) or not storage.startswith("sqlite"):
        return
    try:
        database = make_url(storage).database
    except (sqlalchemy.exc.ArgumentError, ValueError):  # malformed: `open_storage` names what is wrong
        return
    if database and database != ":memory:" and not Path(database).is_file():
        # (a misspelt study name reads as a missing file of the default storage: name the studies beside it)
        near = sorted(p.name for p in Path(database).parent.glob("skistune-*.db"))
        here = f" (study files in that folder: {', '.join(near[:8])}{' ...' if len(near) > 8 else ''})" if near else ""
        raise ValueError(f"storage {storage}: no such database file{here}; create the study first with skistune "
                         "optimize --storage URL --study NAME")


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
    with storage_failures(storage, study_name):
        study = open_study(problem, opened, study_name, sampler=None)
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


# ---- results ------------------------------------------------------------------------------------------------
def completed(study) -> list[Evaluation]:
    import optuna

    return [Evaluation.from_trial(t) for t in study.get_trials(deepcopy=False,
                                                                states=(optuna.trial.TrialState.COMPLETE,))
            if "config" in t.user_attrs]


def _distinct(evaluations: Sequence[Evaluation]) -> list[Evaluation]:
    seen: dict[KVConfig, Evaluation] = {}
    for e in evaluations:
        seen.setdefault(e.config, e)
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


# ---- validation on the real runtime ---------------------------------------------------------------------------
class SkipIdleClock:
    """Wall-clock time for the engine's steps; a wait for the next arrival is skipped rather than slept (the
    engine does nothing while idle), so a replay takes its busy time, not the trace's span."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._skipped_s = 0.0

    def now(self) -> float:
        return time.perf_counter() - self._t0 + self._skipped_s

    def wait_until(self, t_s: float) -> None:
        self._skipped_s += max(0.0, t_s - self.now())


@dataclass(frozen=True)
class Validation:
    """A config replayed on the real runtime at the rate the simulator chose for the validation slice:
    the prediction and the measurement at that same rate."""

    config: KVConfig
    rate_rps: float
    predicted: Evaluation
    measured: Evaluation
    wall_s: float
    role: str = "candidate"  # or "baseline"
    pool_cap_bytes: int | None = None  # the KV pool the replay used, when capped (see `replay_config`)
    held_out_quality: Any = None  # QualityLoss measured on held-out text (configs with a lossy knob)
    # the top configs not replayed because the simulator predicts them the same schedule of the slice as
    # this one (`same_prediction`): their replays would only measure the machine's noise
    twins: tuple[KVConfig, ...] = ()
    replays: int = 1  # replays made of it (`VALIDATE_REPEATS`): the better one is this

    @property
    def untested(self) -> list[str]:
        """Constraints the slice cannot test: its own prediction breaks them (an energy budget in J/token met on
        the search's prompts, broken on the slice's short ones, where fixed costs weigh on fewer tokens). A
        replay checks the prediction; it cannot fail a constraint that the prediction of the same replay
        already breaks."""
        return self.predicted.binding

    @property
    def broken(self) -> list[str]:
        """Constraints the replay broke, among those the prediction of the slice met."""
        return [name for name in self.measured.binding if name not in self.untested]

    @property
    def holds(self) -> bool:
        return not self.broken


def validation_requests(problem: Problem, n: int | None = None, max_input: int | None = None,
                        max_output: int | None = None) -> RequestSet:
    """The first requests of the workload with lengths capped (`VALIDATE_REQUESTS`, `VALIDATE_MAX_INPUT`,
    `VALIDATE_MAX_OUTPUT` unless given)."""
    from skistune.evaluate import workload_requests
    from skistune.workloads import load_workload

    sliced = load_workload(problem.workload, first=n or VALIDATE_REQUESTS, max_input=max_input or VALIDATE_MAX_INPUT,
                           max_output=max_output or VALIDATE_MAX_OUTPUT)
    return request_set(workload_requests(sliced, problem.model))


def _same_behaviour(a: Metrics, b: Metrics) -> bool:
    keys = ("ttft_s", "tbt_s", "e2e_s", "preemptions", "num_finished", "prefix_hit_tokens", "duration_s")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def deployable(problem: Problem, config: KVConfig) -> KVConfig:
    """``config`` as a deployment runs it. With a declared ``kv_memory`` the device pool is given in bytes (the
    configured fraction of that memory): the runtime, or an engine, would otherwise take the fraction of its
    own device's memory."""
    from skistune.runtime.kv_layout import kv_pool_bytes

    if problem.kv_memory is None or config.offload.device_kv_bytes is not None:
        return config
    return config.with_knobs({"offload.device_kv_bytes": kv_pool_bytes(config, problem.kv_memory)})


def replay_config(problem: Problem, predicted: Evaluation, requests: RequestSet) -> KVConfig:
    """The config the runtime replays: host and disk tiers capped at twice the slice's predicted KV peak
    (the slice is small), and the device KV pool too when the simulator shows that changes nothing for it. The runtime zero-fills its whole pool
    (4 GiB x the device fraction on a CPU: seconds per config), which would dominate a short validation."""
    from skistune.runtime.kv_layout import ring_bytes

    config = deployable(problem, predicted.config)
    # the full-precision rings of quantized KV come out of the device pool before any block (`kv_layout`)
    rings = ring_bytes(config, problem.target.spec, problem.target.kv_itemsize)
    # (KV peak counts the rings once: twice the blocks' peak, and the rings once)
    cap = max(2 * (predicted.figures["kv_peak_bytes"] - rings), VALIDATE_MIN_POOL_BYTES) + rings
    # host and disk tiers are allocated up front too (a 128 GiB host tier cannot be zero-filled here): they
    # are always capped at the same size, then the device pool only where the simulator shows no difference
    o = config.offload
    tiers = {"offload.host_kv_bytes": min(o.host_kv_bytes, int(cap)), "offload.disk_kv_bytes": min(o.disk_kv_bytes, int(cap))}
    config = config.with_knobs(tiers)
    if config.offload.device_kv_bytes is not None and config.offload.device_kv_bytes <= cap:
        return config
    capped = config.with_knobs({"offload.device_kv_bytes": int(cap)})
    full, _ = _replay(config, requests.requests, problem.target, predicted.rate_scale)
    small, _ = _replay(capped, requests.requests, problem.target, predicted.rate_scale)
    return capped if _same_behaviour(full, small) else config


def _measure(problem: Problem, runtime, predicted: Evaluation, requests: RequestSet, role: str,
             held_out_quality=None) -> Validation:
    """Replay on the runtime; a measured held-out quality replaces the predicted one in the constraints."""
    from skistune.simulator import with_rate_scale

    replayed = replay_config(problem, predicted, requests)
    engine = runtime.with_config(replayed).new_engine(clock=SkipIdleClock())
    started = time.perf_counter()
    metrics = engine.replay(with_rate_scale(requests.requests, predicted.rate_scale))
    wall_s = time.perf_counter() - started
    rate = predicted.rate_scale * requests.base_rps
    point = point_of(problem, predicted.config, metrics, engine.records, rate, predicted.figures["ttft_p99_s"]
                     - predicted.figures["queue_p99_s"])
    if held_out_quality is not None:
        point = replace(point, quality=held_out_quality)
    measured = evaluation_of(problem, point, predicted.rate_scale)
    return Validation(predicted.config, rate, predicted, measured, wall_s, role,
                      replayed.offload.device_kv_bytes if replayed != predicted.config else None, held_out_quality)


def validation_record(v: Validation) -> dict[str, Any]:
    """A validation as JSON (stored with the study): the config, the role, the rate, predicted and measured
    figures and whether the measurement held every constraint."""
    return {"role": v.role, "config": v.config.to_dict(), "rate_rps": v.rate_rps, "holds": v.holds,
            "binding": v.broken, "untested": v.untested, "wall_s": v.wall_s, "replays": v.replays,
            "predicted": dict(v.predicted.figures),
            "measured": dict(v.measured.figures), "twins": [c.to_dict() for c in v.twins]}


def held_out_quality(problem: Problem, configs: Sequence[KVConfig], runtime=None,
                     progress: Callable[[str], None] | None = None) -> dict[KVConfig, Any]:
    """Quality loss of each config with a lossy knob, measured on held-out text (windows and passkeys the
    quality profile never saw) with the real model: ``runtime`` where it has real weights, else the
    reference model (SmolLM2) loaded here. Empty when the problem has no quality profile."""
    from skistune.objectives import QualityLoss, structural_changes
    from skistune.quality import REFERENCE_MODEL
    from skistune.quality.measure import measure_quality
    from skistune.quality.scoring import SCORING_KV_BYTES

    lossy = [c for c in dict.fromkeys(configs) if structural_changes(c)]
    if problem.quality_profile is None or not lossy:
        return {}
    if runtime is None or runtime.tokenizer is None:
        from skistune.runtime.llm import Runtime

        runtime = Runtime.from_preset(REFERENCE_MODEL, KVConfig().with_knobs({"offload.device_kv_bytes": SCORING_KV_BYTES}))
    needle = any(metric == "needle" for metric, _, _ in _constraint_specs(problem)[1])
    rows = measure_quality(runtime, lossy, needle=needle,
                           progress=(lambda label, done, total: progress(label)) if progress else None)
    basis = "held-out" if runtime.spec.name == problem.model else f"held-out, proxy: {runtime.spec.name}"
    return {c: QualityLoss(r["ppl_mean"], r["ppl_worst"], r.get("needle_retained") or (0.0 if needle else 1.0),
                           basis=basis) for c, r in zip(lossy, rows)}


def _measured_order(problem: Problem, validations: list[Validation]) -> list[Validation]:
    """Validations given in the search's order, put in measured order: those that held first, and among them
    the search's order stands unless one measured better than the first by more than a tie (`beats`); those
    that broke keep the search's order. (Replays at the SLO's edge differ by the machine's noise: a measured
    difference within the tie, or which of two broken configs broke less, is not evidence against the
    search's ranking, which puts the baseline first on a tie.)"""
    held = [v for v in validations if v.holds]
    if held:
        winner = held[0]
        for v in held[1:]:
            if beats(problem, v.measured.values[0], winner.measured.values[0]):
                winner = v
        held = [winner] + [v for v in held if v is not winner]
    return held + [v for v in validations if not v.holds]


def untested_note(v: Validation) -> str:
    """Why a replay did not judge some constraints (`Validation.untested`)."""
    names = ", ".join(v.untested)
    return (f"{names}: not tested on the real runtime: the simulator predicts the validation slice itself breaks "
            f"{'it' if len(v.untested) == 1 else 'them'} (its {VALIDATE_REQUESTS} requests have prompts capped at "
            f"{VALIDATE_MAX_INPUT} tokens and outputs at {VALIDATE_MAX_OUTPUT}, unlike the workload's), so the replay "
            "checks the other constraints; the search's prediction on the workload stands for "
            f"{'it' if len(v.untested) == 1 else 'them'}")


def _measured_key(problem: Problem, v: Validation) -> tuple:
    first = v.measured.values[0]
    return (not v.holds, v.measured.total_violation if not v.holds else 0.0,
            -first if problem.objectives[0].maximize else first)


def load_runtime(problem: Problem):
    """The real model on the profile's device, with a small KV pool: each replay sizes its own
    (`Runtime.with_config`)."""
    from skistune.profile.measure import DTYPES
    from skistune.runtime.llm import Runtime

    device = problem.profile.device
    return Runtime.from_preset(problem.model, problem.base.with_knobs(
        {"offload.device_kv_bytes": VALIDATE_MIN_POOL_BYTES}), device=device, dtype=DTYPES[device])


def validation_unavailable(problem: Problem) -> str | None:
    """A note, when the winners cannot be replayed here: the profile describes a device this machine lacks,
    or the model does not fit its memory (an 8B model's validation on a 23 GiB host was killed for memory
    after the whole search, with nothing written). The search's own winner stands, unvalidated."""
    from skistune.evaluate import runtime_unavailable

    reason = runtime_unavailable(problem.model, problem.profile.device)
    if reason is None:
        return None
    return (f"not validated on the real runtime ({reason}; profile {problem.profile.name} is of "
            f"{problem.model} on {problem.profile.device}): the winner is the simulator's; run the same search on "
            "the machine the profile describes to validate it")


def load_runtime_in_background(problem: Problem):
    """A Future of `load_runtime`: the model loads on the second core while the search (single-threaded,
    simulated time only, so unaffected in its results) runs on the first."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skistune-runtime")
    future = pool.submit(load_runtime, problem)
    pool.shutdown(wait=False)
    return future


def validate(problem: Problem, configs: Sequence[KVConfig], *, runtime=None, requests: RequestSet | None = None,
             progress: Callable[[str], None] | None = None) -> list[Validation]:
    """Replay each config (and then the baseline, at the winner's rate) on the real runtime; the returned
    list is in measured order (the first held its constraints and is best by measurement), baseline last.
    A ``problem`` with a deadline (`with_deadline`) replays only what starts before it; the list's
    ``cut_short`` says what the deadline left out (None: nothing)."""
    validated, cut = _validate(problem, configs, runtime=runtime, requests=requests, progress=progress)
    return Validations(validated, cut)


class Validations(list):
    """`validate`'s list, with ``cut_short``: what the run's deadline left unreplayed (None: nothing)."""

    def __init__(self, validations: Iterable[Validation] = (), cut_short: str | None = None):
        super().__init__(validations)
        self.cut_short = cut_short


def _validate(problem: Problem, configs: Sequence[KVConfig], *, runtime=None, requests: RequestSet | None = None,
              progress: Callable[[str], None] | None = None) -> tuple[list[Validation], str | None]:
    """`validate`, and what the problem's deadline cut short of it (None: nothing)."""
    requests = requests or validation_requests(problem)
    runtime = load_runtime(problem) if runtime is None else runtime
    if hasattr(runtime, "result"):  # a Future from `load_runtime_in_background`
        runtime = runtime.result()
    not_validated = f"not validated on the real runtime ({len(configs)} config{'s' * (len(configs) != 1)} asked)"
    try:
        scored = [score(problem, config, requests, precision=REFINE_PRECISION) for config in configs]
    except TimeUp:
        return [], not_validated
    # one replay per schedule: configs the simulator predicts to run the same steps of the slice (near the
    # SLO's edge one replay holds and its twin's breaks by a few percent of the machine's speed) are replayed
    # once, as the first of them in the search's order
    groups: list[list[Evaluation]] = []
    for e in scored:
        group = next((g for g in groups if same_prediction(g[0], e)), None)
        (group.append(e) if group is not None else groups.append([e]))
    if _deadline_of(problem).passed:
        return [], not_validated
    out, cut = _replay_candidates(problem, runtime, [g[0] for g in groups], requests, progress)
    kept = [(v, g) for v, g in zip(out, groups) if v is not None]
    if not kept:
        return [], cut and not_validated
    out = _measured_order(problem, [replace(v, twins=tuple(e.config for e in g[1:])) for v, g in kept])
    return _and_baseline(problem, runtime, out, requests, progress, cut)


def _replay_candidates(problem: Problem, runtime, predicted: list[Evaluation], requests: RequestSet,
                       progress: Callable[[str], None] | None) -> tuple[list[Validation | None], str | None]:
    """Each config replayed (twice where the first broke a constraint), in the search's order, as far as the
    deadline lets (None: not replayed); and what the deadline cut short."""
    deadline = _deadline_of(problem)
    quality = held_out_quality(problem, [p.config for p in predicted], runtime, progress)
    out: list[Validation | None] = [None] * len(predicted)
    for replay in range(VALIDATE_REPEATS):  # interleaved, so that a slow spell of the machine hits every config
        for i, p in enumerate(predicted):
            if replay and (out[i] is None or not _replay_again(problem, out[i])):
                continue
            if progress:
                progress(f"{i + 1}/{len(predicted)}{_replay_label(replay)}")
            try:
                deadline.check()  # (a replay on the real runtime is not simulated: checked before it starts)
                out[i] = _better(problem, out[i],
                                 _measure(problem, runtime, p, requests, "candidate", quality.get(p.config)))
            except TimeUp:
                done = sum(v is not None for v in out)
                return out, (f"validated {done} of {len(predicted)} configs on the real runtime" if replay == 0
                             else "a second replay of a config that broke a constraint not made")
    return out, None


def _and_baseline(problem: Problem, runtime, out: list[Validation], requests: RequestSet,
                  progress: Callable[[str], None] | None, cut: str | None) -> tuple[list[Validation], str | None]:
    """The validations with the baseline's last, replayed at the winner's rate where that can compare them, as
    far as the deadline lets; and what the deadline cut short (``cut`` so far)."""
    # the baseline among the candidates, replayed at the winner's rate (the winner itself, or one the search
    # found as good): its replays stand for both roles, another replay would only measure the machine's noise
    for v in out:
        if v.config.effective() == problem.base.effective() and v.predicted.rate_scale == out[0].predicted.rate_scale:
            return out + [replace(v, role="baseline")], cut
    if problem.base in out[0].twins:  # predicted to run the winner's schedule: nothing a replay could compare
        return out, cut
    no_baseline = "; ".join(filter(None, (cut, "the baseline not replayed (no measured gain)")))
    try:
        base = score_at(problem, problem.base, requests, out[0].predicted.rate_scale)
    except TimeUp:
        return out, no_baseline
    if same_prediction(base, out[0].predicted):  # the same, though not among the candidates
        return [replace(out[0], twins=out[0].twins + (problem.base,))] + out[1:], cut
    measured = None
    for replay in range(VALIDATE_REPEATS):
        if replay and not _replay_again(problem, measured):
            break
        if progress:
            progress(f"the baseline{_replay_label(replay)}")
        try:
            _deadline_of(problem).check()
            measured = _better(problem, measured, _measure(problem, runtime, base, requests, "baseline"))
        except TimeUp:
            if measured is None:
                return out, no_baseline
            cut = "; ".join(filter(None, (cut, "a second replay of the baseline not made")))
            break
    return out + [measured], cut


# figures of a validation's prediction that tell two schedules of the slice apart: equal in all (to the bit:
# the simulator is deterministic), the simulator predicts the two configs to run the same steps at the same times.
# Not the KV peak: block sizes of 16 and 32 tokens round the same steps' KV differently, and a replay's verdicts
# did not follow it (three replays each of two such configs and the baseline, 2026-12-03: TBT p99 61-90 ms in
# eight, 321 ms in one of the baseline's, the next arrival landing inside a decode). A constraint or objective
# that reads the KV peak still tells them apart: `same_prediction` compares those too.
SCHEDULE_FIGURES = ("rate_rps", "ttft_p99_s", "tbt_p99_s", "e2e_p99_s", "tpot_p99_s", "preemptions", "finished",
                    "energy_j_per_token", "quality_loss", "quality_worst")


def same_prediction(a: Evaluation, b: Evaluation) -> bool:
    """Whether the simulator predicts the two configs to run the same schedule of the slice (same rate, same
    steps), with the same objective values and the same margin to every constraint: whatever would tell
    their replays apart is then the machine's noise, not the configs."""
    fa, fb = a.figures, b.figures
    return (bool(fa) and all(fa.get(k) == fb.get(k) for k in SCHEDULE_FIGURES)  # (no figures: nothing to compare)
            and tuple(a.values) == tuple(b.values) and dict(a.violations) == dict(b.violations))


def same_schedule(a: Validation, b: Validation) -> bool:
    """`same_prediction` of two replays."""
    return same_prediction(a.predicted, b.predicted)


def _replay_label(replay: int) -> str:
    return f", replay {replay + 1}/{VALIDATE_REPEATS}" if VALIDATE_REPEATS > 1 else ""


def _replay_again(problem: Problem, kept: Validation) -> bool:
    """Whether another replay could change a config's validation: one that broke a constraint may have met a
    stall of the machine; one that held is final unless the first objective is read off the replay's timing."""
    return not kept.holds or problem.objectives[0].name not in TIMING_FREE_OBJECTIVES


def _better(problem: Problem, kept: Validation | None, new: Validation) -> Validation:
    """The better of two replays of one config (`VALIDATE_REPEATS`), counting the replays made."""
    better = new if kept is None or _measured_key(problem, new) < _measured_key(problem, kept) else kept
    return replace(better, replays=1 if kept is None else kept.replays + 1)


# ---- the result ---------------------------------------------------------------------------------------------
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
        return bool(self.best)

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


# ---- provenance ---------------------------------------------------------------------------------------------
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


def _storage_label(storage) -> str:
    if not isinstance(storage, str):
        return type(storage).__name__
    import sqlalchemy.exc
    from sqlalchemy.engine import make_url

    try:
        return make_url(storage).render_as_string(hide_password=True)
    except (sqlalchemy.exc.ArgumentError, ValueError):  # not a URL SQLAlchemy reads: show only its scheme
        return f"{storage.partition('://')[0]}://..." if "://" in storage else repr(storage)


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
    """How the config was found: inputs (workload digest, profile fingerprint, space, seed), the search,
    and the predicted and measured figures of the winner and the baseline."""
    from datetime import datetime, timezone
    from importlib.metadata import PackageNotFoundError, version

    p = result.problem
    try:
        tool = f"skistune {version('skistune')}"
    except PackageNotFoundError:
        tool = "skistune"
    w = p.workload
    return _clean({
        "tool": tool, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "objective": [o.name for o in p.objectives], "slo": [str(s) for s in p.slos],
        "constraints": [c.name for c in p.constraints],
        "workload": {"source": w.source, "digest": w.digest(), "requests": len(w), "transforms": list(w.transforms)},
        "model": p.model, "kv_memory": p.kv_memory,
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
        "notes": list(result.notes),
    })


# ---- the main job -------------------------------------------------------------------------------------------
def _check_counts(n_trials: int, n_jobs: int, validate: int, timeout: float | None) -> None:
    for name, value, low in (("n_trials", n_trials, 1), ("n_jobs", n_jobs, 1), ("validate", validate, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: {value!r} must be an integer >= {low}")
    if timeout is not None and not (_is_number(timeout) and timeout > 0):
        raise ValueError(f"timeout: {timeout!r} must be a positive number of seconds (or None: no limit)")


def _is_number(value: Any) -> bool:
    """A real number, not a bool (True > 0) nor text ("5", which Python will not compare with 0)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_run(seed: Any, storage: Any) -> None:
    """`optimize`'s and `solve`'s own arguments, as the CLI checks its options: a type error named, before any
    work (``seed=-1`` had been taken, which --seed refuses; ``storage=5`` had failed with an AttributeError)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed: {seed!r} must be an integer >= 0")
    if storage is not None and not isinstance(storage, str) and not hasattr(storage, "create_new_study"):
        raise ValueError(f"storage: {storage!r} must be an Optuna storage URL (e.g. sqlite:///study.db), an Optuna "
                         "storage object, or None (a SQLite file here)")


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


def beats(problem: Problem, a: float, b: float, objective: Objective | None = None) -> bool:
    """Whether first-objective value ``a`` (or ``objective``'s) is better than ``b`` by more than
    `REFINE_PRECISION` (relative): a smaller difference is a tie the search cannot resolve (capacity comes in
    steps of its precision; other figures are predicted closer than the simulator's error on any machine)."""
    margin = REFINE_PRECISION * abs(b)
    return a > b + margin if (objective or problem.objectives[0]).maximize else a < b - margin


def tie(problem: Problem, objective: Objective, a: float, b: float) -> bool:
    """Whether neither value `beats` the other: a difference the search cannot resolve."""
    return not beats(problem, a, b, objective) and not beats(problem, b, a, objective)


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


def beats_anywhere(problem: Problem, a: Evaluation, b: Evaluation) -> bool:
    """Whether ``a`` `beats` ``b`` on some objective (by more than `REFINE_PRECISION`): where it does not,
    ``a`` gains nothing over ``b`` that the search can resolve."""
    return any(beats(problem, x, y, o) for o, x, y in zip(problem.objectives, a.values, b.values))


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
    # the tries already made for this best config (a resumed study): read back, not run again
    tries = {t.user_attrs[SIMPLIFIES_ATTR]: t for t in study.get_trials(deepcopy=False)
             if t.user_attrs.get(SIMPLIFIES_ATTR, "").startswith(f"{first.trial}:")}
    for label, prefixes in SIMPLIFY_GROUPS:
        candidate = {**params, **{n: v for n, v in base_params.items() if n.startswith(prefixes)}}
        key = f"{first.trial}:{label}:{json.dumps(candidate, sort_keys=True, default=str)}"
        if candidate == params:
            continue
        trial = tries.get(key)
        if trial is None:
            study.enqueue_trial(candidate, user_attrs={SIMPLIFIES_ATTR: key})
            with warnings.catch_warnings():  # (a storage with heartbeats warns that ask and tell don't send them)
                warnings.filterwarnings("ignore", message="Heartbeat of storage")
                trial = study.ask()  # (the enqueued one: ask and tell, so that another worker's trial is never read)
                try:
                    values = run(trial)
                except optuna.TrialPruned:  # a user's callable failed on this config (its error, once), or
                    study.tell(trial, state=optuna.trial.TrialState.PRUNED)  # the deadline passed
                    if scoring.timed_out:
                        stopped.append(label)
                        break
                    raise run.failures[0] from None
                study.tell(trial, values)
            trial = _trial(study, trial.number)
        if "config" not in trial.user_attrs:
            continue
        tried = Evaluation.from_trial(trial)
        if tried.config == best.config or not tried.feasible:
            continue
        try:
            fine = replace(score(problem, tried.config, precision=REFINE_PRECISION, start_scale=tried.rate_scale),
                           trial=tried.trial)
        except TimeUp:
            stopped.append(label)
            break
        if fine.feasible and not beats_anywhere(problem, first, fine):
            best, params = fine, dict(_trial(study, tried.trial).params)
            reverted.append(label)
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
    study.set_user_attr(REFINED_ATTR, {"best": [e.to_record() for e in best], "baseline": baseline.to_record()})
    pareto = front_with(problem, pareto_front(problem, with_refined(evaluations, [*refined, baseline])), best[0])
    notes += [n for n in (ilp_note(study), ceiling_note(problem, best[0])) if n]
    return {"best": best, "pareto": pareto, "baseline": baseline, "validated": validated,
            "trials": _search_trials(study), "simplifying_trials": trial_counts(study)[1],
            "notes": tie_notes + notes + _cut_notes(problem, cut)}


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


def _speed_after_validation(problem: Problem, runtime, stage: Callable[[str], None]) -> list[str]:
    """When the chosen config broke a constraint in its replays: the profile's own steps timed again on the
    same runtime (`profile.check.speed_check`), so that a machine running slower than when it was profiled
    (a busy neighbour on a shared host ran them x2) is told apart from the simulator's error."""
    from skistune.profile.check import speed_check

    if hasattr(runtime, "result"):  # (a Future from `load_runtime_in_background`; validation resolved it)
        runtime = runtime.result()
    stage("timing a few of the profile's steps again")
    runtime = load_runtime(problem) if runtime is None else runtime  # (validation loaded its own: n_jobs > 1)
    try:
        check = speed_check(problem.profile, runtime)
    except ValueError:  # (a profile without 16-bit step points small enough to time again: nothing to say)
        return []
    return [f"the replays broke a constraint; right after them, {check.summary_line()}"]


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
                "skistune worker, or beside another process)" if _study_unseeded(study) else None)
    fields_ = finish(problem, study, top_k=validate, runtime=runtime, on_stage=on_stage)
    fields_["notes"] = notes + fields_["notes"]
    return {**fields_, "study": study}, unseeded


callable_module(__name__, optimize)  # ``skistune.optimize(...)`` runs `optimize`, however it was reached
