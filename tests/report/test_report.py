"""`skistune report`: the report's data from a study's storage alone, the Pareto front, the simulated
replays behind the plots, the files (valid PNGs, a self-contained HTML page), the command's `--json` line
and its one-line errors (exit 2)."""
import dataclasses
import json
import shutil

import optuna
import pytest
from report_fixtures import fake_validation, make_study
from typer.testing import CliRunner

from skistune.cli import app
from skistune.config import KVConfig
from skistune.display import significant
from skistune.optimize import VALIDATED_ATTR
from skistune.report import (FILES, build_report, memory_timeline, report_lines, report_tables, sampled_replay,
                             table_html, tradeoff_front, write_report)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """4 trials of 16 chat requests under TBT p99 <= 200 ms, no validation: (result, storage URL). Seed 2
    samples a trial that meets no rate (``served`` broken), so the constraint table has a violation."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return make_study(tmp_path_factory.mktemp("study"), seed=2)


def violating(result) -> dict[str, int]:
    """Trials of the study breaking each constraint (read from the trials themselves)."""
    counts: dict[str, int] = {}
    for t in result.study.get_trials():
        for name, value in t.user_attrs["violations"].items():
            if value > 0:
                counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.fixture(scope="module")
def report(study):
    return build_report("t", storage=study[1])


@pytest.fixture
def validated_storage(study, tmp_path):
    """A copy of the study with validation records set by hand (simulated, not the real model)."""
    result, url = study
    copy = tmp_path / "v.db"
    shutil.copy(url.removeprefix("sqlite:///"), copy)
    storage = f"sqlite:///{copy}"
    records = fake_validation(result.problem, result.best[0].config)
    optuna.load_study(study_name="t", storage=storage).set_user_attr(VALIDATED_ATTR, records)
    return storage


def test_report_reads_the_study_back_best_first_with_the_baseline_scored_alike(study, report):
    result, _ = study
    assert report.name == "t" and len(report.evaluations) == 4 and report.feasible
    rest = report.best[report.refined:]  # (those optimize printed come first, in its order: ties go to the baseline)
    assert [e.values[0] for e in rest] == sorted((e.values[0] for e in rest), reverse=True)
    assert all(e.feasible for e in report.best) and len({e.config for e in report.best}) == len(report.best)
    assert report.baseline.config == result.problem.base and report.baseline.trial is None
    assert report.validated == () and report.binding == violating(result) and report.binding
    assert report.importance_method == "fANOVA" and report.importance_note is None
    assert sum(report.importance.values()) == pytest.approx(1.0)
    assert set(report.importance) <= {p.name for p in result.problem.space.params}


def test_the_configs_optimize_printed_are_listed_with_its_refined_figures(study, report):
    result, _ = study
    n = len(result.best)
    assert report.refined == n >= 1
    assert [(e.config, e.values, e.trial) for e in report.best[:n]] == [(e.config, e.values, e.trial)
                                                                         for e in result.best]
    assert report.baseline.values == result.baseline.values
    assert not {e.config for e in report.best[n:]} & {e.config for e in result.best}


def test_front_keeps_exactly_the_configs_no_other_beats_on_rate_energy_and_quality(report):
    base = report.best[0]

    def variant(trial, rate, energy, loss, max_num_seqs):
        figures = {**base.figures, "energy_j_per_token": energy, "quality_loss": loss, "quality_basis": "measured"}
        return dataclasses.replace(base, config=base.config.with_knobs({"batching.max_num_seqs": max_num_seqs}),
                                   values=(rate,), figures=figures, trial=trial)

    pool = [variant(0, 2.0, 1.0, 0.00, 1), variant(1, 3.0, 1.0, 0.01, 2),  # faster but lossy: both kept
            variant(2, 2.0, 1.5, 0.00, 3),  # beaten by 0 (same rate and loss, more energy)
            variant(3, 1.0, 0.5, 0.00, 4),  # cheapest: kept
            variant(4, 2.0, 1.0, 0.02, 5)]  # beaten by 0
    infeasible = dataclasses.replace(variant(5, 9.0, 0.1, 0.0, 6), violations={"served": 1.0})
    front = tradeoff_front(report.problem, [*pool, infeasible])
    assert [e.trial for e in front] == [1, 0, 3]  # best first objective first


def test_front_keeps_one_of_equal_configs_and_ignores_float_noise(report):
    """Configs predicted the same figures (up to float summation noise, each better on a different axis by
    1e-15) are one point of the front, not several: the report had listed 9 where optimize listed 4."""
    base = report.best[0]

    def variant(trial, rate, energy, max_num_seqs):
        return dataclasses.replace(base, config=base.config.with_knobs({"batching.max_num_seqs": max_num_seqs}),
                                   values=(rate,), figures={**base.figures, "energy_j_per_token": energy},
                                   trial=trial)

    pool = [variant(0, 2.0, 1.0, 1), variant(1, 2.0, 1.0, 2), variant(2, 2.0 - 1e-15, 1.0 - 1e-15, 3),
            variant(3, 1.0, 0.5, 4)]
    assert [e.trial for e in tradeoff_front(report.problem, pool)] == [0, 3]


def test_the_front_shows_the_refined_figures_optimize_printed(study, report):
    """One set of figures per config: a refined config's row in the front is the one in the best table
    (the front had shown its search figures, 0.094 req/s beside the best table's 0.095)."""
    result, _ = study
    refined = {e.config: e for e in [*result.best, result.baseline]}
    shown = [e for e in report.pareto if e.config in refined]
    assert shown and all(e.values == refined[e.config].values and e.figures == refined[e.config].figures
                         for e in shown)
    by_trial = {e.trial: e for e in report.evaluations}
    assert all(by_trial[e.trial].values == refined[e.config].values for e in result.best if e.trial is not None)


def test_tables_and_html_carry_the_same_rows(report):
    import html
    tables = report_tables(report)
    titles = [str(t.title).split(" ")[0] for t in tables]
    assert titles == ["Best", "Pareto", "Constraints:", "Knob"]  # no validation stored: no fidelity table
    assert tables[0].row_count == len(report.best) + 1 and tables[1].row_count == len(report.pareto) + 1
    # the front's configs named by their place among the best configs, or by a knob line under the tables
    labels = list(tables[1].columns[1].cells)
    best = {b.trial: f"#{i + 1}" for i, b in enumerate(report.best)}
    assert labels[:-1] == [best.get(e.trial, f"trial {e.trial}, below") for e in report.pareto]
    assert labels[-1] == "vLLM defaults"
    lines = report_lines(report)
    assert all(any(line.startswith(f"trial {e.trial} (Pareto front): ") for line in lines)
               for e in report.pareto if e.trial not in best)
    violations = table_html(tables[2])
    for name, n in report.binding.items():
        assert f"<td class='left'>{html.escape(name)}</td><td class='right'>{n} of 4</td>" in violations
    assert violations.count("<tr>") == 1 + len(report.problem.constraints)


def test_pareto_legend_calls_a_4_bit_config_lossy_even_when_its_loss_rounds_to_zero(report, monkeypatch):
    """A 4-bit config predicted +0.00% had put "all lossless: quality loss 0" in the legend."""
    import skistune.report as rep

    figures = []
    monkeypatch.setattr(rep, "_png", lambda fig: figures.append(fig) or b"")

    def legend() -> list[str]:
        return [t.get_text() for t in figures[-1].axes[0].get_legend().get_texts()]

    rep.plot_pareto(report)
    assert any(text.startswith("feasible (all lossless") for text in legend())  # (the study is lossless)
    first = next(e for e in report.evaluations if e.feasible)
    int4 = dataclasses.replace(first, config=first.config.with_knobs({"bitwidth.value_bits": 4}),
                               figures={**first.figures, "quality_loss": 0.0, "quality_basis": "measured"})
    rep.plot_pareto(dataclasses.replace(report, evaluations=(*report.evaluations, int4)))
    assert "feasible" in legend() and not any("all lossless" in text for text in legend())


def test_pareto_plot_goes_log_when_a_config_in_view_dwarfs_the_others(report, monkeypatch):
    """A config whose J/token is thousands of times the others' squashed every feasible point onto the axis: a log
    axis, decided from the points in view (those meeting no rate are zoomed out: `test_report_plots`)."""
    import skistune.report as rep
    from skistune.plotting import LOG_AXIS_SPAN

    figures = []
    monkeypatch.setattr(rep, "_png", lambda fig: figures.append(fig) or b"")
    rep.plot_pareto(report)
    energies = [e.figures["energy_j_per_token"] for e in [*report.evaluations, report.baseline] if e.values[0] > 0]
    spread = max(energies) > LOG_AXIS_SPAN * min(energies)
    assert figures[-1].axes[0].get_yscale() == ("log" if spread else "linear")
    idle = dataclasses.replace(report.evaluations[0], figures={**report.evaluations[0].figures,
                                                               "energy_j_per_token": 1000 * max(energies)})
    rep.plot_pareto(dataclasses.replace(report, evaluations=(idle, *report.evaluations[1:])))
    assert figures[-1].axes[0].get_yscale() == "log"


def test_pareto_plot_zooms_to_the_configs_that_meet_a_rate(report, monkeypatch):
    """A tester's one config meeting no rate (a cross at 0 req/s, 3.6 J/token) squashed the feasible points
    (0.014-0.016 req/s, ~1.5 J/token) into a corner: the axes hold the configs that meet a rate, and the
    title says how many are out of view."""
    import skistune.report as rep

    figures = []
    monkeypatch.setattr(rep, "_png", lambda fig: figures.append(fig) or b"")
    _, rate = rep.plot_x_axis(report)
    served = [e for e in report.evaluations if rate(e) > 0]
    none = dataclasses.replace(served[0], values=tuple(0.0 for _ in served[0].values),
                               figures={**served[0].figures, "energy_j_per_token": 2.5 * max(
                                   e.figures["energy_j_per_token"] for e in served)})
    rep.plot_pareto(dataclasses.replace(report, evaluations=(*served, none)))
    ax = figures[-1].axes[0]
    assert ax.get_xlim()[0] > 0 and ax.get_ylim()[1] < none.figures["energy_j_per_token"]
    assert ax.get_title().endswith("(1 trial meeting no rate, at 0, out of view)")
    rep.plot_pareto(dataclasses.replace(report, evaluations=tuple(served)))
    assert "out of view" not in figures[-1].axes[0].get_title()


def test_write_report_writes_three_pngs_and_a_self_contained_html(report, tmp_path):
    files, missing = write_report(report, tmp_path / "out")
    assert missing == [] and set(files) == set(FILES)
    for name in ("pareto", "latency", "memory"):
        assert files[name].name == FILES[name] and files[name].read_bytes().startswith(PNG_SIGNATURE)
    page = files["html"].read_text()
    assert page.count("data:image/png;base64,") == 3 and page.count("<table>") == 4
    assert "Best configs of study t (4 trials)" in page and "Pareto front" in page and "Knob importance" in page
    assert f"optuna-dashboard {report.storage}" in page and "no validated run in the study" in page
    assert "<script" not in page and "http" not in page  # nothing fetched from elsewhere


def test_validated_records_give_the_fidelity_table_and_the_timeline_of_the_validation_slice(validated_storage):
    rep = build_report("t", storage=validated_storage)
    assert [v["role"] for v in rep.validated] == ["candidate", "baseline"]
    fidelity = table_html(report_tables(rep)[3])
    assert "Predicted vs validated" in fidelity and fidelity.count("(-9%)") == 3  # measured = 1.1 x predicted
    assert "<td class='left'>base</td>" in fidelity and "no (tbt:p99&lt;=200ms)" in fidelity
    timeline = memory_timeline(rep)
    assert timeline.label.startswith("simulated replay of the validation slice (6 requests")
    assert timeline.label.endswith("validated winner") and rep.validated[0]["holds"]
    rep.validated[0]["holds"] = False  # a winner whose replay broke a constraint is not called validated
    assert "winner (its runtime replay broke a constraint)" in memory_timeline(rep).label
    winner = KVConfig.from_dict(rep.validated[0]["config"])  # the tiers it has, whichever the search chose
    tiers = ["device"] + (["host"] if winner.offload.host_kv_bytes else []) + \
        (["disk"] if winner.offload.host_kv_bytes and winner.offload.disk_kv_bytes else [])
    assert list(timeline.used_bytes) == tiers and (timeline.time_s[1:] >= timeline.time_s[:-1]).all()
    device = timeline.used_bytes["device"]
    assert device[0] == device[-1] == 0 and 0 < device.max() <= timeline.capacity_bytes["device"]


def test_the_timeline_peaks_where_the_tables_kv_peak_does(report):
    """Without a validation the timeline replays #1 on the search's requests at its rate: its device line
    reaches the KV peak the tables show (sampled only between steps, it had missed the blocks a step holds
    until its finished sequences free them: 49.9 MiB plotted against 54.8 MiB in the tables)."""
    timeline = memory_timeline(report)
    assert timeline.label.startswith("simulated replay of the search workload")
    assert timeline.used_bytes["device"].max() == report.best[0].figures["kv_peak_bytes"]


def test_sampled_replay_follows_every_tier_and_never_exceeds_the_peak(report):
    p = report.problem
    config = p.base.with_knobs({"offload.host_kv_bytes": 1 << 30, "offload.device_kv_bytes": 64 << 20})
    timeline = sampled_replay(config, p.search.requests, p.target, 0.02, "tiers")
    assert list(timeline.used_bytes) == ["device", "host"] and timeline.capacity_bytes["host"] > 0
    engine_peak = report.best[0].figures["kv_peak_bytes"]
    assert timeline.used_bytes["device"].max() <= timeline.capacity_bytes["device"] < engine_peak
    assert timeline.used_bytes["host"].max() > 0  # the small device pool demotes cached prefix blocks


def invoke(*args):
    return CliRunner().invoke(app, ["report", *args])


def test_command_defaults_to_the_study_file_and_folder_here_and_ends_with_json(study, report, tmp_path, monkeypatch):
    shutil.copy(study[1].removeprefix("sqlite:///"), tmp_path / "skistune-t.db")  # `default_storage("t")`
    monkeypatch.chdir(tmp_path)
    r = invoke("t", "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["study"] == "t" and summary["trials"] == 4 and summary["feasible"]
    assert summary["best"][0]["trial"] == report.best[0].trial and summary["importance_method"] == "fANOVA"
    assert summary["files"] == {k: f"skistune-report-t/{v}" for k, v in FILES.items()}
    assert all((tmp_path / path).is_file() for path in summary["files"].values())
    assert "Best configs of study t" in r.stdout and "Knob importance for capacity" in r.stdout
    # (energy's basis, where scripts and readers see J/token: the shipped CPU profile's power is modeled)
    assert summary["power_source"] == "modeled" and r.stdout.count("(modeled)") >= 2  # J/token of best, Pareto (folded)


def test_infeasible_study_reports_the_binding_constraint_without_the_best_config_plots(tmp_path):
    _, storage = make_study(tmp_path, name="hard", n_trials=2, slo="ttft:p99<=55ms")
    r = invoke("hard", "--storage", storage, "--out-dir", str(tmp_path / "out"), "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert not summary["feasible"] and summary["binding"]["ttft:p99<=55ms"] == 2 and set(summary["files"]) == {"html"}
    assert "no config met every constraint in 2 trials" in r.stdout and "closest" in r.stdout
    # why, as optimize says it: a 55 ms TTFT is broken even with each request served alone
    assert "even with each request served alone" in summary["why"] and summary["why"][:40] in r.stdout
    assert "no latency CDF" in r.stderr and "no memory timeline" in r.stderr
    assert "no Pareto plot: no config met every constraint, and every trial's capacity (req/s) is 0" in r.stderr


@pytest.mark.parametrize("case, message", [
    ("no-file", "no such database file"),
    ("no-study", "study 'nope': not in storage"),
    ("no-recipe", "holds no skistune recipe"),
    ("out-is-file", "is a file; give a folder"),
])
def test_bad_input_is_one_line_and_exit_2(study, tmp_path, case, message):
    storage = study[1]
    name, extra = {"no-file": ("t", ["--storage", f"sqlite:///{tmp_path / 'missing.db'}"]),
                   "no-study": ("nope", ["--storage", storage]),
                   "no-recipe": ("plain", ["--storage", storage]),
                   "out-is-file": ("t", ["--storage", storage, "--out-dir", str(tmp_path / "f")])}[case]
    if case == "no-recipe":
        optuna.create_study(study_name="plain", storage=storage, load_if_exists=True)
    (tmp_path / "f").write_text("")
    r = invoke(name, *extra)
    assert r.exit_code == 2, r.output
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert not (tmp_path / "missing.db").exists()


def test_the_validated_winner_is_listed_first_as_optimize_wrote_it():
    from skistune.config import KVConfig
    from skistune.optimize import Evaluation
    from skistune.report import _winner_first

    configs = [KVConfig().with_knobs({"batching.max_num_seqs": n}) for n in (8, 16, 32)]
    evaluations = [Evaluation(c, 1.0, (1.0,), {}, {}, trial=i) for i, c in enumerate(configs)]
    validated = [{"role": "candidate", "config": configs[2].to_dict()},
                 {"role": "candidate", "config": configs[0].to_dict()},
                 {"role": "baseline", "config": KVConfig().to_dict()}]
    assert [e.trial for e in _winner_first(evaluations, None, validated)] == [2, 0, 1]  # (a study from before)
    assert [e.trial for e in _winner_first(evaluations, None, [])] == [0, 1, 2]  # not validated: the search's order
    baseline_only = [{"role": "baseline", "config": configs[1].to_dict()}]
    assert [e.trial for e in _winner_first(evaluations, None, baseline_only)] == [0, 1, 2]
    # what optimize ranked first and wrote, validated or not (a tie to the baseline, a simpler config)
    assert [e.trial for e in _winner_first(evaluations, configs[1].to_dict(), [])] == [1, 0, 2]
    assert [e.trial for e in _winner_first(evaluations, configs[0].to_dict(), validated)] == [0, 1, 2]


def test_an_out_dir_that_cannot_be_created_is_refused_before_any_work(tmp_path):
    """`--out-dir /proc/nope` printed the whole report, then failed writing it: checked first, by making a
    folder there (permission bits say nothing for root)."""
    from skistune.report import check_out_dir

    with pytest.raises(ValueError, match="--out-dir /proc/nope: cannot create a folder in /proc"):
        check_out_dir("/proc/nope")
    assert check_out_dir(tmp_path / "new" / "sub") == tmp_path / "new" / "sub"
    assert list(tmp_path.iterdir()) == []  # (the check leaves nothing behind)


def test_without_a_rate_objective_the_pareto_plot_spreads_trials_on_another_axis(report):
    """An energy study scores every config at the workload's own rate: a rate axis stacked every trial on
    one vertical line. Its x axis is then the study's first objective other than energy, else the KV peak."""
    from dataclasses import replace

    from skistune.objectives import parse_objectives
    from skistune.report import plot_x_axis

    assert plot_x_axis(report)[0] == "capacity (req/s)"  # (the fixture's study maximises capacity)
    at_own_rate = [replace(e, figures={**e.figures, "rate_rps": 0.5}) for e in report.evaluations]

    def study_of(objective):
        return replace(report, problem=replace(report.problem, objectives=parse_objectives(objective)),
                       evaluations=tuple(at_own_rate))

    axis, x = plot_x_axis(study_of("energy"))
    assert axis == "KV peak (MiB)" and x(at_own_rate[0]) == at_own_rate[0].figures["kv_peak_bytes"] / 2**20
    assert plot_x_axis(study_of("energy,memory"))[0] == "memory: KV peak (MiB)"


def test_an_energy_infeasible_study_says_why_as_optimize_does(tmp_path):
    """An energy budget no config meets: optimize explains it (`energy_line`), the report had said only "see the
    constraints table" (and "why": null)."""
    from skistune.optimize_cli import energy_line

    result, storage = make_study(tmp_path, name="en", n_trials=2, energy="0.05J/token")
    assert not result.feasible and result.binding["energy<=0.05J/token"] == 2
    said = energy_line(result)
    assert said.startswith("energy<=0.05J/token binds in 2 of 2 trials: the closest configs use")
    assert build_report("en", storage=storage).why == said  # (no latency broke: no why_no_rate_line)
    r = invoke("en", "--storage", storage, "--out-dir", str(tmp_path / "out"), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["why"] == said and said[:60] in r.stdout


def test_an_energy_budget_judged_at_the_workloads_rate_is_not_said_to_be_at_capacity(tmp_path):
    """Goodput is judged at the workload's own rate: the line had said "at their capacity" and that a lower rate
    raises J/token (true, but there a higher rate is what helps)."""
    from skistune.optimize_cli import energy_line

    result, _ = make_study(tmp_path, name="gp", n_trials=2, energy="0.05J/token", objective="goodput")
    said = energy_line(result)
    rate = result.problem.search.base_rps
    assert "at their capacity" not in said and f"at the workload's rate ({significant(rate)} req/s)" in said
    assert "a higher arrival rate (--rate) lowers it" in said


def test_the_baselines_config_shows_the_base_rows_refined_figures_wherever_it_ranks(study, tmp_path):
    """A study whose printed (refined) configs leave out trial 0, the baseline's config: its row below them had
    the search's figure (0.04711 req/s) beside the base row's refined one (0.04814), as if they disagreed."""
    result, url = study
    copy = tmp_path / "r.db"
    shutil.copy(url.removeprefix("sqlite:///"), copy)
    storage = f"sqlite:///{copy}"
    printed = [e for e in result.best if e.config != result.problem.base][:1]  # (optimize printed one, not trial 0)
    stored = optuna.load_study(study_name="t", storage=storage)
    stored.set_user_attr("skistune.refined", {"best": [e.to_record() for e in printed],
                                              "baseline": result.baseline.to_record()})
    stored.set_user_attr("skistune.chosen", printed[0].config.to_dict())
    rep = build_report("t", storage=storage)
    rank = next(i for i, e in enumerate(rep.best) if e.trial == 0)
    assert rank >= rep.refined == 1
    row = rep.best[rank]
    assert row.values == rep.baseline.values and row.figures == rep.baseline.figures
    rows = report_tables(rep)[0]
    assert list(rows.columns[2].cells)[rank] == list(rows.columns[2].cells)[-1]  # the same capacity cell
    rest = [f"#{i + 1}" for i in range(1, len(rep.best)) if i != rank]
    title = str(rows.title)
    assert f"#1, #{rank + 1} and base at 2% precision as optimize printed them" in title
    assert title.endswith(f"{', '.join(rest)} at the search's" if rest else "printed them")


def test_the_number_one_label_is_anchored_at_its_ring_and_covers_no_other_dot(report, monkeypatch):
    """The "#1 trial 11" label, written beside its point, had sat over trial 4's dot: it is now on a line from
    its own ring, at an offset that covers no other point (here one put where the label used to go)."""
    import math

    from matplotlib.text import Text

    import skistune.report as rep

    figures = []
    monkeypatch.setattr(rep, "_png", lambda fig: figures.append(fig) or b"")

    def number_one(rpt):
        rep.plot_pareto(rpt)
        ax = figures[-1].axes[0]
        figures[-1].draw_without_rendering()
        return ax, next(t for t in ax.texts if t.get_text().startswith("#1 "))

    first = report.best[0]
    point = (first.values[0], first.figures["energy_j_per_token"])
    ax, label = number_one(report)
    # a dot where the old label went: just left of the ring and above it (the ring is the rightmost point)
    px, py = ax.transData.transform(point)
    x, y = ax.transData.inverted().transform((px - 25, py + 14))
    figures_at = {**first.figures, "energy_j_per_token": y}
    neighbour = dataclasses.replace(first, config=first.config.with_knobs({"batching.max_num_seqs": 3}),
                                    values=(x,), figures=figures_at, violations={"served": 1.0}, trial=99)
    crowded = dataclasses.replace(report, evaluations=(*report.evaluations, neighbour))
    ax, label = number_one(crowded)
    assert label.xy == point and label.arrow_patch is not None  # anchored at #1's own coordinates, with a line
    box = Text.get_window_extent(label)
    dots = [(e.values[0], e.figures["energy_j_per_token"]) for e in (*crowded.evaluations, crowded.baseline)]
    pixels = ax.transData.transform([d for d in dots if all(map(math.isfinite, d))])
    assert not box.count_contains(pixels)


def test_a_sglang_study_names_its_baseline_sglangs_defaults_everywhere(tmp_path, monkeypatch):
    """A study made with --target sglang had its baseline called "vLLM defaults" in the Pareto table and the
    pareto.png legend, under a footer that said "base: SGLang defaults (...)"."""
    import skistune.report as rep

    _, storage = make_study(tmp_path, name="sg", n_trials=2, target="sglang")
    report = build_report("sg", storage=storage)
    assert list(report_tables(report)[1].columns[1].cells)[-1] == "SGLang defaults"
    assert any(line.startswith("base: SGLang defaults (") for line in report_lines(report))
    figures = []
    monkeypatch.setattr(rep, "_png", lambda fig: figures.append(fig) or b"")
    rep.plot_pareto(report)
    legend = [t.get_text() for t in figures[-1].axes[0].get_legend().get_texts()]
    assert any(text.startswith("baseline (SGLang defaults") for text in legend)
    assert not any("vLLM" in text for text in legend)


def test_a_trial_the_front_left_for_the_written_config_is_named_and_the_json_says_each_rows_precision(report):
    """A worker's later trial, at the search's 10% precision, beat #1's refined figures by 1% on both axes; the
    front (which keeps #1 for such a tie) listed #1 alone and said nothing of it, and every row's precision read
    null in the JSON."""
    from skistune.optimize import REFINE_PRECISION, SEARCH_PRECISION
    from skistune.report import pareto_lines, summary

    best = report.best[0]
    later = dataclasses.replace(best, config=best.config.with_knobs({"batching.max_num_seqs": 77}), trial=99,
                                values=(best.values[0] * 1.01,))
    tied = dataclasses.replace(report, front_ties=(later,))
    assert pareto_lines(tied)[-1] == ("trial 99: within 2% of #1 on every axis of the front (its figures at the "
                                      "search's precision), so the same point as #1, which the front keeps for it")
    assert not any("trial 99" in line for line in pareto_lines(report))
    out = summary(tied, {})
    assert out["front_ties"] == [99]
    assert out["best"][0]["capacity_precision"] == REFINE_PRECISION == out["baseline"]["capacity_precision"]
    unrefined = [e for i, e in enumerate(report.best) if i >= report.refined and e.config != report.baseline.config]
    assert all(summary(report, {})["best"][report.best.index(e)]["capacity_precision"] == SEARCH_PRECISION
               for e in unrefined)


def test_report_counts_trials_as_optimize_does_simplifying_ones_apart(study, tmp_path):
    """optimize's JSON and provenance count the searched trials; trials that tried a winner's knob groups at the
    baseline's values (`optimize._simplify`) are counted apart, by report too (it had said 44 where optimize
    said 42, and #1 was trial 44)."""
    from skistune.optimize import SIMPLIFIES_ATTR

    result, url = study
    copy = tmp_path / "s.db"
    shutil.copy(url.removeprefix("sqlite:///"), copy)
    storage = f"sqlite:///{copy}"
    stored = optuna.load_study(study_name="t", storage=storage)
    last = stored.trials[-1]
    stored.add_trial(optuna.trial.create_trial(params=last.params, distributions=last.distributions,
                                               values=last.values,
                                               user_attrs={**last.user_attrs, SIMPLIFIES_ATTR: last.number}))
    report = build_report("t", storage=storage)
    assert (report.searched_trials, report.simplifying_trials) == (result.trials, 1) == (4, 1)
    assert "Best configs of study t (4 trials and 1 simplifying a winner)" in report_tables(report)[0].title
    r = invoke("t", "--storage", storage, "--out-dir", str(tmp_path / "r"), "--json")
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert (summary["trials"], summary["simplifying_trials"]) == (4, 1), r.output


def test_knob_importance_is_not_computed_for_an_objective_that_moves_less_than_the_resolution(study):
    """Goodput that varied by 0.009% over every trial had its 'importance' ranked (batching.policy 0.467)."""
    from skistune.report import knob_importance

    result, _ = study
    flat = optuna.create_study(directions=["maximize"])
    for i, t in enumerate(result.study.get_trials()):
        flat.add_trial(optuna.trial.create_trial(params=t.params, distributions=t.distributions,
                                                 values=[0.0114512 + 1e-7 * i], user_attrs=t.user_attrs))
    found, _, note = knob_importance(flat, result.problem)
    assert found == {} and "varies by at most 2% over the trials" in note
    found, _, note = knob_importance(result.study, result.problem)  # (the study's own spread is real)
    assert found and note is None
