"""`skistune optimize`: search the knobs under SLOs, energy and quality constraints, validate the winners on
the real runtime, and write the tuned config. A thin command over `skistune.optimize`.

Exit codes: 0 written, 2 bad input or a storage that failed mid-run (one line on stderr: for a storage, what failed,
the finished trials the study keeps, and the command that resumes it), 3 no config meets the constraints (the binding
constraints and the configs closest to feasibility are printed; nothing is written), 4 written, but the config
broke a constraint when validated on the real runtime (a warning names it, predicted vs measured).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import shlex
import time
from pathlib import Path
from typing import Annotated, Any, Iterator, Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from skistune.cli_base import JsonOpt, cli_errors, console, err_console, print_json, print_warning
from skistune.display import Table

from skistune.display import significant
from skistune.paths import check_out_file, folder_refuses
from skistune.workloads.cli import (BlockTokensOpt, BurstinessOpt, FirstOpt, FormatOpt, JitterOpt,
                                    LengthScaleOpt, MaxInputOpt, MaxOutputOpt, RateOpt, RateScaleOpt, SampleOpt,
                                    SkipBadRowsOpt, WindowOpt, WorkloadOpt, parse_window, print_notes)
from skistune.objectives import DEFAULT_MAX_QUEUE_S, parse_max_queue
from skistune.optimize import DEFAULT_TOP_K
from skistune.problem import DEFAULT_REQUESTS
from skistune.search import DEFAULT_TRIALS

EXIT_INFEASIBLE = 3
# the search's best is written (it is still the best estimate), but its replay broke a constraint: a script that
# deploys on exit 0 should not take it silently
EXIT_BROKE_WHEN_VALIDATED = 4
DEFAULT_OUT = "skistune-tuned.yaml"

SloOpt = Annotated[Optional[list[str]], typer.Option(
    "--slo", help="SLO, repeatable: METRIC:pXX<=VALUE (ttft:p90<=1s; metrics ttft, tbt, e2e, tpot) or the short "
                  "form pXX=VALUE, which means TBT (p99=200ms: TBT p99 <= 200 ms, Vidur-Search's convention); the "
                  "value needs a unit: s, ms or us")]
EnergyOpt = Annotated[Optional[str], typer.Option(
    "--energy", help="energy budget per generated token, e.g. 0.5J/token (the profile's power model; modeled "
                     "where no meter exists)")]
QualityOpt = Annotated[Optional[list[str]], typer.Option(
    "--quality", help="quality floor, repeatable: ppl+1% (mean-window perplexity increase), worst:ppl+3%, "
                      "needle>=0.95 (share of retrieval accuracy kept)")]
QualityProfileOpt = Annotated[Optional[str], typer.Option(
    "--quality-profile", help="quality profile JSON from `skistune quality`, or a shipped one by name "
                              "(quality-smollm2-135m, the default); "
                              "read when --quality or the quality objective asks for it")]
ObjectiveOpt = Annotated[Optional[list[str]], typer.Option(
    "--objective", help="capacity (max request rate under the SLOs; default), goodput (at the workload's rate), "
                        "energy (J/token), memory (KV peak), quality; several (repeated, or comma-separated) for a "
                        "Pareto front")]


def _requests(spec: str, requests: int | None, first: int | None) -> int | None:
    """--requests, else `DEFAULT_REQUESTS` of a preset (unless --first picks them): evaluate's default is
    another, so the tuned file records the count either way."""
    from skistune.workloads import PRESETS

    return DEFAULT_REQUESTS if requests is None and first is None and spec in PRESETS else requests


def _workload(spec: str, *, requests: int | None, first: int | None, window: str | None, **options: Any):
    """The workload after `workload show`'s options (a preset of `DEFAULT_REQUESTS` unless told)."""
    from skistune.workloads import load_workload

    return load_workload(spec, requests=_requests(spec, requests, first), first=first, window_s=parse_window(window),
                         **options)


def profile_or_measure(path: str | None, model: str) -> Any:
    """The given file, or this machine's cached quick profile (measured now, once, when missing, damaged or
    untrusted: with a status line, as `skistune optimize` and `skistune evaluate` both need it). What
    `default_profile` says of the cache (damaged, waited for, not cacheable) comes as ``warning:`` lines."""
    if path is not None:
        return path
    from skistune.profile import cached_profile_path, default_profile, machine_fingerprint, read_cached_profile

    cached = cached_profile_path(model, "cpu", machine_fingerprint("cpu"))
    # (the fingerprint warning, if any, from `default_profile`'s own read: once)
    if read_cached_profile(cached, check_fingerprint=False)[0] is None:
        # (said in a line, not only a status: a status shows on a terminal only)
        # (no promise of a cache that cannot be written: a warning after the measurement says why)
        kept = "for this run only" if folder_refuses(cached.parent) else f"once (cached in {cached})"
        err_console.print(escape(f"measuring this machine's quick profile for {model}: up to a minute, more on a busy "
                                 f"machine, {kept}"), highlight=False, soft_wrap=True)
        with err_console.status("measuring the quick profile"):
            return default_profile(model, "cpu")
    return default_profile(model, "cpu")


