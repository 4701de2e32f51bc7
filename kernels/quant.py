"""KV quantization (PyTorch implementation, used on CPUs and as the reference for the Triton kernels).

Asymmetric round-to-nearest integers with a scale and a zero point per group (KIVI, arXiv 2402.02750):

- keys are grouped **per channel** over the tokens of one KV block: a block of ``block_size`` tokens
  has one (scale, zero) per KV head and channel. KIVI groups keys over G consecutive tokens; in a
  paged cache the block is the natural group (it is complete exactly when it can be quantized).
- values are grouped **per token** over ``group`` consecutive channels.

Codes are packed along the channel axis, ``8 // bits`` per byte, lowest bits first: channel ``c``
of a token lives in byte ``c // per_byte`` at bit offset ``(c % per_byte) * bits``. Scales and zero
points are stored in the cache's floating dtype. The reconstruction error of one element is at most
half a quantization step, ``scale / 2 = (max - min) / (2 * (2**bits - 1))`` of its group: codes are
computed against the scale and zero as stored (rounded to the storage dtype), so that rounding adds nothing
but at a group's top, where a scale rounded down leaves the largest element past the last code (measured
with a 16-bit storage dtype: at most 0.64 of a step in bfloat16 at 8 bits, 0.50 in float16 and float32;
`tests/kernels/test_quant.py`).
"""
from __future__ import annotations

import torch

QUANT_BITS = (8, 4, 2)


def per_byte(bits: int) -> int:
    if bits not in QUANT_BITS:
        raise ValueError(f"bits: {bits} is not one of {QUANT_BITS}")
    return 8 // bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes ``[..., D]`` in [0, 2**bits) -> bytes ``[..., D * bits // 8]`` (uint8)."""
    n = per_byte(bits)
    grouped = codes.to(torch.uint8).view(*codes.shape[:-1], codes.shape[-1] // n, n)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)  # [n]
    return (grouped << shifts).sum(-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Bytes ``[..., D * bits // 8]`` -> codes ``[..., D]`` (uint8)."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., D/n, n]
    return codes.flatten(-2)


def _quantize(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (uint8), scale and zero of ``x`` with one group along ``dim`` (computed in float32 against the
    scale and zero as stored, in ``x``'s dtype: codes computed against the unrounded ones had missed by up to
    1.4 steps at 8 bits in bf16; a tester's finding)."""
    xf = x.float()
    lo = xf.amin(dim, keepdim=True)
    hi = xf.amax(dim, keepdim=True)
    # a constant group has zero range: any positive scale reconstructs it exactly (code 0 -> lo)
    scale = ((hi - lo) / ((1 << bits) - 1)).clamp_min(1e-8)
    scale = scale.to(x.dtype).float().clamp_min(stored_scale_floor(x.dtype))
    lo = lo.to(x.dtype).float()
    # round half up (not half to even) so that the Triton kernel, which floors x + 0.5, agrees: clamped to
    # [0, 2**bits - 1] first, the cast to an integer truncates, which is the floor there. (Not floor_():
    # PyTorch's CPU rounding ops split past 2,048 elements across threads, and a block of one layer's keys
    # has 3,072 in SmolLM2: waking the sleeping threads took 66 us a call, 30 layers x 2 sides a step.)
    codes = ((xf - lo) / scale).add_(0.5).clamp_(0, (1 << bits) - 1).to(torch.uint8)
    return codes, scale, lo


def stored_scale_floor(dtype: torch.dtype) -> float:
    """The least scale kept: positive in the storage dtype (1e-8 is 0 in float16, and codes against it NaN)."""
    return max(1e-8, torch.finfo(dtype).tiny)


def quantize_keys(k: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full blocks of keys ``[N, block_size, n_kv, D]`` -> packed ``[N, block_size, n_kv, D*bits/8]``,
    scale and zero ``[N, n_kv, D]`` (one per block, head and channel)."""
    codes, scale, zero = _quantize(k, 1, bits)
    return pack(codes, bits), scale.squeeze(1).to(k.dtype), zero.squeeze(1).to(k.dtype)


def dequantize_keys(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `quantize_keys`; any leading block dims (``[..., block_size, n_kv, D*bits/8]``). In float32
    whatever the storage dtype: ``code * scale + zero`` cancels (zero is about -max), and bf16 arithmetic
    would leave errors of 2**-8 of the group's range (measured: 5e-2 relative on attention outputs)."""
    codes = unpack(packed, bits).float()
    return codes * scale.float().unsqueeze(-3) + zero.float().unsqueeze(-3)


def quantize_values(v: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values ``[..., D]`` -> packed ``[..., D*bits/8]``, scale and zero ``[..., D // group]``."""
    grouped = v.view(*v.shape[:-1], v.shape[-1] // group, group)
    codes, scale, zero = _quantize(grouped, -1, bits)
    return pack(codes.flatten(-2), bits), scale.squeeze(-1).to(v.dtype), zero.squeeze(-1).to(v.dtype)


def dequantize_values(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `quantize_values`."""
    codes = unpack(packed, bits)
    n_groups = scale.shape[-1]
    grouped = codes.view(*codes.shape[:-1], n_groups, -1).float()  # float32 for the reason in dequantize_keys
    return (grouped * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).flatten(-2)

