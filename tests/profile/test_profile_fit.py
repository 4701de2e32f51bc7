"""The fits recover known costs from synthetic timings: coefficients, the knee, transfer latency and
bandwidth, and they are not bent by an outlier."""
from __future__ import annotations

import numpy as np
import pytest

from skistune.profile.cost import StepCostModel, StepShape
from skistune.profile.fit import fit_linear, fit_step_cost, fit_transfer

TRUE = StepCostModel(coef=(0.02, 1e-4, 5e-4, 2e-3, 3e-3, 2e-10, 1e-10, 1e-8, 3e-4), knee=256)


def _shapes() -> list[StepShape]:
    kvb = 46080
    shapes = [StepShape(b, b, b * c * kvb, 0, b) for b in (1, 2, 4, 8, 16, 32, 64, 128, 512) for c in (32, 512, 2048)]
    shapes += [StepShape(n, 1, 0, n * (k + n), 1, (k + n) * kvb) for n in (16, 64, 256, 512, 1024) for k in (0, 512, 1536)]
    shapes += [StepShape(n, 1, 0, n * n, 0, n * kvb) for n in (64, 512)]  # chunks ending mid-prompt sample nothing
    shapes += [StepShape(b + n, b + 1, b * 512 * kvb, n * n, b + 1, n * kvb) for b, n in ((4, 64), (16, 256), (32, 512))]
    return shapes


def test_exact_timings_give_back_the_coefficients_and_the_knee():
    shapes = _shapes()
    times_s = [TRUE.predict_s(s) for s in shapes]
    fit = fit_step_cost(shapes, times_s, [i % 5 == 2 for i in range(len(shapes))])
    assert fit.model.knee == 256
    np.testing.assert_allclose(fit.model.coef, TRUE.coef, rtol=1e-4, atol=1e-12)
    assert fit.train.r2 == pytest.approx(1.0) and fit.held_out.max_rel_error < 1e-4
    assert min(fit.knee_loss, key=fit.knee_loss.get) == 256


def test_one_outlier_does_not_bend_the_fit():
    shapes = _shapes()
    times_s = [TRUE.predict_s(s) for s in shapes]
    times_s[3] *= 3  # a median that another process inflated
    fit = fit_step_cost(shapes, times_s, [False] * len(shapes))
    rel = [abs(fit.model.predict_s(s) / TRUE.predict_s(s) - 1) for s in shapes]
    assert max(rel) < 0.01


def test_transfer_fit_recovers_latency_and_bandwidth():
    sizes = [4096 * 4 ** i for i in range(8)]
    fit = fit_transfer(sizes, [20e-6 + n / 5e9 for n in sizes])
    assert fit.latency_s == pytest.approx(20e-6, rel=1e-6) and fit.bytes_per_s == pytest.approx(5e9, rel=1e-6)
    assert fit.time_s(1 << 30) == pytest.approx(20e-6 + (1 << 30) / 5e9)


def test_a_poor_fit_is_flagged():
    x = np.column_stack([np.ones(8), np.arange(1, 9)])
    noisy = np.array([1.0, 9.0, 2.0, 8.0, 3.0, 7.0, 4.0, 6.0])
    fit = fit_linear(("fixed", "seqs"), x, noisy)
    assert fit.quality.r2 < 0.95 and fit.quality.flagged
    assert all(c >= 0 for c in fit.coef)