# ---- display ------------------------------------------------------------------------------------------------
def _fmt(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    if x is None or x != x:
        return "-"
    return "inf" if x == float("inf") else f"{x * scale:,.{digits}f}"


def _value(o, v: float) -> str:
    if o.name == "capacity" or o.name == "goodput":  # (4 digits, trailing zeros kept: 0.01490 beside 0.01556)
        return f"{significant(v, 4)} req/s"
    if o.name == "energy":
        return f"{v:.3g} J/token"
    if o.name == "memory":
        return f"{v / 2**20:,.1f} MiB"
    if o.name == "quality":  # (the relative increase of the mean window's perplexity, as the quality column)
        return f"{_loss(v)} ppl"
    return f"{v:.4g}"


def _diff(config, base, names) -> str:
    """The knobs that differ from the baseline, by short name where no other knob has it: the searched ones
    (``names``) in the space's order, then any other (a knob the space fixes away from the baseline: a config of
    30 fixed 8-bit layers read "(baseline)")."""
    from skistune.config import byte_size_text, knob_fields, layer_bits_text
    from skistune.problem import _value as knob_value

    all_short = [n.partition(".")[2] for n in knob_fields()]
    # (a knob that does nothing here changes nothing: uniform bits under per-layer ones, for one)
    config, base = config.effective(), base.effective()
    out = []
    for name in [*names, *(k for k in knob_fields() if k not in names)]:
        value = knob_value(config, name)
        if value != knob_value(base, name):
            short = name.partition(".")[2]
            label = short if all_short.count(short) == 1 else name
            if isinstance(value, float):
                out.append(f"{label}={value:.2f}")
            elif (size := byte_size_text(name, value)) is not None:
                out.append(f"{label}={size}")  # 8GiB, not 8589934592
            else:
                out.append(f"{label}={layer_bits_text(value)}")
    return ", ".join(out) or "(baseline)"


def best_table(result) -> Table:
    p = result.problem
    t = Table(title=f"Best configs, predicted on {len(p.workload)} requests of {p.workload.name} "
                    "(#1 is written)", title_justify="left")
    for col in ("#", "trial"):
        t.add_column(col)
    for o in p.objectives:
        t.add_column(f"energy ({p.profile.power.source})" if o.name == "energy" else
                     "quality (Δppl mean)" if o.name == "quality" else o.name, justify="right")
    for s in p.slos:
        t.add_column(f"{s.metric.upper()} {s.percentile} (ms)", justify="right")
    energy = "energy" not in [o.name for o in p.objectives]  # (an energy objective is this figure already)
    if energy:
        t.add_column(f"J/token ({p.profile.power.source})", justify="right")
    t.add_column("KV peak (MiB)", justify="right")
    rows = [(f"#{i + 1}", str(e.trial), e) for i, e in enumerate(result.best)] + [("base", "-", result.baseline)]
    limits = any("limited_by" in e.figures for _, _, e in rows)  # (at capacity: what a higher rate breaks)
    if limits:
        t.add_column("capacity set by", overflow="fold")
    # a column of "none (lossless)" on every row says what the lossless-search note says already
    lossy = any(e.figures.get("quality_basis") != "exact" for _, _, e in rows)
    if lossy:
        t.add_column("quality Δppl mean (95% bound) / worst" + (" (proxy)" if _proxy(p) else ""), justify="right")
    for rank, trial, e in rows:
        t.add_row(rank, trial, *(_objective_cell(p, o, v) for o, v in zip(p.objectives, e.values)),
                  *(_fmt(e.figures["slo_s"].get(str(s)), 1e3) for s in p.slos),
                  *([_fmt(e.figures["energy_j_per_token"], digits=3)] if energy else []),
                  _fmt(e.figures["kv_peak_bytes"], 2**-20), *([_limit_cell(e.figures)] if limits else []),
                  *([_quality_cell(e.figures)] if lossy else []))
    return t


def _limit_cell(figures) -> str:
    """What sets a capacity: "not refined" for a row at the search's precision (its figures do not say; a blank
    cell read as a missing figure), none at the ceiling."""
    if "limited_by" not in figures:
        return "not refined"
    return ", ".join(figures["limited_by"]) or "none (the search's ceiling)"


def _lowest_rate_rps(problem) -> float:
    """The lowest arrival rate the capacity search tries: a config that breaks a constraint there meets none."""
    from skistune.scoring import MIN_RATE_SCALE

    return MIN_RATE_SCALE * problem.search.base_rps


def _objective_cell(problem, o, v: float) -> str:
    if o.name == "capacity" and v == 0:
        return f"none ≥ {_lowest_rate_rps(problem):.2g} req/s"
    return _value(o, v)


def _objective(problem, e, name: str) -> float | None:
    """``e``'s value of the objective ``name``, None when the problem does not optimize it."""
    names = [o.name for o in problem.objectives]
    return e.values[names.index(name)] if name in names else None


def no_rate_line(problem, label: str, e) -> str:
    """Why a capacity of 0: the constraints it breaks even at the lowest rate tried (where its figures are)."""
    return (f"{label} meets the constraints at no rate down to {_lowest_rate_rps(problem):.2g} req/s (1/1024 of "
            f"the workload's); there it breaks {', '.join(e.binding) or 'a constraint'}, and its figures above "
            "are at that rate")


def _proxy(problem) -> bool:
    return problem.quality_profile is not None and problem.quality_profile.model != problem.model


def _loss(x) -> str:
    return "outside profile" if x is None else f"+{100 * x:.2f}%"


def _quality_cell(figures: dict) -> str:
    """Predicted quality loss: none for lossless configs, else mean / worst window ("-": not predicted)."""
    basis = figures.get("quality_basis")
    if basis == "exact":
        return "none (lossless)"
    if basis is None:
        return "-"
    bound = figures.get("quality_bound")
    guard = f" (≤{_loss(bound)[1:]})" if bound is not None and bound != figures["quality_loss"] else ""
    return f"{_loss(figures['quality_loss'])}{guard} / {_loss(figures['quality_worst'])}"


def knob_lines(result) -> list[str]:
    """Each best config as the knobs it changes from the baseline (the target engine's defaults)."""
    p = result.problem
    names = [q.name for q in p.space.params if not q.is_switch]
    lines = [f"#{i + 1}: {_diff(e.config, p.base, names)}" for i, e in enumerate(result.best)]
    if result.baseline.rate_scale > 0 and _objective(p, result.baseline, "capacity") == 0:
        lines.append(no_rate_line(p, "base", result.baseline))
    return lines + [f"base: {baseline_text(p)}"]


def baseline_text(problem) -> str:
    """The baseline as its engine's name and the values of the knobs it sets (read off the config itself)."""
    b = problem.base
    bits = f"{b.bitwidth.key_bits}-bit KV" if b.bitwidth.key_bits == b.bitwidth.value_bits else \
        f"{b.bitwidth.key_bits}/{b.bitwidth.value_bits}-bit KV"
    prefix = f"prefix caching, block {b.prefix_reuse.block_size}" if b.prefix_reuse.enabled else "no prefix caching"
    chunk = f"chunk {b.batching.chunk_size}" if b.batching.chunked_prefill else "no chunked prefill"
    return (f"{problem.baseline_engine} defaults ({bits}, no eviction or offload, {prefix}, max_num_seqs "
            f"{b.batching.max_num_seqs}, max_num_batched_tokens {b.batching.max_num_batched_tokens}, {chunk}, "
            f"{b.batching.policy}, memory fraction {b.offload.device_memory_fraction:g})")


def pareto_table(result) -> Table | None:
    """With several objectives: the whole front (configs no other beats on every objective), each by trial,
    the best configs by their rank; None with one objective, or when the best configs are the whole front."""
    p = result.problem
    best = {e.config: i for i, e in enumerate(result.best)}
    if len(p.objectives) < 2 or all(e.config in best for e in result.pareto):
        return None
    t = Table(title=f"Pareto front: {len(result.pareto)} configs no other beats on every objective",
              title_justify="left")
    for col in ("trial", "config"):
        t.add_column(col)
    for o in p.objectives:
        t.add_column(f"{o.name} {'↑' if o.maximize else '↓'}", justify="right")
    for e in result.pareto:
        t.add_row(str(e.trial), f"#{best[e.config] + 1}" if e.config in best else "below",
                  *(_objective_cell(p, o, v) for o, v in zip(p.objectives, e.values)))
    return t


def pareto_knob_lines(result) -> list[str]:
    """The front's configs that are not among the best, as the knobs they change from the baseline."""
    p = result.problem
    names = [q.name for q in p.space.params if not q.is_switch]
    best = {e.config for e in result.best}
    return [f"trial {e.trial}: {_diff(e.config, p.base, names)}" for e in result.pareto if e.config not in best]


def validation_table(result) -> Table:
    p = result.problem
    first = result.validated[0].measured.figures["requests"]
    from skistune.simulator import MAX_RATE_SCALE
    from skistune.validation import VALIDATE_MAX_INPUT, VALIDATE_MAX_OUTPUT

    # (the slice's own figures: its capacity and J/token are not the search workload's in the table above)
    # (the operating point `score` chose: the capacity where an objective needs it, else the trace's own rate)
    rate = "slice's own predicted capacity" if p.at_capacity else "slice's own arrival rate"
    t = Table(title=f"Validated on the real runtime: the first {first} requests of {p.workload.name}, prompts "
                    f"capped at {VALIDATE_MAX_INPUT} tokens and outputs at {VALIDATE_MAX_OUTPUT}, replayed at the "
                    f"{rate} (predicted / measured; not the search workload's figures)",
              title_justify="left")
    for col in ("config", "rate (req/s)"):
        t.add_column(col)
    for s in p.slos:
        t.add_column(f"{s.metric.upper()} {s.percentile} (ms)", justify="right")
    t.add_column(f"J/token ({p.profile.power.source})", justify="right")
    lossy = any(v.held_out_quality is not None for v in result.validated)
    # (a worst-window floor is checked on the worst window: shown beside the mean, which alone had been shown)
    worst = any(c.name.startswith("worst:") for c in p.constraints)
    if lossy:
        t.add_column("Δppl mean (predicted / held-out)", justify="right")
        if worst:
            t.add_column("Δppl worst window (predicted / held-out)", justify="right")
    t.add_column("holds", justify="center", overflow="fold")  # ("no (tbt:p99<=200ms)" whole)
    labels = {b.config: f"#{i + 1}" for i, b in enumerate(result.best)}
    for v in result.validated:
        label = "base" if v.role == "baseline" else labels.get(v.config, "?")
        cells = [f"{_fmt(v.predicted.figures['slo_s'][str(s)], 1e3)} / {_fmt(v.measured.figures['slo_s'][str(s)], 1e3)}"
                 for s in p.slos]
        energy = f"{_fmt(v.predicted.figures['energy_j_per_token'], digits=3)} / " \
                 f"{_fmt(v.measured.figures['energy_j_per_token'], digits=3)}" \
            + (" (not judged)" if any(n.startswith("energy") for n in v.untested) else "")  # (`untested_note`)
        # (a replay that broke is replayed once more and the better kept: "2 replays" says the first broke)
        replays = [f"{v.replays} replays"] if v.replays > 1 else []
        holds = f"[green]yes[/]{f' ({replays[0]})' if replays else ''}" if v.holds else \
            f"[red]no[/] ({', '.join([*v.broken, *replays])})"
        quality = [f"{_loss(v.predicted.figures[key])} / {_loss(v.measured.figures[key])}"
                   if v.held_out_quality is not None else "lossless"
                   for key in ("quality_loss", *(("quality_worst",) if worst else ()))] if lossy else []
        # (at the capacity search's ceiling every rate held: the slice arrived in one burst, say, and the rate is
        # the highest tried, not a capacity)
        rate = significant(v.rate_rps) + (" (every rate held: the search's ceiling)"
                                          if p.at_capacity and v.predicted.rate_scale >= MAX_RATE_SCALE else "")
        t.add_row(label, rate, *cells, energy, *quality, holds)
    return t


def twin_lines(result) -> list[str]:
    """The top configs (and the baseline) left unreplayed because the simulator predicts them the same schedule
    of the slice as a replayed one (`Validation.twins`)."""
    labels = {b.config: f"#{i + 1}" for i, b in enumerate(result.best)}
    labels[result.baseline.config] = "the baseline"  # (when it is also among the best, it is named as such)
    lines = []
    for v in result.validated:
        if v.role == "candidate" and v.twins:
            names = [labels.get(c, "a config") for c in v.twins]
            names = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
            lines.append(f"{names}: the simulator predicts the same schedule of the slice as "
                         f"{labels.get(v.config, 'the replayed config')}, so not replayed (their replays would only "
                         "measure the machine's noise: at the SLO's edge a few percent of its speed flips a verdict)")
    return lines


def gain_lines(result) -> list[str]:
    from skistune.config import layer_bits_text
    from skistune.optimize import baseline_outside_space
    from skistune.problem import _value as knob_value
    from skistune.scoring import REFINE_PRECISION, tie

    p, label = result.problem, f"{result.problem.baseline_engine} defaults"
    if result.best and result.best[0].config.effective() == result.baseline.config.effective():
        return [baseline_verdict(result.trials, label)]
    outside = baseline_outside_space(p)
    fixes = [k for k, v in p.full_space.fixed.items() if v != knob_value(p.base, k)]
    lines = [f"the {p.full_space.name} space cannot express the baseline ({label}): "
             f"{', '.join(f'{k} {layer_bits_text(v)}' for k, v in outside.items())} is outside it"
             + (f" (the space fixes {', '.join(fixes)})" if fixes else "")
             + ", so the search never tried it and it cannot rank first on a tie"] if outside else []
    if not result.baseline.feasible and not p.at_capacity:  # (at capacity that is "meets no rate", said below)
        lines.append(f"the baseline ({label}) breaks {', '.join(result.baseline.binding)} in prediction at the "
                     f"workload's rate, where the tuned config meets every constraint: the figures below set a "
                     "feasible config against an infeasible one")
    gain = result.gain()
    for o, tuned, base in zip(p.objectives, result.best[0].values, result.baseline.values):
        name, ratio = o.name, gain[o.name]
        if name == "capacity" and ratio == float("inf"):  # a number of times more than nothing says nothing
            lines.append(f"gain over the baseline ({label}), predicted: capacity {significant(tuned, 4)} req/s "
                         "where the baseline meets the constraints at no rate tried")
        elif tie(p, o, tuned, base):  # (the rule that ranks the baseline first: no gain to claim)
            lines.append(f"against the baseline ({label}), predicted: {name} a tie ({_value(o, tuned)} vs "
                         f"{_value(o, base)}, within {REFINE_PRECISION:.0%}: below what the search resolves)")
        elif name == "quality":  # (a ratio of losses says nothing against a lossless baseline's 0: "x0.00")
            lines.append(f"against the baseline ({label}), predicted: quality loss {_value(o, tuned)} vs "
                         f"{_value(o, base)}")
        else:
            lines.append(f"gain over the baseline ({label}), predicted: {name} x{_fmt(ratio, digits=2)}")
    measured = result.measured_gain()
    if measured:
        base = f"holds every constraint{' too' if measured['tuned_holds'] else ''}" if measured["baseline_holds"] \
            else f"breaks {', '.join(measured['baseline_binding'])}"
        tuned = "holds every constraint" if measured["tuned_holds"] else "breaks a constraint"
        lines.append(f"measured at {significant(measured['rate_rps'])} req/s: the tuned config {tuned}; the baseline "
                     f"{base}")
        if measured["same_schedule"]:  # near the SLO's edge a few percent of the machine's speed flips a verdict
            lines.append("  (on the validation slice the simulator predicts both to run the same schedule: what "
                         "tells these replays apart is the machine's noise, not the configs)")
        else:
            if measured["tuned_holds"] and not measured["baseline_holds"] and measured["baseline_predicted_holds"]:
                lines.append("  (the simulator predicted the baseline to hold at this rate too: its break is the "
                             "machine's noise or the simulator's error at the SLO's edge, not evidence of the gain)")
            tuned_v, base_v = result.validated[0].measured, result.validated[-1].measured
            for o, t, b in zip(p.objectives, tuned_v.values, base_v.values):
                if o.name in measured:
                    tied = " (a tie: within " f"{REFINE_PRECISION:.0%})" if tie(p, o, t, b) else ""
                    # (the slice's, not the search workload's: a few short requests, where a quantized config's
                    # full-precision rings outweigh its KV, read memory x0.13 beside a predicted x1.14)
                    lines.append(f"gain over the baseline, measured on the validation slice: {o.name} "
                                 f"x{_fmt(measured[o.name], digits=2)}"
                                 f"{tied}")
    return lines


def baseline_verdict(trials: int, label: str) -> str:
    """The best config is the baseline: nothing to change, once the search has tried enough configs (the
    default number of trials); after fewer, a verdict of so few trials, with how to add more."""
    found = f"the best config found is the baseline itself ({label}), in {trials} trial{'s' * (trials != 1)}"
    if trials >= DEFAULT_TRIALS:
        return f"{found}: nothing to change for this workload on this hardware"
    tried = "only the baseline was tried" if trials == 1 else f"fewer than the default {DEFAULT_TRIALS}"
    return (f"{found}: too few to conclude that nothing is to change ({tried}); the same command adds trials to "
            "the study (--trials N: how many)")


def infeasible_report(result) -> str | None:
    """The binding constraints, the closest configs, and why no rate worked where that can be told (returned,
    for the JSON summary)."""
    err_console.print(f"[bold red]infeasible:[/] no config met every constraint in {result.trials} trials",
                      highlight=False)
    t = Table(title="Constraints that bind", title_justify="left")
    t.add_column("constraint")
    t.add_column("trials violating it", justify="right")
    for name, n in sorted(result.binding.items(), key=lambda kv: -kv[1]):
        t.add_row(name, f"{n} of {result.trials}")
    console.print(t)
    c = Table(title="Closest to feasible (least total violation; <= 0 is met)", title_justify="left")
    c.add_column("trial")
    names = [q.name for q in result.problem.space.params if not q.is_switch]
    for name in result.closest[0].violations if result.closest else ():
        c.add_column(name, justify="right")
    for e in result.closest:
        c.add_row(str(e.trial), *(f"{v:+.3g}" for v in e.violations.values()))
    console.print(c)
    for e in result.closest:  # below the table, whole: a column of them cut every knob at "…"
        console.print(escape(f"trial {e.trial}: {_diff(e.config, result.problem.base, names)}"), highlight=False,
                      soft_wrap=True)
    lines = [line for line in (why_no_rate_line(result.problem, result.closest), energy_line(result)) if line]
    for line in lines:
        console.print(escape(line), highlight=False, soft_wrap=True)
    return " ".join(lines) or None


def energy_line(result) -> str | None:
    """Why an energy budget binds: in how many trials, and the least energy per token the closest configs
    reach (a lower arrival rate only adds idle power per token: it cannot help, as it can for a latency)."""
    from skistune.objectives import EnergyBudget

    budgets = [c.value.__self__ for c in result.problem.constraints
               if isinstance(getattr(c.value, "__self__", None), EnergyBudget)]
    name = str(budgets[0]) if budgets else None
    if name is None or not result.binding.get(name) or not result.closest:
        return None
    limit = budgets[0].limit_j_per_token
    # (the baseline as refined, at 2% capacity precision, which the tables print: the trials' own figures are at the
    # search's coarser rates, where idle power adds more per token; "0.265 or more" sat beside a base row of 0.252)
    baseline = getattr(result, "baseline", None)
    scored = [*result.closest, *([baseline] if baseline is not None and name in baseline.violations else [])]
    least = min(limit * (1 + e.violations[name]) for e in scored)
    problem = result.problem
    if problem.at_capacity:
        where, rate_advice = "at their capacity", "so a lower arrival rate raises it"
    else:  # (judged at the workload's own rate: there a higher rate spreads the idle power over more tokens)
        where = f"at the workload's rate ({significant(problem.search.base_rps)} req/s)"
        rate_advice = "so a higher arrival rate (--rate) lowers it, up to where an SLO breaks"
    return (f"{name} binds in {result.binding[name]} of {result.trials} trials: the closest configs use "
            f"{least:.3g} J/token or more {where} (x{least / limit:.3g} the budget, "
            f"{problem.profile.power.source} power); idle power counts per token, {rate_advice}: a looser --energy "
            "budget, or a config that spends less per token, can help")


BURSTY_CV = 2.0  # inter-arrival CV above which a workload's bursts, not its mean rate, decide its queues


def why_no_rate_line(problem, closest) -> str | None:
    """Why no arrival rate worked, when the closest configs meet none: an SLO the closest config breaks even
    with each request served alone (no rate can meet it); without a capacity objective, the workload's own rate
    the constraints were checked at; a bursty workload's bursts (scaling the rate stretches every gap, so the
    requests of a burst still arrive together); or requests that outlast the shortest gap between arrivals
    even at the lowest rate the search tries."""
    from skistune.scoring import MIN_RATE_SCALE, outlasting_gaps, served_alone, slos_broken_alone
    from skistune.workloads.stats import workload_stats

    if not closest:
        return None
    names = [o.name for o in problem.objectives]
    if "capacity" in names and any(e.values[names.index("capacity")] > 0 for e in closest):
        return None  # a rate was met: what bound is in the tables
    alone, records = served_alone(problem, closest[0].config)
    if alone.rejections and closest[0].violations.get("served", 0) > 0:  # (what no rate can change comes first)
        from skistune.display import rejection_lines

        # (the default space rarely lands on what such a pool needs, several knobs at once: small batches, low bits,
        # small blocks; the memory-constrained space searches there, and found it for a tester's 96 MiB case)
        space = "" if problem.full_space.name == "memory-constrained" else (
            ", as can the search space made for it (--space memory-constrained"
            + ("" if problem.quality_profile is not None else ", with --quality") + ")")
        return (f"the closest config can never serve {alone.num_rejected} of {alone.num_requests} requests, at any "
                f"rate ({'; '.join(rejection_lines(alone, limit=2))}): a larger KV pool (--kv-memory, "
                "offload.device_memory_fraction), lower KV bits or eviction (with --quality), or shorter prompts "
                f"(--max-input) can help{space}")
    broken = slos_broken_alone(problem, alone)
    if broken:
        return (f"the closest config breaks {_broken_text(broken)} even with each request served alone, nothing "
                "queued or batched with it: no lower arrival rate can help it; a config that serves one request "
                "faster, a looser SLO or shorter prompts (--max-input) can")
    if not problem.at_capacity:
        from skistune.objectives import queue_name

        timing = {str(s) for s in problem.slos} | ({queue_name(problem.max_queue_s)} if problem.max_queue_s else set())
        if not timing & set(closest[0].binding):
            return None
        return (f"without a capacity objective the constraints are checked at the workload's own rate "
                f"({problem.search.base_rps:.3g} req/s), and the closest configs break them there, not alone: "
                "lower it (--rate-scale), or maximise capacity too (--objective capacity,...)")
    lowest = f"{_lowest_rate_rps(problem):.2g} req/s (1/{round(1 / MIN_RATE_SCALE)} of the workload's rate)"
    cv = workload_stats(problem.workload).burstiness
    if cv is not None and cv > BURSTY_CV:
        return (f"the closest configs break the constraints even at {lowest}: its arrivals come in bursts "
                f"(inter-arrival CV {cv:.1f}, 1 for Poisson), and a lower rate stretches the gaps between bursts, "
                "not the requests within one, which still arrive together")
    overlapping, gap_s = outlasting_gaps(problem, records, MIN_RATE_SCALE)
    if overlapping:  # (e.g. 11k-token prompts on a CPU: one request outlasts what were seconds of trace)
        return (f"the closest configs break the constraints even at {lowest}: requests still overlap there, "
                f"{overlapping} of {len(records)} taking longer to serve alone (the closest config, up to "
                f"{_seconds(alone.e2e_s.max)}) than the gap to the next arrival (the shortest: {_seconds(gap_s)}); "
                "the search tries no lower rate; shorter prompts (--max-input), "
                + ("a looser queueing guard (--max-queue) " if problem.max_queue_s else "") + "or faster hardware "
                "can help")
    return None


def _broken_text(broken: dict[str, float]) -> str:
    """SLOs with the latency each reaches: ``ttft:p99<=5000ms (30.2 s)``."""
    return ", ".join(f"{name} ({_seconds(v)})" for name, v in broken.items())


def _seconds(value_s: float) -> str:
    return f"{value_s:.3g} s" if value_s >= 1 else f"{value_s * 1e3:.3g} ms"


def _summary(result, out: Path | None) -> dict:
    from skistune.optimize import baseline_outside_space, replayed_as

    def scored(e):  # (violations: <= 0 is met; the baseline's may break one, say at the workload's own rate)
        return {"config": e.config.to_dict(), "values": list(e.values), "figures": dict(e.figures),
                "violations": dict(e.violations)}

    return {"feasible": result.feasible, "feasible_predicted": result.feasible,
            "feasible_measured": result.measured_feasible, "study": result.study.study_name, "storage": result.storage,
            "trials": result.trials, "simplifying_trials": result.simplifying_trials,
            "out": str(out) if out else None, "notes": result.notes,
            # (what each entry of a "values" list is: a front's figures had come as bare numbers in --objective's order)
            "objectives": [{"name": o.name, "direction": o.direction, "unit": o.unit or None}
                           for o in result.problem.objectives],
            # (every energy figure's basis: "modeled" where no power meter was read, as the tables' J/token say)
            "power_source": result.problem.profile.power.source,
            "best": {**scored(result.best[0]), "config": result.config.to_dict()} if result.best else None,
            "baseline": scored(result.baseline),
            "pareto": [{"trial": e.trial, **scored(e)} for e in result.pareto],
            "closest": [{"trial": e.trial, "config": e.config.to_dict(), "violations": dict(e.violations)}
                        for e in result.closest],
            "gain": result.gain(), "measured_gain": result.measured_gain(), "binding": result.binding,
            "baseline_engine": result.problem.baseline_engine,
            "baseline_outside_space": baseline_outside_space(result.problem),
            "validated": [{"role": v.role, **replayed_as(result, v), "rate_rps": v.rate_rps, "holds": v.holds,
                           "replays": v.replays,
                           "predicted": dict(v.predicted.figures), "measured": dict(v.measured.figures)}
                          for v in result.validated]}


def _search_bar() -> Progress:
    # (the trial count is a field, not rich's M/N column: under the stages after the search, "simplifying the
    # best config 6/6" read as six simplifications)
    return Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
                    TextColumn("{task.fields[count]}"), TimeElapsedColumn(), TextColumn("{task.fields[status]}"),
                    console=err_console, disable=not err_console.is_terminal)  # (a log gets no stale bar line)


