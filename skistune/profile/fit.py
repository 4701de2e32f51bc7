"""Fitting the measured grids: non-negative least squares (a cost cannot be negative) on relative errors
(a 2 ms step off by 1 ms is as wrong as a 2 s step off by 1 s), made robust by Huber weights, with R²
and per-point relative residuals.
A fit whose R² is below `R2_FLAG_BELOW` is flagged in the profile and in every report of it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from skistune.kernels.rows import PLAIN_RULE, ProjectionRule

from .cost import PARALLEL_COLUMNS, PARALLEL_FEATURES, ProjectionTimes, StepCostModel, StepShape, design_matrix

R2_FLAG_BELOW = 0.95
MIN_POINTS_FOR_R2 = 3
KNEE_CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
SMALL_ROWS_CANDIDATES = (1, 2, 3, 4, 6, 8)  # where a BLAS may leave its small-product path (`cost.StepCostModel`)
# A zero-slope transfer fit would mean infinite bandwidth; cap it at 1 PB/s so every figure stays finite.
MIN_S_PER_BYTE = 1e-15
HUBER_REL_ERROR = 0.10  # relative error up to which a point keeps its full weight in the fit
HUBER_ITERATIONS = 30


@dataclass(frozen=True)
class FitQuality:
    """How well a fit reproduces its points: R² on the times, and |predicted - measured| / measured."""

    r2: float | None  # None below `MIN_POINTS_FOR_R2` points, where R² says nothing
    median_rel_error: float
    max_rel_error: float
    points: int

    @property
    def flagged(self) -> bool:
        return self.r2 is not None and self.r2 < R2_FLAG_BELOW

    def to_dict(self) -> dict:
        return {"r2": self.r2, "median_rel_error": self.median_rel_error, "max_rel_error": self.max_rel_error,
                "points": self.points, "flagged": self.flagged}


def fit_quality(predicted_s: np.ndarray, measured_s: np.ndarray) -> FitQuality:
    rel = np.abs(predicted_s - measured_s) / measured_s
    ss_res = float(np.sum((predicted_s - measured_s) ** 2))
    ss_tot = float(np.sum((measured_s - measured_s.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if len(measured_s) >= MIN_POINTS_FOR_R2 and ss_tot > 0 else None
    return FitQuality(r2=r2, median_rel_error=float(np.median(rel)), max_rel_error=float(np.max(rel)),
                      points=len(measured_s))


def _weighted_nnls(rows: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Non-negative ``coef`` minimising ``sum(weights * (rows @ coef - 1) ** 2)``."""
    from scipy.optimize import (
        nnls,  # here: loading a profile needs the fitted figures, not scipy
    )

    root_w = np.sqrt(weights)[:, None]
    # Columns range from 1 (the fixed cost) to ~1e9 (KV bytes): scale each to a unit maximum so the
    # solver's tolerance means the same for every feature, then undo the scaling.
    scale = np.abs(rows).max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(rows * root_w / scale, root_w[:, 0], maxiter=50 * rows.shape[1])
    return coef / scale


