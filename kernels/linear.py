"""The model's projections (``x @ w.T`` with ``w [out, in]`` as stored), in the orientation the BLAS runs
fastest for the step's shape.

A CPU step streams every weight from memory once (SmolLM2-135M's projections are 405 MiB, far beyond the
caches). In that regime MKL's sgemm computes ``w @ x.T`` (the weight as the left operand, read row by row)
1.2-2.5x faster than ``x @ w.T`` from 2 to about 200 tokens (`benchmarks/cpu_linear.py`, which streams a
whole model's weights per pass as a step does), and its speed at a given size depends on the rows modulo
16: a step a few rows short of a multiple of 16 (13-15, 31, 47, 63 tokens) runs faster padded with zero
rows up to it. One token runs as a two-row product (a zero row added): MKL's matrix-vector path streams
the weight slower than its two-column product (a one-token step took 75-77 ms so, 87-98 ms plain). From
about 256 tokens the transposed result's copy back to rows costs what the product saves. Timing one
projection over and over instead keeps its weight in the cache and gives the opposite answer at many sizes (an
earlier rule, flipping only at multiples of 16, came from such a benchmark: the step time then jumped
by a third between 16 and 15 or 17 tokens, and the profiler, which measures multiples of 16, predicted
real prefill chunks 15-30% fast).

The LM head (49,152 x 576, 108 MiB: never in the cache either; its rows are the step's sampled
sequences) follows the same rule: 1.3-3x flipped from 2 to 224 rows, even at 256, slower at 512. The
orientations round differently, by about 2e-6 on unit-scale outputs. CUDA keeps the plain product (cuBLAS
picks its own kernels).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# the rule (which orientation, how many rows) lives in `rows` without torch: the simulator's step cost
# model counts the rows a CPU step really computes
from .rows import CPU_FLIP_TOKENS, CPU_PAD_SHORT_BY, ROW_MULTIPLE, SINGLE_ROW_PADDED, cpu_orientation, padded_rows

__all__ = ["CPU_FLIP_TOKENS", "CPU_PAD_SHORT_BY", "ROW_MULTIPLE", "SINGLE_ROW_PADDED", "cpu_orientation",
           "padded_rows", "oriented_product", "linear"]


def oriented_product(x: torch.Tensor, w: torch.Tensor, orientation: str) -> torch.Tensor:
    """``x @ w.T`` computed in ``orientation`` (see `cpu_orientation`), as rows ``[T, out]``, contiguous (the
    flipped product's transpose is copied: a few percent of the time it saves, and what follows runs on the
    layout it expects)."""
    if orientation == "plain":
        return F.linear(x, w)
    tokens = x.shape[0]
    if orientation == "padded":
        x = torch.cat([x, x.new_zeros(padded_rows(tokens) - tokens, x.shape[1])])
    return torch.mm(w, x.t()).t()[:tokens].contiguous()


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [T, in] @ w.T`` -> ``[T, out]``, in the orientation this CPU runs fastest for T rows."""
    if x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, w)
    return oriented_product(x, w, cpu_orientation(x.shape[0]))
