"""`skistune evaluate`: metrics of one config on one workload, predicted (simulator) or measured (real
runtime), in the same table and JSON. The workload options are the shared aliases of `workload show`."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from skistune.cli import cli_errors, console, print_json
from skistune.optimize_cli import ModelOpt, ProfileOpt
from skistune.workloads.cli import (FirstOpt, JsonOpt, LengthScaleOpt, MaxInputOpt, MaxOutputOpt, RateScaleOpt,
                                    RequestsOpt, SeedOpt, WorkloadOpt)


@cli_errors
def evaluate(
    config: Annotated[Path, typer.Argument(help="KV config file (YAML/JSON), e.g. one written by optimize")],
    workload: WorkloadOpt = "chat",
    mode: Annotated[str, typer.Option(help="simulate (hardware profile) or run (real runtime)")] = "simulate",
    model: ModelOpt = "smollm2-135m",
    profile: ProfileOpt = None,
    seed: SeedOpt = 0,
    requests: RequestsOpt = None,
    first: FirstOpt = None,
    rate_scale: RateScaleOpt = 1.0,
    length_scale: LengthScaleOpt = 1.0,
    max_input: MaxInputOpt = None,
    max_output: MaxOutputOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Metrics of one config on one workload: predicted by the simulator or measured on the real runtime
    (same table, same JSON), so that any prediction can be checked."""
    from skistune.config import load_config
    from skistune.display import metrics_table, summary_table
    from skistune.evaluate import evaluate as run_evaluate, workload_requests
    from skistune.workloads import load_workload

    cfg = load_config(str(config))
    w = load_workload(workload, seed=seed, requests=requests, first=first, rate_scale=rate_scale,
                      length_scale=length_scale, max_input=max_input, max_output=max_output)
    reqs = workload_requests(w, model, seed)
    label = "predicted (simulator)" if mode == "simulate" else "measured (runtime)"
    with console.status(f"{'simulating' if mode == 'simulate' else 'serving'} {len(reqs)} requests"):
        metrics = run_evaluate(cfg, reqs, model=model, mode=mode, profile=profile)
    console.print(metrics_table(metrics, f"{model} on {w.source}: {label}"))
    console.print(summary_table(metrics))
    if json_out:
        print_json({"mode": mode, "model": model, "workload": w.source, "workload_digest": w.digest(),
                    "metrics": metrics.to_dict()})
