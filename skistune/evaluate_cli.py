"""`skistune evaluate`: metrics of one config on one workload, predicted (simulator) or measured (real
runtime), in the same table and JSON. The workload options are the shared aliases of `workload show`."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from skistune.cli import cli_errors, console, print_json
from skistune.optimize_cli import ModelOpt, ProfileOpt
from skistune.workloads.cli import (BlockTokensOpt, BurstinessOpt, FirstOpt, FormatOpt, JitterOpt, JsonOpt,
                                    LengthScaleOpt, MaxInputOpt, MaxOutputOpt, RateOpt, RateScaleOpt, RequestsOpt,
                                    SampleOpt, SeedOpt, SkipBadRowsOpt, WindowOpt, WorkloadOpt, parse_window,
                                    print_notes)


@cli_errors
def evaluate(
    config: Annotated[Path, typer.Argument(help="KV config file (YAML/JSON), e.g. one written by optimize")],
    workload: WorkloadOpt = "chat",
    mode: Annotated[str, typer.Option(help="simulate (hardware profile), run (real runtime), or compare (both, "
                                      "and the prediction's error)")] = "simulate",
    model: ModelOpt = "smollm2-135m",
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
    from skistune.config import load_config
    from skistune.display import metrics_table, summary_table
    from skistune.evaluate import MODES, evaluate as run_evaluate, fit_workload, hardware_profile, workload_requests
    from skistune.workloads import load_workload

    if mode not in (*MODES, "compare"):
        raise ValueError(f"--mode {mode!r}: use simulate, run or compare")
    cfg = load_config(str(config))
    w = fit_workload(load_workload(
        workload, format=format, skip_bad_rows=skip_bad_rows, seed=seed, requests=requests, rate_rps=rate,
        burstiness=burstiness, block_tokens=block_tokens, jitter_s=jitter, window_s=parse_window(window),
        first=first, sample=sample, length_scale=length_scale, max_input=max_input, max_output=max_output,
        rate_scale=rate_scale), model)
    # the profile and the runtime are checked before the workload's notes are printed: bad input is one line
    prof = hardware_profile(model, profile) if mode != "run" else None
    runtime = None
    if mode != "simulate":
        from skistune.runtime.kv_store import check_fits_memory
        from skistune.runtime.llm import Runtime

        # (the engine checks the tier it sizes from this when a replay starts: after the notes)
        check_fits_memory(cfg.offload.host_kv_bytes, "offload.host_kv_bytes", "host tier")
        with console.status(f"loading {model}"):
            runtime = Runtime.from_preset(model, cfg)
    print_notes(w)
    reqs = workload_requests(w, model, seed)
    if mode == "compare":
        _compare(cfg, reqs, w, model, prof, runtime, speed_check, json_out)
        return
    with console.status(f"{'simulating' if mode == 'simulate' else 'serving'} {len(reqs)} requests"):
        metrics = run_evaluate(cfg, reqs, model=model, mode=mode, profile=prof, runtime=runtime)
    label = "predicted (simulator)" if mode == "simulate" else "measured (runtime)"
    console.print(metrics_table(metrics, f"{model} on {w.label()}: {label}"))
    console.print(summary_table(metrics))
    if json_out:
        print_json({"mode": mode, "model": model, **_workload_fields(w), "metrics": metrics.to_dict()})


def _workload_fields(w) -> dict:
    """What was evaluated, for --json: the source, the transforms applied to it (context caps included) and
    the digest of the requests that ran."""
    return {"workload": w.source, "transforms": list(w.transforms), "workload_notes": list(w.notes),
            "workload_digest": w.digest()}


def _compare(cfg, reqs, w, model: str, prof, runtime, speed_check: bool, json_out: bool) -> None:
    """The prediction and the measurement of the same requests, each figure's error, and (``speed_check``)
    how fast this machine runs the profile's own steps now: on a shared host that drift alone can be tens of
    percent, which the error table cannot tell from the simulator's."""
    from skistune.evaluate import compare_metrics, evaluate as run_evaluate

    with console.status(f"simulating {len(reqs)} requests"):
        predicted = run_evaluate(cfg, reqs, model=model, mode="simulate", profile=prof)
    with console.status(f"serving {len(reqs)} requests"):
        measured = run_evaluate(cfg, reqs, model=model, mode="run", runtime=runtime)
    check = None
    if speed_check:
        from skistune.profile.check import speed_check as time_again

        with console.status("timing a few of the profile's steps again"):
            check = time_again(prof, runtime)
    rows = compare_metrics(predicted, measured)
    console.print(comparison_table(rows, predicted, measured,
                                   f"{model} on {w.label()}: predicted (simulator) / measured (runtime)"))
    if check is not None:
        console.print(check.summary_line(), highlight=False, soft_wrap=True)
    for note in predicted.notes:
        console.print(f"note (prediction): {note}", highlight=False, soft_wrap=True)
    if json_out:
        print_json({"mode": "compare", "model": model, **_workload_fields(w),
                    "predicted": predicted.to_dict(), "measured": measured.to_dict(),
                    "errors": {r["figure"]: r["error"] for r in rows},
                    "speed_check": check.to_dict() if check is not None else None})


def comparison_table(rows: list[dict], predicted, measured, title: str):
    """Predicted, measured and the relative error of each figure (ms for latencies, MiB for the KV peak), then
    the counts that tell two schedules apart."""
    from rich.table import Table

    from skistune.evaluate import FIDELITY_FIGURES

    units = {name: unit for name, unit, _ in FIDELITY_FIGURES}
    scale = {"ms": 1e3, "MiB": 2 ** -20, "tok/s": 1.0}
    t = Table(title=title, title_justify="left")
    for col in ("figure", "predicted", "measured", "error"):
        t.add_column(col, justify="left" if col == "figure" else "right")
    for r in rows:
        unit = units[r["figure"]]
        name = r["figure"] if unit in r["figure"] else f"{r['figure']} ({unit})"
        error = "-" if r["error"] is None else f"{r['error']:+.1%}"
        t.add_row(name, f"{r['predicted'] * scale[unit]:,.1f}", f"{r['measured'] * scale[unit]:,.1f}", error)
    for name, f in (("finished", lambda m: m.num_finished), ("preemptions", lambda m: m.preemptions),
                    ("prefix-hit tokens", lambda m: m.prefix_hit_tokens)):
        t.add_row(name, f"{f(predicted):,}", f"{f(measured):,}", "")
    return t
