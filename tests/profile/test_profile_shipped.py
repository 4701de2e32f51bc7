"""The profile shipped in profiles/ (SmolLM2-135M on the CPU it was measured on): its step cost model
reproduces the grid points that were held out of its fit.

Why the median and not every point within 10%: the cost model (`skistune.profile.cost`) is linear in its
features, and on a CPU the real step is not: the projections' BLAS cost steps with the rows (tokens) in
ways no line follows (`kernels/linear.py`, `benchmarks/step_tokens.py`), and prefill attention also reads
the whole cached context per chunk, which `prefill_pairs` undercounts for small chunks; on top of that, a
grid point's repeats spread by 10-50% on a shared 2-core host. The robust fit keeps the typical point
within 10%; the per-point residuals are in the file.
"""
from __future__ import annotations

import numpy as np
import pytest

from skistune.profile import LINKS, HardwareProfile
from skistune.profile.power import POWER_SOURCES

HELD_OUT_MEDIAN_REL_ERROR = 0.10
HELD_OUT_MAX_REL_ERROR = 0.25


def _held_out_errors(profile: HardwareProfile) -> np.ndarray:
    held = [p for p in profile.steps if p.held_out]
    return np.array([abs(profile.step_cost.predict_s(p.shape) / p.timing.median_s - 1) for p in held])


def test_shipped_profile_describes_smollm2_on_the_cpu(shipped: HardwareProfile):
    assert (shipped.name, shipped.model, shipped.device, shipped.dtype) == (
        "cpu-smollm2-135m", "smollm2-135m", "cpu", "float32")
    assert not shipped.quick
    assert shipped.kv_bytes_per_token == 30 * 2 * 3 * 64 * 4  # layers x (K, V) x KV heads x head_dim x fp32
    assert {p.kind for p in shipped.steps} == {"decode", "prefill", "mixed"}


def test_held_out_grid_points_are_reproduced(shipped: HardwareProfile):
    errors = _held_out_errors(shipped)
    assert len(errors) >= 5
    assert np.median(errors) <= HELD_OUT_MEDIAN_REL_ERROR, errors
    assert errors.max() <= HELD_OUT_MAX_REL_ERROR, errors


def test_recorded_fit_quality_matches_the_model(shipped: HardwareProfile):
    errors = _held_out_errors(shipped)
    quality = shipped.step_fit.held_out
    assert quality.points == len(errors)
    assert quality.median_rel_error == pytest.approx(np.median(errors))
    assert quality.max_rel_error == pytest.approx(errors.max())
    assert shipped.step_fit.train.points + quality.points == len(shipped.steps)


def test_step_fit_explains_the_grid_and_flags_say_so(shipped: HardwareProfile):
    r2 = shipped.step_fit.train.r2
    # a broken fit, or a measurement disturbed by another process, lands near or below 0 (seen here);
    # this CPU's quiet grid fits at 0.88-0.97 (the largest prefill chunks weigh most in R²)
    assert r2 > 0.8
    assert any(name.startswith("step") for name in shipped.flagged_fits()) == (r2 < 0.95)


def test_transfers_and_power_are_there(shipped: HardwareProfile):
    assert sorted(shipped.transfers) == sorted(LINKS)
    for link in LINKS:
        assert 0 < shipped.transfer_time_s(4096, link) < shipped.transfer_time_s(64 << 20, link)
    assert shipped.power.source in POWER_SOURCES
    assert shipped.power.modeled == ("modeled" in shipped.power.note)
    assert shipped.power_w(1.0) > shipped.power_w(0.0) > 0
