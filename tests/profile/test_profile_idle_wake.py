"""The steps that follow an idle engine: what the profiler times them at over the same steps back to back, in
rounds; how the profile keeps them; and how the simulator adds them (a round drawn at each wake-up, its extras
added to the first steps after it)."""
from __future__ import annotations

import json
import random
from dataclasses import replace

import numpy as np
import pytest

from skistune.config import KVConfig
from skistune.evaluate import sim_target
from skistune.profile import HardwareProfile
from skistune.profile.cost import IDLE_WAKE_GAP_S, IdleWake, typical_wake_s
from skistune.profile.measure import IDLE_WAKE_GAPS_S, IDLE_WAKE_STEPS
from skistune.runtime.request import Request
from skistune.simulator import build_engine, simulate
from skistune.workloads import load_workload, to_requests

from profile_tiny import TINY_GRID


def test_the_profiler_times_rounds_of_a_requests_first_steps_and_the_file_keeps_them(tiny_profile):
    wake = tiny_profile.idle_wake
    assert wake.idle_s == IDLE_WAKE_GAPS_S
    assert (wake.rounds, wake.steps) == (TINY_GRID.idle_wake_rounds, IDLE_WAKE_STEPS)
    data = json.loads(json.dumps(tiny_profile.to_dict()))
    assert HardwareProfile.from_dict(data).idle_wake == wake
    # (files written before the rounds: the first step's extra alone, as one round of one step)
    first_only = [{"idle_s": p["idle_s"], "extra_s": p["extra_s"]} for p in data["idle_wake"]]
    older = HardwareProfile.from_dict({**data, "idle_wake": first_only}).idle_wake
    assert (older.rounds, older.steps) == (1, 1)
    assert older.typical_s(0.25)[0] == pytest.approx(max(0.0, float(wake.typical_s(0.25)[0])))
    assert HardwareProfile.from_dict({k: v for k, v in data.items() if k != "idle_wake"}).idle_wake is None


@pytest.mark.parametrize("points, message", [
    ([{"idle_s": 0.5, "extra_s": -0.1}], r"idle_wake\[0\]\.extra_s: -0\.1 is below 0"),
    ([{"idle_s": 0.5, "extra_s": 0.1}] * 2, "two points at the same idle"),
    ([{"idle_s": 0.01, "extra_s": 0.1}], r"idle_wake\[0\]\.idle_s: 0\.01 is below 0\.1"),
    ([{"idle_s": 0.5, "extra_s": 0.1, "rounds_s": [[0.1, 0.0], [0.1]]}], "same number of rounds and of steps"),
    ([{"idle_s": 0.5, "extra_s": 0.1, "rounds_s": [[0.1]]},
      {"idle_s": 1.0, "extra_s": 0.1, "rounds_s": [[0.1], [0.2]]}], "same number of rounds and of steps"),
    ([{"idle_s": 0.5, "extra_s": 0.1, "rounds_s": [[0.1, "x"]]}], r"rounds_s\[0\]\[1\]: expected a finite number"),
    ([{"idle_s": 0.5, "extra_s": 0.1, "rounds_s": [[]]}], r"rounds_s\[0\]: expected a list of step extras"),
    ([{"idle_s": 0.5, "extra_s": 0.1, "rounds_s": []}], r"idle_wake\[0\]\.rounds_s: empty"),
])
def test_a_bad_idle_wake_entry_is_refused_in_one_line(tiny_profile, points, message):
    with pytest.raises(ValueError, match=message):
        HardwareProfile.from_dict({**tiny_profile.to_dict(), "idle_wake": points})


def test_the_wake_up_grows_with_the_log_of_the_idle_between_its_points():
    wake = IdleWake.of_first_steps(((2.0, 0.040), (0.25, 0.010)))
    assert wake.idle_s == (0.25, 2.0)
    assert typical_wake_s(wake, IDLE_WAKE_GAP_S / 2) == 0.0  # (back to back, or nearly)
    assert typical_wake_s(wake, IDLE_WAKE_GAP_S) == typical_wake_s(wake, 0.25) == 0.010
    assert typical_wake_s(wake, 0.25 * 8 ** 0.5) == pytest.approx(0.025)  # halfway in log
    assert typical_wake_s(wake, 60.0) == typical_wake_s(wake, float("inf")) == 0.040
    assert typical_wake_s(None, 60.0) == typical_wake_s(wake, 60.0, step=1) == 0.0


