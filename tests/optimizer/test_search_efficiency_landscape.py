"""The search-efficiency benchmark's description of a grid's landscape (benchmarks/search_efficiency.py): the
ratios just below the optimum with how many configs tie at each, and the knob values every near-optimal config
shares (what a search has to get right together)."""
import sys
from pathlib import Path

import pytest

from skistune.config import KVConfig


def _config(seqs: int, chunk: int, prefix: bool) -> KVConfig:
    d = KVConfig().to_dict()
    d["batching"].update(max_num_seqs=seqs, chunked_prefill=True, chunk_size=chunk)
    d["prefix_reuse"]["enabled"] = prefix
    return KVConfig.from_dict(d)


@pytest.fixture
def table(bench):
    # capacity: one spike (8 seqs, 32-token chunks, prefix reuse), a plateau two lattice steps below it, an
    # infeasible config above it that must not count
    rows = {_config(8, 32, True): bench.Row((10.0,), {"tbt": -0.1}),
            _config(8, 32, False): bench.Row((5.0,), {"tbt": -0.1}),
            _config(16, 16, True): bench.Row((8.409,), {"tbt": -0.1}),
            _config(16, 16, False): bench.Row((8.409,), {"tbt": -0.1}),
            _config(32, 16, False): bench.Row((8.409,), {"tbt": -0.1}),
            _config(32, 64, True): bench.Row((20.0,), {"tbt": 0.5})}
    return bench.Table(rows, leaves=len(rows), uniform_configs=None, seconds=0.0)


def test_levels_count_ties_below_the_optimum(bench, table):
    assert table.levels(10.0, maximize=True) == [(1.0, 1), (0.8409, 3), (0.5, 1)]
    assert table.levels(10.0, maximize=True, n=1) == [(1.0, 1)]


def test_near_knobs_name_what_the_optimum_needs_together(bench, table):
    # the one optimal config narrows each varied knob to one value; knobs the grid never varies are left out
    assert table.near_knobs(10.0, maximize=True) == {"batching.max_num_seqs": [8], "batching.chunk_size": [32],
                                                      "prefix_reuse.enabled": [True]}
    # read against the plateau, the plateau and the spike both count: only the chunk size narrows (64 is infeasible)
    assert table.near_knobs(8.409, maximize=True)["batching.chunk_size"] == [16, 32]


SPACE = """
name: tiny
description: chunking and policy
knobs:
  batching.chunked_prefill: {choices: [false, true]}
  batching.chunk_size: {choices: [128, 256, 2048], when: {batching.chunked_prefill: [true]}}
  batching.policy: {choices: [fcfs, edf]}
"""


def test_grid_statistics_read_the_baseline_as_enqueued(bench):
    from types import SimpleNamespace

    from skistune.optimize import baseline_config
    from skistune.searchspace import parse_space

    problem = SimpleNamespace(space=parse_space(SPACE), base=baseline_config())
    configs, _ = bench.distinct_configs(problem.space, problem.base)
    # capacity 1 for the baseline (chunked, 2048-token chunks, fcfs), 4 for 128-token chunks under edf, 2 elsewhere;
    # the configs without chunking break the TBT constraint
    def row(c):
        best = c.batching.chunked_prefill and c.batching.chunk_size == 128 and c.batching.policy == "edf"
        base = c.batching.chunked_prefill and c.batching.chunk_size == 2048 and c.batching.policy == "fcfs"
        return bench.Row((4.0 if best else 1.0 if base else 2.0,), {"tbt": -1.0 if c.batching.chunked_prefill else 1.0})
    table = bench.Table({c: row(c) for c in configs}, leaves=len(configs), uniform_configs=None, seconds=0.0)
    scenario = SimpleNamespace(name="tiny", what="a tiny grid", definition=lambda: {"name": "tiny"})
    g = bench.grid_statistics(scenario, problem, table, maximize=True)
    assert (g["configs"], g["feasible"], g["near_optimal"], g["optimum"]) == (8, 6, 1, 4.0)
    assert g["baseline_feasible"] is True and g["baseline_ratio"] == 0.25
    assert g["infeasible_by"] == {"tbt": 2}
    # nothing feasible: the statistics still print (the protocol loosens the load on them), with no optimum
    table = bench.Table({c: bench.Row((1.0,), {"tbt": 1.0}) for c in configs}, len(configs), None, 0.0)
    g = bench.grid_statistics(scenario, problem, table, maximize=True)
    assert g["feasible"] == 0 and g["baseline_feasible"] is False and "optimum" not in g


def test_rate_option_refuses_a_bad_pair(bench, capsys):
    sys.path.insert(0, str(Path(bench.__file__).parent))  # the script imports bench_args from its folder
    try:
        for bad in ("agent-energy", "agent-energy=x", "nope=1.0", "agent-energy=0", "agent-energy=inf"):
            with pytest.raises(SystemExit) as stop:
                bench.main(["--grid-only", "--rate", bad])
            assert stop.value.code == 2
            assert f"--rate {bad!r}" in capsys.readouterr().err
    finally:
        sys.path.remove(str(Path(bench.__file__).parent))
