"""`skistune export`: a tuned config in an engine's own file format and flags (`skistune.export`).

Standard output carries the file text only (so ``skistune export kv.yaml --to vllm > vllm.yaml`` works),
or nothing when ``--out`` writes it; the command line, warnings and notes go to standard error. A file the
command line needs beside it (vLLM's LMCache file, for a disk tier) is written by ``--out`` too, next to it.
With ``--json`` the last line of standard output is one JSON object. Exit codes: 0 exported, 2 bad input
(missing or invalid config, unknown target, model or version, or a warning under ``--strict``): one line on
standard error and, with ``--json``, ``{"error", "exit_code"}`` as the last line, as in every command
(`skistune.cli.cli_errors`).
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.syntax import Syntax

from skistune.cli_base import JsonOpt, cli_errors, console, err_console, print_json, print_warning
from skistune.export import DEFAULT_MODEL, Companion, ExportResult, exporter_names, get_exporter
from skistune.paths import check_out_file, write_atomic

# (evaluate's too: both commands take a tuned file's own model unless told, `export.registry.tuned_model`)
TunedModelOpt = Annotated[Optional[str], typer.Option(
    "--model", help="model preset (default: the one the tuned file records, else smollm2-135m)")]
ToOpt = Annotated[str, typer.Option("--to", "--target", help=f"export target: {', '.join(exporter_names())} "
                                                          "(--target, optimize's name for the engine, is the same)")]
EngineVersionOpt = Annotated[Optional[str], typer.Option(
    "--engine-version", help="engine version to write for (default: the newest the exporter knows; an unknown "
                             "one lists those supported)")]
ExportOutOpt = Annotated[Optional[Path], typer.Option(
    "--out", help="write the file here (atomically) instead of printing it")]
StrictOpt = Annotated[bool, typer.Option(
    "--strict", help="fail (exit 2) if any knob cannot be expressed in the target instead of warning")]


def _write(result: ExportResult, config: Path, out: Path) -> None:
    """The file and its companions, each atomically; the companions first, so that the file never names one
    that is not there."""
    for c in result.companions:
        check_out_file(Path(c.file_name), f"--out's {c.target} file", inputs=(config,))
    for c in result.companions:
        write_atomic(Path(c.file_name), c.text)
    write_atomic(out, result.text)


def _companion_steps(result: ExportResult, config: Path, out: Optional[Path]) -> list[str]:
    """The notes saying how to write the companion files the command needs, where --out did not write them.
    Printed before the warnings and, with the export's own notes, in --json's notes: every note printed is
    there (these had been printed only, so a --json reader saw companions[].written false without the step)."""
    return [] if out is not None else [f"the command needs {_companion_line(c, config)}" for c in result.companions]


def _print_result(result: ExportResult, config: Path, out: Optional[Path]) -> None:
    if out is None and console.is_terminal:
        console.print(Syntax(result.text, "yaml", background_color="default"))
    elif out is None:
        typer.echo(result.text, nl=False)
    else:
        for c in result.companions:
            err_console.print(f"wrote {escape(c.file_name)} ({c.target} {c.engine_version})", highlight=False,
                              soft_wrap=True)
        err_console.print(f"wrote {escape(str(out))} ({result.target} {result.engine_version})", highlight=False,
                          soft_wrap=True)
    if result.command:
        files = " and ".join([get_exporter(result.target).default_file, *(c.file_name for c in result.companions)])
        saved = "" if out is not None else f" (with the file{'s' if result.companions else ''} saved as {files})"
        err_console.print(f"[bold]command{saved}:[/] {escape(result.command)}", highlight=False, soft_wrap=True)
    for step in _companion_steps(result, config, out):
        err_console.print(f"[dim]note:[/] {escape(step)}", highlight=False, soft_wrap=True)
    for w in result.warnings:
        print_warning(str(w))
    for note in result.notes:
        err_console.print(f"[dim]note:[/] {escape(str(note))}", highlight=False, soft_wrap=True)
    if result.out_of_scope:
        err_console.print(f"[dim]not part of a {result.target} file (export them to an engine):[/] "
                          f"{escape(', '.join(result.out_of_scope))}", highlight=False, soft_wrap=True)


@cli_errors
def export(
    config: Annotated[Path, typer.Argument(metavar="CONFIG", help="KV config file (YAML/JSON), e.g. one written by optimize")],
    to: ToOpt,
    engine_version: EngineVersionOpt = None,
    model: TunedModelOpt = DEFAULT_MODEL,
    out: ExportOutOpt = None,
    strict: StrictOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Write a config in an engine's own format (vLLM, SGLang, LMCache, TensorRT-LLM, per-layer, native)
    with the equivalent command line; knobs the engine cannot express are listed with what was written
    instead (--strict makes that an error)."""
    from skistune.export import export as run_export

    if out is not None:
        check_out_file(out, "--out", inputs=(config,))
    result = run_export(config, to, engine_version, strict, model=model, file_name=str(out) if out else None)
    if out is not None:
        _write(result, config, out)
    _print_result(result, config, out)
    if json_out:
        print_json({"target": result.target, "engine_version": result.engine_version,
                    "out": str(out) if out else None, "warnings": [w.to_dict() for w in result.warnings],
                    "command": result.command, "notes": [*_companion_steps(result, config, out), *result.notes],
                    "out_of_scope": list(result.out_of_scope),
                    "companions": [{"target": c.target, "engine_version": c.engine_version, "file": c.file_name,
                                    "written": out is not None} for c in result.companions]})


def _companion_line(c: Companion, config: Path) -> str:
    """How to write a companion file that standard output did not carry."""
    return (f"{c.file_name} ({c.target}): give --out to write both files, or run skistune export "
            f"{shlex.quote(str(config))} --to {c.target} --out {shlex.quote(c.file_name)}")
