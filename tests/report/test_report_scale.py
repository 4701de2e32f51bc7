"""`skistune report` on a long trace took minutes and gigabytes: every token gap of every request was drawn in the
latency CDF (4 million points per line for 20,000 chat requests), and the search's requests were simulated three
times where one or two replays give every plot. Checked here without a study: a stub report over the shipped
profile and a few chat requests."""
from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import skistune.simulator as simulator
from skistune.config import KVConfig
from skistune.evaluate import workload_requests
from skistune.profile import load_profile
from skistune.report import Replays, cdf_points, latency_samples, memory_timeline, record_latencies
from skistune.simulator import build_engine, target_from_profile, with_rate_scale
from skistune.workloads import load_workload

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json"


@pytest.fixture(scope="module")
def target():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (measured on another CPU)
        return target_from_profile(load_profile(PROFILE), "smollm2-135m")


@pytest.fixture(scope="module")
def requests():
    return tuple(workload_requests(load_workload("chat", requests=24, seed=0, max_input=256, max_output=24),
                                   "smollm2-135m"))


def _stub(target, requests, best: KVConfig):
    """What `latency_samples` and `memory_timeline` read of a report without a validation."""
    problem = SimpleNamespace(target=target, search=SimpleNamespace(requests=requests), base=KVConfig(),
                              baseline_engine="vLLM")
    return SimpleNamespace(problem=problem, validated=(),
                           best=[SimpleNamespace(config=best, rate_scale=0.5, figures={"rate_rps": 1.0})])


def _naive(records) -> dict[str, np.ndarray]:
    done = [r for r in records if r.finish_s is not None]
    return {"ttft": np.array([r.token_times_s[0] - r.arrival_s for r in done]),
            "tbt": np.concatenate([np.diff(r.token_times_s) for r in done]),
            "e2e": np.array([r.finish_s - r.arrival_s for r in done]),
            "tpot": np.array([(r.finish_s - r.token_times_s[0]) / (len(r.token_times_s) - 1) for r in done
                              if len(r.token_times_s) > 1])}


def _replay(config, target, requests):
    engine, _ = build_engine(config, target)
    engine.replay(with_rate_scale(requests, 0.5))
    return engine


def test_record_latencies_are_each_requests_own_gaps(target, requests):
    engine = _replay(KVConfig(), target, requests)
    got, want = record_latencies(engine.records), _naive(engine.records)
    assert want["tbt"].size > len(requests)  # (several gaps per request: a boundary between two would show)
    for metric in ("ttft", "tbt", "e2e"):
        assert np.array_equal(got[metric], want[metric]), metric
    # TPOT (for a TPOT SLO's panel) as `runtime.metrics` computes it: up to the float rounding of its sums
    assert got["tpot"].size == want["tpot"].size > 0 and np.allclose(got["tpot"], want["tpot"], rtol=1e-12, atol=0)
    assert {k: v.size for k, v in record_latencies([]).items()} == {"ttft": 0, "tbt": 0, "e2e": 0, "tpot": 0}


@pytest.mark.parametrize("best, simulations", [(KVConfig(), 1),
                                               (KVConfig().with_knobs({"batching.max_num_seqs": 4}), 2)])
def test_the_plots_replay_each_config_once_with_the_figures_of_separate_replays(target, requests, monkeypatch,
                                                                                best, simulations):
    """#1's latency CDF comes from the memory timeline's sampled replay (the same config, requests and rate), and
    a baseline that is #1's config is not simulated again."""
    built = []
    monkeypatch.setattr(simulator, "build_engine", lambda *a, **kw: built.append(a) or build_engine(*a, **kw))
    report, replays = _stub(target, requests, best), Replays(target)
    timeline = memory_timeline(report, replays)
    samples = latency_samples(report, replays)
    assert len(built) == simulations
    assert timeline.label.startswith("simulated replay of the search workload (24 requests")
    for label, config in (("best (#1)", best), ("baseline (vLLM defaults)", KVConfig())):
        want = _naive(_replay(config, target, requests).records)
        assert all(np.array_equal(samples[label][m], want[m]) for m in want), label
    # (alone, each function still replays what it needs)
    assert memory_timeline(report).used_bytes["device"].max() == timeline.used_bytes["device"].max() > 0


def test_a_cdf_is_drawn_with_at_most_its_point_budget_and_within_a_step_of_the_full_one():
    values = np.random.default_rng(0).lognormal(size=100_003)
    x, y = cdf_points(values, max_points=1000)
    assert x.size <= 1000 and x[0] == values.min() and x[-1] == values.max() and y[-1] == 1.0
    full = np.sort(values)
    # the drawn (step, where="post") fraction at every value is within 1/1000 of the true one
    drawn = y[np.searchsorted(x, full, side="right") - 1]
    assert np.abs(drawn - np.arange(1, full.size + 1) / full.size).max() <= 1 / 1000 + 1e-12
    small = np.array([3.0, 1.0, 2.0])
    assert [list(a) for a in cdf_points(small)] == [[1.0, 2.0, 3.0], [1 / 3, 2 / 3, 1.0]]
    assert [a.size for a in cdf_points(np.zeros(0))] == [0, 0]
