"""How many rows a CPU projection computes for a step of ``tokens`` rows, and in which orientation: the rule
`linear` follows (see its module for the measurements behind it), kept free of torch so that the
simulator's step cost model (`skistune.profile.cost`) can count the rows a CPU step really computes: a
13-token step costs what a 16-token one does, because it is one.
"""
from __future__ import annotations

ROW_MULTIPLE = 16  # MKL's fast path on this CPU: rows (tokens) in multiples of 16
CPU_FLIP_TOKENS = range(1, 257)  # step tokens (rows of x) computed as w @ x.T on a CPU ...
CPU_PAD_SHORT_BY = 4  # ... padded with zero rows to the next multiple of 16 when at most this many short
SINGLE_ROW_PADDED = 2  # ... and one row padded to two


def padded_rows(tokens: int) -> int:
    """The rows a padded product computes: `SINGLE_ROW_PADDED` for one, else ``tokens`` rounded up to a
    multiple of `ROW_MULTIPLE`."""
    return SINGLE_ROW_PADDED if tokens == 1 else -(-tokens // ROW_MULTIPLE) * ROW_MULTIPLE


def cpu_orientation(tokens: int) -> str:
    """How a CPU computes a projection of ``tokens`` rows: "plain" (``x @ w.T``), "flipped" (``w @ x.T``)
    or "padded" (flipped, with zero rows up to `padded_rows`)."""
    if tokens not in CPU_FLIP_TOKENS:
        return "plain"
    return "padded" if tokens == 1 or 0 < padded_rows(tokens) - tokens <= CPU_PAD_SHORT_BY else "flipped"


def cpu_rows(tokens: int) -> int:
    """The rows a CPU projection computes for ``tokens`` rows: padded ones where `cpu_orientation` pads."""
    return padded_rows(tokens) if cpu_orientation(tokens) == "padded" else tokens
