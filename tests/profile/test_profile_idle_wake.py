"""A step that follows an idle engine: what the profiler times it at over the same step back to back, how the
profile keeps it, and how the simulator adds it (to the first step after an idle gap only)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from skistune.config import KVConfig
from skistune.evaluate import sim_target
from skistune.profile import HardwareProfile
from skistune.runtime.request import Request
from skistune.profile.cost import IDLE_WAKE_GAP_S, idle_wake_at
from skistune.profile.measure import IDLE_WAKE_GAPS_S
from skistune.simulator import simulate


def test_the_profiler_records_it_and_the_file_keeps_it(tiny_profile):
    assert [g for g, _ in tiny_profile.idle_wake] == list(IDLE_WAKE_GAPS_S)
    assert all(x >= 0 for _, x in tiny_profile.idle_wake)
    data = tiny_profile.to_dict()
    assert data["idle_wake"] == [{"idle_s": g, "extra_s": x} for g, x in tiny_profile.idle_wake]
    assert HardwareProfile.from_dict(json.loads(json.dumps(data))).idle_wake == tiny_profile.idle_wake
    older = {k: v for k, v in data.items() if k != "idle_wake"}  # (a file written before it was measured)
    assert HardwareProfile.from_dict(older).idle_wake == ()
    with pytest.raises(ValueError, match=r"idle_wake\[0\]\.extra_s: -0\.1 is below 0"):
        HardwareProfile.from_dict({**data, "idle_wake": [{"idle_s": 0.5, "extra_s": -0.1}]})
    with pytest.raises(ValueError, match="two points at the same idle"):
        HardwareProfile.from_dict({**data, "idle_wake": [{"idle_s": 0.5, "extra_s": 0.1}] * 2})


def test_the_wake_up_grows_with_the_log_of_the_idle_between_its_points():
    points = ((0.25, 0.010), (2.0, 0.040))
    assert idle_wake_at(points, IDLE_WAKE_GAP_S / 2) == 0.0  # (back to back, or nearly)
    assert idle_wake_at(points, IDLE_WAKE_GAP_S) == idle_wake_at(points, 0.25) == 0.010
    assert idle_wake_at(points, 0.25 * 8 ** 0.5) == pytest.approx(0.025)  # halfway in log
    assert idle_wake_at(points, 60.0) == idle_wake_at(points, float("inf")) == 0.040
    assert idle_wake_at((), 60.0) == 0.0


def test_the_simulator_adds_it_to_the_first_step_after_an_idle_engine():
    """A lone request after an idle gap starts later by the wake-up; one that arrives while the engine is busy
    does not; steps back to back (its decodes) do not. A profile without it predicts as before."""
    shipped = sim_target("smollm2-135m", "cpu-smollm2-135m")
    assert [idle for idle, _ in shipped.idle_wake] == [0.25, 2.0]  # (what the profiler measures)
    target, woken = replace(shipped, idle_wake=()), replace(shipped, idle_wake=((0.25, 0.02),))
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
