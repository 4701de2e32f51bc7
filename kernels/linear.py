"""The model's projections (``x @ w.T`` with ``w [out, in]`` as stored), in the orientation the BLAS runs
fastest for the step's shape.

On a CPU, MKL's sgemm computes ``w @ x.T`` (the weight as the left operand) faster than ``x @ w.T`` for
steps of a few dozen tokens, the decode batches, and bit-identically on the shapes measured:
`benchmarks/cpu_linear.py` times both for SmolLM2's projections (at 32 tokens: the MLP's gate/up 1.17x,
the LM head 1.35x). Outside `CPU_FLIP_TOKENS` the plain product is as fast or faster (above 64 tokens,
copying the transposed result back to rows costs more than the product saves). A tall weight (the LM
head: 49,152 x 576) gains from 2 tokens on (1.8x at 8; there the two orientations round differently, by
about 2e-6 on the logits). CUDA keeps the plain product (cuBLAS picks its own kernels).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CPU_FLIP_TOKENS = range(16, 65)  # step tokens (rows of x) computed as w @ x.T on a CPU ...
CPU_FLIP_TOKENS_TALL = range(2, 129)  # ... and for a weight at least TALL times as many rows as columns
TALL = 16


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [T, in] @ w.T`` -> ``[T, out]``, contiguous (the flipped product's transpose is copied: a few
    percent of the time it saves, and what follows runs on the layout it expects)."""
    flip = CPU_FLIP_TOKENS_TALL if w.shape[0] >= TALL * w.shape[1] else CPU_FLIP_TOKENS
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[0] in flip:
        return torch.mm(w, x.t()).t().contiguous()
    return F.linear(x, w)
