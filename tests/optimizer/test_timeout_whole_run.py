"""``--timeout`` bounds the whole run, not only the search: on a 200k-request trace one simulation took 24 s and
`--timeout 60` ran for over 7 minutes, most of it refining the top configs and the baseline after the search. Each
stage after the search now stops at the deadline (a simulation that would start after it raises `TimeUp`: at most
one simulation late) and a note says what was cut short. Here every simulation is made slow (`SIM_S`), as a big
trace's are: a first trial takes 10 of them and what follows the search about 36."""
import json
import time
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

import skistune.optimize as opt
import skistune.simulator as simulator
import skistune.validation as validation
from skistune.cli import app
from skistune.workloads import load_workload

SIM_S = 0.2  # seconds each simulation takes here
SLACK_S = 1.0  # the run's own work besides simulations (storage, sampler, notes), on a loaded 2-core host
SHIPPED = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json")


class Slow:
    started = 0  # simulations started
    delay_s = SIM_S


@pytest.fixture
def slow_simulations(monkeypatch):
    """Every simulation (`simulator.build_engine`: the capacity search's, the trials' and the refinements') takes
    `SIM_S` more seconds after it starts."""
    real, slow = simulator.build_engine, Slow()

    def build_engine(config, target, **options):
        built = real(config, target, **options)  # (the deadline's check: before anything is simulated)
        slow.started += 1
        time.sleep(slow.delay_s)
        return built

    monkeypatch.setattr(simulator, "build_engine", build_engine)
    return slow


@pytest.fixture
def problem(profile):
    return opt.build_problem(load_workload("chat", requests=16), slo="p99=200ms", profile=profile)


def cut_note(notes) -> str:
    found = [n for n in notes if "the timeout (" in n and "was reached" in n]
    assert len(found) == 1, notes
    return found[0]


def test_the_whole_run_ends_within_the_timeout_and_one_simulation(tmp_path, problem, slow_simulations):
    timeout = 30 * SIM_S  # the first trial (10 simulations, each SIM_S and its own time) and some more
    started = time.monotonic()
    result = opt.solve(problem, n_trials=100, timeout=timeout, validate=0, storage=f"sqlite:///{tmp_path / 't.db'}",
                       study_name="t")
    wall = time.monotonic() - started
    assert wall <= timeout + SIM_S + SLACK_S, wall
    assert result.feasible and 1 <= result.trials < 100
    assert f"the search stopped at its timeout ({timeout:g} s) after {result.trials} of 100 trials" in \
        " ".join(result.notes)
    note = cut_note(result.notes)
    assert note.startswith("capacity of the baseline refined to 10% instead of 2%; capacity of ")
    assert f"the timeout ({timeout:g} s) was reached" in note
    # (the cut trial is kept as pruned, without figures; the finished ones are all there)
    states = [t.state for t in result.study.get_trials(deepcopy=False)]
    assert states.count(optuna.trial.TrialState.COMPLETE) == result.trials
    assert states.count(optuna.trial.TrialState.RUNNING) == 0


def test_with_jobs_the_workers_stop_inside_their_trials_too(tmp_path, problem, slow_simulations):
    timeout = 30 * SIM_S
    started = time.monotonic()
    result = opt.solve(problem, n_trials=100, n_jobs=2, timeout=timeout, validate=0,
                       storage=f"sqlite:///{tmp_path / 'j.db'}", study_name="j")
    wall = time.monotonic() - started
    assert wall <= timeout + SIM_S + SLACK_S + 0.5, wall  # (+ the parent's poll of its workers, every 0.5 s)
    assert "capacity of the baseline refined to 10% instead of 2%" in cut_note(result.notes)


def test_every_stage_after_the_search_says_what_the_deadline_cut(tmp_path, problem, slow_simulations):
    study_url = f"sqlite:///{tmp_path / 'f.db'}"
    slow_simulations.delay_s = 0.0
    opt.solve(problem, n_trials=3, validate=0, storage=study_url, study_name="f")  # (no timeout: a study to finish)
    study = optuna.load_study(study_name="f", storage=opt.open_storage(study_url))
    slow_simulations.delay_s, before = SIM_S, slow_simulations.started
    started = time.monotonic()
    fields = opt.finish(problem, study, top_k=3, runtime=object(), deadline=opt.Deadline.after(0.001))
    # (nothing simulated, nothing replayed: `runtime` is no runtime)
    assert time.monotonic() - started < 1.0 and slow_simulations.started == before
    assert fields["validated"] == [] and fields["best"] and fields["baseline"].trial is None
    note = cut_note(fields["notes"])
    assert note.startswith("capacity of the baseline refined to 10% instead of 2%; capacity of 3 of the 3 top configs "
                           "refined to 10% instead of 2%; not validated on the real runtime (")
    assert "what sets the capacity of " in note and note.endswith(
        "the timeout (0.001 s) was reached (a longer --timeout, or the same command again on the same study, does the "
        "rest)")
    # (figures at the search's precision, as the table's "not refined" says)
    assert all("limited_by" not in e.figures for e in fields["best"])


