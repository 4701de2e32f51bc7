"""The shape of one engine step and the cost model that turns it into seconds. Torch-free: the
simulator computes a `StepShape` from each `SchedulerOutput` and asks the hardware profile's fitted
`StepCostModel` for the step's duration; the profiler measures real steps of known shapes to fit it.

The model is linear in features that follow the step's work (a roofline split into its parts):

    step_s = c_fixed                      per-step overhead (Python scheduling, kernel launches)
           + c_seq     * num_seqs         per-sequence bookkeeping (metadata, sampling)
           + c_token   * num_tokens       projections and MLP (weights streamed once, work per token)
           + c_knee    * max(0, num_tokens - knee)   the compute-bound slope past the knee
           + c_multi   * [num_tokens > small_rows]  the BLAS's general product instead of its small-product
                                          path (on CPUs a step of 1 to `small_rows` tokens is markedly
                                          cheaper per token: 1 on one host, 1-3 on another)
           + c_kv      * decode_kv_bytes  decode attention reads each cached KV byte once
           + c_pkv     * prefill_kv_bytes a prefill chunk reads its whole cached context's KV once
           + c_pair    * prefill_pairs    prefill attention does work per query-key pair
           + c_sample  * num_samples      LM head over the vocabulary for each sampled row
           + c_ddq     * decode_dequant_elements   quantized KV elements the decode attention converts
           + c_pdq     * prefill_dequant_elements  ... and the prefill attention
           + c_quant   * quantize_elements         elements quantized on append (once per token)
           + c_dunpack * decode_unpack_elements    sub-byte codes' extra unpacking in decode (x1 at 4 bits,
           + c_punpack * prefill_unpack_elements   x3 at 2 bits, `kv_layout.unpack_work`) ... and prefill
           + c_compact * compactions               eviction compactions run after the forward pass (per
           + c_cslot   * compacted_slots           sequence: select the kept tokens, move them, every layer)
           + c_proj    * projections_s(num_tokens) the projections as timed on this machine: one pass over
           + c_head    * lm_head_s(num_samples)    every layer's weights, and the LM head, at that many rows
           + c_par_*   * [num_tokens > parallel_rows_*]  elementwise ops over a KV / hidden / MLP row that
                                          PyTorch splits across threads past its grain (CPU only)
           + c_mixed   * [decode rows and prefill chunks]  both attention paths run in one step
           + c_packing * [the step packs a block]  quantized KV: the blocks the step completes are packed
           + c_block   * packed_blocks             (one quantize call per side and layer, whatever the blocks)
           + c_stoken  * scored_prefill_tokens     eviction that scores by attention: prefill chunks run
           + c_spair   * scored_prefill_pairs      attention with its probabilities materialized
           + c_pcomp   * parallel_compactions      compactions whose kept slots PyTorch splits across threads

KV bytes are counted at the config's bits (`skistune.runtime.kv_layout.kv_traffic`: packed codes, scales
and zero points, plus the full-precision ring tokens attention reads), so fewer bits read fewer bytes.
The dequantization terms say what converting them costs, which differs by where it happens: the PyTorch
path (CPUs) dequantizes the gathered context into a full-precision copy (on this project's CPU, slower
than reading the same context at 16 bits); a Triton kernel (CUDA) dequantizes in registers, nearly free
next to the bytes. Decode and prefill have a term each, as they may take different paths. One model
expresses both machines; the measured grid decides the coefficients.

The quantized-KV terms (`QUANT_FEATURES`) come after the nine of the first profiles (`FEATURES`): a
profile measured without quantized points loads with them at zero (its quantized KV is extrapolated from
the bytes alone, and says so: `HardwareProfile.quantized_kv_note`). The two unpacking terms came last
(profiles of 2026-12-01 and earlier have the first three quantized terms only): such a profile loads
with them at zero and prices a 4-bit context like an 8-bit one.

The token terms (`tokens`, `tokens_past_knee`, `samples`) count the rows the projections and the LM head
really compute, which the model's ``rows`` rule says: the `ProjectionRule` the runtime ran the measured
steps with (measured per machine; where it pads a step a few rows short of a multiple of 16, 13 tokens
cost what 16 do, and one token may run as two rows). Without it the fit drew a straight line through the
padded sizes and predicted 12-15-token steps 10-15% fast. In a file: ``"tokens"`` (one row per token:
CUDA, and profiles written before the rule existed), ``"cpu"`` (the fixed rule of 2026-12-02,
`LEGACY_RULE`) or the rule's fields.

Where a BLAS leaves its small-product path is a property of the machine: on this project's Intel host a
decode step of 1-3 sequences took 30-32 ms and one of 4 took 47 ms, while an AMD host's steps rose from
1 row on. So ``small_rows`` is fitted like the knee (the candidate with the least loss; profiles written
before it read 1, the old ``[num_tokens > 1]``).

The eviction terms (`EVICTION_FEATURES`) came last (2026-12-02): a compaction of 272 slots to 256 added
9-12 ms to a 29 ms decode step of SmolLM2 on a 2-core CPU, and a sequence under a budget compacts once a
block of new tokens. Profiles without them load with them at zero (compactions then look free). The
attention statistics H2O and TOVA keep each step are not a term: they added 2 ms (3%) to a decode step
of 8 sequences at 512 tokens.

The projection terms (`TABLE_FEATURES`, 2026-12-02) read a table the profiler measures: the time of one
pass over every layer's projection weights, and of the LM head, at 1-16 rows one by one and at sizes up
to 2,048 (`ProjectionTimes`, linear between sizes). A BLAS's speed is not linear in the rows: on this
project's Intel host a pass took 17, 18, 20 and 30 ms at 1-4 rows, 47 ms at 15 rows and 42 at 16, and the
LM head 19 ms at 15 rows against 10 at 16. The token terms could only follow such steps with a term per
step (`small_rows` was one); with the table their coefficients carry the rest of a step's per-token work.
A profile measured before the table has it absent and the terms at zero.

The parallel terms (`PARALLEL_FEATURES`, 2026-12-05) are steps where PyTorch's CPU kernels start to split
an elementwise op (a norm, an add, an activation) across threads: past `TORCH_GRAIN_ELEMENTS` elements
(``at::internal::GRAIN_SIZE``), so past 32768 // width rows of a tensor ``width`` wide. Each such op then
wakes the other threads, which costs nothing much while they spin and a lot where they sleep
(``OMP_WAIT_POLICY=PASSIVE``, skistune's default). On the Intel host, sleeping, a SmolLM2 prefill of 56
tokens took 129 ms and one of 57 took 161 (hidden 576: 32768 // 576 = 56); 21 -> 22 tokens (MLP 1536) and
170 -> 171 (KV 192) added 10 ms each; spinning, 56 and 57 tokens took 97 and 99 ms (`benchmarks/step_tokens.py`).
Without the terms the shipped profile's 64-token chunks were predicted 14-32% short. The thresholds follow
from the model's widths (`parallel_rows`); a GPU profile has none, and profiles written before them load
with the terms at zero.

The mixed term (`MIXED_FEATURES`, 2026-12-05) is a step that computes decode rows and prefill chunks
together: it runs both attention paths in every layer (the decode rows in one batched call, each chunk in
its own), where a decode step or a prefill step runs one, and the intercept carries one path's fixed cost
only. On the Intel host, with OpenMP threads sleeping between parallel regions, one decode beside a prefill
of 8, 40, 64 and 128 tokens added 13.0, 8.5, 15.4 and 10.5 ms to the prefill alone (69-217 ms), where the
model without the term added 0.5-1.6 ms; with spinning threads it added 1.1-5.1 ms (`python
benchmarks/step_tokens.py --tokens 8 40 64 128 --decodes 0 1 4 --rounds 5`, with ``--profile`` for the
predictions). The full profile's grid had mixed steps of 2 to 64 decodes only; its steps of a new prompt
beside one to four decodes, as serving at a low rate mostly has, were predicted up to 17% short (8% with the
term). Profiles written before the term load with it at zero.

The packing terms (`PACKING_FEATURES`, 2026-12-05) are quantized KV's: the runtime writes a step's new tokens
to the full-precision ring and packs each block the step completes (`kernels.attention._append_quantized`), one
quantize call per quantized side and layer, in the step that completes it. A decode step completes a block once
every `block_size` tokens a sequence; a prefill chunk of a block or more completes one at least. On the Intel
host, after the packing stopped waking sleeping threads, a decode step of 4 sequences that completed their
blocks took 13.6 ms more than one that completed none, about the 60 calls' dispatch (`python
benchmarks/block_fill_steps.py --batch 4`). The token-counted ``quantize_elements`` had spread that over every
step: a profile's decode points time the median step, which completes none. Profiles written before the terms
load with them at zero, and their points lack the blocks packed, so a refit cannot add them.

The scored-prefill terms (`SCORED_FEATURES`, 2026-12-06) are eviction's: a policy that scores tokens by attention
(H2O, TOVA, SnapKV: `eviction_budget.SCORING_POLICIES`) records attention statistics at every step, so each prefill
chunk runs attention with its probabilities materialized (`kernels.attention._prefill_torch`) instead of the fused
kernel, and files them layer by layer. On the Intel host a SmolLM2 prompt of 32, 128, 256 and 512 tokens took 6, 17,
27 and 73 ms more under H2O than without eviction (117-581 ms), where the model had them equal
(`benchmarks/eviction_steps.py`, BENCHMARKS.md "Hardware profile"). The terms count the chunk's tokens and its
query-key pairs. Decode rows record statistics too, from the decode kernel's own probabilities: 2 ms (3%) at 8
sequences of 512 tokens, not a term (see the eviction terms). Profiles written before the terms load with them at
zero.

The parallel-compaction term (`PARALLEL_COMPACTION_FEATURES`, 2026-12-06) is a compaction whose kept slots, a tensor
of ``kept x n_kv_heads x head_dim`` per layer and side, pass PyTorch's grain: the KV-row threshold of the parallel
terms (`parallel_rows`). On the Intel host a SmolLM2 compaction to 32, 64, 128 and 160 slots added 12, 14, 15 and 17
ms to its decode step, one to 176 and 256 slots 26 and 36 ms (170 KV rows of 192 elements fill the grain;
`benchmarks/eviction_steps.py`). A line through the profile's compactions to 256 and 1,024 slots had put 24 ms on
one to 32 slots, which Mooncake's replays under H2O at half the context compact every block: their decode steps that
compacted were predicted 14-16% long (`benchmarks/fidelity_steps.py`). A step's compactions count as past the grain
when the mean kept slots are (the simulator's decode runs price each compaction on its own:
`StepCostModel.compaction_s`). Profiles written before the term load with it at zero.

Coefficients are fitted with non-negative least squares (a cost cannot be negative).
"""
from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field, replace
from functools import cached_property
from operator import mul
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np

