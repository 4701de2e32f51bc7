"""How many rows a CPU projection computes for a step of ``tokens`` rows, and in which orientation: the
rule `linear` follows, kept free of torch so that the simulator's step cost model (`skistune.profile.cost`)
counts the rows a CPU step really computes (where the rule pads, a 13-token step costs what a 16-token one
does, because it is one).

The rule is a measurement of the machine, not a constant (`linear.machine_rule` measures it once per
machine and model and caches it). The BLAS libraries disagree from one CPU to the next: on an AVX-512 AMD
EPYC host MKL computed ``w @ x.T`` 1.2-2.5x faster than ``x @ w.T`` from 2 to about 200 rows, and a
product 1-4 rows short of a multiple of 16 faster padded to it (`LEGACY_RULE`); on an Intel Xeon host
with AMX the same flips were 1.1-2.6x slower and the plain product won at every size (`PLAIN_RULE`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

ROW_MULTIPLE = 16  # padded products compute rows in multiples of this
SINGLE_ROW_PADDED = 2  # ... and one row as this many


@dataclass(frozen=True)
class ProjectionRule:
    """Which orientation a CPU projection of ``tokens`` rows runs in: "plain" (``x @ w.T``), "flipped"
    (``w @ x.T``) or "padded" (flipped, with zero rows up to `padded_rows`)."""

    flip_max_rows: int = 0  # 2 .. this many rows run flipped (0: none)
    pad_short_by: int = 0  # ... padded when at most this many rows short of a multiple of 16 (0: never)
    single_row_padded: bool = False  # one row runs as a padded two-row product

    def __post_init__(self) -> None:
        if not (0 <= self.pad_short_by < ROW_MULTIPLE and self.flip_max_rows >= 0):
            raise ValueError(f"projection rule: flip_max_rows >= 0 and 0 <= pad_short_by < {ROW_MULTIPLE}, "
                             f"got {self.flip_max_rows} and {self.pad_short_by}")

    def orientation(self, tokens: int) -> str:
        if tokens == 1:
            return "padded" if self.single_row_padded else "plain"
        if not 2 <= tokens <= self.flip_max_rows:
            return "plain"
        return "padded" if 0 < padded_rows(tokens) - tokens <= self.pad_short_by else "flipped"

    def rows(self, tokens: int) -> int:
        """The rows computed for ``tokens`` rows: `padded_rows` where the rule pads."""
        return padded_rows(tokens) if self.orientation(tokens) == "padded" else tokens

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ProjectionRule":
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            raise ValueError(f"projection rule: expected the fields {sorted(names)}, got {data!r}")
        if not all(isinstance(data[n], int) for n in names):
            raise ValueError(f"projection rule: every field is an integer or a boolean, got {data!r}")
        return cls(int(data["flip_max_rows"]), int(data["pad_short_by"]), bool(data["single_row_padded"]))


PLAIN_RULE = ProjectionRule()  # what F.linear does everywhere: CUDA, small models, machines where flipping loses
LEGACY_RULE = ProjectionRule(256, 4, True)  # the fixed rule of 2026-12-02 (AVX-512 EPYC): profiles with rows "cpu"


def padded_rows(tokens: int) -> int:
    """The rows a padded product computes: `SINGLE_ROW_PADDED` for one, else ``tokens`` rounded up to a
    multiple of `ROW_MULTIPLE`."""
    return SINGLE_ROW_PADDED if tokens == 1 else -(-tokens // ROW_MULTIPLE) * ROW_MULTIPLE