def nnls_relative(features: np.ndarray, measured_s: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the relative error of ``features @ coef``, robustly: Huber
    weights (iteratively reweighted) give points off by more than `HUBER_REL_ERROR` less say, so that a
    median that another process inflated on this shared machine, or a regime the features cannot express
    (one-token steps, which a CPU runs as matrix-vector products), does not bend the fit everywhere."""
    rows = features / measured_s[:, None]
    weights = np.ones(len(measured_s))
    for _ in range(HUBER_ITERATIONS):
        coef = _weighted_nnls(rows, weights)
        rel = np.abs(rows @ coef - 1.0)
        new = np.where(rel <= HUBER_REL_ERROR, 1.0, HUBER_REL_ERROR / np.maximum(rel, 1e-300))
        if np.allclose(new, weights, rtol=1e-6, atol=1e-9):
            break
        weights = new
    return coef


def huber_loss(rel_errors: np.ndarray) -> float:
    """Mean Huber loss of relative errors: what the robust fit minimises, so knees are compared by it."""
    a = np.abs(rel_errors)
    return float(np.mean(np.where(a <= HUBER_REL_ERROR, 0.5 * a ** 2, HUBER_REL_ERROR * (a - 0.5 * HUBER_REL_ERROR))))


@dataclass(frozen=True)
class LinearFit:
    """``time_s = features @ coef`` with named features (transfers, scheduler overhead, kernels)."""

    names: tuple[str, ...]
    coef: tuple[float, ...]
    quality: FitQuality

    def predict_s(self, features: Sequence[float]) -> float:
        return float(np.dot(features, self.coef))

    def to_dict(self) -> dict:
        return {"features": list(self.names), "coef": list(self.coef), "quality": self.quality.to_dict()}


def fit_linear(names: Sequence[str], features: np.ndarray, measured_s: np.ndarray) -> LinearFit:
    coef = nnls_relative(features, measured_s)
    return LinearFit(tuple(names), tuple(float(c) for c in coef), fit_quality(features @ coef, measured_s))


@dataclass(frozen=True)
class StepFit:
    """The step cost model fitted on the training points, checked on the held-out ones."""

    model: StepCostModel
    train: FitQuality
    held_out: FitQuality | None
    knee_loss: dict[int, float]  # Huber loss of the relative errors per candidate knee (training points), at
    # the chosen small-product bound


def fit_step_cost(shapes: Sequence[StepShape], measured_s: Sequence[float], held_out: Sequence[bool],
                  knees: Sequence[int] = KNEE_CANDIDATES, rows: ProjectionRule = PLAIN_RULE,
                  small_rows: Sequence[int] = SMALL_ROWS_CANDIDATES, table: ProjectionTimes | None = None,
                  parallel: tuple[int, ...] = ()) -> StepFit:
    """Fit `StepCostModel` on the points not held out, choosing the knee and the small-product bound
    (`SMALL_ROWS_CANDIDATES`) with the least relative error; ``rows``: the projection rule the steps ran
    with (how it counts a step's rows); ``table``: the projections timed on the same machine, if measured;
    ``parallel``: where the model's elementwise ops go parallel (`cost.parallel_rows`; none off the CPU)."""
    y = np.asarray(measured_s, dtype=np.float64)
    test = np.asarray(held_out, dtype=bool)
    train_shapes = [s for s, h in zip(shapes, test) if not h]
    unfit = separable_steps(train_shapes, parallel) == 0  # (their columns zeroed: their terms stay at zero)
    errors, coefs = {}, {}
    for knee in knees:
        for small in small_rows:
            x = design_matrix(train_shapes, knee, rows, small, table, parallel)
            x[:, PARALLEL_COLUMNS][:, unfit] = 0.0
            coefs[knee, small] = nnls_relative(x, y[~test])
            errors[knee, small] = huber_loss((x @ coefs[knee, small]) / y[~test] - 1.0)
    # Ties (no convex kink in the data: every knee past the largest step fits alike) go to the larger
    # knee, so that the slope is carried by `tokens` and the knee says "not seen below this"; and to the
    # smaller bound (1: one token, the model before the bound was fitted).
    knee, small = min(errors, key=lambda ks: (round(errors[ks], 12), ks[1], -ks[0]))
    model = StepCostModel.of(coefs[knee, small], knee, rows, small, table, parallel)
    predicted = np.array([model.predict_s(s) for s in shapes])
    held = fit_quality(predicted[test], y[test]) if test.any() else None
    return StepFit(model, fit_quality(predicted[~test], y[~test]), held, {k: errors[k, small] for k in knees})


def separable_steps(shapes: Sequence[StepShape], parallel: tuple[int, ...]) -> np.ndarray:
    """Per threshold of ``parallel`` (`cost.parallel_rows`), 1 where the points can tell its step from the
    per-token slope (two or more step sizes on each side of it), else 0. With one size past it the two trade
    freely: a quick grid's three 256-token prefills, the only steps past SmolLM2's 170, had put 279 ms in
    the step and cut the slope, and predicted a 2,048-token prefill at 2.6 s where the full profile says 4.3."""
    sizes = {s.num_tokens for s in shapes}
    return np.array([float(len({n for n in sizes if n <= r}) >= 2 and len({n for n in sizes if n > r}) >= 2)
                     for r in parallel] if parallel else [1.0] * len(PARALLEL_FEATURES))


@dataclass(frozen=True)
class TransferFit:
    """``time_s = calls * latency_s + nbytes / bytes_per_s`` for one link between tiers: ``latency_s`` is paid
    per copy call, and the runtime makes one per part tensor of the KV layout (`kv_layout.part_tensors`), so
    the profiler times copies of one tensor and of as many as the layout has (`transfers.block_copy_timings`)."""

    latency_s: float
    bytes_per_s: float
    quality: FitQuality

    def time_s(self, nbytes: int, calls: int = 1) -> float:
        return calls * self.latency_s + nbytes / self.bytes_per_s

    def to_dict(self) -> dict:
        return {"latency_s": self.latency_s, "bytes_per_s": self.bytes_per_s, "quality": self.quality.to_dict()}


def fit_transfer(sizes_bytes: Sequence[int], measured_s: Sequence[float],
                 calls: Sequence[int] | None = None) -> TransferFit:
    """The link's fit on timings of ``sizes_bytes`` moved in ``calls`` copy calls each (one when None)."""
    counts = np.ones(len(sizes_bytes)) if calls is None else np.asarray(calls, dtype=np.float64)
    x = np.column_stack([counts, np.asarray(sizes_bytes, dtype=np.float64)])
    y = np.asarray(measured_s, dtype=np.float64)
    latency_s, s_per_byte = nnls_relative(x, y)
    s_per_byte = max(float(s_per_byte), MIN_S_PER_BYTE)
    predicted = latency_s * x[:, 0] + x[:, 1] * s_per_byte
    return TransferFit(float(latency_s), 1.0 / s_per_byte, fit_quality(predicted, y))
