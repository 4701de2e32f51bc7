"""Search spaces and studies as a tester met them (2026-12-04, round F): a range capped by another knob whose own
range leaves out the baseline's value, steps that do not divide a range, unknown solvers, per-layer bits."""
import optuna
import pytest

import skistune.optimize as opt
from skistune.searchspace import parse_space, suggest_config
from skistune.workloads import load_workload

from test_optimize_cli import PROFILE

CAPPED = """name: capped
knobs:
  batching.max_num_batched_tokens: {low: 512, high: 1024}
  batching.chunk_size: {low: 64, high: 4096, at_most: batching.max_num_batched_tokens}
"""


def test_a_capped_knob_is_left_out_of_the_baseline_trial_when_its_cap_is_drawn():
    """The baseline's chunks of 2048 were enqueued under a budget the search draws from 512..1024: Optuna warned
    that 2048 lay outside the range, and the first trial was no valid config (exit 2 on a valid space)."""
    problem = opt.build_problem(load_workload("chat", requests=8), slo="p99=200ms", space=parse_space(CAPPED),
                                profile=PROFILE)
    params = opt._baseline_params(problem)
    assert "batching.chunk_size" not in params and "batching.max_num_batched_tokens" not in params
    config = suggest_config(optuna.trial.FixedTrial({**params, "batching.max_num_batched_tokens": 600,
                                                     "batching.chunk_size": 300}), problem.space, problem.base)
    assert (config.batching.max_num_batched_tokens, config.batching.chunk_size) == (600, 300)
    assert opt.baseline_outside_space(problem) == {"batching.max_num_batched_tokens": 2048,
                                                   "batching.chunk_size": 2048}
    # where the cap's range holds the baseline's value, the capped knob stays in the baseline trial
    wide = parse_space(CAPPED.replace("high: 1024", "high: 4096"))
    problem = opt.build_problem(load_workload("chat", requests=8), slo="p99=200ms", space=wide, profile=PROFILE)
    assert opt._baseline_params(problem) == {"batching.max_num_batched_tokens": 2048, "batching.chunk_size": 2048}


def test_a_quality_objective_without_a_floor_says_that_the_loss_is_unbounded():
    """`--objective capacity,quality` searched eviction and KV bits and wrote a +46% perplexity config, exit 0,
    with no note (the README said a search without --quality is lossless)."""
    unbounded = "quality is an objective and no --quality floor bounds it"
    problem = opt.build_problem(load_workload("chat", requests=8), slo="p99=200ms", objective="capacity,quality",
                                profile=PROFILE)
    [note] = [n for n in problem.notes if n.startswith(unbounded)]
    assert "#1 (the written config) is chosen on capacity, whatever its quality loss" in note
    floored = opt.build_problem(load_workload("chat", requests=8), slo="p99=200ms", objective="capacity,quality",
                                quality="ppl+1%", profile=PROFILE)
    assert not any(n.startswith(unbounded) for n in floored.notes)


def _layers(pairs) -> str:
    return "  bitwidth.layer_bits: " + str([list(p) for p in pairs]) + "\n"


SPACE = "name: t\nknobs:\n  batching.policy: {choices: [fcfs, prefix]}\nfixed:\n"


def test_a_config_that_differs_from_the_baseline_only_in_a_fixed_knob_is_not_called_the_baseline():
    from skistune.optimize_cli import _diff

    problem = opt.build_problem(load_workload("chat", requests=8), slo="p99=200ms", quality="ppl+1%",
                                space=parse_space(SPACE + _layers([(8, 8)] * 30)), profile=PROFILE)
    names = [q.name for q in problem.space.params if not q.is_switch]
    config = problem.base.with_knobs({"bitwidth.layer_bits": [[8, 8]] * 30})
    assert _diff(config, problem.base, names) == "key_bits=8, value_bits=8"  # (was "(baseline)")
    assert _diff(config.with_knobs({"batching.policy": "prefix"}), problem.base, names) == \
        "batching.policy=prefix, key_bits=8, value_bits=8"  # (the searched knobs first)


def test_fixed_per_layer_bits_of_16_are_lossless_and_lossy_ones_are_named_in_short():
    opt.build_problem(load_workload("chat", requests=8), slo="p99=200ms",  # (was refused: "changes the outputs")
                      space=parse_space(SPACE + _layers([(16, 16)] * 30)), profile=PROFILE)
    with pytest.raises(ValueError) as err:
        opt.build_problem(load_workload("chat", requests=8), slo="p99=200ms",
                          space=parse_space(SPACE + _layers([(8, 8)] * 15 + [(4, 4)] * 15)), profile=PROFILE)
    assert "fixes bitwidth.layer_bits: [8/8 x15, 4/4 x15], which changes the model's outputs" in str(err.value)