from skistune.config import shown
from skistune.kernels.rows import LEGACY_RULE, PLAIN_RULE, ProjectionRule
from skistune.runtime.kv_layout import KVTraffic

from .fields import entry, finite, items, whole

if TYPE_CHECKING:
    from skistune.runtime.scheduler import SchedulerOutput

FEATURES = ("fixed", "seqs", "tokens", "tokens_past_knee", "multi_token", "decode_kv_bytes", "prefill_kv_bytes",
            "prefill_pairs", "samples")
QUANT_FEATURES = ("decode_dequant_elements", "prefill_dequant_elements", "quantize_elements",
                  "decode_unpack_elements", "prefill_unpack_elements")
EVICTION_FEATURES = ("compactions", "compacted_slots")
TABLE_FEATURES = ("projections_s", "lm_head_s")
PARALLEL_FEATURES = ("parallel_kv_rows", "parallel_hidden_rows", "parallel_mlp_rows")
MIXED_FEATURES = ("mixed_paths",)
PACKING_FEATURES = ("packing_steps", "packed_blocks")
SCORED_FEATURES = ("scored_prefill_tokens", "scored_prefill_pairs")
PARALLEL_COMPACTION_FEATURES = ("parallel_compactions",)
GROUPS = (FEATURES, QUANT_FEATURES, EVICTION_FEATURES, TABLE_FEATURES, PARALLEL_FEATURES, MIXED_FEATURES,
          PACKING_FEATURES, SCORED_FEATURES, PARALLEL_COMPACTION_FEATURES)
