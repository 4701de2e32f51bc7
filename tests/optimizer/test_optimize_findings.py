"""`skistune optimize` / `skistune worker` as UX testers met them: SLOs without a unit, gains within a tie and
baselines a space cannot express, a config that breaks its SLO when validated, resumed studies, output paths
that cannot be written, the target engine's own defaults, per-layer bits, units and precisions, and why an
energy budget binds."""
import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import skistune.optimize as opt
from skistune.cli import app
from skistune.paths import check_out_file
from skistune.slo import as_slos, parse_slo
from skistune.workloads import load_workload

from test_optimize_cli import PROFILE, SMALL


def invoke(*args):
    return CliRunner().invoke(app, list(args))


def last_json(r) -> dict:
    return json.loads(r.stdout.strip().splitlines()[-1])


# 1. a bare number was 200 seconds
def test_an_slo_without_a_unit_is_refused_by_the_one_parser():
    message = "SLO 'p99=200': the limit needs a unit: write 200ms or 0.2s (units: s, ms, us)"
    for parse in (parse_slo, as_slos):
        with pytest.raises(ValueError) as err:
            parse("p99=200")
        assert str(err.value) == message
    with pytest.raises(ValueError, match=r"'ttft:p90<=1': the limit needs a unit: write 1ms or 0.001s"):
        parse_slo("ttft:p90<=1")
    assert parse_slo("p99=0.2s").limit_s == parse_slo("p99=200ms").limit_s == pytest.approx(0.2)


def test_optimize_refuses_a_unitless_slo_in_one_line_exit_2(here):
    r = invoke("optimize", "--slo", "p99=200", *SMALL)
    assert r.exit_code == 2, r.output
    assert r.stderr.strip() == "error: SLO 'p99=200': the limit needs a unit: write 200ms or 0.2s (units: s, ms, us)"
    assert not list(here.iterdir())  # nothing ran: no study, no file


# 2. a x1.00 'gain' in a space that cannot express the baseline
def _evaluation(config, capacity, trial=None):
    figures = {"slo_s": {"tbt:p99<=200ms": 0.15}, "energy_j_per_token": 1.0, "kv_peak_bytes": 1 << 20,
               "quality_basis": "exact"}
    return opt.Evaluation(config, 1.0, (capacity,), {"tbt:p99<=200ms": -0.1, "queue<=5s": -0.5, "served": 0.0},
                          figures, trial=trial)


def _result(problem, tuned_capacity, base_capacity):
    tuned = _evaluation(problem.base.with_knobs({"batching.max_num_seqs": 37}), tuned_capacity, trial=3)
    return opt.OptimizeResult(problem=problem, study=None, storage="", best=[tuned], pareto=[tuned],
                              baseline=_evaluation(problem.base, base_capacity))


def test_a_gain_within_the_tie_rule_is_a_tie_and_an_inexpressible_baseline_is_said():
    from skistune.optimize_cli import gain_lines

    problem = opt.build_problem(load_workload("chat", requests=16), slo="p99=200ms", space="long-context",
                                profile=PROFILE)
    assert opt.baseline_outside_space(problem) == {"batching.max_num_seqs": 256}  # its range is 1-64
    lines = gain_lines(_result(problem, 0.0922, 0.0921))
    assert lines == ["the long-context space cannot express the baseline (vLLM defaults): batching.max_num_seqs 256 "
                     "is outside it, so the search never tried it and it cannot rank first on a tie",
                     "against the baseline (vLLM defaults), predicted: capacity a tie (0.09220 req/s vs 0.09210 req/s, "
                     "within 2%: below what the search resolves)"]
    assert not any("x1.00" in line for line in lines)
    # the same rule as the ranking's (`beats`): 3% more is a gain, in a space that holds the baseline too
    default = opt.build_problem(load_workload("chat", requests=16), slo="p99=200ms", profile=PROFILE)
    assert opt.baseline_outside_space(default) == {}
    assert gain_lines(_result(default, 0.103, 0.1)) == [
        "gain over the baseline (vLLM defaults), predicted: capacity x1.03"]


# 3. a config that broke its SLO on the real runtime exited 0 with "feasible": true
def test_a_config_that_breaks_an_slo_when_validated_is_warned_about_and_exits_4(here, monkeypatch):
    def broken_replay(problem, configs, *, runtime=None, requests=None, progress=None):
        predicted = opt.score(problem, configs[0], precision=opt.REFINE_PRECISION)
        measured = replace(predicted, violations={**predicted.violations, "tbt:p99<=200ms": 0.5},
                           figures={**predicted.figures, "slo_s": {"tbt:p99<=200ms": 0.3}})
        return [opt.Validation(configs[0], predicted.figures["rate_rps"], predicted, measured, 1.0)]

    monkeypatch.setattr(opt, "load_runtime_in_background", lambda problem: None)  # (no model to load)
    monkeypatch.setattr(opt, "validate", broken_replay)
    r = invoke("optimize", "--slo", "p99=200ms", *SMALL[:-4], "--validate", "1", "--profile", PROFILE, "--json")
    assert r.exit_code == 4, r.output
    summary = last_json(r)
    assert summary["feasible_predicted"] is True and summary["feasible_measured"] is False
    assert summary["baseline_engine"] == "vLLM" and summary["baseline_outside_space"] == {}
    predicted_ms = summary["validated"][0]["predicted"]["slo_s"]["tbt:p99<=200ms"] * 1e3
    assert (f"warning: the written config broke tbt:p99<=200ms (predicted {predicted_ms:.3g} ms, measured 300 ms) "
            "on the real runtime at ") in " ".join(r.stderr.split())
    assert (here / "skistune-tuned.yaml").is_file()  # written: still the search's best estimate
    assert "4 written, but the" in invoke("optimize", "--help").stdout  # the exit code is documented


