"""What the report's plots compute (scales, limits, labels, lines, file names), for problems a visual QA test
found: a Pareto y axis chosen from points zoomed out of view, a rate x axis for a study without a rate
objective, labels placed before the zoom, the baseline drawn twice, empty CDF panels for one request, SLOs in
the wrong unit or missing, another study's plots left in a reused folder and an unsafe default folder name."""
from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import optuna
import pytest
from report_fixtures import make_study
from typer.testing import CliRunner

import skistune.report as rep
from skistune.cli import app
from skistune.objectives import parse_objectives
from skistune.report import build_report
from skistune.slo import parse_slo


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return make_study(tmp_path_factory.mktemp("plots"), seed=2)


@pytest.fixture(scope="module")
def report(study):
    return build_report("t", storage=study[1])


@pytest.fixture
def figures(monkeypatch):
    """The figures the report draws, instead of their PNG bytes."""
    drawn = []
    monkeypatch.setattr(rep, "_png", lambda fig: drawn.append(fig) or b"")
    return drawn


def variant(e, trial: int, rate: float, energy: float, *, feasible: bool = True, knob: int | None = None):
    """``e`` as another trial at ``rate`` req/s (its capacity objective) and ``energy`` J/token."""
    config = e.config if knob is None else e.config.with_knobs({"batching.max_num_seqs": knob})
    violations = {**e.violations, "served": 0.0 if feasible else 1.0}
    return dataclasses.replace(e, config=config, trial=trial, values=(rate,), violations=violations,
                               figures={**e.figures, "rate_rps": rate, "energy_j_per_token": energy})


def spread_report(report, energies, *, zero_rate_energy: float | None = 31.0):
    """The fixture's report with trials at rising rates and the J/token ``energies``, the baseline among them,
    and (``zero_rate_energy``) one trial meeting no rate, at 0 req/s with that J/token."""
    first = report.best[0]
    served = [variant(first, i + 1, 0.02 * (i + 1), j, knob=i + 1) for i, j in enumerate(energies)]
    none = [variant(first, 99, 0.0, zero_rate_energy, feasible=False, knob=99)] if zero_rate_energy else []
    base = variant(report.baseline, None, 0.09, 0.41)
    return dataclasses.replace(report, evaluations=(*served, *none), baseline=base, pareto=(served[-1],),
                               best=(served[-1],), front_ties=())  # (#1: the fastest and cheapest, the last)


def tick_texts(ax, axis: str = "y") -> list[str]:
    """The labels of the ticks inside the axes' limits (major and minor), drawn."""
    ax.figure.draw_without_rendering()
    which = ax.yaxis if axis == "y" else ax.xaxis
    low, high = sorted(ax.get_ylim() if axis == "y" else ax.get_xlim())
    ticks = [*which.get_major_ticks(), *which.get_minor_ticks()]
    return [t.label1.get_text() for t in ticks if low <= t.get_loc() <= high and t.label1.get_text()]


# ---- 1. the Pareto plot's scale and labels come from the points in view -----------------------------------
def test_the_pareto_y_axis_is_chosen_from_the_points_in_view_and_labelled(report, figures):
    """Trials meeting no rate (J/token up to 31) made the span over 100x: a log axis without minor labels, then
    zoomed to 0.28-0.95 J/token, where only "1" was labelled."""
    energies = [0.95, 0.72, 0.57, 0.5, 0.44, 0.4, 0.37, 0.33, 0.3, 0.28]
    rep.plot_pareto(spread_report(report, energies))
    ax = figures[-1].axes[0]
    assert ax.get_yscale() == "linear"
    low, high = ax.get_ylim()
    assert 0.2 < low < 0.28 and 0.95 < high < 1.05  # in view: the served points, with a margin for the markers
    assert len(tick_texts(ax)) >= 4
    assert ax.get_title().endswith("(1 trial meeting no rate, at 0, out of view)")


def test_a_pareto_span_in_view_over_20x_is_a_log_axis_in_plain_labels(report, figures):
    energies = [30.0, 8.0, 2.0, 0.5, 0.2]
    rep.plot_pareto(spread_report(report, energies, zero_rate_energy=None))
    ax = figures[-1].axes[0]
    assert ax.get_yscale() == "log" and ax.get_ylim() == pytest.approx((0.2 / 1.15, 30 * 1.15))
    labels = tick_texts(ax)
    assert {"1", "10"} <= set(labels) and not any("e" in text or "^" in text for text in labels)


