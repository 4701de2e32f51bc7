"""Validation on the real runtime: the top configs replayed on the real model, each with a short, length-capped
slice of the workload at the rate the simulator chose for it, predicted next to measured, then the baseline at
the winner's rate; the winner is chosen by measurement (`validate`).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from skistune.config import KVConfig
from skistune.problem import Problem, RequestSet, _constraint_specs, request_set
from skistune.runtime.metrics import Metrics
from skistune.scoring import (REFINE_PRECISION, Evaluation, TimeUp, _deadline_of, _replay, beats, evaluation_of,
                              point_of, score, score_at)

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
    # the baseline replayed at the winner's rate: the constraints the winner's replay could not test there (a
    # break the simulator predicts for the baseline at that rate is the gain being checked, not untested)
    untested_as_winner: tuple[str, ...] | None = None

    @property
    def untested(self) -> list[str]:
        """Constraints the slice cannot test: its own prediction breaks them (an energy budget in J/token met on
        the search's prompts, broken on the slice's short ones, where fixed costs weigh on fewer tokens). A
        replay checks the prediction; it cannot fail a constraint that the prediction of the same replay
        already breaks. For the baseline replayed at the winner's rate, those of the winner's replay."""
        if self.untested_as_winner is not None:
            return list(self.untested_as_winner)
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
    # (passkeys are run only for a needle floor: otherwise their share kept is unknown, not 1.0; a floor asked
    # for them, so a missing figure there counts as none kept)
    return {c: QualityLoss(r["ppl_mean"], r["ppl_worst"],
                           (r.get("needle_retained") or 0.0) if needle else None, basis=basis)
            for c, r in zip(lossy, rows)}


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
    runtime = Runtime.from_preset(problem.model, problem.base.with_knobs(
        {"offload.device_kv_bytes": VALIDATE_MIN_POOL_BYTES}), device=device, dtype=DTYPES[device])
    problem.profile.run_as_measured(runtime)  # (the replays check the profile's predictions: its steps, its rule)
    return runtime


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
    untested = tuple(out[0].untested)
    for v in out:
        if v.config.effective() == problem.base.effective() and v.predicted.rate_scale == out[0].predicted.rate_scale:
            return out + [replace(v, role="baseline", untested_as_winner=untested)], cut
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
            measured = _better(problem, measured, replace(_measure(problem, runtime, base, requests, "baseline"),
                                                          untested_as_winner=untested))
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
