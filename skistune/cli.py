"""The `skistune` command line: thin commands over the library, assembled here (`skistune.cli_base` has
what they share).

Domain errors (``ValueError``, ``OSError``) are caught at this edge and printed as one line with exit
code 2, and so are click's own usage errors (unknown option, missing or bad value): ``error: <what>
(see skistune <command> --help)``. Commands that print figures take ``--json`` and then end with one JSON
object on the last line; on such an error too: ``{"error": <the line>, "exit_code": 2}``.
"""
from __future__ import annotations

import contextlib
import errno
import importlib
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from skistune.cli_base import JsonOpt, app, cli_errors, console, err_console, print_json, print_warning

DEFAULT_DEMO_PROMPTS = ("The capital of France is", "Water boils at a temperature of",
                        "The three primary colors are", "A short poem about the sea:")


@app.command()
@cli_errors
def demo(
    prompt: Annotated[list[str], typer.Option("--prompt", "-p", help="prompt to complete (repeatable)")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, max=4096, help="tokens generated per prompt")] = 32,
    config: Annotated[Optional[Path], typer.Option(help="KV config file (YAML/JSON); default knobs if absent")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Serve a few prompts with the real SmolLM2-135M model through the paged KV cache; print the
    completions and the measured metrics (exit code 2, with the reasons, if every prompt is rejected)."""
    from skistune.config import KVConfig, load_config
    from skistune.display import metrics_table, rejection_lines, summary_table
    from skistune.runtime.llm import Runtime
    from skistune.runtime.request import Request

    cfg = load_config(str(config)) if config else KVConfig()
    prompts = list(prompt or DEFAULT_DEMO_PROMPTS)
    empty = [i + 1 for i, p in enumerate(prompts) if not p.strip()]
    if empty:  # (before the model loads; the runtime's "request p0: empty prompt" named its own id)
        raise ValueError(f"--prompt number {empty[0]}: empty; give some text to complete")
    with err_console.status("loading SmolLM2-135M-Instruct"):
        rt = Runtime.from_preset("smollm2-135m", cfg)
    # (a completion ends at the model's end-of-turn token, which is not printed: past it SmolLM2 opens a
    # new ChatML turn, "<|im_end|>\n<|im_start|>...", as the demo printed before)
    requests = [Request(f"p{i}", rt.tokenizer.encode(p), max_new_tokens, stop_at_eos=True)
                for i, p in enumerate(prompts)]
    engine = rt.new_engine()
    with err_console.status(f"generating up to {max_new_tokens} tokens for {len(prompts)} prompts"):
        metrics = engine.replay(requests)
    if metrics.num_rejected == metrics.num_requests:  # nothing was served: a failure, not an empty table
        raise ValueError(f"every prompt was rejected ({'; '.join(rejection_lines(metrics))}): shorten the "
                         "prompts or --max-new-tokens, or raise the limit named in --config")
    eos = rt.tokenizer.eos_token_id
    # (a rejected prompt has no completion: null in the JSON, its reason on its line, not an empty string
    # that reads as an empty generation)
    completions = [None if r.rejected_reason else
                   rt.tokenizer.decode(r.output_token_ids[:-1] if r.output_token_ids[-1:] == [eos]
                                       else r.output_token_ids) for r in engine.records]
    from skistune.config import knob_fields
    from skistune.optimize_cli import _diff

    # which knobs served these prompts: a tuned file's changes, as optimize's "#1:" line names them
    knobs = _diff(cfg, KVConfig(), list(knob_fields()))
    console.print(escape(f"config: {config or 'none'}; knobs off skistune's defaults: "
                         f"{'none' if knobs == '(baseline)' else knobs}"), highlight=False, soft_wrap=True)
    for p, c, r in zip(prompts, completions, engine.records):  # (the arrow: a completion need not start with a space)
        served = escape(c.lstrip()) if c is not None else f"[red](rejected: {escape(r.rejected_reason)})[/]"
        console.print(f"[bold]{escape(p)}[/] [dim]→[/] {served}", highlight=False)
    console.print(metrics_table(metrics, "Measured on this machine"))
    console.print(summary_table(metrics))
    if json_out:
        print_json({"config": str(config) if config else None, "knobs": None if knobs == "(baseline)" else knobs,
                    "completions": completions, "rejected": [r.rejected_reason for r in engine.records],
                    "metrics": metrics.to_dict()})


PIPED_WIDTH = 200  # columns of tables written to a file or a pipe (rich's 80 cut cells short in logs)
EXIT_OUTPUT_LOST = 1  # the command's work is done, but what it printed could not be written (a full disk)
READER_GONE = (errno.EPIPE, errno.ECONNRESET)  # `| head -1`: what was not read was not wanted


class ForgivingOutput:
    """stdout or stderr for the program: a write that fails (its reader went away, a full disk, a closed stream)
    silences the stream instead of ending the command, so that the work goes on and its files are written (a
    tester's `skistune optimize ... | head -1` had lost its tuned file, and `>/dev/full` with --json had ended in
    two tracebacks). The descriptor is pointed at /dev/null, so that every later write to it, by any code, the
    interpreter's last flush included, goes nowhere quietly. ``failure``: the first error, or None."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.failure: OSError | None = None

    def write(self, text: str) -> int:
        if self.failure is None:
            try:
                return self._stream.write(text)
            except (OSError, ValueError) as exc:  # (ValueError: a closed file)
                self._silence(exc)
        return len(text)

    def flush(self) -> None:
        if self.failure is None:
            try:
                self._stream.flush()
            except (OSError, ValueError) as exc:
                self._silence(exc)

    def _silence(self, exc: Exception) -> None:
        self.failure = exc if isinstance(exc, OSError) else OSError(errno.EBADF, str(exc))
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:  # (isatty, fileno, encoding, buffer: the stream's own)
        return getattr(self._stream, name)


def _usable_output() -> tuple[ForgivingOutput, ForgivingOutput]:
    """stdout and stderr as the commands write them: a closed one (``>&-``) is /dev/null, a character its
    encoding lacks is replaced (PYTHONIOENCODING=ascii had ended `profile --show` at its R²), and each is a
    `ForgivingOutput`."""
    streams = []
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:
            stream = open(os.devnull, "w")
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(errors="replace")
        streams.append(ForgivingOutput(stream))
        setattr(sys, name, streams[-1])
    return streams[0], streams[1]


def _lost_output_code(code: Any, out: ForgivingOutput) -> Any:
    """The exit code once the command has ended: unchanged, but for output lost to something other than its
    reader going away (a full disk, an I/O error), which is said on stderr and ends with `EXIT_OUTPUT_LOST` if
    the command had succeeded: a script must not take a missing --json line for a success."""
    if out.failure is None or out.failure.errno in READER_GONE:
        return code
    print_warning(f"the output could not be written ({out.failure.strerror or out.failure}): what the command "
                  "printed is lost; the files it wrote are whole")
    return EXIT_OUTPUT_LOST if code in (0, None) else code


def main() -> None:
    out, _ = _usable_output()
    if "COLUMNS" not in os.environ and not sys.stdout.isatty():
        os.environ["COLUMNS"] = str(PIPED_WIDTH)  # (a terminal's own width otherwise; COLUMNS= still decides)
    try:
        app()
    except SystemExit as exc:  # (the command has ended, its output printed: a signal now changes nothing)
        from skistune.signals import finished_before_signals

        finished_before_signals()
        code = _lost_output_code(exc.code, out)
        if code == exc.code:
            raise
        raise SystemExit(code) from None


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

# (their imports register `skistune worker`, `skistune quality` and `skistune report`; imported by name, as
# nothing here uses them)
for _commands in ("skistune.worker_cli", "skistune.quality_cli", "skistune.report_cli"):
    importlib.import_module(_commands)