def test_pareto_view_leaves_the_trials_at_rate_0_out_and_keeps_a_budget_in_view(report):
    r = spread_report(report, [0.6, 0.4, 0.3])
    _, rate = rep.plot_x_axis(r)
    view = rep.pareto_view(r, rate)
    assert (view.out_of_view, view.undrawn, view.log_y) == (1, 0, False)
    assert view.xlim[0] > 0 and view.ylim[1] < 31
    assert rep.pareto_view(r, rate, budget=0.1).ylim[0] < 0.1  # (an energy budget line stays in view)


# ---- 2. a study without a rate objective: trials that served nothing do not make the rate vary -----------------
def test_trials_that_served_nothing_do_not_make_a_rate_axis(report, figures):
    """--objective energy,memory at --rate 0.1: failed trials (no rate_rps, read as 0) made {0.1, 0} look like
    varying rates, and every point sat on x = 0.1."""
    first = report.best[0]

    def trial(i, figures, values, served=0.0):
        return dataclasses.replace(first, config=first.config.with_knobs({"batching.max_num_seqs": i + 1}), trial=i,
                                   values=values, figures=figures, violations={**first.violations, "served": served})

    served = [trial(i, {**first.figures, "rate_rps": 0.1, "energy_j_per_token": 0.4 + 0.1 * i,
                        "kv_peak_bytes": (100 + 50 * i) * 2**20}, (0.4 + 0.1 * i, (100 + 50 * i) * 2**20))
              for i in range(3)]
    failed = trial(3, {}, (float("inf"), float("inf")), served=float("inf"))
    problem = dataclasses.replace(report.problem, objectives=parse_objectives("energy,memory"))
    r = dataclasses.replace(report, problem=problem, evaluations=(*served, failed), pareto=(), best=(),
                            baseline=dataclasses.replace(served[0], trial=None))
    axis, x = rep.plot_x_axis(r)
    assert axis == "memory: KV peak (MiB)" and x(served[2]) == 200
    rep.plot_pareto(r)
    ax = figures[-1].axes[0]
    assert ax.get_xlabel() == "memory: KV peak (MiB)" and ax.get_xlim()[1] > 200
    assert ax.get_title().endswith("(1 trial serving no request, not drawn)")


# ---- 5. the labels are placed on the final axes ----------------------------------------------------------------
def test_labels_are_placed_after_the_zoom_clear_of_every_dot(report, figures):
    """With trials zoomed out, the labels had been placed on the limits before the zoom: "#1 trial 24" landed
    on the baseline's star. A dot is put where #1's label would go on the final axes: the label moves off it."""
    import math

    from matplotlib.text import Text

    r = spread_report(report, [0.9, 0.7, 0.6, 0.5, 0.45, 0.4])
    rep.plot_pareto(r)
    ax = figures[-1].axes[0]
    first = r.best[0]
    px, py = ax.transData.transform((first.values[0], first.figures["energy_j_per_token"]))
    label = next(t for t in ax.texts if t.get_text().startswith("#1 "))
    assert label.xyann == (-14, 14)  # up and left of its ring (the ring is the rightmost point)
    x, y = ax.transData.inverted().transform((px - 40, py + 28))  # inside that label, on a clear plot
    crowded = dataclasses.replace(r, evaluations=(*r.evaluations, variant(first, 50, x, y, feasible=False, knob=50)))
    rep.plot_pareto(crowded)
    ax = figures[-1].axes[0]
    figures[-1].draw_without_rendering()
    label = next(t for t in ax.texts if t.get_text().startswith("#1 "))
    dots = [(e.values[0], e.figures["energy_j_per_token"]) for e in (*crowded.evaluations, crowded.baseline)]
    pixels = ax.transData.transform([d for d in dots if all(map(math.isfinite, d))])
    assert not Text.get_window_extent(label).count_contains(pixels)


# ---- 9. an infeasible study: the baseline's config as optimize refined it, drawn once, the budget a line -----------
@pytest.fixture(scope="module")
def energy_study(tmp_path_factory):
    folder = tmp_path_factory.mktemp("energy")
    # (seed 1: the baseline's coarse and refined capacities differ with the shipped profile; seed 0's coincide)
    result, storage = make_study(folder, name="en", n_trials=3, energy="0.05J/token", workload_seed=1)
    return result, storage, folder


