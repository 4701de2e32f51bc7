"""Evaluate one config on one workload, simulated (hardware profile) or run (real runtime): the same
`Metrics` either way, so any prediction can be checked."""
from __future__ import annotations

from typing import Callable, Sequence

from skistune.config import KVConfig
from skistune.runtime.metrics import Metrics
from skistune.runtime.presets import get_preset
from skistune.runtime.request import Request
from skistune.simulator import SimTarget, simulate, target_from_profile
from skistune.workloads import Workload, scale_lengths, to_requests

MODES = ("simulate", "run")
# what a prediction is checked on, (name, unit, figure of a Metrics): `skistune evaluate --mode compare` and
# benchmarks/fidelity.py
FIDELITY_FIGURES: tuple[tuple[str, str, Callable[[Metrics], float]], ...] = (
    ("ttft p50", "ms", lambda m: m.ttft_s.p50), ("ttft p99", "ms", lambda m: m.ttft_s.p99),
    ("tbt p50", "ms", lambda m: m.tbt_s.p50), ("tbt p99", "ms", lambda m: m.tbt_s.p99),
    ("e2e p50", "ms", lambda m: m.e2e_s.p50), ("e2e p99", "ms", lambda m: m.e2e_s.p99),
    ("tok/s", "tok/s", lambda m: m.throughput_tok_per_s), ("kv peak", "MiB", lambda m: m.kv_peak_bytes))


def relative_error(predicted: float, measured: float) -> float | None:
    """(predicted - measured) / measured; None where nothing was measured (0, or NaN: no request finished)."""
    if not measured or measured != measured or predicted != predicted:
        return None
    return (predicted - measured) / measured


def compare_metrics(predicted: Metrics, measured: Metrics) -> list[dict]:
    """Each of `FIDELITY_FIGURES`: the prediction, the measurement and the relative error."""
    return [{"figure": name, "predicted": f(predicted), "measured": f(measured),
             "error": relative_error(f(predicted), f(measured))} for name, _, f in FIDELITY_FIGURES]


def fit_to_context(workload: Workload, max_context: int, model: str = "the model") -> Workload:
    """Cap outputs, then prompts, so that every request fits the model's context; a note on the workload
    says how many requests and prompt tokens the caps cut (a trace of long prompts can lose most of them)."""
    too_long = (workload.input_tokens + workload.output_tokens) > max_context
    if not too_long.any():
        return workload
    max_output = min(int(workload.output_tokens.max()), max_context // 4)
    fitted = scale_lengths(workload, 1.0, max_input=max_context - max_output, max_output=max_output)
    total = int(workload.input_tokens.sum())
    cut = total - int(fitted.input_tokens.sum())
    return fitted.with_note(
        f"{int(too_long.sum()):,} of {len(workload):,} requests do not fit {model}'s {max_context:,}-token context: "
        f"prompts capped at {max_context - max_output:,} tokens and outputs at {max_output:,} "
        f"({cut:,} of {total:,} prompt tokens cut, {cut / total:.0%})")


def fit_workload(workload: Workload, model: str) -> Workload:
    """``workload`` as a model preset serves it: fitted to its context (`fit_to_context`)."""
    return fit_to_context(workload, get_preset(model).max_context, model)


def workload_requests(workload: Workload, model: str, seed: int = 0) -> list[Request]:
    return to_requests(fit_workload(workload, model), vocab_size=get_preset(model).vocab_size, seed=seed)


def hardware_profile(model: str, profile=None, device: str = "cpu"):
    """``profile`` as a `HardwareProfile`: loaded from its file, or this machine's cached quick profile for
    ``model`` when None."""
    from skistune.profile import default_profile, load_profile

    return default_profile(model, device) if profile is None else (
        load_profile(profile) if isinstance(profile, str) else profile)


def sim_target(model: str, profile=None, device: str = "cpu") -> SimTarget:
    """The simulation target of a model preset on the profiled machine (the cached quick profile of this
    machine when ``profile`` is None)."""
    return target_from_profile(hardware_profile(model, profile, device), model)


def evaluate(config: KVConfig, requests: Sequence[Request], *, model: str = "smollm2-135m", mode: str = "simulate",
             profile=None, runtime=None) -> Metrics:
    """Metrics of serving ``requests`` with ``config``: predicted from the profile, or measured on the real
    runtime (``runtime`` reuses a loaded model)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: use simulate or run")
    if mode == "simulate":
        return simulate(config, requests, sim_target(model, profile))
    from skistune.runtime.llm import Runtime

    rt = runtime.with_config(config) if runtime is not None else Runtime.from_preset(model, config)
    return rt.replay(requests)