def test_per_layer_bits_for_another_layer_count_are_refused_before_any_study(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from skistune.cli import app

    with pytest.raises(ValueError, match=r"^space t for smollm2-135m: bitwidth.layer_bits: 5 \(key, value\) pairs "
                                         r"for a model of 30 layers"):
        opt.build_problem(load_workload("chat", requests=8), slo="p99=200ms", quality="ppl+1%",
                          space=parse_space(SPACE + _layers([(8, 8)] * 5)), profile=PROFILE)
    (tmp_path / "five.yaml").write_text(SPACE + _layers([(8, 8)] * 5))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["optimize", "--slo", "p99=200ms", "--quality", "ppl+1%", "--space", "five.yaml",
                                 "--profile", str(PROFILE), "--trials", "2", "--validate", "0", "--study", "five"])
    assert r.exit_code == 2 and not list(tmp_path.glob("*.db"))  # (the study file had been left behind)


def test_a_step_that_does_not_divide_its_range_is_refused_with_where_a_search_would_stop():
    with pytest.raises(ValueError, match=r"batching.max_num_seqs: step 5 does not divide the range 1..64 \(a search "
                                         r"would stop at 61\)"):
        parse_space("name: t\nknobs:\n  batching.max_num_seqs: {low: 1, high: 64, step: 5}\n")
    with pytest.raises(ValueError, match=r"step 0.2 does not divide the range 0.5..0.95"):
        parse_space("name: t\nknobs:\n  offload.device_memory_fraction: {low: 0.5, high: 0.95, step: 0.2}\n")
    parse_space("name: t\nknobs:\n  offload.device_memory_fraction: {low: 0.5, high: 0.95, step: 0.05}\n")  # (9 steps)


def test_a_solver_the_optimizer_does_not_have_is_refused():
    with pytest.raises(ValueError, match=r"^space t: bitwidth.layer_bits: solver 'nope' is not one of skistune's "
                                         r"\(layer_bits\)$"):
        opt.build_problem(load_workload("chat", requests=8), slo="p99=200ms", profile=PROFILE,
                          space=parse_space("name: t\nknobs:\n  bitwidth.layer_bits: {solver: nope}\n"))


@pytest.mark.parametrize("specs, twice", [
    ({"slo": ["tbt:p95<=200ms", "tbt:p95<=200ms"]}, "tbt:p95<=200ms"),
    ({"slo": ["p99=200ms", "tbt:p99<=200ms"]}, "tbt:p99<=200ms"),  # (the short form is the same SLO)
    ({"slo": "p99=200ms", "quality": ["ppl+1%", "ppl+1%"]}, "ppl+1%"),
])
def test_an_slo_or_floor_given_twice_is_named_in_the_users_words(specs, twice):
    with pytest.raises(ValueError) as err:  # (was "constraints: two share a name (...); name your functions")
        opt.build_problem(load_workload("chat", requests=8), profile=PROFILE, **specs)
    assert str(err.value) == f"{twice} is given twice; give each SLO and quality floor once"


def test_the_energy_line_reads_the_refined_baseline_the_tables_print():
    """It quoted the closest trials' 0.265 J/token (at the search's coarser rates) beside a base row of 0.252."""
    from dataclasses import replace
    from types import SimpleNamespace

    from skistune.optimize_cli import energy_line

    problem = opt.build_problem(load_workload("chat", requests=8), slo="p99=200ms", energy="0.2J/token",
                                profile=PROFILE)
    name = "energy<=0.2J/token"
    trial = opt.Evaluation(problem.base, 1.0, (1.0,), {name: 0.325, "served": 0.0}, {}, trial=0)
    base = replace(trial, violations={name: 0.26, "served": 0.0}, trial=None)
    seen = SimpleNamespace(problem=problem, binding={name: 1}, closest=[trial], trials=1)
    assert "use 0.265 J/token or more at their capacity (x1.32 the budget" in energy_line(seen)
    assert "use 0.252 J/token or more at their capacity (x1.26 the budget" in energy_line(
        SimpleNamespace(**vars(seen), baseline=base))


@pytest.mark.parametrize("name", ["my study", "x%41", "a/b", "r-goodput,energy", "-x", ""])
def test_a_study_name_the_default_file_would_change_is_refused(name):
    """'x%41' made skistune-xA.db (another study's file), 'a/b' a raw sqlite error, a comma a URL with %2C."""
    with pytest.raises(ValueError, match=r"the default storage is a file named after it \(skistune-NAME.db\)"):
        opt.default_storage(name)
    assert opt.default_storage("chat-p99_v2.1").endswith("/skistune-chat-p99_v2.1.db")
