"""The fits recover known costs from synthetic timings: coefficients, the knee, transfer latency and
bandwidth, and they are not bent by an outlier."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from skistune.profile.cost import FEATURES, QUANT_FEATURES, StepCostModel, StepShape
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


def test_the_cpu_row_rule_counts_the_rows_a_cpu_step_computes():
    from skistune.kernels.rows import LEGACY_RULE, PLAIN_RULE, ProjectionRule

    model = StepCostModel(coef=(0.02, 1e-4, 5e-4, 0.0, 3e-3, 0.0, 0.0, 0.0, 3e-4), knee=2048, rows=LEGACY_RULE)
    plain = replace(model, rows=PLAIN_RULE)
    step = lambda n, samples=1: StepShape(n, 1, 0, 0, samples)  # noqa: E731
    # 13-15 tokens are padded to 16 rows (`kernels.rows`), 11 is not, one token runs as two rows
    assert model.predict_s(step(13)) == model.predict_s(step(16)) > plain.predict_s(step(13))
    assert model.predict_s(step(11, samples=0)) == plain.predict_s(step(11, samples=0))
    assert model.predict_s(step(1)) == pytest.approx(plain.predict_s(step(1)) + 5e-4 + 3e-4)  # token and LM-head row
    assert model.predict_s(step(16, samples=0)) == plain.predict_s(step(16, samples=0))
    # written and read back; the names files used before rules were measured per machine still read
    measured = replace(model, rows=ProjectionRule(64, 1, False))
    for m in (model, plain, measured):
        assert StepCostModel.from_dict(m.to_dict()) == m
    assert plain.to_dict()["rows"] == "tokens" and measured.to_dict()["rows"]["flip_max_rows"] == 64
    assert StepCostModel.from_dict({**model.to_dict(), "rows": "cpu"}).rows == LEGACY_RULE
    old = {k: v for k, v in plain.to_dict().items() if k != "rows"}
    assert StepCostModel.from_dict(old).rows == PLAIN_RULE
    with pytest.raises(ValueError, match=r"step\.cost_model\.rows: 'avx' is not one of tokens, cpu"):
        StepCostModel.from_dict({**model.to_dict(), "rows": "avx"})
    with pytest.raises(ValueError, match="projection rule"):
        StepCostModel.from_dict({**model.to_dict(), "rows": {"flip_max_rows": 3}})


def test_a_fit_with_the_cpu_row_rule_recovers_costs_that_follow_padded_rows():
    from skistune.kernels.rows import LEGACY_RULE

    truth = replace(TRUE, rows=LEGACY_RULE)
    shapes = _shapes() + [StepShape(n, 1, 0, n * n, 1, n * 46080) for n in (13, 15, 29, 62)]
    times_s = [truth.predict_s(s) for s in shapes]
    fit = fit_step_cost(shapes, times_s, [False] * len(shapes), rows=LEGACY_RULE)
    assert fit.model.rows == LEGACY_RULE and fit.train.max_rel_error < 1e-4
    wrong = fit_step_cost(shapes, times_s, [False] * len(shapes))  # one row per token cannot follow the padding
    assert wrong.train.max_rel_error > 10 * fit.train.max_rel_error


def test_the_fit_finds_where_the_blas_leaves_its_small_product_path():
    """Steps of 1-3 tokens cheap, 4 and more paying the general product's cost (this project's Intel host):
    the fit picks that bound among the candidates; a model written without it reads one token."""
    truth = replace(TRUE, small_rows=3)
    shapes = _shapes() + [StepShape(b, b, b * c * 46080, 0, b) for b in (3, 6) for c in (32, 512)]
    fit = fit_step_cost(shapes, [truth.predict_s(s) for s in shapes], [False] * len(shapes))
    assert fit.model.small_rows == 3 and fit.train.max_rel_error < 1e-4
    one = fit_step_cost(shapes, [truth.predict_s(s) for s in shapes], [False] * len(shapes), small_rows=(1,))
    assert one.train.max_rel_error > 0.05  # one token as the bound cannot follow it
    assert StepCostModel.from_dict(fit.model.to_dict()) == fit.model
    old = {k: v for k, v in fit.model.to_dict().items() if k != "small_rows"}
    assert StepCostModel.from_dict(old).small_rows == 1
    with pytest.raises(ValueError, match="small_rows"):
        StepCostModel.from_dict({**fit.model.to_dict(), "small_rows": 0})
    with pytest.raises(ValueError, match="small_rows"):
        StepCostModel.from_dict({**fit.model.to_dict(), "small_rows": "3"})


def test_the_fit_recovers_what_a_compaction_costs():
    """Decode steps that also compact (per compaction and per slot) next to plain ones: the eviction terms
    come back, and a model written before them reads them as zero."""
    truth = replace(TRUE, evict_coef=(9e-3, 2e-6))
    kvb = 46080
    shapes = _shapes() + [StepShape(b, b, b * (n + 16) * kvb, 0, b, compactions=b, compacted_slots=b * (n + 16))
                          for b in (1, 8, 32) for n in (256, 1024)]
    fit = fit_step_cost(shapes, [truth.predict_s(s) for s in shapes], [False] * len(shapes))
    np.testing.assert_allclose(fit.model.evict_coef, truth.evict_coef, rtol=1e-3)
    assert fit.model.compaction_s(272, 256) == pytest.approx(9e-3 + 272 * 2e-6)
    old = fit.model.to_dict()
    kept = len(FEATURES) + len(QUANT_FEATURES)  # the features of profiles written before compactions were timed
    old["features"], old["coef"] = old["features"][:kept], old["coef"][:kept]
    assert StepCostModel.from_dict(old).evict_coef == (0.0, 0.0)


def test_projection_times_interpolate_and_are_validated():
    from skistune.profile.cost import ProjectionTimes
    table = ProjectionTimes((1, 2, 4, 16), (0.010, 0.012, 0.020, 0.030), (0.002, 0.002, 0.004, 0.003))
    assert table.layers(2) == 0.012 and table.layers(3) == pytest.approx(0.016)  # measured, and between
    assert table.layers(32) == pytest.approx(0.030 + 16 * 0.010 / 12)  # past the last: its segment goes on
    assert table.head(0) == 0.0 and table.head(16) == 0.003
    assert ProjectionTimes.from_dict(table.to_dict()) == table
    for rows, times in (((1,), (0.01,)), ((2, 1), (0.01, 0.02)), ((1, 2), (0.01, -1.0))):
        with pytest.raises(ValueError, match="projection table"):
            ProjectionTimes(rows, times, times)
    with pytest.raises(ValueError, match="projection table"):
        ProjectionTimes.from_dict({"rows": [1, 2], "layers_s": [0.1, "x"], "head_s": [0.1, 0.1]})


def test_the_fit_reads_the_projection_table_and_follows_its_steps():
    """Projections that cost what a measured table says (flat to 3 rows, a jump at 4, cheaper at 16 than at
    15: a BLAS's kernels), plus the rest of a step: with the table the fit follows them exactly, the
    coefficient on the table is the share the table explains, and the table is written with the model."""
    from skistune.profile.cost import ProjectionTimes
    rows = tuple(range(1, 17)) + (32, 64, 128, 256, 512, 1024, 2048)
    layers = [0.017, 0.018, 0.020, 0.030, 0.032, 0.033, 0.037, 0.036, 0.037, 0.040, 0.041, 0.042, 0.045, 0.046,
              0.047, 0.042, 0.051, 0.072, 0.11, 0.20, 0.36, 0.69, 1.34]
    table = ProjectionTimes(rows, tuple(layers), tuple(t / 4 for t in layers))
    truth = replace(TRUE, coef=(0.005,) + TRUE.coef[1:], table_coef=(1.1, 1.0), table=table)
    truth = replace(truth, coef=truth.coef[:2] + (1e-5, 0.0, 0.0) + truth.coef[5:])  # little per-token work left
    shapes = _shapes() + [StepShape(b, b, b * 300 * 46080, 0, b) for b in (3, 5, 6, 7, 9, 13, 15)]
    times_s = [truth.predict_s(s) for s in shapes]
    fit = fit_step_cost(shapes, times_s, [False] * len(shapes), table=table)
    assert fit.train.max_rel_error < 1e-3
    np.testing.assert_allclose(fit.model.table_coef, (1.1, 1.0), rtol=1e-2)
    without = fit_step_cost(shapes, times_s, [False] * len(shapes))
    assert without.train.max_rel_error > 0.05
    assert StepCostModel.from_dict(fit.model.to_dict()) == fit.model


def test_the_parallel_steps_are_recovered_where_the_grid_can_separate_them_from_the_slope():
    """Exact timings with a jump of 40 ms past 56 tokens and 10 ms past 21: the fit gives them back. A grid
    with one step size past a threshold (a quick grid's 256-token prefills past 170) cannot tell a jump there
    from the slope: that term stays at zero, and the sizes past it are fitted by the slope alone."""
    from skistune.profile.cost import ALL_FEATURES, StepCostModel
    from skistune.profile.fit import separable_steps

    parallel = (170, 56, 21)
    jumps = {"parallel_kv_rows": 0.0, "parallel_hidden_rows": 0.040, "parallel_mlp_rows": 0.010}
    coef = [dict(zip(ALL_FEATURES, TRUE.coef)).get(f, jumps.get(f, 0.0)) for f in ALL_FEATURES]
    truth = StepCostModel.of(coef, knee=256, parallel=parallel)
    shapes = _shapes()
    fit = fit_step_cost(shapes, [truth.predict_s(s) for s in shapes], [False] * len(shapes), parallel=parallel)
    np.testing.assert_allclose(fit.model.parallel_coef, (0.0, 0.040, 0.010), atol=1e-6)
    assert fit.model.parallel_rows == parallel and fit.train.max_rel_error < 1e-4
    quick = [s for s in shapes if s.num_tokens <= 256]  # (as the quick grid: no step larger than 256 tokens)
    assert sorted({s.num_tokens for s in quick if s.num_tokens > 170}) == [256]
    np.testing.assert_array_equal(separable_steps(quick, parallel), [0.0, 1.0, 1.0])
    jump = replace(truth, parallel_coef=(0.3, 0.040, 0.010))  # 300 ms past 170
    fit = fit_step_cost(quick, [jump.predict_s(s) for s in quick], [False] * len(quick), parallel=parallel)
    assert fit.model.parallel_coef[0] == 0.0
    np.testing.assert_array_equal(separable_steps(shapes, parallel), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(separable_steps(shapes, ()), [1.0, 1.0, 1.0])


def test_the_mixed_term_is_recovered_from_mixed_steps_and_stays_zero_without_them():
    """Exact timings where a step with decode rows beside a chunk costs 12 ms more (both attention paths):
    the fit gives the 12 ms back from the grid's mixed steps, and the other terms stay as they were. A grid
    without mixed steps leaves the term at zero (nothing tells it apart)."""
    truth = replace(TRUE, mixed_coef=(0.012,))
    kvb = 46080
    shapes = _shapes() + [StepShape(b + n, b + 1, b * c * kvb, n * n, b + 1, n * kvb)
                          for b, c, n in ((1, 128, 9), (3, 128, 16), (1, 512, 37), (2, 64, 100))]
    fit = fit_step_cost(shapes, [truth.predict_s(s) for s in shapes], [False] * len(shapes))
    np.testing.assert_allclose(fit.model.mixed_coef, (0.012,), rtol=1e-4)
    np.testing.assert_allclose(fit.model.coef, TRUE.coef, rtol=1e-4, atol=1e-12)
    unmixed = [s for s in shapes if not (s.decode_kv_bytes and s.prefill_pairs)]
    fit = fit_step_cost(unmixed, [truth.predict_s(s) for s in unmixed], [False] * len(unmixed))
    assert fit.model.mixed_coef == (0.0,)