ALL_FEATURES = sum(GROUPS, ())
# every list a profile was written with: each group's terms came after the last's (the first quantized three first)
READABLE_FEATURES = (FEATURES, FEATURES + QUANT_FEATURES[:3],
                     *(sum(GROUPS[:i], ()) for i in range(2, len(GROUPS) + 1)))
# the columns of the parallel terms in `StepShape.feature_values` (the fit zeroes those it cannot separate)
PARALLEL_COLUMNS = slice(ALL_FEATURES.index(PARALLEL_FEATURES[0]), ALL_FEATURES.index(PARALLEL_FEATURES[-1]) + 1)
NO_PARALLEL = (0.0,) * len(PARALLEL_FEATURES)
# PyTorch's CPU kernels run an elementwise op on the calling thread up to this many elements and split it
# across threads past it (at::internal::GRAIN_SIZE, a compile-time constant that Python cannot read)
TORCH_GRAIN_ELEMENTS = 32768


def parallel_rows(spec, device: str) -> tuple[int, ...]:
    """The token counts past which a step's elementwise ops over a KV row, a hidden row and an MLP row (in
    `PARALLEL_FEATURES`' order) are split across threads; () off the CPU, where no such switch exists."""
    if device != "cpu":
        return ()
    return tuple(TORCH_GRAIN_ELEMENTS // width for width in (spec.n_kv_heads * spec.head_dim, spec.hidden,
                                                               spec.ffn_hidden))


@dataclass(frozen=True)
class ProjectionTimes:
    """Seconds of one pass over every layer's projection weights (``layers_s``) and over the LM head
    (``head_s``) at ``rows`` rows, as the runtime computes them on the machine measured (its projection
    rule included); linear between the sizes measured, and past the last one along its last segment."""

    rows: tuple[int, ...]
    layers_s: tuple[float, ...]
    head_s: tuple[float, ...]

    def __post_init__(self) -> None:
        n = len(self.rows)
        if n < 2 or len(self.layers_s) != n or len(self.head_s) != n:
            raise ValueError("projection table: needs two or more sizes, with a time of each kind at each")
        if any(b <= a for a, b in zip(self.rows, self.rows[1:])) or self.rows[0] < 1:
            raise ValueError(f"projection table: rows must increase from 1 or more, got {shown(list(self.rows))}")
        if not all(t > 0 and t == t for t in self.layers_s + self.head_s):
            raise ValueError("projection table: every time must be a positive number of seconds")

    def layers(self, rows: int) -> float:
        return _interpolate(self.rows, self.layers_s, rows)

    def head(self, rows: int) -> float:
        return _interpolate(self.rows, self.head_s, rows)

    def to_dict(self) -> dict:
        return {"rows": list(self.rows), "layers_s": list(self.layers_s), "head_s": list(self.head_s)}

    @classmethod
    def from_dict(cls, data, where: str = "projection table") -> "ProjectionTimes":
        if not isinstance(data, dict) or set(data) != {"rows", "layers_s", "head_s"}:
            raise ValueError(f"{where}: expected rows, layers_s and head_s")
        listed = {key: items(data, key, where, nonempty=False) for key in ("rows", "layers_s", "head_s")}
        rows = tuple(_integer(r, f"{where}.rows[{i}]") for i, r in enumerate(listed["rows"]))
        layers_s, head_s = (tuple(finite(t, f"{where}.{key}[{i}]") for i, t in enumerate(listed[key]))
                            for key in ("layers_s", "head_s"))
        try:
            return cls(rows, layers_s, head_s)
        except ValueError as exc:  # (its own checks say "projection table: ..."; name where it sits)
            raise ValueError(f"{where}: {str(exc).removeprefix('projection table: ')}") from None


