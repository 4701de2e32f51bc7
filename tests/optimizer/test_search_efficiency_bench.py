"""The search-efficiency benchmark's own logic (benchmarks/search_efficiency.py): the grid it scores
exhaustively, and the ratios it reports. The benchmark itself is run by hand (see BENCHMARKS.md)."""
import math

import pytest

from skistune.optimize import baseline_config
from skistune.searchspace import parse_space

SPACE = """
name: tiny
description: a when-condition, a switch that only steers a solver, and an unconditioned knob
switches:
  mixed_precision: {choices: [false, true]}
knobs:
  batching.chunked_prefill: {choices: [false, true]}
  batching.chunk_size: {choices: [128, 256, 512], when: {batching.chunked_prefill: [true]}}
  batching.policy: {choices: [fcfs, edf]}
  bitwidth.layer_bits: {solver: layer_bits, when: {mixed_precision: [true]}}
"""


def test_grid_follows_conditions_and_collapses_duplicates(bench):
    space = parse_space(SPACE)
    leaves = list(bench.grid_leaves(space, baseline_config()))
    # switch (2) x [chunked off, or on with 3 chunk sizes] (4) x policy (2)
    assert len(leaves) == 16
    assert all(("batching.chunk_size" in params) == params["batching.chunked_prefill"] for params, _ in leaves)
    assert len({tuple(sorted(params.items())) for params, _ in leaves}) == 16
    # without a solver the switch changes nothing: every config appears twice
    configs, n = bench.distinct_configs(space, baseline_config())
    assert n == 16 and len(configs) == 8
    assert {c.batching.chunk_size for c in configs if not c.batching.chunked_prefill} == {2048}  # the base value
    # with one, mixed precision is a config of its own
    solved, n = bench.distinct_configs(space, baseline_config(), {"layer_bits": lambda c: [[8, 8]] * 30})
    assert n == 16 and len(solved) == 16
    assert sum(c.bitwidth.layer_bits is not None for c in solved) == 8


def test_grid_refuses_continuous_ranges(bench):
    space = parse_space("name: r\nknobs:\n  offload.device_memory_fraction: {low: 0.5, high: 0.9}\n")
    with pytest.raises(ValueError, match="no finite grid"):
        list(bench.grid_leaves(space, baseline_config()))


def test_ratio_both_directions(bench):
    assert bench.ratio(3.0, 4.0, maximize=True) == 0.75
    assert bench.ratio(4.0, 3.0, maximize=False) == 0.75
    assert bench.ratio(3.0, 3.0, maximize=False) == 1.0
    assert bench.ratio(None, 3.0, maximize=True) == 0.0
    assert bench.ratio(math.inf, 3.0, maximize=False) == 0.0


def test_best_so_far_skips_infeasible_trials(bench):
    trials = [(5.0, False), (2.0, True), (9.0, False), (3.0, True), (1.0, True)]
    assert bench.best_so_far(trials, [1, 3, 5], maximize=True) == {1: None, 3: 2.0, 5: 3.0}
    assert bench.best_so_far(trials, [1, 3, 5], maximize=False) == {1: None, 3: 2.0, 5: 1.0}
    assert bench.best_so_far(trials[:2], [1, 10], maximize=True) == {1: None, 10: 2.0}  # a study cut short


def test_trials_to_goal_counts_feasible_trials_only(bench):
    trials = [(100.0, False), (50.0, True), (99.5, True), (100.0, True)]
    assert bench.trials_to_goal(trials, 100.0, maximize=True) == 3  # 99.5 is within 1%; the infeasible 100 is not
    assert bench.trials_to_goal(trials[:2], 100.0, maximize=True) is None
    assert bench.trials_to_goal([(2.0, True), (1.005, True)], 1.0, maximize=False) == 2


def test_code_reads_only_tables_cached_for_that_source_and_never_scores_them(bench, tmp_path, monkeypatch, capsys):
    """--code searches another source's tables (a sampler change moves no score): a table that source never
    scored is an error (one ``error:`` line, exit code 2), not a grid scored now and filed under its name; it
    cannot go with --fresh."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(bench.__file__).parent))  # (its sibling modules, as a script has them)
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--scenarios", "chat-capacity", "--code", "0.1.0-000000000000", "--cache-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: --code 0.1.0-000000000000: no table cached for chat-capacity")
    assert not list(tmp_path.iterdir())
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--code", "0.1.0-000000000000", "--fresh", "--cache-dir", str(tmp_path)])
    assert exit_info.value.code == 2
