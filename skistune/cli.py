"""The `skistune` command line: thin commands over the library.

Domain errors (``ValueError``, ``OSError``) are caught at this edge and printed as one line with exit
code 2; commands that print figures take ``--json`` and then end with one JSON object on the last line.
"""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Find the best KV-cache settings for serving an LLM under latency, energy and "
                       "quality constraints.")
console = Console()
err_console = Console(stderr=True)

EXIT_BAD_INPUT = 2


def cli_errors(fn: Callable) -> Callable:
    """Turn domain errors into one line on stderr and exit code 2 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ValueError, OSError, KeyError) as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_BAD_INPUT) from None

    return wrapper


def print_json(figures: dict) -> None:
    """The machine-readable result: one JSON object on the last line of stdout."""
    sys.stdout.write(json.dumps(figures, separators=(",", ":"), default=float) + "\n")


DEFAULT_DEMO_PROMPTS = ("The capital of France is", "Water boils at a temperature of",
                        "The three primary colors are", "A short poem about the sea:")


@app.command()
@cli_errors
def demo(
    prompt: Annotated[list[str], typer.Option("--prompt", "-p", help="prompt to complete (repeatable)")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, max=4096, help="tokens generated per prompt")] = 32,
    config: Annotated[Optional[Path], typer.Option(help="KV config file (YAML/JSON); default knobs if absent")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="end with one JSON object on the last line")] = False,
) -> None:
    """Serve a few prompts with the real SmolLM2-135M model through the paged KV cache; print the
    completions and the measured metrics."""
    from skistune.config import KVConfig, load_config
    from skistune.display import metrics_table, summary_table
    from skistune.runtime.llm import Runtime
    from skistune.runtime.request import Request

    cfg = load_config(str(config)) if config else KVConfig()
    prompts = list(prompt or DEFAULT_DEMO_PROMPTS)
    with console.status("loading SmolLM2-135M-Instruct"):
        rt = Runtime.from_preset("smollm2-135m", cfg)
    requests = [Request(f"p{i}", rt.tokenizer.encode(p), max_new_tokens) for i, p in enumerate(prompts)]
    engine = rt.new_engine()
    with console.status(f"generating {max_new_tokens} tokens for {len(prompts)} prompts"):
        metrics = engine.replay(requests)
    completions = [rt.tokenizer.decode(r.output_token_ids) for r in engine.records]
    for p, c in zip(prompts, completions):
        console.print(f"[bold]{p}[/]{c}", highlight=False)
    console.print(metrics_table(metrics, "Measured on this machine"))
    console.print(summary_table(metrics))
    if json_out:
        print_json({"completions": completions, "metrics": metrics.to_dict()})


@app.command()
@cli_errors
def evaluate(
    config: Annotated[Path, typer.Argument(help="KV config file (YAML/JSON), e.g. one written by optimize")],
    workload: Annotated[str, typer.Option(help="a preset (chat, code, long-context, agent) or a trace file")] = "chat",
    mode: Annotated[str, typer.Option(help="simulate (hardware profile) or run (real runtime)")] = "simulate",
    model: Annotated[str, typer.Option(help="model preset")] = "smollm2-135m",
    profile: Annotated[Optional[Path], typer.Option(help="hardware profile JSON (default: this machine's, "
                                                         "measured and cached if missing)")] = None,
    seed: Annotated[int, typer.Option(min=0, help="seed for presets and prompt tokens")] = 0,
    requests: Annotated[Optional[int], typer.Option(min=1, help="requests in a preset")] = None,
    first: Annotated[Optional[int], typer.Option(min=1, help="keep the first N requests")] = None,
    rate_scale: Annotated[float, typer.Option(help="multiply the arrival rate")] = 1.0,
    length_scale: Annotated[float, typer.Option(help="multiply input and output lengths")] = 1.0,
    max_input: Annotated[Optional[int], typer.Option(min=1, help="cap prompts at this many tokens")] = None,
    max_output: Annotated[Optional[int], typer.Option(min=1, help="cap outputs at this many tokens")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="end with one JSON object on the last line")] = False,
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
        metrics = run_evaluate(cfg, reqs, model=model, mode=mode, profile=str(profile) if profile else None)
    console.print(metrics_table(metrics, f"{model} on {w.source}: {label}"))
    console.print(summary_table(metrics))
    if json_out:
        print_json({"mode": mode, "model": model, "workload": w.source, "workload_digest": w.digest(),
                    "metrics": metrics.to_dict()})


def main() -> None:
    app()


from skistune.workloads.cli import workload_app  # noqa: E402
app.add_typer(workload_app, name="workload")

from skistune.profile.cli import profile  # noqa: E402
app.command()(profile)

from skistune.optimize_cli import optimize  # noqa: E402
app.command()(optimize)
