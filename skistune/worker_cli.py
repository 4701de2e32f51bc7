"""`skistune worker STUDY --storage URL` (or `--study STUDY`): one more worker on an existing study. It only
runs trials: the problem (workload, profile, SLOs, constraints, search space, sampler) is the one the study's creator
(`skistune optimize --storage URL --study NAME`) stored in the study, so any machine that reaches the
storage can join. Run `skistune optimize` with the same storage and study again to refine, validate and
write the tuned config from every worker's trials.

Exit codes: 0 done, 2 bad input (one line on stderr: a storage that cannot be opened, a missing study, a
study whose problem is Python code) or a storage that failed mid-run (a full disk: what failed, the finished trials
the study keeps, the command that goes on), 130 interrupted (Ctrl-C) and 143 terminated (SIGTERM): its running trial
is marked failed, the finished ones are kept.
"""
from __future__ import annotations

from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from skistune.cli_base import JsonOpt, app, cli_errors, err_console, print_json

StorageArg = Annotated[Optional[str], typer.Option(
    "--storage", help="the study's Optuna storage URL, e.g. postgresql://user@host/db (default: "
                      "sqlite:///skistune-STUDY.db in this folder, where skistune optimize puts it)")]
StudyArg = Annotated[Optional[str], typer.Argument(
    metavar="STUDY", help="name of an existing study (made by skistune optimize), as skistune report takes it",
    show_default=False)]
StudyOpt = Annotated[Optional[str], typer.Option("--study", help="the study, as an option (as skistune optimize "
                                                                 "takes it)")]
TrialsOpt = Annotated[int, typer.Option("--trials", min=1, help="trials this worker adds to the study")]
TimeoutOpt = Annotated[Optional[float], typer.Option("--timeout", min=0.001,
                                                     help="stop after this many seconds (the trial it falls in "
                                                          "too, at most one simulation late)")]
SeedOpt = Annotated[Optional[int], typer.Option(
    "--seed", min=0, help="this worker's sampler seed (default: random, so that workers started together "
                          "propose different configs; each trial records its worker's seed)")]


def _run(job, trials: int, timeout: float | None, storage: str, resume: str):
    """`skistune.study_recipe.run_worker` under a progress bar; a storage that fails mid-run (a full disk, a lost
    server) is one line, not a traceback: what failed, the finished trials the study keeps (they are in the
    storage already), and ``resume``, the command that goes on."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from skistune.signals import interrupted_exit_code, sigterm_as_interrupt, stopped_line
    from skistune.study_recipe import run_worker
    from skistune.study_storage import StorageWriteError

    bar = Progress(SpinnerColumn(), TextColumn("[bold]worker"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=err_console, disable=not err_console.is_terminal)
    done = [0]

    def on_progress(p) -> None:
        done[0] = p.done
        bar.update(task, completed=p.done)

    try:
        with sigterm_as_interrupt(), bar:
            task = bar.add_task("trials", total=trials)
            return run_worker(job, n_trials=trials, timeout=timeout, storage=storage, progress=on_progress)
    except StorageWriteError as exc:
        raise OSError(exc.line(resume)) from None
    except KeyboardInterrupt as exc:  # (as optimize's search says it: the study, this run's trials, what resumes)
        err_console.print(escape(stopped_line(exc, f"study {job.study.study_name} keeps its finished trials "
                                                   f"({done[0]} from this worker); rerun `{resume}` to add more")),
                          highlight=False, soft_wrap=True)
        raise typer.Exit(interrupted_exit_code(exc)) from None


def _best(job) -> tuple[Any, int]:
    """The study's best feasible config so far (by the first objective; None until a trial is feasible) and the
    size of its Pareto front, at the search's precision (`skistune optimize` refines and validates)."""
    from skistune.optimize import completed, pareto_front, ranked

    evaluations = completed(job.study)
    top = ranked(job.problem, evaluations)
    return (top[0] if top else None), len(pareto_front(job.problem, evaluations))


@cli_errors
def worker(ctx: typer.Context, study_arg: StudyArg = None, study: StudyOpt = None, storage: StorageArg = None, trials: TrialsOpt = 10,
           timeout: TimeoutOpt = None, seed: SeedOpt = None, json_out: JsonOpt = False) -> None:
    """Run trials of an existing study as one more worker (on this or any machine that reaches the storage);
    the study's creator stored everything a worker needs."""
    import optuna

    from skistune.optimize_cli import _best_text, command_line
    from skistune.search import COMMAND_ATTR, running_notes
    from skistune.study_recipe import join_study
    from skistune.study_storage import _storage_label, default_storage

    if study_arg and study and study_arg != study:
        raise ValueError(f"two studies given: {study_arg} and --study {study}; give one")
    study = study_arg or study
    if not study:
        raise ValueError("no study given: skistune worker STUDY (or --study STUDY), a study made by skistune "
                         "optimize --study STUDY")
    storage = storage or default_storage(study)

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # (a failed trial: our own one line)
    from skistune.study_storage import StorageWriteError

    try:
        job = join_study(storage, study, seed=seed)  # every check before the first trial (and the progress bar)
    except StorageWriteError as exc:
        raise OSError(exc.line(command_line(ctx))) from None
    for note in running_notes(job.study):  # (the other workers' trials, or a killed one's)
        err_console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
    run = _run(job, trials, timeout, storage, command_line(ctx))
    best, front = _best(job)
    objectives = job.problem.objectives
    values = {o.name: (best.values[i] if best is not None else None) for i, o in enumerate(objectives)}
    if len(objectives) == 1:
        so_far = f"best {objectives[0].name} so far: {_best_text(objectives[0], values[objectives[0].name])}"
    else:  # (the front is the result: each objective of its first config, and how many configs it holds)
        so_far = (f"best by {objectives[0].name} so far: "
                  + ", ".join(f"{o.name} {_best_text(o, values[o.name])}" for o in objectives)
                  + f"; Pareto front of {front} config{'s' * (front != 1)}")
    # (the study's own optimize command: `optimize --study NAME` alone is another problem without its --slo)
    again = job.study.user_attrs.get(COMMAND_ATTR) or f"the skistune optimize command that made it, with --study {study},"
    err_console.print(escape(f"worker (seed {job.seed}) finished {run.finished} trial{'s' * (run.finished != 1)} of "
                             f"study {study} in {_storage_label(storage)}; the study has {run.complete_in_study} complete "
                             f"trials; {so_far} (at the search's precision: {again} refines, validates and writes the "
                             "config)"), highlight=False, soft_wrap=True)
    if json_out:
        print_json({"study": study, "storage": _storage_label(storage), "seed": job.seed, "finished": run.finished,
                    "failed": run.failed, "complete_in_study": run.complete_in_study,
                    "objective": objectives[0].name, "best": values[objectives[0].name], "best_values": values,
                    "pareto_size": front, "precision": "search"})


app.command()(worker)  # `skistune.cli` imports this module at its end: that import registers the command