def test_a_draw_is_one_rounds_steps_and_the_median_is_over_rounds():
    rounds = ((0.02, 0.0), (0.02, 0.013), (0.03, 0.001))  # (one slow second step in three rounds)
    wake = IdleWake((0.25, 2.0), (rounds, tuple((2 * a, 2 * b) for a, b in rounds)))
    np.testing.assert_allclose(wake.typical_s(0.25), [0.02, 0.001])
    np.testing.assert_allclose(wake.typical_s(2.0), [0.04, 0.002])
    rng = random.Random(0)
    drawn = {tuple(np.round(wake.draw_s(0.25 * 8 ** 0.5, rng), 6)) for _ in range(60)}
    assert drawn == {(0.03, 0.0), (0.03, 0.0195), (0.045, 0.0015)}  # every round, halfway between its idles


def test_the_simulator_adds_it_to_the_first_step_after_an_idle_engine():
    """A lone request after an idle gap starts later by the wake-up; one that arrives while the engine is busy
    does not; steps back to back (its decodes) do not. A profile without it predicts as before."""
    shipped = sim_target("smollm2-135m", "cpu-smollm2-135m")
    assert shipped.idle_wake.idle_s == (0.25, 2.0)  # (what the profiler measures)
    target = replace(shipped, idle_wake=None)
    woken = replace(shipped, idle_wake=IdleWake.of_first_steps(((0.25, 0.02),)))
    alone = [Request("a", list(range(100, 140)), 4, arrival_s=0.0), Request("b", list(range(200, 240)), 4,
                                                                             arrival_s=5.0)]
    plain, slow = simulate(KVConfig(), alone, target), simulate(KVConfig(), alone, woken)
    assert slow.ttft_s.max == pytest.approx(plain.ttft_s.max + 0.02)  # every first step follows an idle engine
    assert slow.tbt_s.max == pytest.approx(plain.tbt_s.max)  # decodes back to back: none
    busy = alone + [Request("c", list(range(300, 340)), 4, arrival_s=5.0 + IDLE_WAKE_GAP_S / 10)]
    plain, slow = simulate(KVConfig(), busy, target), simulate(KVConfig(), busy, woken)
    waits = [slow.e2e_s.max - plain.e2e_s.max, slow.ttft_s.mean * 3 - plain.ttft_s.mean * 3]
    assert waits[0] == pytest.approx(0.02)  # "c" waits behind "b"'s woken step, and no wake-up of its own
    assert waits[1] == pytest.approx(0.06)  # a, b and c each 20 ms later


@pytest.mark.parametrize("fast_forward", [True, False])
def test_the_steps_after_the_first_take_their_rounds_extras_too(fast_forward):
    """The decodes right after a woken prefill take the drawn round's later extras, in order, whether the
    simulator steps them one at a time or fast-forwards them as a run; the steps after those take none."""
    shipped = sim_target("smollm2-135m", "cpu-smollm2-135m")
    extras = (0.02, 0.011, 0.005)
    woken = replace(shipped, idle_wake=IdleWake((0.25,), ((extras,),)))
    alone = [Request("a", list(range(100, 140)), 6, arrival_s=0.0)]
    engines = []
    for target in (replace(shipped, idle_wake=None), woken):
        engine, _ = build_engine(KVConfig(), target, fast_forward=fast_forward)
        engine.replay(alone)
        engines.append(engine)
    plain, slow = (np.diff(e.records[0].token_times_s, prepend=0.0) for e in engines)
    np.testing.assert_allclose(slow - plain, [0.02, 0.011, 0.005, 0, 0, 0], atol=1e-12)


def test_a_replay_draws_the_same_rounds_every_time_and_fast_forwarding_draws_as_stepping():
    """Rounds that differ: requests alone after idles draw among them (seeded), the same on every replay, and
    the same whether the decode runs are fast-forwarded or stepped."""
    shipped = sim_target("smollm2-135m", "cpu-smollm2-135m")
    rounds = ((0.02, 0.0, 0.0), (0.02, 0.013, 0.002), (0.035, 0.001, 0.0))
    woken = replace(shipped, idle_wake=IdleWake((0.25, 2.0), (rounds, rounds)))
    w = load_workload("../shared/traces/azure_llm_2023_conv/AzureLLMInferenceTrace_conv.csv", first=40,
                      rate_scale=0.02, length_scale=0.05, max_input=64, max_output=8)
    reqs = to_requests(w, vocab_size=shipped.spec.vocab_size)
    times = []
    for ff in (True, True, False):
        engine, _ = build_engine(KVConfig(), woken, fast_forward=ff)
        engine.replay(reqs)
        times.append([list(r.token_times_s) for r in engine.records])
    assert times[0] == times[1]
    for a, b in zip(times[0], times[2]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    plain, _ = build_engine(KVConfig(), replace(shipped, idle_wake=None))
    plain.replay(reqs)
    firsts = {round(r.token_times_s[0] - p.token_times_s[0], 6)
              for r, p in zip(engine.records, plain.records)}
    assert {0.02, 0.035} <= firsts  # requests alone after an idle engine, each with one round's first step