def _interpolate(xs: tuple[int, ...], ys: tuple[float, ...], x: int) -> float:
    if x <= 0:
        return 0.0
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    i = min(max(i, 1), len(xs) - 1)  # the segment [i - 1, i]: below the first or past the last, the nearest
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))
NAMED_RULES = {"tokens": PLAIN_RULE, "cpu": LEGACY_RULE}  # how files written before measured rules name theirs


def rule_to_json(rule: ProjectionRule) -> str | dict:
    return "tokens" if rule == PLAIN_RULE else rule.to_dict()


def rule_from_json(data, where: str = "step cost model: rows") -> ProjectionRule:
    if isinstance(data, str) and data in NAMED_RULES:
        return NAMED_RULES[data]
    if isinstance(data, dict):
        try:
            return ProjectionRule.from_dict(data)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{where}: {exc}") from None
    raise ValueError(f"{where}: {shown(data)} is not one of {', '.join(NAMED_RULES)} or a projection rule")


def _integer(value, where: str, minimum: int = 0) -> int:
    """An integer read from a file (`fields.whole`), at least ``minimum``."""
    value = whole(value, where)
    if value < minimum:
        raise ValueError(f"{where}: {shown(value)} is {'negative' if minimum == 0 else f'below {minimum}'}")
    return value


class StepShape(NamedTuple):
    """What one step computes: enough to predict its time, nothing about which tokens. (A named tuple: the
    simulator builds one per step it does not fast-forward, and a frozen dataclass took 1.7 us to build
    against 0.5 here.)"""

    num_tokens: int  # tokens computed (prefill chunk tokens + one per decode)
    num_seqs: int
    decode_kv_bytes: int  # KV bytes the decode sequences read (context tokens x bytes per token, + rings)
    prefill_pairs: int  # sum over prefill chunks of chunk tokens x context tokens
    num_samples: int  # sequences that sample a token this step
    prefill_kv_bytes: int = 0  # KV bytes the prefill chunks read (their contexts x bytes per token, + rings)
    decode_dequant_elements: int = 0  # quantized KV elements the decode sequences' contexts hold
    prefill_dequant_elements: int = 0  # ... the prefill chunks' contexts hold
    quantize_elements: int = 0  # new tokens' KV elements stored quantized
    decode_unpack_elements: int = 0  # extra sub-byte codes the decode sequences' contexts unpack
    prefill_unpack_elements: int = 0  # ... the prefill chunks' contexts
    compactions: int = 0  # sequences compacted after the step (eviction)
    compacted_slots: int = 0  # ... their KV slots before it
    packed_blocks: int = 0  # quantized KV: blocks the step completes, which it packs
    scored_prefill_tokens: int = 0  # eviction that scores by attention: the prefill chunks' tokens ...
    scored_prefill_pairs: int = 0  # ... and their query-key pairs (chunk tokens x context tokens)
    compacted_kept_slots: int = 0  # eviction: the KV slots the step's compactions keep, in all

    def feature_values(self, knee: int, rows: ProjectionRule = PLAIN_RULE, small_rows: int = 1,
                       table: ProjectionTimes | None = None, parallel: tuple[int, ...] = ()) -> tuple[float, ...]:
        """The value of each feature of `ALL_FEATURES`, in order, as Python numbers: what `features` puts
        in an array for the fitter and `StepCostModel.predict_s` weighs one by one. ``parallel``: the
        model's `parallel_rows` (none: those terms are zero)."""
        tokens, samples = rows.rows(self.num_tokens), rows.rows(self.num_samples) if self.num_samples else 0
        projections, head = (table.layers(self.num_tokens), table.head(self.num_samples)) if table else (0.0, 0.0)
        n = self.num_tokens  # (an elementwise op covers the step's tokens, not the rows a projection pads to)
        return (1.0, self.num_seqs, tokens, max(0, tokens - knee), float(n > small_rows),
                self.decode_kv_bytes, self.prefill_kv_bytes, self.prefill_pairs, samples,
                self.decode_dequant_elements, self.prefill_dequant_elements, self.quantize_elements,
                self.decode_unpack_elements, self.prefill_unpack_elements, self.compactions, self.compacted_slots,
                projections, head,  # (the parallel terms unrolled: the simulator predicts a step per call)
                *((float(n > parallel[0]), float(n > parallel[1]), float(n > parallel[2])) if parallel
                  else NO_PARALLEL),
                float(self.decode_kv_bytes > 0 and self.prefill_pairs > 0),  # (a decode reads one KV slot or more)
                float(self.packed_blocks > 0), self.packed_blocks, self.scored_prefill_tokens,
                self.scored_prefill_pairs,  # (compactions past the grain, judged by their mean kept slots)
                float(self.compactions) if parallel and self.compacted_kept_slots > parallel[0] * self.compactions
                else 0.0)

    def features(self, knee: int, rows: ProjectionRule = PLAIN_RULE, small_rows: int = 1,
                 table: ProjectionTimes | None = None, parallel: tuple[int, ...] = ()) -> np.ndarray:
        return np.array(self.feature_values(knee, rows, small_rows, table, parallel), dtype=np.float64)