def test_the_closest_baseline_config_shows_the_refined_figures_and_is_drawn_once(energy_study, figures):
    result, storage, _ = energy_study
    report = build_report("en", storage=storage)
    assert not report.feasible
    trial0 = next(e for e in report.closest if e.config == report.baseline.config)
    searched = next(t for t in result.study.get_trials() if t.number == trial0.trial)
    assert searched.user_attrs["violations"] != report.baseline.violations  # (the search's, coarser: not shown)
    assert trial0.violations == report.baseline.violations  # the refined figures optimize printed
    rep.plot_pareto(report)
    ax = figures[-1].axes[0]
    star = (report.baseline.values[0], report.baseline.figures["energy_j_per_token"])
    points = [tuple(p) for c in ax.collections for p in c.get_offsets()]
    assert star not in points  # the star alone, no cross under it
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert f"baseline (vLLM defaults; trial {trial0.trial}, infeasible)" in legend
    assert f"infeasible ({len(report.evaluations) - 1} trials)" in legend
    assert "energy budget (0.05 J/token)" in legend
    budget = next(line for line in ax.get_lines() if line.get_label().startswith("energy budget"))
    assert list(budget.get_ydata()) == [0.05, 0.05] and ax.get_ylim()[0] < 0.05


def test_the_constraints_table_shows_the_refined_figures_of_the_baselines_config(energy_study):
    _, storage, folder = energy_study
    r = CliRunner().invoke(app, ["report", "en", "--storage", storage, "--out-dir", str(folder / "o")],
                           terminal_width=200)
    assert r.exit_code == 0, r.output
    report = build_report("en", storage=storage)
    row = next(line for line in r.stdout.splitlines() if line.startswith("│ energy<=0.05J/token"))
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells[2] == cells[3] == f"{report.baseline.violations['energy<=0.05J/token']:+.3g}"


# ---- 3, 6 and 7: the latency CDFs -----------------------------------------------------------------------------
def one_request_report(report):
    """The fixture's report on one request of the search's, the best config the baseline."""
    problem = report.problem
    search = dataclasses.replace(problem.search, requests=problem.search.requests[:1])
    best = dataclasses.replace(report.baseline, figures={**report.baseline.figures, "rate_rps": 1e9})
    return dataclasses.replace(report, problem=dataclasses.replace(problem, search=search), best=(best,))


def test_one_request_draws_a_marker_per_panel_and_invents_no_rate(report, figures):
    """A 1-request workload drew empty TTFT and E2E panels (a single value draws nothing as a step) under the
    title "1 requests at ... (1,000,000,000 req/s)"."""
    r = one_request_report(report)
    samples = {"best (#1)": {"ttft": np.array([0.32]), "tbt": np.array([0.03, 0.031]), "e2e": np.array([1.6]),
                             "tpot": np.array([0.03])}}
    samples["baseline (vLLM defaults)"] = samples["best (#1)"]
    rep.plot_latency_cdf(r, samples)
    fig = figures[-1]
    assert fig._suptitle.get_text() == "Latency CDFs, simulated on 1 request, alone: no arrival rate"
    ttft, tbt, e2e = fig.axes[:3]
    for ax, value_ms in ((ttft, 320), (e2e, 1600)):
        (line,) = ax.get_lines()  # the best config is the baseline: one line, said so
        assert line.get_label() == "best (#1) = baseline (vLLM defaults)"
        assert list(line.get_xdata()) == pytest.approx([value_ms, value_ms]) and list(line.get_ydata()) == [0, 1]
        assert line.get_marker() == "o"
        assert [t.get_text() for t in ax.texts] == ["one request: each line is its one value"]
    assert not tbt.texts  # (two gaps: a CDF of its own)


def test_requests_at_says_no_rate_where_the_requests_arrive_at_once(report):
    requests = report.problem.search.requests
    assert rep.requests_at(requests[:1], 1e9) == "1 request, alone: no arrival rate"
    at_once = [dataclasses.replace(q, arrival_s=0.0) for q in requests[:3]]
    assert rep.requests_at(at_once, 1e9) == "3 requests arriving at once: no arrival rate"
    assert rep.requests_at(requests, 0.0512, "the best config's operating rate") == \
        f"{len(requests)} requests at the best config's operating rate (0.0512 req/s)"


