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
    assert "#1 (the written config) is the best on capacity, whatever its quality loss" in note
    floored = opt.build_problem(load_workload("chat", requests=8), slo="p99=200ms", objective="capacity,quality",
                                quality="ppl+1%", profile=PROFILE)
    assert not any(n.startswith(unbounded) for n in floored.notes)
