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


def main() -> None:
    app()


from skistune.workloads.cli import workload_app  # noqa: E402
app.add_typer(workload_app, name="workload")

from skistune.profile.cli import profile  # noqa: E402
app.command()(profile)

from skistune.optimize_cli import optimize  # noqa: E402
app.command()(optimize)

from skistune.evaluate_cli import evaluate  # noqa: E402
app.command()(evaluate)

from skistune.export_cli import export  # noqa: E402
app.command()(export)

import skistune.worker_cli  # noqa: E402,F401  (its import registers `skistune worker`)
import skistune.quality_cli  # noqa: E402,F401  (its import registers `skistune quality`)
import skistune.report_cli  # noqa: E402,F401  (its import registers `skistune report`)