@dataclass(frozen=True)
class StepCostModel:
    """Fitted coefficients (seconds per unit of each feature) and the knee in tokens: ``coef`` for
    `FEATURES`, ``quant_coef`` for `QUANT_FEATURES` (zero where quantized KV was not measured),
    ``evict_coef`` for `EVICTION_FEATURES` (zero where compactions were not measured), ``table_coef`` for
    `TABLE_FEATURES` with the ``table`` they read (None, and zeros, where it was not measured),
    ``parallel_coef`` for `PARALLEL_FEATURES` with the ``parallel_rows`` they switch at (`parallel_rows`;
    none, and zeros, off the CPU and in older profiles), ``mixed_coef`` for `MIXED_FEATURES` and
    ``packing_coef`` for `PACKING_FEATURES`, ``scored_coef`` for `SCORED_FEATURES` and ``parallel_compaction_coef``
    for `PARALLEL_COMPACTION_FEATURES` (zero in older profiles); ``rows``: the projection rule the steps
    ran with, which says how the token terms count a step's rows."""

    coef: tuple[float, ...]
    knee: int
    quant_coef: tuple[float, ...] = (0.0,) * len(QUANT_FEATURES)
    rows: ProjectionRule = PLAIN_RULE
    small_rows: int = 1  # steps of at most this many tokens take the BLAS's small-product path
    evict_coef: tuple[float, ...] = (0.0,) * len(EVICTION_FEATURES)
    table_coef: tuple[float, ...] = (0.0,) * len(TABLE_FEATURES)
    table: ProjectionTimes | None = None
    parallel_coef: tuple[float, ...] = NO_PARALLEL
    parallel_rows: tuple[int, ...] = ()
    mixed_coef: tuple[float, ...] = (0.0,) * len(MIXED_FEATURES)
    packing_coef: tuple[float, ...] = (0.0,) * len(PACKING_FEATURES)
    scored_coef: tuple[float, ...] = (0.0,) * len(SCORED_FEATURES)
    parallel_compaction_coef: tuple[float, ...] = (0.0,) * len(PARALLEL_COMPACTION_FEATURES)
    # the terms the file it was read from had fitted (the first of `ALL_FEATURES`: the rest read zero), not a
    # difference between two models; a refit fits them all (`HardwareProfile.fitted_before_current_terms`)
    fitted_terms: int = field(default=len(ALL_FEATURES), compare=False)
    # step shape -> `predict_s`, kept by the simulator (`ProfileExecutor._predict_s`) for every replay priced by
    # this model: a capacity search replays one workload at several rates, and a search many configs, whose steps
    # repeat shapes (three configs' searches on 1,000 chat requests: 37,751 predictions with one memo per replay,
    # 9,434 with this one). Not an init field, so a model derived with `dataclasses.replace` (other coefficients)
    # starts with its own.
    predicted: dict[StepShape, float] = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        counts = tuple(len(c) for c in (self.coef, self.quant_coef, self.evict_coef, self.table_coef,
                                        self.parallel_coef, self.mixed_coef, self.packing_coef, self.scored_coef,
                                        self.parallel_compaction_coef))
        if counts != tuple(len(g) for g in GROUPS):
            raise ValueError(f"step cost model: needs {' + '.join(str(len(g)) for g in GROUPS)} coefficients, "
                             f"got {' + '.join(map(str, counts))}")
        if self.small_rows < 1:
            raise ValueError(f"step cost model: small_rows must be at least 1, got {self.small_rows}")
        if self.parallel_rows and len(self.parallel_rows) != len(PARALLEL_FEATURES):
            raise ValueError(f"step cost model: parallel_rows needs {len(PARALLEL_FEATURES)} token counts "
                             f"(KV, hidden, MLP), got {len(self.parallel_rows)}")
        if not self.parallel_rows and any(self.parallel_coef):
            raise ValueError("step cost model: parallel terms without the parallel_rows they switch at")

    @classmethod
    def of(cls, coef, knee: int, rows: ProjectionRule = PLAIN_RULE, small_rows: int = 1,
           table: ProjectionTimes | None = None, parallel: tuple[int, ...] = ()) -> "StepCostModel":
        """From one coefficient per feature of `ALL_FEATURES`."""
        values, groups, start = tuple(float(c) for c in coef), [], 0
        for group in GROUPS:
            groups.append(values[start:start + len(group)])
            start += len(group)
        return cls(groups[0], knee, groups[1], rows, small_rows, groups[2], groups[3], table, groups[4],
                   tuple(parallel), groups[5], groups[6], groups[7], groups[8])

    @cached_property  # `predict_s` reads it every call (the fields are frozen: it cannot go stale)
    def all_coef(self) -> tuple[float, ...]:
        return (self.coef + self.quant_coef + self.evict_coef + self.table_coef + self.parallel_coef + self.mixed_coef
                + self.packing_coef + self.scored_coef + self.parallel_compaction_coef)

    def compaction_s(self, kv_slots: int, kept_slots: int) -> float:
        """What one compaction of a sequence holding ``kv_slots`` KV slots, down to ``kept_slots``, adds to its
        step."""
        past_grain = bool(self.parallel_rows) and kept_slots > self.parallel_rows[0]
        return self.evict_coef[0] + self.evict_coef[1] * kv_slots + self.parallel_compaction_coef[0] * past_grain

    def packing_s(self, blocks: np.ndarray) -> np.ndarray:
        """What packing ``blocks[j]`` completed blocks adds to step j (the simulator's decode runs: their
        steps' shapes leave the packing out, `decode_shape`)."""
        fixed, per_block = self.packing_coef
        return fixed * (blocks > 0) + per_block * blocks

    def predict_s(self, shape: StepShape) -> float:
        # The simulator predicts every step it does not fast-forward (~4 a request): Python floats, as a
        # numpy array and a dot product per call took 1.7x as long (4.0 us against 2.4 here). The sum's
        # order is not numpy's: predictions agree with `features` @ coefficients to ~1e-16 relative.
        return sum(map(mul, self.all_coef, shape.feature_values(self.knee, self.rows, self.small_rows, self.table,
                                                                self.parallel_rows)))

    def to_dict(self) -> dict:
        table = {} if self.table is None else {"projection_table": self.table.to_dict()}
        return {"features": list(ALL_FEATURES), "coef": list(self.all_coef), "knee_tokens": self.knee,
                "rows": rule_to_json(self.rows), "small_rows": self.small_rows, **table,
                "parallel_rows": list(self.parallel_rows)}

    @classmethod
    def from_dict(cls, data: dict, where: str = "step.cost_model") -> "StepCostModel":
        """Reads every feature list a profile was written with (`READABLE_FEATURES`): the terms an older
        profile lacks are zero. Every field is checked, and a bad one named (``where``: the model's place in
        the file): a knee or coefficient that merely converted (-3, "0.1") would change every prediction."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
        features = items(data, "features", where, nonempty=False)
        if features not in [list(f) for f in READABLE_FEATURES]:
            raise ValueError(f"{where}.features: {shown(features, 1000)} are not {list(ALL_FEATURES)} "
                             "(or the first terms of them an older profile was written with)")
        coef = tuple(finite(c, f"{where}.coef[{i}]")
                     for i, c in enumerate(items(data, "coef", where, nonempty=False)))
        if len(coef) != len(features):
            raise ValueError(f"{where}.coef: needs one coefficient per feature ({len(features)}), got {len(coef)}")
        negative = next((i for i, c in enumerate(coef) if c < 0), None)
        if negative is not None:  # (the fit is non-negative least squares: a cost cannot be negative)
            raise ValueError(f"{where}.coef[{negative}]: {coef[negative]!r} is negative: needs one finite, "
                             "non-negative coefficient per feature")
        knee = _integer(entry(data, "knee_tokens", where), f"{where}.knee_tokens")  # (0: every token past the knee)
        rows = rule_from_json(data.get("rows", "tokens"), f"{where}.rows")  # files before the rule: a row per token
        small = _integer(data.get("small_rows", 1), f"{where}.small_rows", minimum=1)  # ... before it was fitted: 1
        table = (ProjectionTimes.from_dict(data["projection_table"], f"{where}.projection_table")
                 if "projection_table" in data else None)
        parallel = tuple(_integer(r, f"{where}.parallel_rows[{i}]", minimum=1)  # (files before them: none)
                         for i, r in enumerate(items(data, "parallel_rows", where, nonempty=False)
                                               if "parallel_rows" in data else ()))
        try:
            return replace(cls.of(coef + (0.0,) * (len(ALL_FEATURES) - len(coef)), knee, rows, small, table, parallel),
                           fitted_terms=len(coef))
        except ValueError as exc:  # (its own checks say "step cost model: ..."; name where it sits)
            raise ValueError(f"{where}: {str(exc).removeprefix('step cost model: ')}") from None


def step_kind(shape: StepShape) -> str:
    """decode (one new token a sequence), prefill (one sequence's chunk) or mixed (chunks with decodes, or
    several chunks): the kinds a profile's step points and its speed check (`check.SpeedCheck`) are timed by."""
    if shape.num_tokens == shape.num_seqs:
        return "decode"
    return "prefill" if shape.num_seqs == 1 else "mixed"


