"""Evaluate one config on one workload, simulated (hardware profile) or run (real runtime): the same
`Metrics` either way, so any prediction can be checked."""
from __future__ import annotations

import math
import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from skistune import callable_module
from skistune.runtime.metrics import Metrics
from skistune.runtime.presets import get_preset
from skistune.runtime.request import Request
from skistune.simulator import SimTarget, as_config, request_list, simulate, target_from_profile
from skistune.workloads import Workload, to_requests
from skistune.workloads.model import truncate_blocks

MODES = ("simulate", "run")
# what a prediction is checked on, (name, unit, figure of a Metrics): `skistune evaluate --mode compare` and
# benchmarks/fidelity.py
FIDELITY_FIGURES: tuple[tuple[str, str, Callable[[Metrics], float]], ...] = (
    ("ttft p50", "ms", lambda m: m.ttft_s.p50), ("ttft p99", "ms", lambda m: m.ttft_s.p99),
    ("tbt p50", "ms", lambda m: m.tbt_s.p50), ("tbt p99", "ms", lambda m: m.tbt_s.p99),
    ("e2e p50", "ms", lambda m: m.e2e_s.p50), ("e2e p99", "ms", lambda m: m.e2e_s.p99),
    ("tok/s", "tok/s", lambda m: m.throughput_tok_per_s), ("kv peak", "MiB", lambda m: m.kv_peak_bytes))


def relative_error(predicted: float, measured: float) -> float | None:
    """(predicted - measured) / measured; None where nothing was measured (0, or NaN: no request finished) or
    a figure is infinite (energy per token with no token generated)."""
    if not measured or not (math.isfinite(predicted) and math.isfinite(measured)):
        return None
    return (predicted - measured) / measured


def compare_metrics(predicted: Metrics, measured: Metrics) -> list[dict]:
    """Each of `FIDELITY_FIGURES`: the prediction, the measurement and the relative error."""
    return [{"figure": name, "predicted": f(predicted), "measured": f(measured),
             "error": relative_error(f(predicted), f(measured))} for name, _, f in FIDELITY_FIGURES]