def test_a_validated_config_that_held_says_so_in_the_json(here):
    from skistune.optimize_cli import validation_warning

    problem = opt.build_problem(load_workload("chat", requests=16), slo="p99=200ms", profile=PROFILE)
    result = _result(problem, 0.2, 0.1)
    assert result.measured_feasible is None and validation_warning(result) is None  # not validated
    held = opt.Validation(result.best[0].config, 0.2, result.best[0], result.best[0], 1.0)
    assert replace(result, validated=[held]).measured_feasible is True


# 4. a resumed study said nothing of its trials; 9. the provenance's capacity precision was the search's
def test_a_resumed_study_says_how_many_trials_it_has_and_the_provenance_states_its_precision(here):
    first = invoke("optimize", "--slo", "p99=200ms", *SMALL, "--study", "again")
    assert first.exit_code == 0, first.output
    assert "resuming" not in first.stderr  # a new study: nothing to resume
    second = invoke("optimize", "--slo", "p99=200ms", *SMALL[:2], "--trials", "2", *SMALL[4:], "--study", "again")
    assert second.exit_code == 0, second.output
    assert "resuming study again: 3 finished trials, running 2 more" in second.stderr
    search = yaml.safe_load((here / "skistune-tuned.yaml").read_text())["provenance"]["search"]
    # the figures the file records are refined to 2%; the trials in the study were searched to 10%
    assert (search["capacity_precision"], search["trial_capacity_precision"]) == (0.02, 0.1)