@dataclass(frozen=True)
class ScaledStepCost:
    """A step cost model whose predictions are multiplied by a factor per kind of step (`step_kind`): the
    profile's steps at the speed a speed check timed them today, so that a replay's error can be split into
    the machine's drift since the profile and the simulator's own error (`benchmarks/fidelity.py`).
    Compactions and kinds without a factor take ``other``."""

    base: StepCostModel
    factors: tuple[tuple[str, float], ...]  # (kind, now / then): a tuple, so that the model stays hashable
    other: float = 1.0
    # step shape -> `predict_s`, for the simulator (as `StepCostModel.predicted`)
    predicted: dict[StepShape, float] = field(default_factory=dict, init=False, compare=False, repr=False)

    def factor(self, kind: str) -> float:
        return next((f for k, f in self.factors if k == kind), self.other)

    def predict_s(self, shape: StepShape) -> float:
        return self.base.predict_s(shape) * self.factor(step_kind(shape))

    def compaction_s(self, kv_slots: int, kept_slots: int) -> float:
        return self.base.compaction_s(kv_slots, kept_slots) * self.other

    def packing_s(self, blocks: np.ndarray) -> np.ndarray:
        return self.base.packing_s(blocks) * self.factor("decode")  # (the decode runs' steps)


# A step that follows an idle engine takes longer than back to back (threads and cores waking), and the longer
# the idle the more: on a 2-core Intel host a 131-token prefill took +9 ms after 0.05 s of idle, +17-20 ms after
# 0.2-1 s and +33 ms after 2 s, whatever the step's size (+17-19 ms for 9, 48 and 131 tokens after 1 s). The
# steps after it can be slower too, now and then: after 2 s of idle, one of the next three took +6.8 to +31.8 ms
# in 4 of 8 rounds (`benchmarks/idle_wake.py`, BENCHMARKS.md). The profiler times a request's first steps after
# each of `measure.IDLE_WAKE_GAPS_S` of idle, in rounds; a step that starts `IDLE_WAKE_GAP_S` or more after the
# last one ended draws one round's extras (`IdleWake.draw_s`) for itself and the steps that follow it in the
# simulator.
IDLE_WAKE_GAP_S = 0.1


