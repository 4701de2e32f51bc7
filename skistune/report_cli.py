"""`skistune report STUDY`: what a study found, as tables in the terminal and, in a folder, a Pareto-front
plot, latency CDFs (best vs baseline), a per-tier memory timeline and a self-contained HTML report.
A thin command over `skistune.report`; the study stays in its Optuna storage (optuna-dashboard reads it).

Exit codes: 0 written, 2 bad input (one line on stderr: no such storage or study, a study without the
skistune recipe).
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from skistune.cli_base import JsonOpt, app, cli_errors, console, err_console, print_json

StudyArg = Annotated[str, typer.Argument(metavar="STUDY", help="name of a study made by skistune optimize")]
StorageOpt = Annotated[Optional[str], typer.Option(
    "--storage", help="the study's Optuna storage URL (default: sqlite:///skistune-STUDY.db in this folder)")]
OutDirOpt = Annotated[Optional[Path], typer.Option(
    "--out-dir", help="folder for the plots and report.html (default: ./skistune-report-STUDY/, one folder here "
                      "whatever STUDY holds: characters other than letters, digits and _.+=,@- made _ and a hash "
                      "of STUDY added; a long STUDY shortened with the hash to fit a file name); plots of an "
                      "earlier report there that this one leaves out are removed")]
TopOpt = Annotated[int, typer.Option("--top", min=1, help="best configs shown")]


@app.command()
@cli_errors
def report(ctx: typer.Context, study: StudyArg, storage: StorageOpt = None, out_dir: OutDirOpt = None,
           top: TopOpt = 5, json_out: JsonOpt = False) -> None:
    """Report on a study: the best configs, the Pareto front, the binding constraints, predicted vs
    validated figures and the knobs' importance (fANOVA); write plots and an HTML report. Ctrl-C (exit 130) or
    SIGTERM (143) says which of the folder's files were written; the same command rewrites them all."""
    from skistune.report import FILES, check_out_dir, default_out_dir
    from skistune.signals import file_states, rerun_command, stopped_by_signal

    out = check_out_dir(out_dir if out_dir is not None else default_out_dir(study))
    made = not out.exists()  # (a folder this run creates and leaves empty is removed when it is stopped)
    before = file_states(out / name for name in FILES.values())
    rerun = rerun_command(ctx)
    with stopped_by_signal(lambda: _kept(out, before, made, rerun, study, storage), json_out):
        _report(study, storage, out, top, json_out)


def _report(study: str, storage: Optional[str], out: Path, top: int, json_out: bool) -> None:
    import optuna

    from skistune.report import build_report, report_lines, report_tables, summary, write_report
    from skistune.signals import signals_ignored

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with err_console.status(f"reading study {study} and scoring the baseline"):
        rep = build_report(study, storage=storage, top_k=top)
    # (the tables first, while the plots are drawn: a reader that goes away costs no file, `cli.ForgivingOutput`)
    for table in report_tables(rep):
        console.print(table)
    for line in report_lines(rep):
        console.print(line, highlight=False, soft_wrap=True)
    with err_console.status("simulating the replays and drawing the plots"):
        files, missing = write_report(rep, out)
    # the work is done: a signal now would stop only the last lines, or land in a finalizer (a weakref callback
    # printed "Exception ignored ... KeyboardInterrupt" after the report was written whole)
    with signals_ignored():
        for note in missing:
            err_console.print(f"[yellow]note:[/] {escape(str(note))}", highlight=False, soft_wrap=True)
        console.print(escape(f"wrote {', '.join(str(p) for p in files.values())}; browse every trial with "
                             f"optuna-dashboard {shlex.quote(rep.storage)}"), highlight=False, soft_wrap=True)
        if json_out:
            print_json(summary(rep, files))


def _kept(out: Path, before: dict, made: bool, rerun: str, study: str, storage: Optional[str]) -> tuple[str, dict]:
    """What a stopped report leaves (the `signals.stopped_by_signal` line and JSON fields): the files of the
    folder written by then (each whole: `paths.write_atomic`), the others missing or from an earlier report. The
    study is only read: it is as it was."""
    from skistune.report import FILES
    from skistune.signals import written_since

    written = written_since(before)
    if made and out.is_dir() and not any(out.iterdir()):
        out.rmdir()  # (created for the report, nothing in it: not left behind)
    fields = {"study": study, "storage": storage, "out_dir": str(out), "written": [str(p) for p in written],
              "rerun": rerun}
    if not written:
        old = [p.name for p in before if p.exists()]
        left = f" ({out} keeps the {', '.join(old)} of an earlier report)" if old else ""
        return f"no report file written{left}; rerun `{rerun}` to write the report", fields
    if out / FILES["html"] in written:  # (written last: the plots left out, if any, were left out by choice)
        return f"the report was written whole: {', '.join(str(p) for p in written)}", fields
    rest = [p for p in before if p not in written]
    old = [p.name for p in rest if p.exists()]
    left = f" ({', '.join(old)} from an earlier report)" if old else ""
    return (f"wrote {', '.join(str(p) for p in written)} of the report, not {', '.join(p.name for p in rest)}{left}; "
            f"rerun `{rerun}` to write it whole (it rewrites every file)", fields)