def fit_to_context(workload: Workload, max_context: int, model: str = "the model") -> Workload:
    """Cut the requests that do not fit the model's context, each by as few tokens as it needs (its prompt
    plus output come to exactly ``max_context``); the others are left as they are. The output of a request
    that does not fit keeps what the context leaves beside its prompt, and at least a quarter of the context
    where the output asks for that much: a long prompt loses its end, a long generation is cut short. A
    prompt keeps its prefix (and the prefix blocks it still holds). A note on the workload says how many
    requests and tokens the cuts took (a trace of long prompts can lose most of them)."""
    inputs, outputs = workload.input_tokens, workload.output_tokens
    too_long = (inputs + outputs) > max_context
    if not too_long.any():
        return workload
    # outputs up to what the prompt leaves, or a quarter of the context (>= 1 token); prompts get the rest
    output_room = np.maximum(np.maximum(max_context - inputs, max_context // 4), 1)
    new_outputs = np.where(too_long, np.minimum(outputs, output_room), outputs)
    new_inputs = np.where(too_long, np.minimum(inputs, max_context - new_outputs), inputs)
    block_offsets, block_ids = truncate_blocks(workload.block_offsets, workload.block_ids,
                                               -(-new_inputs // workload.block_tokens))
    n_cut = int(too_long.sum())
    fitted = workload.with_transform(f"fit {max_context}-token context ({n_cut} cut)", input_tokens=new_inputs,
                                     output_tokens=new_outputs, block_offsets=block_offsets, block_ids=block_ids)
    total_in, total_out = int(inputs.sum()), int(outputs.sum())
    cut_in, cut_out = total_in - int(new_inputs.sum()), total_out - int(new_outputs.sum())
    return fitted.with_note(
        f"{n_cut:,} of {len(workload):,} requests do not fit {model}'s {max_context:,}-token context: each cut "
        f"to fit it, the others kept whole ({cut_in:,} of {total_in:,} prompt tokens cut, {_share(cut_in, total_in)}; "
        f"{cut_out:,} of {total_out:,} output tokens cut, {_share(cut_out, total_out)})")


def _share(part: int, whole: int) -> str:
    """``part / whole`` as a whole percentage, ``<1%`` where a cut that happened would round to 0%."""
    if part == 0:
        return "0%"
    return "<1%" if part / whole < 0.005 else f"{part / whole:.0%}"


def fit_workload(workload: Workload, model: str) -> Workload:
    """``workload`` as a model preset serves it: fitted to its context (`fit_to_context`)."""
    return fit_to_context(workload, get_preset(model).max_context, model)


def workload_requests(workload: Workload, model: str, seed: int = 0) -> list[Request]:
    return to_requests(fit_workload(workload, model), vocab_size=get_preset(model).vocab_size, seed=seed)


def runtime_unavailable(model: str, device: str = "cpu") -> str | None:
    """Why the runtime cannot serve ``model`` on ``device`` here, in a phrase (None: it can): no such device,
    or weights larger than the device's memory as the runtime builds them (float32 on a CPU, bfloat16 on a
    GPU; q/k/v and gate/up are fused, so those weights exist twice while it is built): an 8B preset on a
    23 GiB host otherwise ends in the kernel's out-of-memory kill, with no message."""
    import torch

    from skistune.profile.fingerprint import host_memory_bytes
    from skistune.profile.measure import DTYPES

    if device == "cuda":
        if not torch.cuda.is_available():
            return "this machine has no CUDA device"
        memory, where = torch.cuda.mem_get_info()[1], "this GPU's"
    else:
        memory, where = host_memory_bytes(), "this machine's"
    dtype = DTYPES[device]
    need = 2 * get_preset(model).param_count() * dtype.itemsize
    if memory is not None and need > memory:
        return (f"model {model}: the runtime needs about {need / 2 ** 30:.1f} GiB of memory to build its weights "
                f"({str(dtype).removeprefix('torch.')}), more than {where} {memory / 2 ** 30:.1f} GiB")
    return None


def check_runtime_memory(model: str, device: str = "cpu") -> None:
    """A ``ValueError`` (one line) unless the runtime can serve ``model`` on ``device`` here."""
    reason = runtime_unavailable(model, device)
    if reason is not None:
        raise ValueError(f"{reason}; predict it with the simulator instead (--mode simulate)")


def hardware_profile(model: str, profile=None, device: str = "cpu"):
    """``profile`` as a `HardwareProfile`: loaded from its file, or this machine's cached quick profile for
    ``model`` when None."""
    from skistune.profile import HardwareProfile, default_profile, load_profile

    if profile is None:
        return default_profile(model, device)
    if isinstance(profile, HardwareProfile):
        return profile
    if isinstance(profile, (str, os.PathLike)):
        return load_profile(os.fspath(profile), model=model)
    raise TypeError(f"profile: expected a HardwareProfile, its file or None (this machine's cached quick "
                    f"profile), got {type(profile).__name__}")


def sim_target(model: str, profile=None, device: str = "cpu") -> SimTarget:
    """The simulation target of a model preset on the profiled machine (the cached quick profile of this
    machine when ``profile`` is None)."""
    return target_from_profile(hardware_profile(model, profile, device), model)


# ---- tiers larger than the machine -------------------------------------------------------------------------
def tier_notes(config, mode: str, profile=None, target=None) -> list[str]:
    """Notes, in every mode, for a config's tiers larger than the machine can give them: a prediction's against
    the profiled machine (`problem.oversized_tier_notes`, with ``profile`` and its ``target``), a run's disk
    tier against the disk where its file lives (`run_disk_note`). A run refuses a host tier (and, on a CPU, a
    device pool) larger than the memory before this, with an error; its disk tier is noted, not refused. In
    compare mode both, the run's where the prediction's does not name the disk tier already."""
    notes = []
    if mode != "run":
        from skistune.problem import oversized_tier_notes  # (lazily: it imports the search's modules)

        notes = oversized_tier_notes(config, profile, target)
    if mode != "simulate" and not any(n.startswith("offload.disk_kv_bytes:") for n in notes):
        notes += [n for n in [run_disk_note(config)] if n]
    return notes


def run_disk_note(config) -> str | None:
    """A run's disk tier larger than the disk where its file lives can give one (the optimizer's limit:
    `problem.DISK_TIER_SHARE` of the space free there now), or None. A note, not a refusal: the file is
    sparse, so a run that writes less than the free space is served in full, and a write the disk refuses
    loses only its block (recomputed, and counted as a disk write error)."""
    import tempfile

    from skistune.config import format_bytes
    from skistune.problem import DISK_TIER_SHARE
    from skistune.profile.transfers import disk_free_bytes
    from skistune.runtime.disk_pool import DISK_DIR_ENV, default_disk_dir

    size = config.offload.disk_kv_bytes
    free = disk_free_bytes(None) if size else None
    if free is None or size <= DISK_TIER_SHARE * free:
        return None
    folder = default_disk_dir() or tempfile.gettempdir()
    return (f"offload.disk_kv_bytes: {format_bytes(size)} is more than the {format_bytes(int(DISK_TIER_SHARE * free))} "
            f"this machine can give a disk tier ({DISK_TIER_SHARE:.0%} of the {format_bytes(free)} free in {folder}, "
            f"where the run keeps its file): served as configured, but blocks the disk cannot take are lost and "
            f"recomputed (disk write errors); lower it, or set {DISK_DIR_ENV} to a folder on a larger disk")


def run_machine(device: str = "cpu") -> str:
    """The machine a run measures, as `evaluate_cli.profiled_machine` names a prediction's: this one's GPU or
    CPU."""
    from skistune.profile import machine_fingerprint

    return f"{machine_fingerprint(device).chip} (this machine)"


# ---- energy ------------------------------------------------------------------------------------------------
POWER_LABELS = {"nvml": "power measured (NVML)", "rapl": "power measured (RAPL)", "modeled": "power modeled"}


def power_model(model: str, profile=None, device: str = "cpu"):
    """The `PowerModel` energy figures of a run use, without measuring anything: ``profile``'s, else this
    machine's cached quick profile's, else the model the profiler declares where no meter is read (marked
    ``modeled``)."""
    if profile is not None:
        return hardware_profile(model, profile, device).power
    from skistune.profile import cached_profile_path, load_profile, machine_fingerprint
    from skistune.profile.power import modeled_power

    path = cached_profile_path(model, device, machine_fingerprint(device))
    if path.is_file():
        try:
            return load_profile(path).power
        except ValueError:
            pass  # a damaged cache entry: `default_profile` measures it again when a simulation needs it
    return modeled_power(device, os.cpu_count() or 1)


def energy_figure(metrics: Metrics, power, *, measured_time: bool = False) -> dict:
    """Energy per generated token (J/token) of a run, by the optimizer's own formula
    (`objectives.energy_j_per_token`: busy time at full power, idle time at idle power), with where the
    power figures come from (``power_source``: nvml, rapl or modeled) and what the time is: simulated, or
    measured on the runtime (which no meter reads: the power model is applied to its measured time)."""
    from skistune.objectives import energy_j_per_token

    time = "measured busy/idle time" if measured_time else "simulated busy/idle time"
    return {"j_per_token": energy_j_per_token(metrics, power), "power_source": power.source,
            "basis": f"{POWER_LABELS.get(power.source, power.source)} x {time}"
                     + ("; the run itself is not metered" if measured_time else ""),  # (tables put it in parentheses)
            "power_note": power.note, "modeled_note": power.modeled_note}


# ---- the public function -----------------------------------------------------------------------------------
def as_requests(requests, model: str, seed: int = 0) -> list[Request]:
    """``requests`` as a list of `Request`: a `Workload` becomes its requests for ``model`` (fitted to its
    context, `workload_requests`); a sequence of requests is taken as it is."""
    if isinstance(requests, Workload):
        return workload_requests(requests, model, seed)
    if isinstance(requests, (str, bytes, Mapping)) or not isinstance(requests, Sequence):
        raise TypeError(f"requests: expected a Workload (e.g. load_workload('chat', requests=8)) or a sequence of "
                        f"Request, got {type(requests).__name__}")
    requests = request_list(requests)  # (each a Request)
    if not requests:
        raise ValueError("requests: empty; give at least one request")
    return requests


def evaluate(config, requests, *, model: str = "smollm2-135m", mode: str = "simulate",
             profile=None, runtime=None, on_progress: Callable[[int, int], None] | None = None) -> Metrics:
    """Metrics of serving ``requests`` with ``config``: predicted from the profile, or measured on the real
    runtime (``runtime`` reuses a loaded model).

    ``config``: a `KVConfig`, a mapping of knob families or a config file; ``requests``: a `Workload`
    (fitted to the model's context) or a sequence of `Request`; ``mode``: simulate or run; ``profile``: a
    `HardwareProfile`, its file, or None (this machine's cached quick profile); ``on_progress``: in run mode,
    called with (requests done, requests) about every `PROGRESS_INTERVAL_S` from another thread, and once
    at the end (`replay_with_progress`). Bad input raises ``ValueError`` or ``TypeError`` before anything is
    simulated or loaded."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: use simulate or run")
    if not isinstance(model, str):
        raise TypeError(f"model: expected a preset name, got {type(model).__name__}")
    get_preset(model)  # (an unknown model is a ValueError naming the presets)
    config = as_config(config)
    requests = as_requests(requests, model)
    if mode == "simulate":
        return simulate(config, requests, sim_target(model, profile))
    from skistune.runtime.llm import Runtime

    if runtime is None:
        check_runtime_memory(model)
    rt = runtime.with_config(config) if runtime is not None else Runtime.from_preset(model, config)
    return rt.replay(requests) if on_progress is None else replay_with_progress(rt, requests, on_progress)


# ---- how long a run takes --------------------------------------------------------------------------------
PROGRESS_INTERVAL_S = 0.5  # how often a run's progress is read (from another thread: the replay's loop is untouched)


def requests_done(engine) -> int:
    """Requests of a replay that are done: finished, rejected on arrival or dropped, i.e. queued and neither
    waiting nor running. Read from another thread while the replay runs: a sequence moving between the
    queues can be miscounted by one for that instant."""
    scheduler = engine.scheduler
    return len(engine.records) - len(scheduler.waiting) - len(scheduler.running)


def replay_with_progress(runtime, requests: Sequence[Request], on_progress: Callable[[int, int], None],
                         interval_s: float | None = None) -> Metrics:
    """``runtime.replay(requests)``, calling ``on_progress(done, total)`` every ``interval_s`` (default
    `PROGRESS_INTERVAL_S`) from a thread that only reads the engine's queues (`requests_done`), and with
    (total, total) once the replay ends."""
    import threading

    interval_s = PROGRESS_INTERVAL_S if interval_s is None else interval_s
    engine, total, stop = runtime.new_engine(), len(requests), threading.Event()

    def poll() -> None:
        while not stop.wait(interval_s):
            on_progress(min(max(requests_done(engine), 0), total), total)

    thread = threading.Thread(target=poll, name="skistune-run-progress", daemon=True)
    thread.start()
    try:
        metrics = engine.replay(requests)
    finally:
        stop.set()
        thread.join()
    on_progress(total, total)
    return metrics


def predicted_run_s(config, requests: Sequence[Request], model: str, device: str = "cpu",
                    profile=None) -> tuple[float, str] | None:
    """How long the simulator predicts a run of ``requests`` takes (arrivals replayed in real time, so never
    less than their span), and the profile it used: ``profile`` (a `HardwareProfile`) when it was measured on
    ``device``, else this machine's cached quick profile of ``model``. None where there is neither (a profile
    is not measured for an estimate: that takes a minute) or the simulator refuses the config. Warnings of
    the estimate's simulation are not shown: the run says its own."""
    import warnings

    from skistune.profile import cached_profile_path, load_profile, machine_fingerprint

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if profile is None or profile.device != device:
                path = cached_profile_path(model, device, machine_fingerprint(device))
                if not path.is_file():
                    return None
                profile = load_profile(path, check_fingerprint=False, model=model)
                if profile.unreliable is not None:  # (as `default_profile`, which would measure it again)
                    return None
            metrics = simulate(config, requests, target_from_profile(profile, model))
    except ValueError:  # (a damaged cache entry, a config the simulator refuses: no estimate, the run goes on)
        return None
    return metrics.duration_s, profile.name


def run_eta_s(done: int, total: int, elapsed_s: float, arrivals_end_s: float,
              predicted_s: float | None = None) -> tuple[float | None, bool]:
    """Seconds a run still needs, and whether that is only a lower bound: the requests left at the rate they
    have finished so far, else (none finished yet) the prediction's time left; never less than the time
    until the last arrival, since a run replays its arrivals in real time (with neither rate nor prediction,
    that time is the lower bound; (None, True) once it has passed too)."""
    if done >= total:
        return 0.0, False
    until_last_arrival = max(arrivals_end_s - elapsed_s, 0.0)
    if done > 0 and elapsed_s > 0:
        return max((total - done) * elapsed_s / done, until_last_arrival), False
    if predicted_s is not None:
        return max(predicted_s - elapsed_s, until_last_arrival), False
    return (until_last_arrival, True) if until_last_arrival > 0 else (None, True)


callable_module(__name__, evaluate)  # ``skistune.evaluate(...)`` runs `evaluate`, however it was reached


# ---- a tuned file: what its figures are for ---------------------------------------------------------------
# The workload options `skistune optimize` and `skistune evaluate` share (their names are the same in both; the
# workload seed is evaluate's --seed too), in their order, each with the value it takes when not given: a tuned
# file records the others (`provenance.workload.options`), so that evaluate can say how to rebuild its workload.
WORKLOAD_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("format", None), ("skip-bad-rows", False), ("workload-seed", 0), ("requests", None), ("rate", None),
    ("burstiness", None), ("block-tokens", None), ("jitter", None), ("window", None), ("first", None),
    ("sample", None), ("length-scale", 1.0), ("max-input", None), ("max-output", None), ("rate-scale", 1.0))
SAME_RATE_SCALE = 1e-9  # relative: a scale pasted from the note is the recorded one, exactly (repr)


def workload_options(workload: str | os.PathLike, **given: Any) -> dict[str, Any]:
    """A command line's workload options as a tuned file records them: ``workload`` (a preset's name, or a
    trace's absolute path, so that the note's command works from any folder), then each of `WORKLOAD_OPTIONS`
    given (keywords with ``_`` for ``-``: ``max_input=512``) that is not its default, exactly as given."""
    from skistune.workloads import PRESETS

    known = dict(WORKLOAD_OPTIONS)
    unknown = sorted(set(given) - {name.replace("-", "_") for name in known})
    if unknown:
        raise TypeError(f"workload_options: unknown option(s) {', '.join(unknown)}")
    spec = str(workload) if str(workload) in PRESETS else os.path.abspath(workload)
    options: dict[str, Any] = {"workload": spec}
    for name, default in WORKLOAD_OPTIONS:
        value = given.get(name.replace("-", "_"), default)
        if value != default:
            options[name] = value
    return options


# `load_workload`'s keywords -> `workload_options`' (the command line's names, with ``_``)
_LOAD_KEYWORDS = {"seed": "workload_seed", "rate_rps": "rate", "jitter_s": "jitter", "window_s": "window"}


def preset_options(workload: Workload) -> dict[str, Any] | None:
    """The options that build ``workload`` again, else None: what a tuned file made by the Python API can record,
    which is given a `Workload`, not the options that made it. From `load_workload`'s own arguments where it
    built it (`Workload.loaded_with`: a tester's `rate_scale=0.04` had been lost, and evaluate's hint then asked
    for x8 where x0.32 was meant), else a preset's requests untouched by any transform (its source names them,
    with the rate rounded); either checked by the digest of the workload they build."""
    from skistune.workloads import PRESETS, load_workload

    given = workload.loaded_with
    if given is not None:
        try:
            again = load_workload(**given)
        except (OSError, ValueError):
            again = None
        if again is not None and again.digest() == workload.digest():
            options = {_LOAD_KEYWORDS.get(k, k): v for k, v in given.items() if k != "spec"}
            if "window" in options:
                options["window"] = f"{options['window'][0]!r}:{options['window'][1]!r}"
            return workload_options(given["spec"], **options)
    words = workload.source.split()
    if workload.transforms or not words or not words[0].startswith("preset:"):
        return None
    name, fields = words[0].removeprefix("preset:"), dict(w.split("=", 1) for w in words[1:] if "=" in w)
    try:
        requests, seed = int(fields["requests"]), int(fields.get("seed", 0))
        again = load_workload(name, requests=requests, seed=seed) if name in PRESETS else None
    except (KeyError, ValueError):
        return None
    if again is None or again.digest() != workload.digest():
        return None
    return workload_options(name, requests=requests, workload_seed=seed)


def options_command(options: Mapping[str, Any], rate_scale: float) -> str:
    """The workload options, in `skistune evaluate`'s words, that rebuild the workload a tuned file records
    (``options``: its `provenance.workload.options`), at ``rate_scale`` x its rate (optimize's own --rate-scale
    included: evaluate has the one)."""
    words = ["--workload", str(options["workload"])]
    for name, value in options.items():
        if name in ("workload", "rate-scale") or value is None or value is False:
            continue
        words += [f"--{name}"] if value is True else [f"--{name}", repr(value) if isinstance(value, float) else
                                                      str(value)]
    if rate_scale != 1.0:
        words += ["--rate-scale", repr(float(rate_scale))]
    return shlex.join(words)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def recorded_options(tuned: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """A tuned file's workload options (`workload_options`), None where it records none: a file made before
    they were recorded, or by the Python API from a `Workload` it could not name (`preset_options`)."""
    options = tuned.get("options")
    return options if isinstance(options, Mapping) and isinstance(options.get("workload"), str) else None


def digest_as_tuned(workload: Workload, options: Mapping[str, Any] | None) -> str:
    """The digest ``workload`` (built without evaluate's --rate-scale) has as optimize built it: at optimize's
    own --rate-scale, which its recorded digest includes."""
    from skistune.workloads.transforms import scale_rate

    scale = _number((options or {}).get("rate-scale")) or 1.0
    return (scale_rate(workload, scale) if scale != 1.0 else workload).digest()


def _same_requests(tuned: Mapping[str, Any], workload: Workload, options: Mapping[str, Any] | None) -> bool:
    """Whether ``workload`` holds the requests the figures are for: the same digest; a file that records none
    (written by hand), the same source, transforms and count."""
    digest = tuned.get("digest")
    if isinstance(digest, str):
        return digest_as_tuned(workload, options) == digest
    return (tuned.get("source") == workload.source and tuned.get("requests") == len(workload)
            and list(tuned.get("transforms") or []) == list(workload.transforms))


def _same_options(tuned: Mapping[str, Any], recorded: Mapping[str, Any] | None, workload: Workload,
                  options: Mapping[str, Any] | None) -> bool:
    """Whether this evaluation asked for the workload the figures are for, whatever it holds now: the options
    recorded (evaluate's --rate-scale aside); a file that records none, the same source and transforms."""
    if recorded is not None:
        if options is None:
            return False
        return ({k: v for k, v in recorded.items() if k != "rate-scale"}
                == {k: v for k, v in options.items() if k != "rate-scale"})
    return tuned.get("source") == workload.source and list(tuned.get("transforms") or []) == list(workload.transforms)


def _how_to_check(tuned, recorded, workload, options, same_requests: bool, same_rate: bool, scale: float) -> str:
    """The end of `tuned_workload_note`: how to evaluate what the figures are for, or why no command can."""
    if same_requests:  # (only the rate differs)
        return (f"to check them, evaluate that workload ({options_command(recorded, scale)})" if recorded else
                f"to check them, evaluate these requests at --rate-scale {scale!r}")
    if isinstance(tuned.get("digest"), str) and _same_options(tuned, recorded, workload, options):
        made = "an earlier skistune" if str(tuned.get("source")).startswith("preset:") else \
            "an earlier skistune, or another version of the trace file"
        return (f"these are the options that built the workload tuned on, but they now build other requests (it was "
                f"made by {made}), so its figures will not be matched exactly"
                + ("" if same_rate else f" (they were predicted at --rate-scale {scale!r})"))
    if recorded is not None:
        return f"to check them, evaluate that workload ({options_command(recorded, scale)})"
    if not isinstance(tuned.get("digest"), str):  # (a provenance written by hand)
        return "the file records neither the workload options that built those requests nor their digest"
    at = f" at --rate-scale {scale!r}" if scale != 1.0 else ""
    return ("the file does not record the workload options that built those requests (made by an earlier skistune, "
            f"or by the Python API from a Workload): the workload of that digest{at} reproduces them (`skistune "
            "workload show` prints a workload's digest)")


def tuned_workload_note(provenance: Mapping[str, Any], workload: Workload, rate_scale: float | None,
                        options: Mapping[str, Any] | None = None) -> str | None:
    """When the config is a tuned file (`skistune optimize` wrote its provenance) and this evaluation's workload
    is not the one its predicted figures are for: other requests (another digest: a tester's same trace under
    another path spelling had been told apart by its source text, and a preset that now draws other requests
    had not), or another rate (a tester read a TTFT p50 of 2,989 s for a file whose provenance said 0.3 s: 2,000
    requests at the preset's rate against optimize's 100 at x0.027). None when it is the same, or the file has no
    provenance. ``workload``: evaluate's, built without its --rate-scale (``rate_scale``, None: 1); ``options``:
    evaluate's `workload_options`. The note says how to evaluate what the figures are for, from the options the
    file records (`recorded_options`), or what is known where it records none."""
    tuned, predicted = provenance.get("workload"), provenance.get("predicted")
    if not isinstance(tuned, Mapping):
        return None
    recorded = recorded_options(tuned)
    predicted_scale = _number(predicted.get("rate_scale")) if isinstance(predicted, Mapping) else None
    own_scale = _number((recorded or {}).get("rate-scale")) or 1.0  # (optimize's own --rate-scale)
    scale = own_scale * (predicted_scale if predicted_scale is not None else 1.0)  # (evaluate's, to match them)
    rate_scale = 1.0 if rate_scale is None else rate_scale
    same_requests = _same_requests(tuned, workload, recorded)
    same_rate = predicted_scale is None or math.isclose(rate_scale, scale, rel_tol=SAME_RATE_SCALE)
    if same_requests and same_rate:
        return None
    transforms = ", ".join(str(t) for t in tuned.get("transforms") or [])
    digest = f"digest {tuned['digest']}" if isinstance(tuned.get("digest"), str) else "no digest recorded"
    at = f" at x{predicted_scale:.4g} its rate" if predicted_scale is not None else ""
    return (f"the config's predicted figures (its provenance) are for {tuned.get('requests')} requests of "
            f"{tuned.get('source')}{f' | {transforms}' if transforms else ''} ({digest}){at}; this is "
            f"{len(workload)} requests of {workload.label()} (digest {digest_as_tuned(workload, recorded)}) at "
            f"x{rate_scale:g}: {_how_to_check(tuned, recorded, workload, options, same_requests, same_rate, scale)}")


def quality_figure(config, model: str, requests) -> dict[str, Any] | None:
    """The predicted quality loss of a config with a lossy knob (eviction, KV bits), from the shipped quality
    profile (a proxy for a model without weights), its token budgets read against the requests' 90th-percentile
    context as the optimizer reads them; None for a lossless config (evaluate had shown nothing of a tuned
    lossy config's quality). Mean and worst window, with their 95% bounds (what floors are checked against)."""
    import math

    from skistune.objectives import context_tokens_p90, predict_quality, structural_changes
    from skistune.quality import load_quality_profile

    if not structural_changes(config):
        return None
    qp = load_quality_profile()
    loss = predict_quality(config, qp, model, context_tokens_p90(requests))
    if loss is None:
        return None

    def finite(x):
        return x if x is not None and math.isfinite(x) else None

    return {"ppl_mean": finite(loss.ppl_mean), "ppl_mean_bound": finite(loss.guarded_mean),
            "ppl_worst": finite(loss.ppl_worst), "ppl_worst_bound": finite(loss.guarded_worst),
            "needle_retained": loss.needle_retained, "basis": loss.basis, "profile": qp.path}


def other_model_note(model: str, provenance: Mapping[str, Any], config: str | os.PathLike) -> str | None:
    """A model asked for (--model) other than the one the tuned file records, in one line (None: the same, or
    none recorded), as `skistune export` warns of it."""
    from skistune.export.registry import recorded_model

    recorded = recorded_model(provenance)
    if recorded is None or recorded == model:
        return None
    return (f"evaluated for model {model} (--model), but {config} was tuned for {recorded}: its predicted figures "
            f"(provenance) are that model's, and its byte sizes were chosen for it")