def _best_text(objective, best: float | None) -> str:
    return "-" if best is None else _value(objective, best)


# ---- the command ------------------------------------------------------------------------------------------
RequestsOpt = Annotated[Optional[int], typer.Option(
    "--requests", min=1, help=f"requests in a preset (default {DEFAULT_REQUESTS} here)")]
ModelOpt = Annotated[str, typer.Option("--model", help="model preset")]
ProfileOpt = Annotated[Optional[str], typer.Option(
    "--profile", help="hardware profile: a JSON file from `skistune profile`, or a shipped one by name (the profiles/ "
                      "folder's: cpu-smollm2-135m, cuda-llama-3-8b, cuda-llama-3-8b-quick) (default: this machine's, "
                      "measured once and cached)")]
SpaceOpt = Annotated[Optional[str], typer.Option(
    "--space", help="search space: a shipped name (default, vllm, sglang, memory-constrained, long-context) or a "
                    "YAML file")]
TrialsOpt = Annotated[int, typer.Option("--trials", min=1, help="trials this run adds to the study")]
TimeoutOpt = Annotated[Optional[float], typer.Option(
    "--timeout", min=0.001,
    help="seconds the whole command may take: the search gets what the start leaves, then refining, "
         "simplifying and validating the winners stop when it is reached (at most one simulation or replay late; "
         "a note says what was cut short)")]
