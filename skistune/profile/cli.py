"""`skistune profile`: measure this machine for a model (with a progress bar) and write the profile, or
``--show`` an existing one. Either way it prints the fitted figures and flags weak fits. Where it writes is
checked before it measures, and an option that the chosen mode does not read is refused, not ignored."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from skistune.cli_base import JsonOpt, cli_errors, console, err_console, print_json, print_warning
from skistune.display import Table

from skistune.config import format_bytes
from skistune.kernels.rows import PLAIN_RULE, ProjectionRule
from skistune.paths import check_existing_dir, check_out_file

from .cost import ALL_FEATURES, PARALLEL_FEATURES, ProjectionTimes
from .fingerprint import machine_fingerprint
from .profile import HardwareProfile, cached_profile_path, load_profile, profile_path, warn_if_elsewhere

MODEL_HELP = "model preset (smollm2-135m has real weights; larger presets run with random weights, for timing)"

# what each mode other than measuring does, and the options it reads besides --json: any other option given is
# refused (`--show P --quick`, `--refit P --model M` had exited 0, the option silently unused)
MODES = {
    "--show": ("prints the profile as it is", ("--show",)),
    "--refit": ("fits the file's own step points again", ("--refit", "--out")),
    "--check": ("times the file's own steps again, on its own model and device", ("--check",)),
    "--cache": ("measures the quick profile", ("--cache", "--model", "--device", "--quick", "--disk-dir")),
}


def _summary(profile: HardwareProfile, path: Path, wall_s: float | None = None) -> dict:
    fit = profile.step_fit
    return {
        "path": str(path), "name": profile.name, "model": profile.model, "device": profile.device,
        "quick": profile.quick, "duration_s": profile.duration_s, "wall_s": wall_s, "threads": profile.threads,
        "step": {"cost_model": profile.step_cost.to_dict(), "train": fit.train.to_dict(),
                 "held_out": fit.held_out.to_dict() if fit.held_out else None},
        "transfers": {link: m.fit.to_dict() for link, m in profile.transfers.items()},
        "block_io": {kind: m.fit.to_dict() for kind, m in profile.block_io.items()},
        "host_memory_bytes": profile.fingerprint.host_memory_bytes, "disk_free_bytes": profile.disk_free_bytes,
        "drift": dict(profile.drift),
        "power": profile.power.to_dict(), "flagged": profile.flagged_fits(),
        "notes": list(profile.all_notes) + [n for n in (profile.quantized_kv_note, profile.drift_note) if n],
        "step_coverage": profile.step_coverage_note,
    }


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _r2(value: float | None) -> str:
    return "n/a (too few points)" if value is None else f"{value:.3f}"


def _errors(quality) -> str:
    return f"{_pct(quality.median_rel_error)} / {_pct(quality.max_rel_error)}"


def _held_errors(fit) -> str:
    return "none held out" if fit.held_out is None else _errors(fit.held_out)


def _row_unit(profile: HardwareProfile) -> str:
    """What the token terms count: rows as the CPU computes them (padded), or tokens."""
    rule = profile.step_cost.rows
    return "row (tokens as computed, CPU padding)" if rule.pad_short_by or rule.single_row_padded else "token"


def rule_text(rule: ProjectionRule) -> str:
    """A projection rule in words."""
    if rule == PLAIN_RULE:
        return "plain products (x @ w.T) at every size"
    parts = [f"w @ x.T from 2 to {rule.flip_max_rows} rows" if rule.flip_max_rows else "x @ w.T"]
    if rule.pad_short_by:  # (a rule measured to pad only one row short read "1-1 rows short")
        short = "1 row" if rule.pad_short_by == 1 else f"1-{rule.pad_short_by} rows"
        parts.append(f"padded to a multiple of 16 when {short} short")
    if rule.single_row_padded:
        parts.append("one row as two")
    return ", ".join(parts)


def _step_rows(profile: HardwareProfile) -> list[tuple[str, str]]:
    fit, knee = profile.step_fit, profile.step_cost.knee
    c = dict(zip(ALL_FEATURES, profile.step_cost.all_coef))
    rows = [("step fit R² (training points)", _r2(fit.train.r2)),
            ("step error median / max (training)", _errors(fit.train))]
    if fit.held_out is not None:  # (its R² too: it is flagged below the threshold, as the training points' is)
        rows += [(f"step fit R² ({fit.held_out.points} held-out points)", _r2(fit.held_out.r2)),
                 (f"step error median / max ({fit.held_out.points} held-out points)", _errors(fit.held_out))]
    return rows + [
        ("step: projections ran as", rule_text(profile.step_cost.rows)),
        ("step: fixed + per sequence", f"{c['fixed'] * 1e3:.2f} ms + {c['seqs'] * 1e6:.0f} µs"),
        (f"step: per {_row_unit(profile)} / past the knee",
         f"{c['tokens'] * 1e6:.0f} µs / {c['tokens_past_knee'] * 1e6:.0f} µs (knee {knee} tokens)"),
        (f"step: more than {profile.step_cost.small_rows} token(s) (the BLAS's general product)",
         f"{c['multi_token'] * 1e3:.2f} ms"),
        ("step: per GB of KV read (decode / prefill)",
         f"{c['decode_kv_bytes'] * 1e12:.1f} / {c['prefill_kv_bytes'] * 1e12:.1f} ms"),
        ("step: per prefill query-key pair", f"{c['prefill_pairs'] * 1e9:.2f} ns"),
        ("step: per sampled row", f"{c['samples'] * 1e6:.0f} µs"),
        ("step: per M quantized KV elements read (decode / prefill) / appended",
         f"{c['decode_dequant_elements'] * 1e9:.2f} / {c['prefill_dequant_elements'] * 1e9:.2f} / "
         f"{c['quantize_elements'] * 1e9:.2f} ms" if profile.measures_quantized_kv else "not measured"),
        ("step: per M sub-byte codes unpacked beyond a byte's first (decode / prefill)",
         f"{c['decode_unpack_elements'] * 1e9:.2f} / {c['prefill_unpack_elements'] * 1e9:.2f} ms"
         if profile.measures_quantized_kv else "not measured"),
        ("step: x the projection passes timed here (layers / LM head)",
         f"{c['projections_s']:.2f} / {c['lm_head_s']:.2f}" if profile.step_cost.table else "not measured"),
        *_projection_rows(profile.step_cost.table),
        ("step: elementwise ops split over threads past N tokens (KV / hidden / MLP rows)",
         " / ".join(f"{c[f] * 1e3:.2f} ms past {n}" for f, n in zip(PARALLEL_FEATURES, profile.step_cost.parallel_rows))
         or ("not fitted (skistune profile --refit FILE fits them)" if profile.fitted_before_parallel_terms
             else "none on this device")),
        ("step: decode rows and prefill chunks together (both attention paths)",
         "not fitted (skistune profile --refit FILE fits it)" if profile.fitted_before_mixed_term
         else f"{c['mixed_paths'] * 1e3:.2f} ms" if any(p.kind == "mixed" for p in profile.steps)
         else "not measured"),
        ("step: quantized KV, a step that packs completed blocks + per block",
         f"{c['packing_steps'] * 1e3:.2f} ms + {c['packed_blocks'] * 1e3:.2f} ms"
         if any(p.kind == "packing" for p in profile.steps) else "not measured"),
        ("step: eviction scoring by attention, per prefill token + per M query-key pairs",
         f"{c['scored_prefill_tokens'] * 1e3:.3f} ms + {c['scored_prefill_pairs'] * 1e9:.2f} ms"
         if any(p.kind == "scored" for p in profile.steps) else "not measured"),
        ("step: per eviction compaction + per K slots compacted (+ kept slots past the KV rows' grain)",
         f"{c['compactions'] * 1e3:.2f} ms + {c['compacted_slots'] * 1e6:.2f} ms"
         + (f" (+ {c['parallel_compactions'] * 1e3:.2f} ms past {profile.step_cost.parallel_rows[0]})"
            if profile.step_cost.parallel_rows else "")
         if any(p.kind == "compaction" for p in profile.steps) else "not measured"),
    ]


def _projection_rows(table: ProjectionTimes | None) -> list[tuple[str, str]]:
    """The projection passes as timed (the table the two terms above weigh), at its first size, at 16 rows
    (where a CPU BLAS's speed jumps) and at its last."""
    if table is None:
        return [("projection pass timed (all layers / LM head)", "not measured")]
    label = f"projection pass timed (all layers / LM head), {len(table.rows)} sizes"
    sizes = dict.fromkeys(r for r in (table.rows[0], 16, table.rows[-1]) if r in table.rows)
    return [(f"{label}: at {rows} row{'s' if rows > 1 else ''}" if i == 0 else f"... at {rows} rows",
             f"{table.layers(rows) * 1e3:.1f} / {table.head(rows) * 1e3:.1f} ms") for i, rows in enumerate(sizes)]


def _transfer_row(link: str, fit) -> tuple[str, str]:
    # (per copy call: the runtime makes one per part tensor of a block, `fit.TransferFit`)
    figures = f"{fit.latency_s * 1e6:.0f} µs/call + {fit.bytes_per_s / 1e9:.2f} GB/s (R² {_r2(fit.quality.r2)})"
    return f"transfer {link.replace('_', ' ')}", figures


def _block_io_row(kind: str, fit) -> tuple[str, str]:
    per_block_s, per_part_s, s_per_byte = fit.coef
    bandwidth = f"{1e-9 / s_per_byte:.2f} GB/s" if s_per_byte > 0 else "no per-byte cost"
    figures = (f"{per_block_s * 1e6:.1f} µs/block + {per_part_s * 1e6:.1f} µs/part + {bandwidth} "
               f"(R² {_r2(fit.quality.r2)})")
    return f"disk block conversion {kind.replace('_', ' ')}", figures


def _other_rows(profile: HardwareProfile) -> list[tuple[str, str]]:
    fixed_s, per_seq_s = profile.overhead.fit.coef
    rows = [("scheduler overhead: per step + per sequence", f"{fixed_s * 1e6:.0f} µs + {per_seq_s * 1e6:.1f} µs"),
            ("paged attention (one layer) R²", _r2(profile.attention.fit.quality.r2)),
            ("quantize-on-append (one layer) R²",
             "not measured" if profile.quantize is None else _r2(profile.quantize.fit.quality.r2))]
    rows += [_transfer_row(link, m.fit) for link, m in profile.transfers.items()]
    rows += [_block_io_row(kind, m.fit) for kind, m in profile.block_io.items()]
    rows.append(("steps after an idle engine: time added", _idle_wake_text(profile.idle_wake)))
    rows.append(("machine speed while measured: last / first step timed",
                 ", ".join(f"{k} x{r:.2f}" for k, r in profile.drift.items()) or "not recorded"))
    # what bounds the host and disk tiers the optimizer recommends for this machine
    memory, free = profile.fingerprint.host_memory_bytes, profile.disk_free_bytes
    rows.append(("machine memory / disk free where timed", " / ".join(
        "not recorded" if b is None else format_bytes(b) for b in (memory, free))))
    power = profile.power
    tag = " (modeled)" if power.modeled else f" ({power.source})"
    rows.append((f"power idle / busy{tag}", f"{power.power_w(0.0):.1f} W / {power.power_w(1.0):.1f} W"))
    energy = profile.energy_j_per_token()
    if energy:  # the smallest and largest batch at the shortest context, from the step fit
        context = min(e["context"] for e in energy)
        at = [e for e in energy if e["context"] == context]
        low, high = min(at, key=lambda e: e["batch"]), max(at, key=lambda e: e["batch"])
        rows.append((f"energy per token (step fit), batch {low['batch']} / {high['batch']}, context {context}{tag}",
                     f"{low['j_per_token']:.3f} J / {high['j_per_token']:.3f} J"))
    return rows


def _duration_text(profile: HardwareProfile, wall_s: float | None) -> str:
    """How long the measurement took. The profile's ``duration_s`` is its timing and fitting alone, without
    loading the model (73 s had read as the run's time, where the command ran 101 s): said so, and beside
    the command's own time when it measured just now (``wall_s``)."""
    timed = f"timed in {profile.duration_s:.0f} s"
    if wall_s is None:
        return f"{timed} (loading the model not counted)"
    return f"{timed} ({wall_s:.0f} s with loading the model)"


def profile_table(profile: HardwareProfile, path: Path, wall_s: float | None = None) -> Table:
    fp = profile.fingerprint
    table = Table(title=f"{profile.name}: {profile.model} on {fp.chip}, {fp.threads} threads, measured {fp.date}, "
                        f"{_duration_text(profile, wall_s)}", show_header=False)
    table.add_column("figure", style="bold")
    table.add_column("value", justify="right")
    for label, value in _step_rows(profile) + _other_rows(profile):
        table.add_row(label, value)
    table.caption = f"{path}"
    return table


def _measure(model: str, device: str, quick: bool, disk_dir: Optional[Path], console: Console) -> HardwareProfile:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from .measure import check_target, profile_model

    check_target(model, device)  # before the bar: bad input is one line
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task(f"loading {model}", total=None)

        def advance(label: str, done: int, total: int) -> None:
            bar.update(task, description=label, completed=done, total=total)

        return profile_model(model, device=device, quick=quick, disk_dir=disk_dir, progress=advance)


def _report(profile: HardwareProfile, path: Path, json_out: bool, wall_s: float | None = None) -> None:
    console.print(profile_table(profile, path, wall_s))
    for flagged in profile.flagged_fits():
        err_console.print(f"[yellow]flagged:[/] {escape(str(flagged))} is below the R² threshold", highlight=False)
    if profile.step_coverage_note:
        err_console.print(f"[yellow]flagged:[/] {escape(profile.step_coverage_note)}", highlight=False, soft_wrap=True)
    extra = [n for n in (profile.quantized_kv_note, profile.drift_note) if n]
    for note in list(profile.all_notes) + extra:
        err_console.print(f"[yellow]note:[/] {escape(str(note))}", highlight=False, soft_wrap=True)
    if json_out:
        print_json(_summary(profile, path, wall_s))


def _check_applies(given: tuple[str, ...], show: Optional[Path], refit: Optional[Path], check: Optional[Path],
                   cache: bool) -> None:
    """A one-line ``ValueError`` naming the options ``given`` (on the command line) that the chosen mode does
    not read, instead of running without them."""
    mode = "--show" if show is not None else "--refit" if refit is not None else "--check" if check is not None \
        else "--cache" if cache else None
    if mode is None:  # measuring: reads every option but the other modes'
        return
    what, reads = MODES[mode]
    unused = [option for option in given if option not in (*reads, "--json")]
    if unused:
        it = "it" if len(unused) == 1 else "them"
        raise ValueError(f"{mode} {what}: {', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not apply "
                         f"to it (drop {it})")


def _make_folder(folder: Path, what: str) -> None:
    """Create the folder a default output file goes to (`HardwareProfile.save` would, after the measurement),
    so that it is checked before: one that cannot be created is refused now, in one line."""
    if folder.exists() or folder.is_symlink():  # (a file of that name: `check_out_file` names it)
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{what} {folder}: cannot create it ({exc.strerror or exc})") from None


def _check_disk_dir(disk_dir: Optional[Path], quick: bool) -> None:
    """The folder the disk tier is timed in (--disk-dir, else $SKISTUNE_DISK_DIR, else the temporary directory)
    takes a file as large as the largest write timed: a full or read-only one had failed after the whole
    measurement (a tester's 4 MiB tmpfs: "No space left on device" after 72 s, the profile lost)."""
    import tempfile

    from skistune.runtime.disk_pool import DISK_DIR_ENV, default_disk_dir

    from .measure import FULL_GRID, QUICK_GRID
    from .transfers import disk_free_bytes

    env = default_disk_dir()
    folder, option = ((disk_dir, "--disk-dir") if disk_dir is not None else
                      (Path(env), f"${DISK_DIR_ENV}") if env is not None else
                      (Path(tempfile.gettempdir()), "the temporary directory (give --disk-dir for another)"))
    check_existing_dir(folder, option)
    largest = max((QUICK_GRID if quick else FULL_GRID).disk_bytes)
    free = disk_free_bytes(folder)
    if free is not None and free < 2 * largest:
        raise ValueError(f"{option} {folder}: {free / 2**20:.1f} MiB free, and the disk tier's timings write up to "
                         f"{largest >> 20} MiB there: free some space, or give --disk-dir on another drive")


def _check_outputs(model: str, device: str, quick: bool, out: Optional[Path], disk_dir: Optional[Path],
                   cache: bool) -> Optional[Path]:
    """Check where a measurement writes, before it runs: a path refused after minutes of measuring (a folder
    given as --out, a missing --disk-dir) had lost the measurement. Returns the file it writes, when known
    before (--out, or the cache's)."""
    from .measure import check_target

    # a bad --model before a folder is made for it, a bad --device before the fingerprint reads it
    check_target(model, device)
    _check_disk_dir(disk_dir, quick)
    if cache:
        out = cached_profile_path(model, device, machine_fingerprint(device))
        _make_folder(out.parent, "the cache folder")
        check_out_file(out, "the cached profile")
    elif out is not None:
        check_out_file(out, "--out")
    else:  # the default file, named as `profile_model` names the profile
        default = Path("profiles") / f"{device}-{model}{'-quick' if quick else ''}.json"
        _make_folder(default.parent, "the default --out folder")
        check_out_file(default, "the default --out")
    return out


def _profile(model: str, device: str, quick: bool, out: Optional[Path], disk_dir: Optional[Path],
             show: Optional[Path], refit: Optional[Path], check: Optional[Path], json_out: bool,
             cache: bool = False, given: tuple[str, ...] = ()) -> None:
    if sum(x is not None for x in (show, refit, check)) > 1:
        raise ValueError("--show, --refit and --check: give one")
    if cache and (out is not None or show or refit or check):
        raise ValueError("--cache writes the quick profile where skistune optimize reads it: not with --out, "
                         "--show, --refit or --check")
    _check_applies(given, show, refit, check, cache)
    if check is not None:
        _check(check, json_out)
        return
    if refit is not None and out is None and profile_path(refit) != Path(refit):  # (a shipped profile, by name)
        raise ValueError(f"--refit {refit}: a shipped profile, which is not written over: give --out FILE for the "
                         "refitted copy")
    if show is not None or refit is not None:
        shown = load_profile(show or refit)  # (a fingerprint warning: one line, through `cli_errors`)
        if refit is not None:  # same points, this version's step model; written over the file unless --out
            check_out_file(out or refit, "--out" if out is not None else "--refit")  # (before the fit)
            before = shown.step_fit
            shown = shown.refit_steps()
            refit = shown.save(out or refit)
            err_console.print(f"wrote {refit}", highlight=False, soft_wrap=True)
            err_console.print(f"refitted (projections: {rule_text(shown.step_cost.rows)}): step error median / "
                              "max, training "
                              f"{_errors(before.train)} -> {_errors(shown.step_fit.train)}, held-out "
                              f"{_held_errors(before)} -> {_held_errors(shown.step_fit)}", highlight=False)
        _report(shown, show or refit, json_out)
        return
    out = _check_outputs(model, device, quick, out, disk_dir, cache)
    started = time.perf_counter()
    profile = _measure(model, device, quick or cache, disk_dir, err_console)
    if profile.unreliable is not None:
        message = (f"this profile cannot be trusted ({profile.unreliable}): another process was probably using the "
                   "CPU; measure it again when the machine is quiet")
        if cache:  # (`skistune optimize` would not read it: it measures again)
            raise ValueError(f"{message}; the cached quick profile is left as it was")
        print_warning(message)
    path = profile.save(out or Path("profiles") / f"{profile.name}.json")
    _report(profile, path, json_out, wall_s=time.perf_counter() - started)


def _given(ctx: typer.Context) -> tuple[str, ...]:
    """The options given on the command line (as their flags, in the command's order), not left at their defaults:
    `--model smollm2-135m --show P` gives --model as surely as `--model llama-3-8b` does, which comparing values
    with the defaults would miss."""
    sources = {p.opts[0]: ctx.get_parameter_source(p.name) for p in ctx.command.params}
    # (by name: typer may run a vendored click, whose ParameterSource is not the installed click's)
    return tuple(flag for flag, source in sources.items()
                 if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP"))


def profile(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help=MODEL_HELP)] = "smollm2-135m",
    device: Annotated[str, typer.Option(help="where the runtime runs: cpu or cuda")] = "cpu",
    quick: Annotated[bool, typer.Option("--quick", help="a smaller grid, at most a minute on a laptop CPU "
                                        "(what `skistune optimize` measures when given no profile)")] = False,
    out: Annotated[Optional[Path], typer.Option(help="profile file to write (default profiles/DEVICE-MODEL"
                                                "[-quick].json)")] = None,
    disk_dir: Annotated[Optional[Path], typer.Option("--disk-dir", help=(
        "directory on the disk tier to time file I/O in (default: $SKISTUNE_DISK_DIR where set, where the runtime "
        "keeps its disk tier, else a temporary directory)"))] = None,
    show: Annotated[Optional[Path], typer.Option(help="print an existing profile instead of measuring")] = None,
    refit: Annotated[Optional[Path], typer.Option(help="fit an existing profile's step cost model again from its "
                                                  "measured points with this version's model (written back, or "
                                                  "to --out), instead of measuring")] = None,
    check: Annotated[Optional[Path], typer.Option(help="time a few of an existing profile's steps again and say "
                                                  "how much faster or slower this machine runs them now")] = None,
    cache: Annotated[bool, typer.Option("--cache", help="measure the quick profile again and write it where "
                                        "`skistune optimize` reads it when given no profile (replacing the one "
                                        "it keeps for this machine)")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Measure this machine for a model: whole runtime steps over batch x context and prefill chunks (and
    a few with 8- and 4-bit KV), the attention kernel at 16/8/4/2 bits, quantize-on-append, the scheduler's
    overhead, transfers between tiers and power; fit the cost functions the simulator reads and write them
    to a profile file."""
    from skistune.signals import stopped_by_signal

    given = _given(ctx)
    written = _target(model, device, quick, out, refit, cache)
    with stopped_by_signal(lambda: _kept(written, ctx), json_out):
        cli_errors(_profile)(model, device, quick, out, disk_dir, show, refit, check, json_out=json_out,
                             cache=cache, given=given)


def _target(model: str, device: str, quick: bool, out: Optional[Path], refit: Optional[Path],
            cache: bool) -> dict[Path, object]:
    """The file the command would write (`signals.file_states`: to tell, when it is stopped, whether it did):
    --out, the file --refit fits again, the cache's, or the default profiles/DEVICE-MODEL[-quick].json; none
    for --show and --check, which write nothing (nor for a bad --model or --device: refused before measuring)."""
    from skistune.signals import file_states

    path = out or refit
    if path is None and not cache:
        path = Path("profiles") / f"{device}-{model}{'-quick' if quick else ''}.json"
    elif path is None:
        try:
            path = cached_profile_path(model, device, machine_fingerprint(device))
        except (ValueError, OSError, KeyError):
            path = None
    return file_states([path] if path is not None else [])


def _kept(before: dict[Path, object], ctx: typer.Context) -> tuple[str, dict]:
    """What a stopped profile leaves (`signals.stopped_by_signal`): a profile is written whole once measured and
    fitted (or fitted again: --refit), never part way, so nothing is kept of one stopped before its end; its file,
    if there was one, is as it was. --show and --check write nothing."""
    from skistune.signals import rerun_command, written_since

    rerun, params = rerun_command(ctx), ctx.params
    if params.get("show") is not None or params.get("check") is not None:
        what = "--show only reads the profile" if params.get("show") is not None else \
            "--check only times the profile's steps again"
        return f"nothing written ({what}); rerun `{rerun}` to run it again", {"out": None, "rerun": rerun}
    written = written_since(before)
    if written:
        return f"the profile was written whole: {written[0]}", {"out": str(written[0]), "rerun": rerun}
    left = next((f" ({p} is as it was)" for p in before if p.exists()), "")
    if params.get("refit") is not None:
        return (f"no profile written: a refit is written whole at its end, nothing part way{left}; rerun `{rerun}` "
                "to fit it again", {"out": None, "rerun": rerun})
    return (f"no profile written: a profile is written whole at the end of the measurement, nothing part way"
            f"{left}; rerun `{rerun}` to measure again", {"out": None, "rerun": rerun})


def _check(path: Path, json_out: bool) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .check import check_device, speed_check

    profile = load_profile(path, check_fingerprint=False)
    check_device(profile)  # (one line: not also the fingerprint warning of a machine it cannot run on)
    warn_if_elsewhere(profile, path)  # (one line, through `cli_errors`)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=True, disable=not err_console.is_terminal) as bar:
        task = bar.add_task(f"loading {profile.model}", total=None)
        result = speed_check(profile, progress=lambda label, done, total: bar.update(
            task, description=label, completed=done, total=total))
    table = Table(title=f"{path}: its steps timed again on this machine")
    for name, justify in (("step", "left"), ("grid point", "left"), ("profile (ms)", "right"),
                          ("now (ms)", "right"), ("now / profile", "right")):
        table.add_column(name, justify=justify)
    for p in result.points:
        grid = ", ".join(f"{k} {v}" for k, v in p.grid.items() if k != "bits")
        table.add_row(p.kind, grid, f"{p.then_s * 1e3:.1f}", f"{p.now_s * 1e3:.1f}", f"{p.ratio:.3f}")
    console.print(table)
    console.print(result.summary_line(), highlight=False)
    if json_out:
        print_json({"profile": str(path), **result.to_dict()})


def _idle_wake_text(wake) -> str:
    """Per idle, each step's median extra from the first after it, e.g. "after 2 s: +22.7 / +2.7 ms"."""
    if wake is None:
        return "not measured"
    per_idle = "; ".join(f"after {g:g} s: " + " / ".join(f"{x * 1e3:+.1f}" for x in wake.typical_s(g)) + " ms"
                         for g in wake.idle_s)
    return per_idle + (f" (medians of {wake.rounds} rounds)" if wake.rounds > 1 else "")