@dataclass(frozen=True)
class IdleWake:
    """What the steps that follow an idle engine take over the same steps back to back, measured in rounds
    after each of a few idles: ``rounds_s[g][r][i]`` is step ``i`` (0: the first after the idle) after
    ``idle_s[g]`` of idle in round ``r``. Each round times every idle once, so a round's figures at the
    idles belong together. A profile written before the rounds has one round of one step at each idle.

    The simulator draws a round at random (seeded: a replay predicts the same each time) rather than taking
    the median: the wake-up is noisy, and a latency tail (TBT p99 of a lightly loaded server) is made of the
    rounds in which it was slow, which a median leaves out."""

    idle_s: tuple[float, ...]  # ascending, each at least IDLE_WAKE_GAP_S
    rounds_s: tuple[tuple[tuple[float, ...], ...], ...]

    def __post_init__(self) -> None:
        try:
            table = np.asarray(self.rounds_s, dtype=np.float64)
        except ValueError:  # (ragged)
            table = np.zeros(0)
        if table.ndim != 3 or len(self.idle_s) != len(table) or not table.size:
            raise ValueError("idle_wake: needs the same number of rounds and of steps at every idle, and one "
                             "idle per set of rounds")
        if list(self.idle_s) != sorted(set(self.idle_s)):
            raise ValueError("idle_wake: two points at the same idle")
        if self.idle_s[0] < IDLE_WAKE_GAP_S:
            raise ValueError(f"idle_wake: idle {self.idle_s[0]:g} s is below {IDLE_WAKE_GAP_S:g} s")
        # (lists, not arrays: the simulator draws at every wake-up, and a numpy call costs more than the loop)
        object.__setattr__(self, "_rounds", table.tolist())  # [idles][rounds][steps]
        object.__setattr__(self, "_medians", np.median(table, axis=1).tolist())  # [idles][steps]

    @classmethod
    def of_first_steps(cls, points: Sequence[tuple[float, float]]) -> "IdleWake":
        """One round of one step: (idle s, extra s) points (a profile written before the rounds)."""
        points = sorted(points)
        return cls(tuple(g for g, _ in points), tuple(((x,),) for _, x in points))

    @property
    def rounds(self) -> int:
        return len(self.rounds_s[0])

    @property
    def steps(self) -> int:
        return len(self.rounds_s[0][0])

    def typical_s(self, gap_s: float) -> list[float]:
        """The median over the rounds of each step's extra after ``gap_s`` of idle (`_at`)."""
        return self._at(self._medians, gap_s)

    def draw_s(self, gap_s: float, rng: random.Random) -> list[float]:
        """One round's extras, chosen by ``rng``, of the steps after ``gap_s`` of idle (`_at`)."""
        r = rng.randrange(self.rounds)
        return self._at([by_round[r] for by_round in self._rounds], gap_s)

    def _at(self, by_idle: list[list[float]], gap_s: float) -> list[float]:
        """[steps] from ``by_idle`` [idles][steps]: none below `IDLE_WAKE_GAP_S`, the nearest idle's outside
        them, linear in the log of the idle between them."""
        if gap_s < IDLE_WAKE_GAP_S:
            return [0.0] * self.steps
        idle = self.idle_s
        if gap_s <= idle[0]:
            return list(by_idle[0])
        for i in range(1, len(idle)):
            if gap_s <= idle[i]:
                w = math.log(gap_s / idle[i - 1]) / math.log(idle[i] / idle[i - 1])
                return [a + (b - a) * w for a, b in zip(by_idle[i - 1], by_idle[i])]
        return list(by_idle[-1])