# 5. unwritable folders passed the up-front check; a file in the folder's place was "does not exist"
def test_the_output_check_tries_the_folder_and_names_a_file_in_its_place(tmp_path):
    with pytest.raises(ValueError, match=r"^--out /proc/x: cannot create a file in /proc \("):
        check_out_file(Path("/proc/x"), "--out")
    (tmp_path / "typo.yaml").write_text("")
    for path in (tmp_path / "typo.yaml" / "x.yaml", tmp_path / "typo.yaml" / "sub" / "x.yaml"):
        with pytest.raises(ValueError, match=f"^--out {path}: {tmp_path / 'typo.yaml'} is a file, not a folder$"):
            check_out_file(path, "--out")
    with pytest.raises(ValueError, match="folder .*missing does not exist$"):
        check_out_file(tmp_path / "missing" / "x.yaml", "--out")
    check_out_file(tmp_path / "ok.yaml", "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["typo.yaml"]  # the probe file is gone


def test_optimize_refuses_an_unwritable_out_before_the_search(here):
    r = invoke("optimize", "--slo", "p99=200ms", *SMALL, "--out", "/proc/x.yaml")
    assert r.exit_code == 2 and r.stderr.startswith("error: --out /proc/x.yaml: cannot create a file in /proc")
    assert not list(here.glob("*.db"))


# 6. --target sglang was compared with (and labelled) vLLM's defaults
def test_the_baseline_is_the_target_engines_defaults_and_says_so():
    from skistune.optimize_cli import knob_lines

    sglang = opt.build_problem(load_workload("chat", requests=16), slo="p99=200ms", target="sglang", profile=PROFILE)
    assert sglang.base == opt.baseline_config("sglang") and sglang.baseline_engine == "SGLang"
    b = sglang.base
    assert (b.prefix_reuse.block_size, b.batching.max_num_batched_tokens, b.batching.chunk_size,
            b.batching.max_num_seqs, b.batching.policy) == (1, 8192, 8192, 2048, "fcfs")
    assert opt.baseline_outside_space(sglang) == {}  # the SGLang space holds SGLang's defaults
    assert knob_lines(_result(sglang, 0.2, 0.1))[-1] == (
        "base: SGLang defaults (16-bit KV, no eviction or offload, prefix caching, block 1, max_num_seqs 2048, "
        "max_num_batched_tokens 8192, chunk 8192, fcfs, memory fraction 0.9)")
    vllm = opt.build_problem(load_workload("chat", requests=16), slo="p99=200ms", target="vllm", profile=PROFILE)
    assert vllm.base == opt.baseline_config() and knob_lines(_result(vllm, 0.2, 0.1))[-1].startswith(
        "base: vLLM defaults (16-bit KV, no eviction or offload, prefix caching, block 16, max_num_seqs 256, ")


# 7. key_bits 16 printed next to 4 bits on every layer
def test_per_layer_bits_print_as_the_bits_every_layer_gets():
    from skistune.optimize_cli import _diff

    base = opt.baseline_config()
    names = ["bitwidth.key_bits", "bitwidth.value_bits", "bitwidth.layer_bits"]
    assert _diff(base.with_knobs({"bitwidth.layer_bits": [[4, 4]] * 30}), base, names) == "key_bits=4, value_bits=4"
    mixed = base.with_knobs({"bitwidth.key_bits": 8, "bitwidth.layer_bits": [[4, 4]] * 28 + [[8, 8]] * 2})
    assert _diff(mixed, base, names) == "layer_bits=[4/4 x28, 8/8 x2]"  # (key_bits 8 applies to no layer)
    assert _diff(base.with_knobs({"bitwidth.key_bits": 8, "bitwidth.layer_bits": [[16, 16]] * 30}), base,
                 names) == "(baseline)"


# 8. the worker's best capacity had no unit
def test_the_worker_prints_the_best_capacity_with_its_unit(here):
    assert invoke("optimize", "--slo", "p99=200ms", *SMALL, "--study", "shared").exit_code == 0
    r = invoke("worker", "--study", "shared", "--trials", "1", "--seed", "1", "--json")
    assert r.exit_code == 0, r.output
    best = last_json(r)["best"]
    assert f"best capacity so far: {best:.4g} req/s" in " ".join(r.stderr.split())


def test_the_worker_of_a_multi_objective_study_reports_every_objective_and_the_front(here):
    """It had reported the first objective alone, at the search's precision, unlabelled."""
    assert invoke("optimize", "--slo", "p99=200ms", *SMALL, "--objective", "capacity,energy",
                  "--study", "multi").exit_code == 0
    r = invoke("worker", "multi", "--trials", "1", "--seed", "1", "--json")
    assert r.exit_code == 0, r.output
    summary = last_json(r)
    assert set(summary["best_values"]) == {"capacity", "energy"} and summary["precision"] == "search"
    assert summary["best"] == summary["best_values"]["capacity"] and summary["pareto_size"] >= 1
    text = " ".join(r.stderr.split())
    assert (f"best by capacity so far: capacity {summary['best']:.4g} req/s, energy "
            f"{summary['best_values']['energy']:.3g} J/token; Pareto front of {summary['pareto_size']} config") in text
    # (the study's own command: `optimize --study multi` alone is another problem, without its --slo)
    assert "at the search's precision: skistune optimize --slo p99=200ms " in text
    assert "--objective capacity,energy" in text and "--study multi" in text
    assert text.endswith("refines, validates and writes the config)")


# 10. an energy budget that binds had no "why" line
def test_an_infeasible_energy_budget_says_why(here):
    r = invoke("optimize", "--slo", "p99=200ms", "--energy", "0.05J/token", *SMALL, "--json")
    assert r.exit_code == 3, r.output
    why = last_json(r)["why"]
    assert why.startswith("energy<=0.05J/token binds in 3 of 3 trials: the closest configs use ")
    assert "J/token or more at their capacity (x" in why and "a looser --energy budget" in why
    assert why.split(":")[0] in r.stdout


def test_the_profiles_own_notes_reach_the_search_as_they_reach_evaluate(profile):
    """A quick profile measured on a busy machine said so in `evaluate` and `profile --show`, not in optimize."""
    busy = replace(profile, notes=("measured while the machine was busy (load average 2.2 on 2 cores as it began)",))
    problem = opt.build_problem(load_workload("chat", requests=8), slo="p99=200ms", profile=busy)
    assert busy.notes[0] in problem.notes


def test_each_validation_record_names_the_ranked_config_it_replayed(here):
    """Runs had said only ``role: candidate``: which config each replayed was left to their order."""
    problem = opt.build_problem(load_workload("chat", requests=16), slo="p99=200ms", profile=PROFILE)
    result = _result(problem, 0.2, 0.1)
    tuned = result.best[0]
    runs = [opt.Validation(tuned.config, 0.2, tuned, tuned, 1.0),
            opt.Validation(problem.base, 0.2, result.baseline, result.baseline, 1.0, role="baseline")]
    validated = replace(result, validated=runs)
    assert [opt.replayed_as(validated, v) for v in runs] == [{"rank": 1, "trial": 3}, {"rank": None, "trial": None}]


def test_a_resumed_study_counts_the_trials_that_simplified_a_winner_too(monkeypatch):
    """`report` counted every finished trial and the resume line only the searched ones (20 of 23)."""
    import io

    import optuna
    from rich.console import Console

    import skistune.optimize_cli as cli

    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    for i in range(3):
        trial = study.ask()
        if i == 2:
            trial.set_user_attr(opt.SIMPLIFIES_ATTR, 0)
        study.tell(trial, 1.0)
    out = io.StringIO()
    monkeypatch.setattr(cli, "err_console", Console(file=out, width=200))
    cli._say_resumed(study, "s", 5)
    assert out.getvalue().strip() == "resuming study s: 3 finished trials (2 searched, 1 simplifying a winner), running 5 more"
