"""`skistune.simulate` and `skistune.capacity` take a config in the forms `skistune.evaluate` takes (a
`KVConfig`, a mapping, a file), and anything they cannot use is a one-line TypeError or ValueError before any
simulation: a precision of 0 or less used to search forever, a scale of 0 failed with "math domain error",
and requests arriving all at once were given a capacity of 1,024 x an "arrival rate" of 1e12 req/s."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import skistune.simulator as simulator
from skistune.config import KVConfig
from skistune.evaluate import workload_requests
from skistune.runtime.request import Request
from skistune.simulator import capacity, lattice_step, simulate
from skistune.workloads import load_workload

PROFILE = str(Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json")


@pytest.fixture(scope="module")
def setup(shipped_target):
    target = shipped_target
    workload = load_workload("chat", requests=4, max_input=64, max_output=8, seed=0)
    return workload, workload_requests(workload, "smollm2-135m"), target


def test_a_mapping_and_a_file_are_taken_as_evaluate_takes_them(setup, tmp_path):
    _, requests, target = setup
    expected = simulate(KVConfig().with_knobs({"batching.max_num_seqs": 2}), requests, target)
    path = tmp_path / "kv.yaml"
    path.write_text("batching:\n  max_num_seqs: 2\n")
    for config in ({"batching": {"max_num_seqs": 2}}, str(path), path):
        assert simulate(config, iter(requests), target).ttft_s == expected.ttft_s
    by_object = capacity(KVConfig().with_knobs({"batching.max_num_seqs": 2}), requests, target, "p99=40ms",
                         precision=0.1)
    by_file = capacity(path, requests, target, "p99=40ms", precision=0.1)
    assert (by_file.rate_scale, by_file.evaluations) == (by_object.rate_scale, by_object.evaluations)


@pytest.mark.parametrize("call, error, message", [
    (lambda w, r, t: simulate(42, r, t), TypeError, "config: expected a KVConfig, a mapping"),
    (lambda w, r, t: simulate({"batching": {"max_num_seqs": 0}}, r, t), ValueError, "batching.max_num_seqs: 0"),
    (lambda w, r, t: simulate(KVConfig(), w, t), TypeError,
     r"requests: expected a sequence of Request, got Workload \(a workload's requests: "
     r"skistune.workloads.to_requests\(workload, vocab_size=...\); skistune.evaluate takes a workload as it is\)"),
    (lambda w, r, t: simulate(KVConfig(), "chat", t), TypeError, "requests: expected a sequence of Request, got str"),
    (lambda w, r, t: simulate(KVConfig(), [1, 2], t), TypeError, "requests: expected Request items, got int"),
    (lambda w, r, t: simulate(KVConfig(), r, PROFILE), TypeError,
     r"target: expected a SimTarget \(skistune.sim_target\(model, profile\)\), got str"),
    (lambda w, r, t: capacity({"eviction": {"policy": "lru"}}, r, t, "p99=1s"), ValueError, "eviction.policy"),
    (lambda w, r, t: capacity(KVConfig(), w, t, "p99=1s"), TypeError, "requests: expected a sequence of Request"),
    (lambda w, r, t: capacity(KVConfig(), r, None, "p99=1s"), TypeError, "target: expected a SimTarget"),
])
def test_bad_input_is_a_clear_error_before_any_simulation(setup, monkeypatch, call, error, message):
    workload, requests, target = setup
    monkeypatch.setattr(simulator, "build_engine", lambda *a, **k: pytest.fail("simulated before checking"))
    with pytest.raises(error, match=message):
        call(workload, requests, target)


@pytest.mark.parametrize("kwargs, message", [
    ({"precision": 0}, "precision 0: expected a relative resolution of at least 1e-06"),  # (searched forever)
    ({"precision": -0.1}, "precision -0.1: expected a relative resolution of at least 1e-06"),  # (looped forever)
    ({"precision": float("nan")}, "precision nan: expected"),  # (was a whole doubling, silently)
    ({"precision": 1e-17}, "precision 1e-17: expected"),  # (below float resolution: never converged)
    ({"min_scale": 0}, "min_scale 0: expected a rate scale > 0"),  # (was "math domain error")
    ({"max_scale": float("inf")}, "max_scale inf: expected a rate scale > 0"),
    ({"min_scale": 2, "max_scale": 0.5}, "min_scale 2 is above max_scale 0.5"),  # (was capacity 0)
    ({"start": float("inf")}, "start inf: expected a rate scale to search from"),  # (was OverflowError)
    ({"start": float("nan")}, "start nan: expected a rate scale to search from"),
])
def test_search_settings_out_of_range_are_refused_before_any_simulation(setup, monkeypatch, kwargs, message):
    _, requests, target = setup
    monkeypatch.setattr(simulator, "build_engine", lambda *a, **k: pytest.fail("simulated before checking"))
    with pytest.raises(ValueError, match=message):
        capacity(KVConfig(), requests, target, "p99=200ms", **kwargs)


def test_requests_arriving_all_at_once_have_no_rate_to_scale(setup, monkeypatch):
    _, requests, target = setup
    monkeypatch.setattr(simulator, "build_engine", lambda *a, **k: pytest.fail("simulated before checking"))
    at_once = [Request(r.request_id, r.prompt_token_ids, r.max_new_tokens, 2.5) for r in requests]
    for reqs in (at_once, requests[:1]):
        message = (f"capacity: a single request, or requests that all arrive at once (here at {reqs[0].arrival_s:g} "
                   "s), have no arrival rate to scale; give requests that arrive over time")
        with pytest.raises(ValueError, match=re.escape(message)):
            capacity(KVConfig(), reqs, target, "p99=200ms")


def test_the_finest_precision_still_gives_a_lattice_step():
    assert lattice_step(0.02) == 1 / 64 and lattice_step(10) == 1.0
    assert 0 < lattice_step(simulator.MIN_PRECISION) <= simulator.MIN_PRECISION * 2