StorageOpt = Annotated[Optional[str], typer.Option(
    "--storage", help="Optuna storage URL (default: sqlite:///skistune-STUDY.db in this folder)")]
StudyOpt = Annotated[Optional[str], typer.Option(
    "--study", help="study name: resumes it if it exists (default: named after the problem, so the same command "
                    "resumes)")]
JobsOpt = Annotated[int, typer.Option("--jobs", min=1, help="worker processes sharing the study")]
SearchSeedOpt = Annotated[int, typer.Option("--seed", min=0, help="seed of the search")]
WorkloadSeedOpt = Annotated[int, typer.Option("--workload-seed", min=0, help="seed of the workload: presets, "
                                              "generated arrivals, --sample and --jitter")]
ValidateOpt = Annotated[int, typer.Option("--validate", min=0, help="top configs replayed on the real runtime "
                                                                    "(0 skips)")]
TargetOpt = Annotated[Optional[str], typer.Option(
    "--target", help="search only what this engine can deploy: vllm or sglang")]
OutOpt = Annotated[Path, typer.Option("--out", help="where to write the tuned config")]
SamplerOpt = Annotated[str, typer.Option(
    "--sampler", help="auto (TPE with local moves for one objective, NSGA-II for several), tpe, gp, nsga2, random")]
