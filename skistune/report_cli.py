"""`skistune report STUDY`: what a study found, as tables in the terminal and, in a folder, a Pareto-front
plot, latency CDFs (best vs baseline), a per-tier memory timeline and a self-contained HTML report.
A thin command over `skistune.report`; the study stays in its Optuna storage (optuna-dashboard reads it).

Exit codes: 0 written, 2 bad input (one line on stderr: no such storage or study, a study without the
skistune recipe).
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from skistune.cli import JsonOpt, app, cli_errors, console, err_console, print_json

StudyArg = Annotated[str, typer.Argument(help="name of a study made by skistune optimize")]
StorageOpt = Annotated[Optional[str], typer.Option(
    "--storage", help="the study's Optuna storage URL (default: sqlite:///skistune-STUDY.db in this folder)")]
OutDirOpt = Annotated[Optional[Path], typer.Option(
    "--out-dir", help="folder for the plots and report.html (default: ./skistune-report-STUDY/)")]
TopOpt = Annotated[int, typer.Option("--top", min=1, help="best configs shown")]


@app.command()
@cli_errors
def report(study: StudyArg, storage: StorageOpt = None, out_dir: OutDirOpt = None, top: TopOpt = 5,
           json_out: JsonOpt = False) -> None:
    """Report on a study: the best configs, the Pareto front, the binding constraints, predicted vs
    validated figures and the knobs' importance (fANOVA); write plots and an HTML report."""
    import optuna

    from skistune.report import build_report, check_out_dir, report_lines, report_tables, summary, write_report

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out = check_out_dir(out_dir if out_dir is not None else Path(f"skistune-report-{study}"))
    with err_console.status(f"reading study {study} and scoring the baseline"):
        rep = build_report(study, storage=storage, top_k=top)
    for table in report_tables(rep):
        console.print(table)
    for line in report_lines(rep):
        console.print(line, highlight=False, soft_wrap=True)
    with err_console.status("simulating the replays and drawing the plots"):
        files, missing = write_report(rep, out)
    for note in missing:
        err_console.print(f"[yellow]note:[/] {escape(str(note))}", highlight=False, soft_wrap=True)
    console.print(escape(f"wrote {', '.join(str(p) for p in files.values())}; browse every trial with "
                         f"optuna-dashboard {rep.storage}"), highlight=False, soft_wrap=True)
    if json_out:
        print_json(summary(rep, files))