def test_a_timeout_too_short_for_any_trial_says_so_in_one_line(tmp_path, monkeypatch, slow_simulations):
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    r = CliRunner().invoke(app, ["optimize", "--slo", "p99=200ms", "--requests", "16", "--trials", "5", "--timeout",
                                 str(3 * SIM_S), "--validate", "0", "--profile", SHIPPED, "--json"])
    assert time.monotonic() - started <= 3 * SIM_S + SIM_S + SLACK_S + 1.0  # (+ the CLI's loading before its clock)
    assert r.exit_code == 2, r.output
    line = f"the timeout ({3 * SIM_S:g} s) ran out before any trial finished"
    assert [x for x in r.stderr.splitlines() if x.startswith("error:")][0].startswith(f"error: {line}")
    assert json.loads(r.stdout.strip().splitlines()[-1])["error"].startswith(line)
    assert not (tmp_path / "skistune-tuned.yaml").exists()


def test_the_cli_counts_its_timeout_from_its_start_and_prints_the_note(tmp_path, monkeypatch, slow_simulations):
    monkeypatch.chdir(tmp_path)
    timeout = 31 * SIM_S  # (the check of the baseline served alone, before the search, is one simulation)
    started = time.monotonic()
    r = CliRunner().invoke(app, ["optimize", "--slo", "p99=200ms", "--requests", "16", "--trials", "50", "--timeout",
                                 f"{timeout:g}", "--validate", "0", "--profile", SHIPPED, "--json"])
    assert r.exit_code == 0, r.output
    assert time.monotonic() - started <= timeout + SIM_S + SLACK_S + 1.0  # (+ the CLI's loading before its clock)
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert "capacity of the baseline refined to 10% instead of 2%" in cut_note(summary["notes"])
    assert "note: capacity of the baseline refined to 10% instead of 2%" in " ".join(r.stderr.split())


def test_validation_replays_only_what_starts_before_the_deadline(problem, monkeypatch):
    """A replay on the real runtime is not simulated: the deadline is checked before each one starts."""
    first = opt.baseline_config().with_knobs({"batching.max_num_seqs": 8})
    second = opt.baseline_config().with_knobs({"batching.max_num_seqs": 1})
    figures = {"rate_rps": 0.3, "ttft_p99_s": 0.37, "tbt_p99_s": 0.064, "e2e_p99_s": 1.06, "kv_peak_bytes": 13 << 20}

    def fake_score(problem_, config, requests=None, **kw):  # (each config its own schedule of the slice)
        return opt.Evaluation(config, 1.0, (0.3,), {"tbt:p99<=200ms": -0.5},
                              {**figures, "e2e_p99_s": 1.0 + config.batching.max_num_seqs})

    replays = []

    def slow_replay(problem_, runtime, p, requests, role, quality=None):
        replays.append(p.config)
        time.sleep(4 * SIM_S)  # (the deadline passes during the first replay)
        return opt.Validation(p.config, 0.3, p, opt.Evaluation(p.config, 1.0, (0.3,), {"tbt:p99<=200ms": -0.6}, {}),
                              1.0, role)

    monkeypatch.setattr(validation, "score", fake_score)
    monkeypatch.setattr(validation, "score_at",
                        lambda problem_, config, requests, scale, **kw: fake_score(problem_, config))
    monkeypatch.setattr(validation, "_measure", slow_replay)
    monkeypatch.setattr(validation, "held_out_quality", lambda *a, **k: {})
    timed = opt.with_deadline(problem, opt.Deadline.after(2 * SIM_S))
    out = validation.validate(timed, [first, second], runtime=object(),
                              requests=validation.validation_requests(problem, 2))
    assert replays == [first] and [(v.config, v.role) for v in out] == [(first, "candidate")]
    assert out.cut_short == "validated 1 of 2 configs on the real runtime; the baseline not replayed (no measured gain)"
    assert validation.validate(problem, [first, second], runtime=object(),  # (no deadline: both, then the baseline)
                               requests=validation.validation_requests(problem, 2)).cut_short is None
    assert replays[1:] == [first, second, problem.base]