SLOS = [parse_slo("tpot:p90<=150ms"), parse_slo("ttft:p99<=20s"), parse_slo("e2e:mean<=40s"),
        parse_slo("tbt:max<=3s")]


def test_a_tpot_slo_gets_a_panel_and_each_slo_is_drawn_in_the_axis_unit_for_what_it_is(report, figures):
    """A TPOT SLO that set the capacity had no panel; "e2e:mean<=40000ms" labelled an axis in seconds; a mean
    limit was drawn as if a percentile."""
    assert rep.latency_metrics(SLOS) == ("ttft", "tbt", "tpot", "e2e")
    assert rep.latency_metrics(SLOS[1:]) == ("ttft", "tbt", "e2e")
    rng = np.random.default_rng(0)
    samples = {label: {"ttft": rng.uniform(0.1, 8, 40), "tbt": rng.uniform(0.03, 0.9, 400),
                       "e2e": rng.uniform(2, 90, 40), "tpot": rng.uniform(0.03, 0.3, 40)}
               for label in ("best (#1)", "baseline (vLLM defaults)")}
    r = dataclasses.replace(report, problem=dataclasses.replace(report.problem, slos=tuple(SLOS)))
    rep.plot_latency_cdf(r, samples)
    cdf = dict(zip(("ttft", "tbt", "tpot", "e2e"), figures[-1].axes[:4]))
    tail = dict(zip(("ttft", "tbt", "tpot", "e2e"), figures[-1].axes[4:]))
    assert tail["tpot"].get_xlabel() == "TPOT (ms)" and tail["e2e"].get_xlabel() == "E2E (s)"
    legends = {m: [t.get_text() for t in ax.get_legend().get_texts()] for m, ax in cdf.items()}
    assert "SLO: p90 TPOT ≤ 150 ms" in legends["tpot"] and "p90: the CDF reaches 0.9 left of here" in legends["tpot"]
    assert "SLO: p99 TTFT ≤ 20 s" in legends["ttft"]  # (a 20 s limit on an axis of seconds)
    assert "SLO: max TBT ≤ 3,000 ms" in legends["tbt"]
    assert "SLO: mean E2E ≤ 40 s" in legends["e2e"] and "mean of best" in legends["e2e"]
    styles = {m: {line.get_label(): line.get_linestyle() for line in ax.get_lines()} for m, ax in cdf.items()}
    assert styles["e2e"]["SLO: mean E2E ≤ 40 s"] == ":" and styles["ttft"]["SLO: p99 TTFT ≤ 20 s"] == "--"
    assert not any(line.get_marker() == "<" for line in cdf["e2e"].get_lines())  # (the mean is no CDF level)
    means = [line for line in cdf["e2e"].get_lines() if line.get_label() == "mean of best"]
    assert means[0].get_xdata()[0] == pytest.approx(samples["best (#1)"]["e2e"].mean())


def test_the_upper_tail_panel_shows_what_a_p99_limit_lets_past(report, figures):
    """The last percent that decides a p99 SLO was a sliver at the top of a linear 0-1 axis: each CDF has its
    upper tail below it on a log axis, with the limit's share (0.01) marked at the limit."""
    values = np.arange(1, 401) / 1000  # 400 gaps, 1-400 ms
    x, y = rep.tail_points(values)
    assert (x[0], y[0]) == (0.001, 1.0) and y[-1] == pytest.approx(1 / 400) and x[-1] == 0.4
    samples = {"best (#1)": {m: values for m in ("ttft", "tbt", "e2e", "tpot")}}
    r = dataclasses.replace(report, problem=dataclasses.replace(report.problem, slos=(parse_slo("p99=200ms"),)))
    r = dataclasses.replace(r, best=(dataclasses.replace(r.best[0], config=r.problem.base),))
    rep.plot_latency_cdf(r, samples)
    tbt_tail = figures[-1].axes[4]
    assert tbt_tail.get_yscale() == "log" and tbt_tail.get_ylim()[0] <= 1 / 800
    marker = next(line for line in tbt_tail.get_lines() if line.get_marker() == "<")
    assert (marker.get_xdata()[0], marker.get_ydata()[0]) == pytest.approx((200, 0.01))
    assert [t.get_text() for t in tbt_tail.texts] == ["p99: at most 0.01 above"]


