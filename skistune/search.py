"""The search: an Optuna study of the problem (created, or resumed for the same problem), its sampler (TPE with
local moves for one objective, NSGA-II for several, GP or random on request) and its trial function (a suggested
config scored by the simulator, every figure stored with the trial), run in this process or in forked worker
processes sharing one storage. Each trial records the process that ran it; Ctrl-C and SIGTERM stop a search
inside a trial, which Optuna marks failed; a worker that dies leaves its running trial to be failed and retried,
and the trials it did not run to this process.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from skistune.config import KVConfig
from skistune.objectives import ReturnValueError, predict_quality, raised_by
from skistune.problem import LAYER_BITS_SOLVER, Problem, _baseline_params, _constraint_specs
from skistune.scoring import Evaluation, TimeUp, _deadline_of, scale_guess, score, without_deadline
from skistune.searchspace import suggest_config
from skistune.signals import Terminated, raise_terminated
from skistune.study_storage import (HEARTBEAT_S, StorageWriteError, _fail_and_retry, _quiet_heartbeat_failures,
                                    fail_trials_that_never_beat, open_storage, storage_failure)

DEFAULT_TRIALS = 20
SAMPLERS = ("auto", "tpe", "gp", "nsga2", "random")
PROBLEM_ATTR = "skistune.problem"
COMMAND_ATTR = "skistune.command"  # the `skistune optimize` command line that last searched the study
ERROR_ATTR = "skistune.error"  # on a trial a user's callable failed: the error (the trial is stored as pruned)
ILP_ATTR = "skistune.ilp"  # a trial's integer-program runs: {program: {calls, solve_s}}


# ---- the study --------------------------------------------------------------------------------------------
def default_study_name(problem: Problem) -> str:
    """Named after the problem: the same command resumes its study, another problem gets its own."""
    digest = hashlib.sha256(json.dumps(problem.identity(), sort_keys=True).encode()).hexdigest()[:8]
    return f"optimize-{digest}"


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


class ProblemMismatch(ValueError):
    """A study was created for another problem, as its stored identity says (or by an earlier skistune, which
    described the same problem differently: a profile's fingerprint key and a preset's draws have changed)."""

    def __init__(self, study_name: str, differs: str) -> None:
        self.study_name, self.differs = study_name, differs
        super().__init__(f"study {study_name!r} was created for another problem, or by an earlier skistune that "
                         f"described it differently (differs in: {differs}); pass another study name (--study, or "
                         "study_name= in Python), or omit it")


SHOWN_KEYS = ("objective", "direction", "slo", "constraints", "model", "space", "kv_memory")  # short: both shown


def _difference(key: str, stored: Any, now: Any) -> str:
    """One differing key of a study's identity, with the study's value and this run's where they are short
    (a tester resuming with another objective read "differs in: objective" without what the study had)."""
    if key == "callables":
        return "callables (the code or values of an objective or constraint function)"
    if key in SHOWN_KEYS:
        return f"{key} (the study's {json.dumps(stored)}, this run's {json.dumps(now)})"
    return key


def open_study(problem: Problem, storage, study_name: str, sampler):
    """Create the study, or resume it when it exists for the same problem. Safe when another process creates
    the same study at the same moment (two runs started together): one creates it, the other loads it, and
    the baseline is queued once."""
    import optuna

    from skistune.study_storage import create_or_load_study, created_attr

    study, created = create_or_load_study(storage, study_name, problem.directions, sampler)
    stored = study.user_attrs.get(PROBLEM_ATTR)
    identity = json.loads(json.dumps(problem.identity()))
    if stored is None and not created and all(t.state == optuna.trial.TrialState.WAITING
                                              for t in study.get_trials(deepcopy=False)):
        # made a moment ago by a run started with this one: that run queues the baseline and names the problem
        # (both had done it, and the baseline ran twice)
        stored = created_attr(study, PROBLEM_ATTR)
    if stored is None:
        # the baseline queued before the problem is named: a run that finds the name finds the baseline queued
        # (skip_if_exists: a creator stopped in between had queued it already)
        study.enqueue_trial(_baseline_params(problem), user_attrs={"enqueued": "baseline"}, skip_if_exists=True)
        study.set_user_attr(PROBLEM_ATTR, identity)
        stored = identity
    if stored != identity:
        differs = ", ".join(_difference(k, stored.get(k), identity.get(k)) for k in {**stored, **identity}
                            if stored.get(k) != identity.get(k))
        raise ProblemMismatch(study_name, differs)
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


# ---- running the search -----------------------------------------------------------------------------------
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


class _StopRecords:
    """A logging filter for Optuna's "Trial N failed ... because of the following error: Terminated()" warning and
    its traceback: a worker stopped mid-trial (the parent stopping its workers once another's trial met a user's
    error) is no failure to report; the trial stays failed in the study, as a stopped trial is."""

    def filter(self, record) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(error, (Terminated, KeyboardInterrupt))


def quiet_stops() -> None:
    """Install `_StopRecords` on the logger of Optuna's trial loop (once)."""
    import logging

    logger = logging.getLogger("optuna.study._optimize")
    if not any(isinstance(f, _StopRecords) for f in logger.filters):
        logger.addFilter(_StopRecords())


def _worker(problem, storage_url, study_name, sampler_name, n_trials, deadline, parent, errors) -> None:
    """One forked worker process: its own storage connection and sampler, the shared study, until ``deadline``
    (`time.monotonic`, shared by the processes of a machine). Its seed is random, as `skistune worker`'s: the
    order of the workers' trials is the machine's, so no seed makes their search reproducible, and two runs
    started together must not propose the same configs; each trial records it."""
    import optuna

    seed = _random_seed()  # (Optuna's verbosity is the parent's: `_quiet_optuna`, or the CLI's)
    quiet_stops()
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
        # the parent stops every worker once one reports an error (SIGTERM): one that came while this handler
        # ran raised out of it, past the KeyboardInterrupt clause below, and multiprocessing printed its traceback
        _ignore_stops()
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
        _ignore_stops()


def _ignore_stops() -> None:
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