MaxQueueOpt = Annotated[str, typer.Option(
    "--max-queue", help="queueing guard: TTFT p99 at most this much above the same requests served one at a "
                        "time, with a unit: 5s, 500ms; or off")]
KvMemoryOpt = Annotated[Optional[str], typer.Option(
    "--kv-memory", help="memory KV may use on the device, e.g. 256MiB (default: the device's own; 4GiB on a CPU, "
                        "as vLLM's VLLM_CPU_KVCACHE_SPACE): the tuned config's pool is its chosen fraction of it")]


@cli_errors
def optimize(ctx: typer.Context, slo: SloOpt = None, energy: EnergyOpt = None, quality: QualityOpt = None,
             quality_profile: QualityProfileOpt = None, workload: WorkloadOpt = "chat",
             format: FormatOpt = None, skip_bad_rows: SkipBadRowsOpt = False, workload_seed: WorkloadSeedOpt = 0,
             requests: RequestsOpt = None, rate: RateOpt = None, burstiness: BurstinessOpt = None,
             block_tokens: BlockTokensOpt = None, jitter: JitterOpt = None, window: WindowOpt = None,
             first: FirstOpt = None, sample: SampleOpt = None, rate_scale: RateScaleOpt = 1.0,
             length_scale: LengthScaleOpt = 1.0, max_input: MaxInputOpt = None, max_output: MaxOutputOpt = None,
             model: ModelOpt = "smollm2-135m", profile: ProfileOpt = None, space: SpaceOpt = None,
             objective: ObjectiveOpt = None, trials: TrialsOpt = DEFAULT_TRIALS, timeout: TimeoutOpt = None,
             storage: StorageOpt = None, study: StudyOpt = None, jobs: JobsOpt = 1, seed: SearchSeedOpt = 0,
             validate: ValidateOpt = DEFAULT_TOP_K, target: TargetOpt = None, out: OutOpt = Path(DEFAULT_OUT),
             sampler: SamplerOpt = "auto", max_queue: MaxQueueOpt = f"{DEFAULT_MAX_QUEUE_S:g}s",
             kv_memory: KvMemoryOpt = None, json_out: JsonOpt = False) -> None:
    """Find the best KV-cache config for a workload under SLOs, an energy budget and a quality floor:
    search with the simulator, validate the top configs on the real runtime, write the tuned config.

    Exit codes: 0 written; 2 bad input; 3 no config meets the constraints (nothing written); 4 written, but the
    config broke a constraint when validated on the real runtime (the warning names it)."""
    started = time.monotonic()  # (--timeout bounds the whole command)
    import optuna

    from skistune.problem import UnmeetableSLO, build_problem
    from skistune.scoring import Deadline, with_deadline
    from skistune.search import COMMAND_ATTR, SAMPLERS, default_study_name, open_study, running_notes
    from skistune.signals import stopped_by_signal
    from skistune.study_storage import default_storage, open_storage, storage_failures
    from skistune.workloads.synthetic import check_workers_fit

    # a stop before the search (the trace read, a profile measured, the baseline served alone) has written nothing
    before_search = ("the search had not started: nothing written; run the same command to start it",
                     {"out": None, "study": study, "storage": storage})
    with stopped_by_signal(lambda: before_search, json_out):
        optuna.logging.set_verbosity(optuna.logging.ERROR)  # (a failed trial: our own one line)
        check_out_file(out, "--out", _input_files(workload, profile, space, quality_profile,
                                                   None if storage is None else _sqlite_file(storage)))
        check_replaceable(out, "--out")
        if storage is None:  # (before the profile is measured: a tester's read-only folder failed after 43 s of it)
            _check_study_folder(Path.cwd())
        if sampler not in SAMPLERS:
            from skistune.config import did_you_mean

            raise ValueError(f"--sampler {sampler!r}{did_you_mean(sampler, SAMPLERS)}: use {', '.join(SAMPLERS)}")
        w, options = _workload_and_options(
            workload, format=format, skip_bad_rows=skip_bad_rows, workload_seed=workload_seed, requests=requests,
            rate=rate, burstiness=burstiness, block_tokens=block_tokens, jitter=jitter, window=window, first=first,
            sample=sample, rate_scale=rate_scale, length_scale=length_scale, max_input=max_input, max_output=max_output)
        check_workers_fit(len(w), jobs)  # (before the profile is measured)
        chosen_profile = _chosen_profile(profile, model, study, storage)
        try:
            problem = build_problem(w, slo=slo or (), objective=",".join(objective or ["capacity"]), energy=energy, quality=quality or (),
                                    model=model, profile=chosen_profile, space=space,
                                    target=target, max_queue_s=parse_max_queue(max_queue),
                                    quality_profile=quality_profile, kv_memory=kv_memory)
        except UnmeetableSLO as exc:  # infeasible before any search: exit 3, as when no trial meets it
            _unmeetable(exc, json_out)
        name = study or default_study_name(problem)
        resume = f"--study {shlex.quote(name)}" + (f" --storage {shlex.quote(storage)}" if storage else "")  # (to paste)
        storage = storage or default_storage(name)
        # the study's own file, now that its name is known, existing or about to be (a tester's --out skistune-NAME.db
        # replaced the study with the tuned config: every trial lost)
        db = _sqlite_file(storage)
        if db is not None and Path(db).resolve() == out.resolve():
            raise ValueError(f"--out {out}: is the study's database ({storage}), which writing would overwrite "
                             "(give another file name)")
        # a bad URL, or a study of another problem under this name, is bad input: one line before the progress bar
        with _resumable(ctx, name), storage_failures(storage, name):
            existing = open_study(problem, open_storage(storage), name, sampler=None)
            # (the command that searches this study again, for `skistune worker`'s last line to name)
            existing.set_user_attr(COMMAND_ATTR, command_line(ctx, study=name))
        print_notes(w)  # (every input checked: what the workload's reader noticed, before the search)
        _say_resumed(existing, name, trials)
        for note in running_notes(existing):  # (another process's trials, or a killed one's)
            err_console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
        _warn_broken_alone(with_deadline(problem, Deadline.after(timeout, started)))
    with _resumable(ctx, name):
        result = _solve_with_progress(problem, json_out=json_out, rerun=command_line(ctx, study=name), n_trials=trials,
                                      timeout=timeout, storage=storage, study_name=name, n_jobs=jobs, seed=seed,
                                      sampler=sampler, validate=validate, started=started)
    _say_unseeded(ctx, result, seed, jobs)
    _report(dataclasses.replace(result, workload_options=options), out, json_out, resume)