def typical_wake_s(wake: IdleWake | None, idle_s: float, step: int = 0) -> float:
    """The median extra of step ``step`` (0: the first) after ``idle_s`` of idle; 0 where the profile has none."""
    if wake is None or step >= wake.steps:
        return 0.0
    return float(wake.typical_s(idle_s)[step])


def design_matrix(shapes: Sequence[StepShape], knee: int, rows: ProjectionRule = PLAIN_RULE,
                  small_rows: int = 1, table: ProjectionTimes | None = None,
                  parallel: tuple[int, ...] = ()) -> np.ndarray:
    return np.stack([s.features(knee, rows, small_rows, table, parallel) for s in shapes])


def step_shape(out: "SchedulerOutput", kv: KVTraffic | int) -> StepShape:
    """The shape of a scheduled step, with the KV traffic of its config (`kv_layout.kv_traffic`; an int is
    the bytes per token of a cache with nothing quantized)."""
    kv = KVTraffic(kv) if isinstance(kv, int) else kv
    tokens = decode_tokens = decode_seqs = prefill_tokens = prefill_seqs = pairs = samples = 0
    for s in out.scheduled:  # (the simulator's hot path: one pass, ``tokens`` is out.num_batched_tokens)
        new = s.num_new_tokens
        tokens += new
        context = s.kv_start + new  # KV slots read: fewer than the positions after an eviction
        if new == 1:
            decode_tokens += context
            decode_seqs += 1
        else:
            prefill_tokens += context
            prefill_seqs += 1
            pairs += new * context
        samples += s.samples
    q, u, bs = kv.quantized_elements_per_token, kv.unpacked_elements_per_token, kv.block_size
    scored = kv.scored_prefill  # (a chunk of one token runs the decode path, as it is counted here)
    compactions = out.compactions  # (most steps have none: no generators built for them)
    compacted, kept = (sum(c.kv_len for c in compactions), sum(c.new_num_kv_tokens for c in compactions)) \
        if compactions else (0, 0)
    return StepShape(num_tokens=tokens, num_seqs=len(out.scheduled),
                     decode_kv_bytes=decode_tokens * kv.bytes_per_token + decode_seqs * kv.ring_bytes_per_seq,
                     prefill_pairs=pairs, num_samples=samples,
                     prefill_kv_bytes=prefill_tokens * kv.bytes_per_token + prefill_seqs * kv.ring_bytes_per_seq,
                     decode_dequant_elements=decode_tokens * q, prefill_dequant_elements=prefill_tokens * q,
                     quantize_elements=tokens * q, decode_unpack_elements=decode_tokens * u,
                     prefill_unpack_elements=prefill_tokens * u, compactions=len(compactions),
                     compacted_slots=compacted, compacted_kept_slots=kept,
                     packed_blocks=completed_blocks(out, bs) if bs else 0,
                     scored_prefill_tokens=tokens - decode_seqs if scored else 0,
                     scored_prefill_pairs=pairs if scored else 0)


def completed_blocks(out: "SchedulerOutput", block_size: int) -> int:
    """Blocks of ``block_size`` KV slots that the scheduled step completes (a quantized store packs them in
    the step: `kernels.attention._append_plan`)."""
    return sum((s.kv_start + s.num_new_tokens) // block_size - s.kv_start // block_size for s in out.scheduled)


def decode_shape(batch: int, kv_tokens: int, kv: KVTraffic) -> StepShape:
    """A step of ``batch`` one-token decodes that read ``kv_tokens`` KV slots in all and all sample: what
    `step_shape` gives for such a step (the simulator's fast-forward predicts runs of them)."""
    q = kv.quantized_elements_per_token
    return StepShape(num_tokens=batch, num_seqs=batch,
                     decode_kv_bytes=kv_tokens * kv.bytes_per_token + batch * kv.ring_bytes_per_seq,
                     prefill_pairs=0, num_samples=batch, decode_dequant_elements=kv_tokens * q,
                     quantize_elements=batch * q, decode_unpack_elements=kv_tokens * kv.unpacked_elements_per_token)