# ---- 8. a reused folder: the plots this report leaves out are removed ---------------------------------------------
def test_a_reused_folder_keeps_no_plot_of_an_earlier_report(report, tmp_path, monkeypatch):
    out = tmp_path / "shared"
    out.mkdir()
    for name in ("pareto.png", "latency-cdf.png", "memory-timeline.png", "other.png", "notes.txt"):
        (out / name).write_bytes(b"old")
    monkeypatch.setattr(rep, "render_plots", lambda r: ({"pareto": b"new"}, ["no latency CDF: why"]))
    files, notes = rep.write_report(report, out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "other.png", "pareto.png", "report.html"]
    assert (out / "pareto.png").read_bytes() == b"new" and set(files) == {"pareto", "html"}
    assert notes == ["no latency CDF: why",
                     f"removed {out / 'latency-cdf.png'}, an earlier report's plot this report leaves out",
                     f"removed {out / 'memory-timeline.png'}, an earlier report's plot this report leaves out"]
    assert f"note: removed {out / 'latency-cdf.png'}" in (out / "report.html").read_text()


# ---- 4. the default folder is one safe folder whatever the study's name --------------------------------------------
@pytest.mark.parametrize("name", ["a/../../tp-outside", '<script>alert("x")</script>&amp;', "..", "a\\b", "x y"])
def test_the_default_folder_of_a_study_name_is_one_folder_here(name):
    folder = rep.default_out_dir(name)
    assert len(folder.parts) == 1 and folder.name.startswith("skistune-report-") and folder.name not in (".", "..")
    assert all(c.isalnum() or c in "_.+=,@-" for c in folder.name)
    assert folder == rep.default_out_dir(name)  # (the same study: the same folder each time)


def test_names_alike_once_cleaned_keep_their_own_folders_and_safe_names_are_unchanged():
    assert rep.default_out_dir("a/b") != rep.default_out_dir("a_b") == rep.default_out_dir("a_b")
    assert str(rep.default_out_dir("a_b")) == "skistune-report-a_b"
    assert str(rep.default_out_dir("optimize-3fa2c1.v2")) == "skistune-report-optimize-3fa2c1.v2"
    assert str(rep.default_out_dir("a/../x")).startswith("skistune-report-a_.._x-")


def test_a_report_of_a_study_named_with_a_path_writes_inside_this_folder(study, tmp_path, monkeypatch):
    """--study 'a/../../tp-outside' had its report written two folders up."""
    here = tmp_path / "deep" / "here"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    name = "a/../../outside"
    copy = tmp_path / "c.db"
    shutil.copy(study[1].removeprefix("sqlite:///"), copy)
    optuna.copy_study(from_study_name="t", from_storage=f"sqlite:///{copy}", to_storage=f"sqlite:///{copy}",
                      to_study_name=name)
    r = CliRunner().invoke(app, ["report", name, "--storage", f"sqlite:///{copy}", "--json"])
    assert r.exit_code == 0, r.output
    files = json.loads(r.stdout.strip().splitlines()[-1])["files"]
    (folder,) = [p for p in here.iterdir()]
    assert folder.name == rep.default_out_dir(name).name and (folder / "report.html").is_file()
    assert all(path.startswith(f"{folder.name}/") for path in files.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.db", "deep"]



def test_configs_whose_quality_is_not_predicted_are_rings_not_the_colour_of_a_100_percent_loss(report, figures):
    """A tester's lossless front config was hidden under two configs of unknown quality (outside the quality
    profile's grid) drawn at its spot in the colour of a loss of 100% and above."""
    first = report.best[0]
    known = variant(first, 1, 0.05, 0.5, knob=1)
    known = dataclasses.replace(known, figures={**known.figures, "quality_loss": 0.02, "quality_basis": "predicted"})
    unknown = [dataclasses.replace(v, figures={**v.figures, "quality_basis": "outside", "quality_loss": None})
               for v in (variant(first, 2, 0.05, 0.5, knob=2), variant(first, 3, 0.06, 0.45, knob=3))]
    rep.plot_pareto(dataclasses.replace(report, evaluations=(known, *unknown), pareto=(known,), best=(known,),
                                        front_ties=()))
    ax = figures[-1].axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(label.startswith("feasible, quality not predicted") and "2 trials" in label for label in labels)
    assert figures[-1].axes[1].get_ylabel().startswith("predicted quality loss")  # (the colour bar: known ones only)
    coloured = [c for c in ax.collections if c.get_array() is not None]
    assert len(coloured) == 1 and list(coloured[0].get_array()) == [2.0]
