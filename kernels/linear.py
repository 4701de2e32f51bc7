"""The model's projections (``x @ w.T`` with ``w [out, in]`` as stored), in the orientation the BLAS runs
fastest for the step's shape.

On a CPU, MKL's sgemm computes ``w @ x.T`` (the weight as the left operand) faster than ``x @ w.T`` at
some step sizes and slower at others, and bit-identically on the shapes measured: `benchmarks/cpu_linear.py`
times both for SmolLM2's projections. The flipped product gains where the tokens are a multiple of 16
from 16 to 64 (the MLP's down projection 1.1-1.4x, the others about even) and loses 20-30% at other
sizes (17, 37 or 63 tokens: 0.70-0.85x; a prefill chunk of a short prompt has such sizes); above 64
tokens copying the transposed result back to rows costs more than the product saves. A tall weight (the
LM head: 49,152 x 576) gains from 2 to 32 rows (2-3.7x at 2-7 rows, 1.05-1.3x at 16-32) and loses above
about 36 (0.6-0.85x at 37-128); there the two orientations round differently, by about 2e-6 on the
logits. Measured with alternating repeats, medians of five. CUDA keeps the plain product (cuBLAS picks
its own kernels).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CPU_FLIP_TOKENS = range(16, 65, 16)  # step tokens (rows of x) computed as w @ x.T on a CPU ...
CPU_FLIP_TOKENS_TALL = range(2, 33)  # ... and for a weight at least TALL times as many rows as columns
TALL = 16


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [T, in] @ w.T`` -> ``[T, out]``, contiguous (the flipped product's transpose is copied: a few
    percent of the time it saves, and what follows runs on the layout it expects)."""
    flip = CPU_FLIP_TOKENS_TALL if w.shape[0] >= TALL * w.shape[1] else CPU_FLIP_TOKENS
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[0] in flip:
        return torch.mm(w, x.t()).t().contiguous()
    return F.linear(x, w)