def _workload_and_options(spec: str, *, workload_seed: int, rate: float | None, jitter: float | None,
                          **options: Any) -> tuple[Any, dict[str, Any]]:
    """The workload, and the options that built it as the tuned file records them (`evaluate.workload_options`:
    evaluate's note rebuilds the workload from them)."""
    from skistune.evaluate import workload_options

    w = _workload(spec, seed=workload_seed, rate_rps=rate, jitter_s=jitter, **options)
    recorded = {**options, "requests": _requests(spec, options["requests"], options["first"])}
    return w, workload_options(spec, workload_seed=workload_seed, rate=rate, jitter=jitter, **recorded)


def _chosen_profile(profile: str | None, model: str, study: str | None, storage: str | None) -> Any:
    """The profile to build the problem with: the one given, else (resuming a study) the one the study was made
    with, not today's cache, else this machine's (measured when the problem is built)."""
    from skistune.study_recipe import stored_profile
    from skistune.study_storage import default_storage

    if profile is None and study is not None:
        stored = stored_profile(storage or default_storage(study), study)
        if stored is not None:
            err_console.print(escape(f"note: study {study} keeps the profile it was created with ({stored.name}, "
                                     f"measured {stored.fingerprint.date[:10]}); --profile FILE starts another study"),
                              highlight=False, soft_wrap=True)
            return stored
    return functools.partial(profile_or_measure, profile, model)


