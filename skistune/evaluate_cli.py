"""`skistune evaluate`: metrics of one config on one workload, predicted (simulator) or measured (real
runtime), in the same table and JSON. The workload options are the shared aliases of `workload show`."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import typer

from rich.markup import escape

from skistune.cli_base import JsonOpt, cli_errors, console, err_console, print_json
from skistune.export import FALLBACK_MODEL
from skistune.export_cli import TunedModelOpt
from skistune.optimize_cli import ProfileOpt, profile_or_measure
from skistune.signals import stopped_by_signal
from skistune.workloads.cli import (BlockTokensOpt, BurstinessOpt, FirstOpt, FormatOpt, JitterOpt,
                                    LengthScaleOpt, MaxInputOpt, MaxOutputOpt, RateOpt, RateScaleOpt, RequestsOpt,
                                    SampleOpt, SeedOpt, SkipBadRowsOpt, WindowOpt, WorkloadOpt, parse_window,
                                    print_notes)


@cli_errors
def evaluate(
    config: Annotated[Path, typer.Argument(metavar="CONFIG", help="KV config file (YAML/JSON), e.g. one written by optimize")],
    workload: WorkloadOpt = "chat",
    mode: Annotated[str, typer.Option(help="simulate (hardware profile), run (real runtime), or compare (both, "
                                      "and the prediction's error)")] = "simulate",
    model: TunedModelOpt = None,
    profile: ProfileOpt = None,
    format: FormatOpt = None,
    skip_bad_rows: SkipBadRowsOpt = False,
    seed: SeedOpt = 0,
    requests: RequestsOpt = None,
    rate: RateOpt = None,
    burstiness: BurstinessOpt = None,
    block_tokens: BlockTokensOpt = None,
    jitter: JitterOpt = None,
    window: WindowOpt = None,
    first: FirstOpt = None,
    sample: SampleOpt = None,
    length_scale: LengthScaleOpt = 1.0,
    max_input: MaxInputOpt = None,
    max_output: MaxOutputOpt = None,
    rate_scale: RateScaleOpt = 1.0,
    speed_check: Annotated[bool, typer.Option(help="with --mode compare: time a few of the profile's steps again "
                                              "after the replay, to tell the machine's drift from the model's "
                                              "error")] = True,
    json_out: JsonOpt = False,
) -> None:
    """Metrics of one config on one workload: predicted by the simulator or measured on the real runtime
    (same table, same JSON), so that any prediction can be checked."""
    from skistune.config import did_you_mean, load_config, load_provenance
    from skistune.display import metrics_table, prefetch_mode, summary_table
    from skistune.evaluate import (MODES, energy_figure, evaluate as run_evaluate, fit_workload, hardware_profile,
                                   check_runtime_memory, other_model_note, power_model, predicted_run_s, quality_figure,
                                   run_machine, sim_target, tier_notes, tuned_workload_note, workload_options,
                                   workload_requests)
    from skistune.export.registry import tuned_model
    from skistune.workloads import load_workload

    if mode not in (*MODES, "compare"):
        raise ValueError(f"--mode {mode!r}{did_you_mean(mode, (*MODES, 'compare'))}: use simulate, run or compare")
    # Ctrl-C (exit 130) or SIGTERM (143) ends it as it ends optimize's search: a line on stderr and, with --json,
    # {"stopped": ..., "exit_code": ..., "mode": ...} as the last line (a script reading it learns why there are
    # no figures)
    stopped = "a simulation" if mode == "simulate" else "a replay"  # (what was cut short, for the line)
    with stopped_by_signal(lambda: (f"no figures ({stopped} stopped part way is not reported)", {"mode": mode}),
                           json_out):
        cfg = load_config(str(config))
        provenance = load_provenance(config)
        # (a tuned file's own model unless told: export's rule; a file tuned for llama-3-8b had been evaluated for
        # smollm2-135m, silently)
        asked, model = model, tuned_model(model, provenance, config)
        if asked is None and model != FALLBACK_MODEL:  # (said first: a profile measured for it, or a run, may fail)
            err_console.print(escape(f"note: evaluating for {model}, the model {config} was tuned for (its "
                                     "provenance; --model names another)"), highlight=False, soft_wrap=True)
        # built without --rate-scale first: what a tuned file's digest is compared with (`tuned_workload_note`)
        unscaled = load_workload(
            workload, format=format, skip_bad_rows=skip_bad_rows, seed=seed, requests=requests, rate_rps=rate,
            burstiness=burstiness, block_tokens=block_tokens, jitter_s=jitter, window_s=parse_window(window),
            first=first, sample=sample, length_scale=length_scale, max_input=max_input, max_output=max_output)
        w = fit_workload(load_workload(unscaled, rate_scale=rate_scale), model)
        # the profile and the runtime are checked before the workload's notes are printed: bad input is one line
        with fingerprint_warnings() as fingerprint_notes:
            prof = hardware_profile(model, profile_or_measure(profile, model)) if mode != "run" else None
            # (a profile of another model is refused here, not after the notes)
            target = sim_target(model, prof) if prof is not None else None
            # (a run is not metered: its energy is the power model's, which never needs a profile measured first; a
            # profile given to a run is read for that model, and named in its JSON)
            given = hardware_profile(model, profile) if mode == "run" and profile is not None else prof
        power = given.power if given is not None else power_model(model, profile)
        runtime = None
        if mode != "simulate":
            from skistune.profile.measure import DTYPES
            from skistune.runtime.kv_store import check_fits_memory
            from skistune.runtime.llm import Runtime

            # (the engine checks the tier it sizes from this when a replay starts: after the notes)
            check_fits_memory(cfg.offload.host_kv_bytes, "offload.host_kv_bytes", "host tier")
            device = prof.device if prof is not None else "cpu"  # a comparison replays where the profile was measured
            check_runtime_memory(model, device)
            with err_console.status(f"loading {model}"):
                runtime = Runtime.from_preset(model, cfg, device=device, dtype=DTYPES[device])
            if mode == "compare":  # (the replay checks the profile's predictions: it runs the steps it timed)
                prof.run_as_measured(runtime)
        print_notes(w)
        options = workload_options(workload, format=format, skip_bad_rows=skip_bad_rows, workload_seed=seed,
                                   requests=requests, rate=rate, burstiness=burstiness, block_tokens=block_tokens,
                                   jitter=jitter, window=window, first=first, sample=sample,
                                   length_scale=length_scale, max_input=max_input, max_output=max_output,
                                   rate_scale=rate_scale)
        tuned = tuned_workload_note(provenance, unscaled, rate_scale, options)
        other_model = other_model_note(model, provenance, config) if asked is not None else None
        # (a run refuses a host tier or a CPU's device pool larger than the memory before this, with an error:
        # `check_fits_memory`; a disk tier larger than the disk's free space is noted in every mode; another model
        # than the tuned file's first: it bears on every figure)
        notes = [n for n in [other_model] if n] + tier_notes(cfg, mode, prof, target) + [n for n in [tuned] if n]
        # (on stderr, as the workload's notes and optimize's: --json's last line stays the one object)
        for note in notes:
            err_console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
        reqs = workload_requests(w, model, seed)
        if mode == "compare":
            _compare(cfg, reqs, w, model, prof, runtime, speed_check, json_out, notes, fingerprint_notes)
            return
        if mode == "run":  # how long it will take, said before it starts (a default run had taken hours)
            estimate = predicted_run_s(cfg, reqs, model, runtime.model.device.type, given)
            _print_real_time_note(len(reqs), w.duration_s, estimate)
            with run_progress(reqs, estimate[0] if estimate else None) as on_progress:
                metrics = run_evaluate(cfg, reqs, model=model, mode=mode, runtime=runtime, on_progress=on_progress)
        else:
            with err_console.status(f"simulating {len(reqs)} requests"):
                metrics = run_evaluate(cfg, reqs, model=model, mode=mode, profile=prof)
    label = f"predicted (simulator) for {profiled_machine(prof)}" if mode == "simulate" else "measured (runtime)"
    energy = energy_figure(metrics, power, measured_time=mode == "run")
    quality = quality_figure(cfg, model, reqs)
    console.print(metrics_table(metrics, f"{model} on {w.label()}: {label}"))
    console.print(summary_table(metrics, energy, prefetch_mode(cfg), quality))
    if json_out:
        # the same keys in both modes: a run's machine is this one, and its profile the one given (for the power
        # model), if any
        where = ({"profile": prof.name, "device": prof.device, "machine": profiled_machine(prof)} if prof else
                 {"profile": given.name if given is not None else None, "device": runtime.model.device.type,
                  "machine": run_machine(runtime.model.device.type)})
        print_json({"mode": mode, "model": model, **where, **_workload_fields(w), "metrics": metrics.to_dict(),
                    "energy": energy, "quality": quality, "notes": notes,
                    # (a profile measured elsewhere: the warning lines, which had been on stderr alone)
                    "warnings": fingerprint_notes})


REAL_TIME_NOTE_S = 10.0  # a run whose arrivals span this long says so first (it had looked hung for 100 s)
LONG_RUN_S = 600.0  # a run predicted to take this long says how to shorten it


def real_time_note(n_requests: int, span_s: float, estimate: tuple[float, str] | None) -> str | None:
    """What a run will take, before it starts (None: under `REAL_TIME_NOTE_S`, nothing to say): its arrivals'
    span, a lower bound since they are replayed in real time, and the simulator's prediction (``estimate``:
    `evaluate.predicted_run_s`), with how to shorten a long one. A default run of 2,000 chat requests arrives
    over 6 minutes and is predicted to take 1.6 h (shipped CPU profile) to 5.7 h (a 2-core host's quick profile):
    it had run for hours behind a spinner."""
    from skistune.display import format_duration

    predicted_s = estimate[0] if estimate is not None else 0.0
    if max(span_s, predicted_s) < REAL_TIME_NOTE_S:
        return None
    text = f"a run replays the arrivals in real time: these {n_requests} requests arrive over {span_s:,.0f} s"
    if estimate is not None:
        text += (f"; the simulator predicts the run takes about {format_duration(predicted_s)} "
                 f"(profile {estimate[1]})")
        if predicted_s >= LONG_RUN_S:
            text += ": fewer requests (--requests) or a lower rate (--rate-scale) make it shorter"
    return text


def _print_real_time_note(n_requests: int, span_s: float, estimate: tuple[float, str] | None) -> None:
    note = real_time_note(n_requests, span_s, estimate)
    if note is not None:  # (on stderr whether or not it is a terminal: the progress display shows only on one)
        err_console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)


@contextlib.contextmanager
def run_progress(requests, predicted_s: float | None = None):
    """A run's progress on a terminal, where the spinners show: requests done (finished or rejected) of all,
    the wall time elapsed and the time left (`evaluate.run_eta_s`, ``predicted_s`` before any request has
    finished). Yields `evaluate.evaluate`'s ``on_progress``, None off a terminal (nothing is polled then)."""
    import time

    if not err_console.is_terminal:  # (the progress shows on stderr)
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from skistune.display import EtaColumn
    from skistune.evaluate import run_eta_s

    arrivals_end_s = max((r.arrival_s for r in requests), default=0.0)
    progress = Progress(TextColumn("serving"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
                        TimeElapsedColumn(), EtaColumn(), console=err_console, transient=True)
    task = progress.add_task("serving", total=len(requests))
    start = time.monotonic()

    def update(done: int, total: int) -> None:
        eta_s, lower = run_eta_s(done, total, time.monotonic() - start, arrivals_end_s, predicted_s)
        progress.update(task, completed=done, eta_s=eta_s, eta_lower_bound=lower)

    update(0, len(requests))  # (before the first frame: it had read "ETA ?" with a prediction at hand)
    with progress:
        yield update


def profiled_machine(prof) -> str:
    """The machine a prediction is for: the profile's GPU or CPU and its name (an H200 predicted from a
    laptop says so, rather than leaving it to the warning that the profile was measured elsewhere)."""
    return f"{prof.fingerprint.chip} (profile {prof.name})"


@contextlib.contextmanager
def fingerprint_warnings():
    """The messages of the profile warnings (a profile measured on another machine) given inside, shown as warnings
    still: a list, for the JSON's notes."""
    import warnings

    from skistune.profile import FingerprintWarning

    messages: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FingerprintWarning)
        try:
            yield messages
        finally:
            messages += [str(w.message).strip() for w in caught if issubclass(w.category, FingerprintWarning)]
    for w in caught:  # (shown as they would have been: one warning line each under `cli_errors`)
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def _workload_fields(w) -> dict:
    """What was evaluated, for --json: the source, the transforms applied to it (context caps included) and
    the digest of the requests that ran."""
    return {"workload": w.source, "transforms": list(w.transforms), "workload_notes": list(w.notes),
            "workload_digest": w.digest()}


def _compare(cfg, reqs, w, model: str, prof, runtime, speed_check: bool, json_out: bool,
             notes: tuple[str, ...] | list[str] = (), profile_warnings: tuple[str, ...] | list[str] = ()) -> None:
    """The prediction and the measurement of the same requests, each figure's error, and (``speed_check``)
    how fast this machine runs the profile's own steps now: on a shared host that drift alone can be tens of
    percent, which the error table cannot tell from the simulator's. ``notes``: printed before, for --json;
    ``profile_warnings``: the profile's (measured elsewhere), shown as warnings, for --json."""
    from skistune.display import rejection_lines
    from skistune.evaluate import compare_metrics, energy_figure, evaluate as run_evaluate, relative_error

    with err_console.status(f"simulating {len(reqs)} requests"):
        predicted = run_evaluate(cfg, reqs, model=model, mode="simulate", profile=prof)
    _print_real_time_note(len(reqs), w.duration_s, (predicted.duration_s, prof.name))
    with run_progress(reqs, predicted.duration_s) as on_progress:
        measured = run_evaluate(cfg, reqs, model=model, mode="run", runtime=runtime, on_progress=on_progress)
    check = None
    if speed_check:
        from skistune.profile.check import speed_check as time_again

        with err_console.status("timing a few of the profile's steps again"):
            check = time_again(prof, runtime)
    rows = compare_metrics(predicted, measured)
    energy = {"predicted": energy_figure(predicted, prof.power),
              "measured": energy_figure(measured, prof.power, measured_time=True)}
    energy["error"] = relative_error(energy["predicted"]["j_per_token"], energy["measured"]["j_per_token"])
    console.print(comparison_table(rows, predicted, measured,
                                   f"{model} on {w.label()}: predicted (simulator) / measured (runtime)", energy))
    for which, m in (("predicted", predicted), ("measured", measured)):
        for line in rejection_lines(m):
            console.print(f"rejected ({which}): {line}", highlight=False, soft_wrap=True)
    console.print(f"energy, predicted: {energy['predicted']['basis']}; measured: {energy['measured']['basis']}",
                  highlight=False, soft_wrap=True)
    if prof.power.modeled:
        console.print(f"note: {prof.power.modeled_note}", highlight=False, soft_wrap=True)
    at_speed = None
    if check is not None:
        console.print(check.summary_line(), highlight=False, soft_wrap=True)
        at_speed = _errors_at_checked_speed(cfg, reqs, model, prof, check, measured)
        console.print("the prediction's errors with the profile's steps at the speed just checked (the machine's "
                      "drift taken out): " + ", ".join(f"{name} {e:+.0%}" for name, e in at_speed.items()
                                                      if e is not None), highlight=False, soft_wrap=True)
    for note in predicted.notes:
        console.print(f"note (prediction): {note}", highlight=False, soft_wrap=True)
    if json_out:
        # (the tier rows' errors too, as the table shows them: they had been in the table only)
        tiers = {name: relative_error(f(predicted), f(measured)) for name, _, f, _ in tier_figures(predicted, measured)}
        print_json({"mode": "compare", "model": model, "profile": prof.name, "device": prof.device,
                    "machine": profiled_machine(prof), **_workload_fields(w),
                    "predicted": predicted.to_dict(), "measured": measured.to_dict(),
                    "errors": {**{r["figure"]: r["error"] for r in rows}, "energy": energy["error"], **tiers},
                    "energy": energy, "speed_check": check.to_dict() if check is not None else None,
                    "errors_at_checked_speed": at_speed,
                    "notes": list(notes), "warnings": list(profile_warnings)})


def _errors_at_checked_speed(cfg, reqs, model: str, prof, check, measured) -> dict[str, float | None]:
    """Each figure's error once the prediction is made again with the profile's steps at the speed ``check``
    timed (`profile.check.cost_at_speed`): what is left is the simulator's own error (approximately: the check
    follows the replay, and the machine's speed may have moved during it)."""
    from dataclasses import replace

    from skistune.evaluate import compare_metrics, sim_target
    from skistune.profile.check import cost_at_speed
    from skistune.simulator import simulate

    target = sim_target(model, prof)
    again = simulate(cfg, reqs, replace(target, step_cost=cost_at_speed(target.step_cost, [check.to_dict()])))
    return {row["figure"]: row["error"] for row in compare_metrics(again, measured)}


# what the tiers did, in the compare table and its JSON errors: (figure, unit, value in that unit, decimals);
# to the microsecond: a run's few block copies take tens of them, which 0.1 ms would show as 0.0
TIER_FIGURES = (("tier transfer time", "ms", lambda m: 1e3 * m.tiers.transfer_s, 3),
                ("tier stall time", "ms", lambda m: 1e3 * m.tiers.stall_s, 3),
                ("tier bytes moved", "MiB", lambda m: sum(m.tiers.moved_bytes.values()) / 2 ** 20, 1))


def tier_figures(predicted, measured) -> tuple:
    """`TIER_FIGURES` where both sides have tiers (each fits its own), else none."""
    return TIER_FIGURES if predicted.tiers is not None and measured.tiers is not None else ()


def comparison_table(rows: list[dict], predicted, measured, title: str, energy: dict | None = None):
    """Predicted, measured and the relative error of each figure (ms for latencies, MiB for the KV peak),
    energy per token (``energy``: predicted and measured `evaluate.energy_figure`s with their error), then
    the counts that tell two schedules apart. A figure that does not exist (no token gap with one output
    token each, no request finished) is ``-``, as in the simulate and run tables."""
    from skistune.display import Table

    from skistune.display import format_figure
    from skistune.evaluate import FIDELITY_FIGURES, relative_error

    units = {name: unit for name, unit, _ in FIDELITY_FIGURES}
    scale = {"ms": 1e3, "MiB": 2 ** -20, "tok/s": 1.0}
    t = Table(title=title, title_justify="left")
    for col in ("figure", "predicted", "measured", "error"):
        t.add_column(col, justify="left" if col == "figure" else "right")
    for r in rows:
        unit = units[r["figure"]]
        name = r["figure"] if unit in r["figure"] else f"{r['figure']} ({unit})"
        error = "-" if r["error"] is None else f"{r['error']:+.1%}"
        t.add_row(name, format_figure(r["predicted"] * scale[unit]), format_figure(r["measured"] * scale[unit]), error)
    if energy is not None:
        source = energy["predicted"]["power_source"]
        t.add_row(f"energy (J/token: {'modeled' if source == 'modeled' else source + '-measured'} power x time)",
                  format_figure(energy["predicted"]["j_per_token"], 3),
                  format_figure(energy["measured"]["j_per_token"], 3),
                  "-" if energy["error"] is None else f"{energy['error']:+.1%}")
    for name, unit, f, digits in tier_figures(predicted, measured):  # what the tiers did (their own fits)
        error = relative_error(f(predicted), f(measured))
        t.add_row(f"{name} ({unit})", format_figure(f(predicted), digits), format_figure(f(measured), digits),
                  "-" if error is None else f"{error:+.1%}")
    for name, p, m in count_rows(predicted, measured):
        t.add_row(name, f"{p:,}", f"{m:,}", "")
    return t


# the counts that tell two schedules apart, (row, figure of a Metrics): always; eviction's where either side
# evicted; the tiers' where both have tiers (the simulator shares the runtime's scheduler: they should agree)
COUNT_FIGURES = (("finished", lambda m: m.num_finished), ("rejected", lambda m: m.num_rejected),
                 ("preemptions", lambda m: m.preemptions), ("prefix-hit tokens", lambda m: m.prefix_hit_tokens),
                 ("... at re-admissions", lambda m: m.readmission_hit_tokens))
TIER_COUNTS = (("preemptions swapped out", lambda t: t.swapped_out),
               ("swaps recomputed instead (no host room)", lambda t: t.swap_fallbacks),
               ("demoted blocks", lambda t: t.demotions), ("promoted blocks", lambda t: t.promotions))
# (the simulator writes no file: its are 0, which is what it assumes of the disk)
DISK_COUNTS = (("disk write errors (blocks lost)", lambda t: t.disk_write_errors),
               ("corrupt disk blocks", lambda t: t.corrupt_blocks))


def count_rows(predicted, measured) -> list[tuple[str, int, int]]:
    """(row, predicted, measured) of the counts the compare table shows (`COUNT_FIGURES` and the others where
    the config has them: disk rows with a disk tier)."""
    rows = [(name, f(predicted), f(measured)) for name, f in COUNT_FIGURES]
    if predicted.evicted_tokens or measured.evicted_tokens:
        rows.append(("evicted KV tokens", predicted.evicted_tokens, measured.evicted_tokens))
    if predicted.tiers is None or measured.tiers is None:
        return rows
    counts = TIER_COUNTS + (DISK_COUNTS if measured.tiers.capacity_bytes.get("disk") else ())
    return rows + [(name, f(predicted.tiers), f(measured.tiers)) for name, f in counts]
