"""`skistune quality`: measure the quality cost of eviction and low-bit KV on the real model (progress bar,
resumable), or ``--show`` a profile; either way print the single-knob losses and the combination check."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from skistune.display import Table

from skistune.cli_base import JsonOpt, app, cli_errors, console, err_console, print_json
from skistune.paths import check_out_file


def _pct(x: float) -> str:
    return "∞" if x == float("inf") else f"{100 * x:+.2f}%"


def _headline(profile) -> list[tuple[str, dict]]:
    """Representative configs (on the grid's points) for the summary table."""
    rows = []
    for bits in (8, 4, 2):
        both = {"bitwidth.key_bits": bits, "bitwidth.value_bits": bits}
        rows.append((f"int{bits} keys+values", both))
        if bits < 8:
            rows.append((f"int{bits} keys+values, newest 128 at 16 bits",
                         {**both, "bitwidth.full_precision_window": 128}))
    for policy in ("streaming", "h2o", "snapkv", "tova"):
        for fraction in (0.1, 0.25, 0.5):
            rows.append((f"{policy} {fraction:.0%}", {"eviction.policy": policy, "eviction.budget_fraction": fraction}))
    return rows


def _passkey(measured: tuple[int, int, float] | None) -> str:
    if measured is None:
        return "not measured"
    found, trials, share = measured
    return f"{share:.0%} ({found}/{trials})"


def quality_table(profile) -> tuple[Table, list[dict]]:
    from skistune.config import KVConfig

    corpus = profile.data["corpus"]
    table = Table(title=f"Quality of {profile.model} ({(profile.data.get('protocol') or {}).get('grid', 'unnamed')} grid, "
                        f"{profile.data['protocol']['windows']} windows of {corpus['window_tokens']} tokens, "
                        f"Python {corpus['python']} docstrings): single knobs",
                  title_justify="left")
    for col in ("config", "ppl Δ mean", "95% bound", "ppl Δ worst window", "ppl Δ source", "passkey kept"):
        table.add_column(col, justify="left" if col == "config" else "right")
    rows = []
    for name, knobs in _headline(profile):
        config = KVConfig().with_knobs(knobs)
        loss = profile.predict(config)
        finite = math.isfinite(loss.ppl_mean)  # outside the profile's grid: null in JSON, ∞ in the table
        basis = "measured" if profile.perplexity_measured(config) else "predicted" if finite else "outside grid"
        needle = profile.needle_measured(config)
        bound = loss.guarded_mean  # (what a mean-window floor is checked against: few windows, a wide bound)
        rows.append({"config": name, "knobs": knobs, "ppl_mean": loss.ppl_mean if finite else None,
                     "ppl_mean_bound": bound if math.isfinite(bound) else None,
                     "ppl_worst": loss.ppl_worst if finite else None, "ppl_basis": basis,
                     "needle_retained": None if needle is None else needle[2],
                     "needle_found": None if needle is None else needle[0],
                     "needle_trials": None if needle is None else needle[1]})
        table.add_row(name, _pct(loss.ppl_mean), _pct(bound), _pct(loss.ppl_worst), basis, _passkey(needle))
    table.caption = ("ppl Δ: perplexity increase over the baseline (a loss measured below 0 reads 0); 95% bound: "
                     "the one-sided upper bound of the mean from the spread between windows, which a perplexity "
                     "floor (--quality ppl+X%) is checked against; measured: this config is a grid point; "
                     "predicted: by the quality model from the single-knob measurements (keys and values are "
                     "measured apart). "
                     "passkey kept: found / trials of this config, as a share of the baseline's; not measured: "
                     "no trials of this config (the optimizer reads the nearest measured one at or below it, "
                     "0% below the grid)")
    table.caption_justify = "left"
    return table, rows


def baseline_line(baseline: dict) -> str:
    """The reference the losses are relative to, in one line."""
    continuation = baseline["ppl_continuation"]
    needle = ("not measured" if baseline["needle_found"] is None
              else f"{baseline['needle_found']}/{baseline['needle_trials']} found")
    return (f"baseline (16-bit KV, no eviction): perplexity {baseline['ppl_all_positions']:.2f} over the windows' "
            f"positions" + (f", {continuation:.2f} over their decoded continuations (SnapKV's losses are read on "
                            f"these)" if continuation is not None else "") + f"; passkey {needle}")


def combination_table(checks: list[dict]) -> Table:
    from skistune.quality.model import GOAL_RULE

    table = Table(title="Combination model: joint configs, predicted from single knobs vs measured",
                  title_justify="left", caption=f"within goal: {GOAL_RULE}", caption_justify="left")
    for col in ("joint config", "predicted", "measured", "error", "within goal"):
        table.add_column(col, justify="left" if col == "joint config" else "right")
    for c in checks:
        knobs = ", ".join(f"{k.split('.')[1]}={v}" for k, v in c["knobs"].items() if k != "bitwidth.layer_bits")
        if "bitwidth.layer_bits" in c["knobs"]:
            knobs = (knobs + ", " if knobs else "") + "per-layer bits"
        table.add_row(knobs, _pct(c["predicted"]), _pct(c["measured"]), f"{c['error_pp']:.2f} pp",
                      "yes" if c["within_goal"] else "[red]no[/]")
    return table


DEFAULT_MODEL = "smollm2-135m"


@app.command()
@cli_errors
def quality(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="model with real weights to measure")] = DEFAULT_MODEL,
    quick: Annotated[bool, typer.Option("--quick", help="a small grid (about 3 minutes on 2 CPU cores)")] = False,
    out: Annotated[Optional[Path], typer.Option(help="profile file to write [default: profiles/quality-MODEL.json, "
                                                     "quality-MODEL-quick.json with --quick]")] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="measure everything again instead of resuming the "
                                                          "measurements already in --out")] = False,
    show: Annotated[Optional[Path], typer.Option(help="print an existing quality profile; measure nothing")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Measure the quality cost of eviction and low-bit KV on the real model, through the runtime's own KV
    path: perplexity increase on standard-library docstrings (mean and worst window) and passkey retrieval,
    per knob, per layer, and for joint configs that check the combination model. Ctrl-C (exit 130) or SIGTERM
    (143) keeps every measurement taken in --out, and says how to resume."""
    from skistune.signals import file_states, stopped_by_signal

    path = out or Path("profiles") / f"quality-{model}{'-quick' if quick else ''}.json"
    before = file_states([path] if show is None else [])
    with stopped_by_signal(lambda: _kept(before, fresh, ctx), json_out):
        _quality(model, quick, out, fresh, show, json_out)


def _quality(model: str, quick: bool, out: Optional[Path], fresh: bool, show: Optional[Path], json_out: bool) -> None:
    from skistune.quality import QualityProfile, incomplete_notes, quality_profile_path
    from skistune.quality.grid import GRIDS
    from skistune.quality.model import GOAL_RULE

    if show is not None:
        given = [name for name, on in (("--quick", quick), ("--fresh", fresh), ("--out", out is not None),
                                       ("--model", model != DEFAULT_MODEL)) if on]
        if given:  # (they were ignored: a user took `--show Q --model llama-3-8b` for a profile of that model)
            raise ValueError(f"--show prints a profile as it is; {', '.join(given)} applies only when measuring")
        profile = QualityProfile.load(quality_profile_path(show))  # (a file, or a shipped profile by name)
        path = show
        for line in incomplete_notes(profile):
            err_console.print(f"[yellow]note:[/] {escape(line)}", highlight=False, soft_wrap=True)
    else:
        path = out or Path("profiles") / f"quality-{model}{'-quick' if quick else ''}.json"
        if out is None:
            path.parent.mkdir(parents=True, exist_ok=True)  # (the default folder; a mistyped --out folder is an error)
        check_out_file(path, "--out")  # (before the model loads and the first measurement: not after it)
        profile = _measure(model, GRIDS["quick" if quick else "full"], path, resume=not fresh)
    table, rows = quality_table(profile)
    baseline = profile.baseline()
    console.print(baseline_line(baseline), highlight=False)
    console.print(table)
    checks = profile.combination_checks()  # by this version's model (the file's copy is the measuring run's)
    if checks:
        console.print(combination_table(checks))
    console.print(f"profile: {escape(str(path))}", highlight=False)
    if json_out:
        print_json({"path": str(path), "model": profile.model, "grid": (profile.data.get("protocol") or {}).get("grid"),
                    "measured_s": profile.data.get("measured_s"), "baseline": baseline, "headline": rows,
                    "combination": checks, "goal": GOAL_RULE})


def _kept(before: dict, fresh: bool, ctx: typer.Context) -> tuple[str, dict]:
    """What a stopped run leaves (`signals.stopped_by_signal`): its file keeps every measurement taken (written
    after each one, whole: `paths.write_atomic`), which the same command, without --fresh, resumes."""
    import json

    from skistune.signals import rerun_command, written_since

    if not before:  # (--show)
        return "nothing written (--show only reads the profile)", {"out": None, "rerun": rerun_command(ctx)}
    path = next(iter(before))
    written = bool(written_since(before))
    if not path.exists():
        rerun = rerun_command(ctx, drop=("--fresh",))
        return (f"no measurement taken yet, no file written; rerun `{rerun}` to start again",
                {"out": None, "kept": 0, "total": None, "rerun": rerun})
    if fresh and not written:  # (the old file is still there: --fresh replaces it at the first measurement)
        rerun = rerun_command(ctx)
        return (f"no measurement taken yet: {path} is as it was (--fresh had not replaced it); rerun `{rerun}` to "
                "measure again", {"out": str(path), "kept": None, "total": None, "rerun": rerun})
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        kept, total = len(data["perplexity"]) + len(data["needle"]), _grid_total(data)
    except (OSError, ValueError, KeyError, TypeError):  # (not ours to count: said as it is)
        rerun = rerun_command(ctx)
        return f"{path} is as it was; rerun `{rerun}` to measure", {"out": str(path), "kept": None, "total": None,
                                                                      "rerun": rerun}
    rerun = rerun_command(ctx, drop=("--fresh",))  # (--fresh would measure them all again)
    fields = {"out": str(path), "kept": kept, "total": total, "rerun": rerun}
    if total is not None and kept >= total:
        return f"{path} keeps all {kept} measurements (the profile is whole); `{rerun}` prints it", fields
    of = f" of {total}" if total is not None else ""
    new = "" if written else " (none new)"
    return f"{path} keeps {kept}{of} measurements{new}; rerun `{rerun}` to resume", fields


def _grid_total(data: dict) -> int | None:
    """How many measurements a profile's grid takes (None: a grid this version does not know)."""
    from skistune.quality.grid import GRIDS

    grid = GRIDS.get(data["protocol"].get("grid"))
    return None if grid is None else len(grid.perplexity(data["n_layers"])) + len(grid.needle())


def _measure(model: str, grid, path: Path, *, resume: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from skistune.config import KVConfig
    from skistune.quality.measure import build_profile
    from skistune.quality.scoring import SCORING_KV_BYTES
    from skistune.runtime.llm import Runtime
    from skistune.runtime.presets import get_preset

    if not get_preset(model).has_real_weights:
        raise ValueError(f"model {model}: no real weights here; quality is measured on smollm2-135m and used as a "
                         "proxy for other models")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err_console, disable=not err_console.is_terminal) as bar:
        task = bar.add_task(f"loading {model}", total=None)
        runtime = Runtime.from_preset(model, KVConfig().with_knobs({"offload.device_kv_bytes": SCORING_KV_BYTES}))

        def advance(label: str, done: int, total: int) -> None:
            bar.update(task, description=label, completed=done, total=total)

        return build_profile(runtime, grid, path, resume=resume, progress=advance,
                             note=lambda line: bar.console.print(escape(line), highlight=False, soft_wrap=True))
