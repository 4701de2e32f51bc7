"""`skistune profile --check`: a profile's own step points timed again on this machine, the median ratio
now / then, and the command's output and errors."""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from profile_tiny import TINY_GRID, tiny_runtime
from typer.testing import CliRunner

from skistune.cli import app
from skistune.profile.check import MAX_KV_TOKENS, check_points, speed_check
from skistune.profile.measure import measure_profile
from skistune.profile.records import kv_bits


def test_the_checked_points_are_16_bit_steps_of_every_kind(tiny_profile):
    points = check_points(tiny_profile)
    assert [p.kind for p in points] == ["decode", "decode", "prefill", "prefill", "mixed", "mixed"]
    assert all(kv_bits(p.grid) == 16 for p in points)
    decodes = sorted((p for p in tiny_profile.steps if p.kind == "decode" and kv_bits(p.grid) == 16),
                     key=lambda p: p.timing.median_s)
    assert points[0] is decodes[0] and points[1] is decodes[len(decodes) // 2]  # the fastest and the median
    assert all(p.grid.get("batch", 1) * p.grid.get("context", 0) <= MAX_KV_TOKENS for p in points)
    assert [p.kind for p in check_points(tiny_profile, per_kind=1)] == ["decode", "prefill", "mixed"]


def test_a_profile_timed_again_on_its_machine_reads_near_one_and_a_scaled_one_reads_its_scale():
    """The profile is measured here, just before its check, not taken from the session's fixture: on a loaded
    2-core CI machine the fixture's steps were once timed at 5x today's (x0.07). Up to three measure-then-check
    rounds, so that one burst of load on the machine cannot fail the test; a check that misreads its own
    machine misreads every round."""
    runtime = tiny_runtime()
    for _ in range(3):
        tiny_profile = measure_profile(runtime, TINY_GRID, name="cpu-tiny", model="tiny", quick=True)
        check = speed_check(tiny_profile, runtime, per_kind=1)
        if 0.2 < check.ratio < 5:  # the same machine (steps of the tiny model are noisy: ~1 ms)
            break
    assert len(check.points) == 3 and all(p.now_s > 0 for p in check.points)
    assert 0.2 < check.ratio < 5, check.points
    # a profile whose steps took half as long as today's reads about twice as slow now
    halved = replace(tiny_profile, steps=tuple(replace(p, timing=replace(p.timing, median_s=p.timing.median_s / 2))
                                               for p in tiny_profile.steps))
    again = speed_check(halved, runtime, per_kind=1)
    assert {p.then_s for p in again.points} == {p.then_s / 2 for p in check.points}
    assert json.loads(json.dumps(check.to_dict()))["ratio"] == check.ratio
    assert set(check.to_dict()["by_kind"]) == {"decode", "prefill", "mixed"}


def test_kinds_that_drift_apart_are_reported_apart():
    """Decodes (memory bound) at x1.8 and prefills at x1.04: the median over all points reads near 1, the
    verdict must not say every step is as profiled."""
    from skistune.profile.check import CheckedPoint, SpeedCheck

    def point(kind, ratio):
        return CheckedPoint(kind, {}, 0.1, 0.1 * ratio)

    drift = SpeedCheck((point("decode", 1.72), point("decode", 2.04), point("prefill", 1.045), point("prefill", 1.04),
                        point("mixed", 0.98)))
    assert abs(drift.ratio - 1.045) < 1e-9 and abs(drift.by_kind()["decode"] - 1.88) < 1e-9
    assert drift.verdict() == ("decode steps x1.88: this machine runs them 88% slower than the profile says, so its "
                               "predictions of them are optimistic (about 47% short of today's times) (the others "
                               "within 5%)")
    steady = SpeedCheck((point("decode", 1.01), point("prefill", 0.97)))
    assert steady.verdict() == "every kind of step within 5% of when it was measured"
    assert SpeedCheck((point("prefill", 0.8),)).verdict() == (
        "prefill steps x0.80: this machine runs them 20% faster than the profile says, so its predictions of them "
        "are pessimistic (about 25% over today's times)")


def test_the_verdict_says_plainly_which_way_the_predictions_err():
    """"x1.14: predictions of them about 12% fast" had read as a speed: a slower machine is now said to run the
    steps slower than the profile says, its predictions optimistic; in the verdict and the summary line alike."""
    from skistune.profile.check import CheckedPoint, SpeedCheck

    slower = SpeedCheck((CheckedPoint("decode", {}, 0.1, 0.114),))
    assert slower.summary_line() == (
        "this machine runs the profile's steps x1.140 (median of 1; decode x1.140): decode steps x1.14: this machine "
        "runs them 14% slower than the profile says, so its predictions of them are optimistic (about 12% short of "
        "today's times)")
    for check in (slower, SpeedCheck((CheckedPoint("prefill", {}, 0.1, 0.05),))):
        assert not re.search(r"\d% (fast|slow)\b", check.verdict()), check.verdict()


def test_the_check_command_prints_the_ratio_and_json(tmp_path, tiny_profile, monkeypatch):
    from skistune.profile import check as check_module
    path = tiny_profile.save(tmp_path / "tiny.json")
    real = check_module.speed_check
    monkeypatch.setattr(check_module, "speed_check", lambda profile, progress=None: real(
        profile, tiny_runtime(), per_kind=1, progress=progress))
    result = CliRunner().invoke(app, ["profile", "--check", str(path), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["profile"] == str(path) and len(summary["points"]) == 3 and summary["ratio"] > 0
    assert "this machine runs the profile's steps x" in result.stdout and "decode x" in result.stdout
    assert set(summary["by_kind"]) == {"decode", "prefill", "mixed"}


def test_check_with_show_or_a_missing_file_is_a_one_line_error(tmp_path, tiny_profile):
    path = tiny_profile.save(tmp_path / "tiny.json")
    both = CliRunner().invoke(app, ["profile", "--check", str(path), "--show", str(path)])
    assert both.exit_code == 2 and "give one" in both.stderr
    missing = CliRunner().invoke(app, ["profile", "--check", str(tmp_path / "none.json")])
    assert missing.exit_code == 2 and len(missing.stderr.strip().splitlines()) == 1


def test_a_profile_of_a_device_this_machine_lacks_is_a_one_line_error(monkeypatch):
    """The shipped H200 profile checked on a machine without CUDA: one line naming the profile, exit 2 (it was
    torch's CUDA-generator traceback, exit 1)."""
    import torch

    from skistune.profile import load_profile

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (a machine without CUDA, wherever it runs)
    shipped = Path(__file__).resolve().parents[2] / "profiles" / "cuda-llama-3-8b.json"
    r = CliRunner().invoke(app, ["profile", "--check", str(shipped)])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.stderr.strip().splitlines() == [  # (no --device was given: not named; no fingerprint warning first)
        f"error: profile {load_profile(str(shipped)).name} (llama-3-8b) was measured on cuda and this machine has "
        "no CUDA device: check it on a machine with one"]


def test_replays_that_check_a_profile_run_the_projection_rule_it_timed(tiny_profile, monkeypatch):
    """A fidelity run read every TBT p50 25-28% fast: its runtime computed the projections by this machine's cached
    rule (measured once, on a busy machine), the profile by the rule its steps ran with, and batch-1 decodes took
    x1.45 as long. A runtime checking a profile's predictions runs the profile's rule; the speed check does too."""
    from skistune.kernels.rows import PLAIN_RULE, ProjectionRule

    timed = ProjectionRule(7, 4, True)
    profile = replace(tiny_profile, step_fit=replace(tiny_profile.step_fit,
                                                     model=replace(tiny_profile.step_cost, rows=timed)))
    runtime = tiny_runtime()
    runtime.model.rule = PLAIN_RULE  # (another rule: as a cache measured at another time gives)
    profile.run_as_measured(runtime)
    assert runtime.model.rule == timed
    runtime.model.rule = PLAIN_RULE
    speed_check(profile, runtime, per_kind=1)
    assert runtime.model.rule == timed
    other = replace(profile, device="cuda")  # (a profile of another device says nothing of this one's projections)
    runtime.model.rule = PLAIN_RULE
    other.run_as_measured(runtime)
    assert runtime.model.rule == PLAIN_RULE


def test_the_step_costs_at_a_checked_speed_scale_each_kind_of_step_by_its_own_factor(tiny_profile):
    """`check.cost_at_speed`: per kind, the geometric mean of the checks' now / then (before and after a run);
    compactions and kinds no check timed take the mean of the overall ratios."""
    from skistune.profile.check import cost_at_speed
    from skistune.profile.cost import StepShape, step_kind

    decode = StepShape(num_tokens=4, num_seqs=4, decode_kv_bytes=1 << 20, prefill_pairs=0, num_samples=4)
    prefill = StepShape(num_tokens=64, num_seqs=1, decode_kv_bytes=0, prefill_pairs=64 * 64, num_samples=1)
    mixed = StepShape(num_tokens=67, num_seqs=4, decode_kv_bytes=1 << 20, prefill_pairs=64 * 64, num_samples=4)
    assert [step_kind(s) for s in (decode, prefill, mixed)] == ["decode", "prefill", "mixed"]
    base = tiny_profile.step_cost
    scaled = cost_at_speed(base, [{"ratio": 1.5, "by_kind": {"decode": 2.0, "prefill": 0.5}},
                                  {"ratio": 6.0, "by_kind": {"decode": 8.0}}])
    assert scaled.predict_s(decode) == pytest.approx(4.0 * base.predict_s(decode))  # sqrt(2 x 8)
    assert scaled.predict_s(prefill) == pytest.approx(0.5 * base.predict_s(prefill))  # one check timed prefills
    assert scaled.predict_s(mixed) == pytest.approx(3.0 * base.predict_s(mixed))  # none: sqrt(1.5 x 6)
    assert scaled.compaction_s(100, 80) == pytest.approx(3.0 * base.compaction_s(100, 80))
    with pytest.raises(ValueError, match="no speed check"):
        cost_at_speed(base, [])