def _unmeetable(exc, json_out: bool) -> None:
    """An SLO no config meets even with each request alone, found before any search: exit 3, as when no trial
    meets the constraints."""
    err_console.print(f"[bold red]infeasible:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    if json_out:  # (the keys of the other infeasible summary that mean something before any trial)
        print_json({"feasible": False, "feasible_predicted": False, "feasible_measured": None, "trials": 0,
                    "out": None, "best": None, "pareto": [], "binding": {exc.slo: 0}, "closest": [],
                    "why": str(exc), "unmeetable": str(exc)})
    raise typer.Exit(EXIT_INFEASIBLE) from None


def _say_unseeded(ctx, result, seed: int, jobs: int) -> None:
    """Where --seed was asked for (or --jobs ran workers), say when it does not reproduce the search, as the tuned
    file's provenance does."""
    seed_given = getattr(ctx.get_parameter_source("seed"), "name", None) == "COMMANDLINE"
    if result.unseeded and (seed_given or jobs > 1):
        err_console.print(escape(f"note: --seed {seed} does not reproduce this search: {result.unseeded}"),
                          highlight=False, soft_wrap=True)


@contextlib.contextmanager
def _resumable(ctx, study: str) -> Iterator[None]:
    """A storage write that failed (a full disk) becomes one line: what failed, what is kept, how to resume."""
    from skistune.study_storage import StorageWriteError

    try:
        yield
    except StorageWriteError as exc:
        raise OSError(exc.line(command_line(ctx, study=study))) from None


def _check_study_folder(folder: Path) -> None:
    """The default storage is a SQLite file in the working folder: SQLite writes the file and its journal
    there, for a new study as for a resumed one."""
    from skistune.study_storage import folder_refusal

    why = folder_refusal(folder)
    if why is not None:
        raise ValueError(f"the study is kept in a SQLite file in the working folder {folder}, which cannot take a "
                         f"new file ({why}): run from a writable folder, or give --storage URL")


def command_line(ctx, **given: str) -> str:
    """The command as it was typed, read back from click's context (each parameter given on the command line,
    in the command's own order), with ``given`` options (``study=NAME``: ``--study NAME``) added where they were
    not: the command that resumes the same study, to paste."""
    words = ["skistune", ctx.info_name]
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name)
        value = ctx.params.get(param.name)
        if getattr(source, "name", None) != "COMMANDLINE" or value is None:
            continue
        if param.param_type_name == "argument":
            words += [str(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
            continue
        option = max(param.opts, key=len)
        if getattr(param, "is_flag", False):
            words += [option] if value else list(param.secondary_opts[:1])
        else:
            words += [w for v in (value if isinstance(value, (list, tuple)) else [value]) for w in (option, str(v))]
    for name, value in given.items():
        if getattr(ctx.get_parameter_source(name), "name", None) != "COMMANDLINE":
            words += [f"--{name.replace('_', '-')}", value]
    return shlex.join(words)


FS_IOC_GETFLAGS = 0x80086601  # Linux ioctl(2): a file's attributes, as lsattr reads them
FS_IMMUTABLE_FL, FS_APPEND_FL = 0x10, 0x20  # chattr +i, chattr +a: no rename over the file, even by root


def check_replaceable(out: Path, option: str) -> None:
    """Refuse an existing file that cannot be written over, before the work (a tester's immutable --out was found
    after a 19 s search): one marked immutable or append-only (chattr +i, +a), which the rename of
    `skistune.paths.write_atomic` cannot replace, even as root. Read-only: the file is opened to read its flags,
    never created or changed. (The folder's own refusal of new files is `check_out_file`'s.)"""
    import fcntl
    import os
    import struct

    target = Path(os.path.realpath(out))  # (a link is written through: its target is replaced)
    if not target.is_file():
        return
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:  # (unreadable: the write says so, if it fails)
        return
    try:
        flags = struct.unpack("i", fcntl.ioctl(fd, FS_IOC_GETFLAGS, bytes(8))[:4])[0]
    except OSError:  # (a file system without such flags: tmpfs, NFS)
        return
    finally:
        os.close(fd)
    for flag, what, lift in ((FS_IMMUTABLE_FL, "immutable", "-i"), (FS_APPEND_FL, "append-only", "-a")):
        if flags & flag:
            raise ValueError(f"{option} {out}: the existing file is {what} (chattr +{lift[1]}), so it cannot be "
                             f"replaced: give another file, or lift the flag (chattr {lift} {out}, as root)")


def _input_files(*paths) -> tuple[Path, ...]:
    """The files among a command's inputs (names of presets, spaces and None left out): --out must not be one
    of them (a tester overwrote the trace, the profile and the study database with the tuned config)."""
    return tuple(Path(p) for p in paths if isinstance(p, (str, Path)) and str(p) and Path(p).is_file())


def _sqlite_file(storage: str) -> str | None:
    """The file of an SQLite storage URL (sqlite:///relative or sqlite:////absolute), else None."""
    return storage[len("sqlite:///"):] if storage.startswith("sqlite:///") else None


def _say_resumed(study, name: str, trials: int) -> None:
    """One line when the study has trials already: the search adds to them, and the result ranks them all."""
    from skistune.optimize import trial_counts

    searched, simplifying = trial_counts(study)  # (the rest tried a winner's knob groups at the baseline's values)
    done = searched + simplifying
    if done:
        split = f" ({searched} searched, {simplifying} simplifying a winner)" if simplifying else ""
        err_console.print(escape(f"resuming study {name}: {done} finished trial{'s' * (done != 1)}{split}, running "
                                 f"{trials} more"), highlight=False, soft_wrap=True)


def _warn_broken_alone(problem) -> None:
    """Before a long search: an SLO the baseline breaks even with each request served alone (a TTFT limit
    under the prefill of the workload's longest prompts) is likely to leave every config infeasible."""
    from skistune.scoring import TimeUp, served_alone, slos_broken_alone

    label = f"{problem.baseline_engine}'s defaults"
    try:
        with err_console.status(f"checking {label} with each request served alone"):  # (seconds on a big trace)
            alone = served_alone(problem, problem.base)[0]
    except TimeUp:  # (--timeout reached already: the search says so)
        return
    if alone.num_finished == 0:  # (its latencies are NaN: "breaks p99 (nan ms)" had named the wrong cause)
        why = next(iter(alone.rejections.values()), "no request finished")
        print_warning(f"{label} serve no request of the workload, even alone ({why}): a config must hold more KV, "
                      "or give requests that fit (the search goes on; Ctrl-C keeps its trials)")
        return
    broken = slos_broken_alone(problem, alone)
    if broken:
        print_warning(f"{label} break {_broken_text(broken)} even with each request served alone: a config "
                      "must serve a request alone faster than they do to meet it (the search goes on; Ctrl-C keeps "
                      "its trials)")


def _solve_with_progress(problem, *, n_trials: int, rerun: str, json_out: bool = False, **options: Any):
    """`skistune.optimize.solve` under a progress bar (trials done, feasible count, best so far, then the
    refinement and validation stages); Ctrl-C (exit 130) or SIGTERM (exit 143) keeps the finished trials and
    says where, how many this run added, and the command that resumes (``rerun``)."""
    from skistune.optimize import solve
    from skistune.signals import Terminated, interrupted_exit_code, sigterm_as_interrupt

    feasible, done = [0], [0]

    def on_progress(p) -> None:
        feasible[0], done[0] = p.feasible, p.done
        bar.update(task, completed=p.done, count=f"{p.done}/{n_trials}",
                   status=f"feasible {p.feasible}  best {_best_text(problem.objectives[0], p.best)}")

    def on_stage(message: str) -> None:  # (the search's best, at its precision, is not what the table shows)
        bar.update(task, description=message, count="", status=f"after {done[0]} trials, feasible {feasible[0]}")

    try:
        with sigterm_as_interrupt(), _search_bar() as bar:
            task = bar.add_task("search", total=n_trials, status="", count=f"0/{n_trials}")
            return solve(problem, n_trials=n_trials, progress=on_progress, on_stage=on_stage, **options)
    except KeyboardInterrupt as exc:
        stopped = "terminated" if isinstance(exc, Terminated) else "interrupted"
        study = options.get("study_name")
        err_console.print(escape(f"{stopped}: study {study} keeps its finished trials ({done[0]} from this run; "
                                 f"nothing written); rerun `{rerun}` to resume"), highlight=False, soft_wrap=True)
        if json_out:  # (a script reading the last line learns why there is no result, and where the trials are)
            print_json({"stopped": stopped, "exit_code": interrupted_exit_code(exc), "out": None, "study": study,
                        "storage": options.get("storage"), "trials_this_run": done[0], "rerun": rerun})
        raise typer.Exit(interrupted_exit_code(exc)) from None


def _report(result, out: Path, json_out: bool, resume: str) -> None:
    for note in result.notes:
        err_console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
    if not result.feasible:
        why = infeasible_report(result)
        if json_out:
            print_json({**_summary(result, None), "why": why})
        raise typer.Exit(EXIT_INFEASIBLE)
    # the tuned file first: what follows is printing, which no reader going away (`| head -1`) may cost it
    name = result.study.study_name
    previous = replaced_file(out)  # (read before the file is written over)
    try:
        path = result.write(out)
    except OSError as e:  # (after the search: say the trials are not lost, and how to get the file)
        raise OSError(f"{e.strerror or e}; the study {name} in {result.storage} keeps its trials: the same "
                      f"command with {resume} writes the file (`skistune report {name}` shows them)") from None
    console.print(best_table(result))
    for line in knob_lines(result):
        console.print(escape(line), highlight=False, soft_wrap=True)
    front = pareto_table(result)
    if front is not None:
        console.print(front)
        for line in pareto_knob_lines(result):
            console.print(escape(line), highlight=False, soft_wrap=True)
    if result.validated:
        console.print(validation_table(result))
        for line in twin_lines(result):
            console.print(escape(line), highlight=False)
    for line in gain_lines(result):
        console.print(escape(line), highlight=False)
    console.print(escape(f"wrote {path} (study {name} in {result.storage}; the same command with {resume} adds "
                         "trials)"), highlight=False, soft_wrap=True)
    if previous is not None:  # (two runs in one folder both write skistune-tuned.yaml: the second says so)
        err_console.print(f"[yellow]note:[/] {escape(replaced_line(path, previous, name))}", highlight=False,
                          soft_wrap=True)
    broke = validation_warning(result)
    if broke:
        print_warning(broke)
    if json_out:
        print_json({**_summary(result, path), "replaced": previous})
    if broke:
        raise typer.Exit(EXIT_BROKE_WHEN_VALIDATED)


REPLACED_READ_BYTES = 4 << 20  # of an existing --out file, read to tell whether it is a tuned config


def replaced_file(out: Path) -> dict | None:
    """What ``out`` holds before it is written over: None when there is no such file, else ``{"study": the study
    its provenance names (None when it is no skistune tuned config), "created": when that was written}``."""
    import yaml

    from skistune.config import load_yaml

    if not out.is_file():
        return None
    try:
        with open(out, "rb") as f:
            data = load_yaml(f.read(REPLACED_READ_BYTES).decode("utf-8"))  # (bounded: any file may sit there)
    except (OSError, ValueError, yaml.YAMLError):  # (unreadable, not UTF-8, not YAML: not a tuned config)
        data = None
    provenance = data.get("provenance") if isinstance(data, dict) else None
    search = provenance.get("search") if isinstance(provenance, dict) else None
    tuned = isinstance(search, dict) and str(provenance.get("tool", "")).startswith("skistune")
    return {"study": str(search.get("study")) if tuned else None,
            "created": str(provenance.get("created")) if tuned and provenance.get("created") else None}


def replaced_line(path: Path, previous: dict, study: str) -> str:
    """One line on the file this run wrote over: whose tuned config it was."""
    if previous["study"] is None:
        return f"{path} existed and was replaced (it was not a skistune tuned config)"
    when = f", written {previous['created']}" if previous["created"] else ""
    same = "this same study, an earlier run" if previous["study"] == study else f"study {previous['study']}"
    return f"{path} existed and was replaced: it held the tuned config of {same}{when}"


def _quality_pair(name: str, v) -> str | None:
    """A quality floor's predicted figure (what the floor was checked against: the 95% bound) and its held-out
    measurement, as the floor reads them (a tester had read "margin predicted -0.0604, measured +1.32")."""
    keys = {"worst:ppl": ("quality_worst_bound", "quality_worst", "worst window"),
            "ppl": ("quality_bound", "quality_loss", "mean")}
    for prefix, (bound, held, what) in keys.items():
        if name.startswith(prefix):
            predicted, measured = v.predicted.figures.get(bound), v.measured.figures.get(held)
            if predicted is None or measured is None:
                return None
            return f"{what} predicted {predicted:+.2%} (95% bound), held-out {measured:+.2%}"
    if name.startswith("needle"):
        predicted, measured = v.predicted.figures.get("needle_retained"), v.measured.figures.get("needle_retained")
        if predicted is None or measured is None:
            return None
        return f"passkeys kept: predicted {predicted:.0%}, held-out {measured:.0%}"
    return None


def validation_warning(result) -> str | None:
    """When the written config broke a constraint replayed on the real runtime: each broken constraint with
    its predicted and measured figure (None when it held, or was not validated)."""
    if result.measured_feasible is not False:
        return None
    v = result.validated[0]  # (the written config: validation's measured order puts it first)
    parts = []
    for name in v.broken:
        predicted, measured = v.predicted.figures["slo_s"].get(name), v.measured.figures["slo_s"].get(name)
        quality = _quality_pair(name, v)
        if predicted is not None and measured is not None:
            parts.append(f"{name} (predicted {_seconds(predicted)}, measured {_seconds(measured)})")
        elif quality is not None:
            parts.append(f"{name} ({quality})")
        else:  # (no latency or quality figure by that name: the margins, <= 0 met)
            parts.append(f"{name} (margin predicted {v.predicted.violations.get(name, 0.0):+.3g}, measured "
                         f"{v.measured.violations[name]:+.3g}; <= 0 is met)")
    return (f"the written config broke {', '.join(parts)} on the real runtime at {significant(v.rate_rps)} req/s: it "
            f"is the search's best, met in prediction only (exit {EXIT_BROKE_WHEN_VALIDATED})")
