"""How many KV tokens eviction keeps, per layer, and when a sequence is compacted. Torch-free: the scheduler
(and through it the simulator) decides compactions with this module; `eviction` selects the tokens.

Budget. ``budget_tokens``, or ``ceil(budget_fraction * context_len)`` where ``context_len`` is the number of
tokens the sequence has computed so far (evicted ones included): a fraction keeps that share of everything
seen, so the budget grows with the sequence. The fraction is read as the nearest ratio with a denominator of
at most 10^6, so that 0.1 of 30 tokens is 3, not 4 (0.1 is slightly above 1/10 as a float).

A layer never keeps more tokens than its budget. The protected tokens (``sink_tokens`` first ones and the
``recent_window`` newest ones) are part of the budget; when they do not fit, the recent window is clipped
first, then the sinks (see `eviction`).

Per-layer schedule.
- ``uniform``: every layer keeps the budget.
- ``pyramid`` (PyramidKV, kvpress's formula): the protected part ``p = sink_tokens + recent_window`` is kept
  by every layer; the rest ``c = budget - p`` is spread linearly from ``hi = 2c - c/β`` at layer 0 down to
  ``lo = c/β`` at the last layer (β = 20, PyramidKV's default), ``budget_l = p + hi - l (hi - lo)/(L - 1)``.
  The mean over layers is exactly the budget: the real values are rounded down and the tokens this loses
  (fewer than the layers) go, one each, to the lowest layers, so the budgets still decrease and layer 0's
  is the largest. When ``c <= 0`` or there is one layer, the schedule is uniform.

The block table is shared by all layers, so the number of blocks a sequence holds is set by its LARGEST
layer budget: pyramid (whose layer 0 keeps about ``p + 1.95 c``) saves no memory against uniform with the
same mean, it moves attention from the top layers to the bottom ones. A layer that keeps fewer tokens than
the largest leaves its first slots empty: after a compaction to ``n`` slots, layer ``l`` holds its tokens in
the slots ``[n - keep_l, n)`` and attention must skip the slots before (`Sequence.kv_first_slot`).

When to compact. After a step, when a sequence's KV slots reach its largest layer budget plus one block
(``kv_len >= budget + block_size``), it is compacted back to the budget: whole blocks are freed and the
work is done once per block of new tokens, not every step. So a sequence holds at most ``budget +
block_size - 1`` slots between steps, and its attention reads at most that plus the step's new tokens.
SnapKV is the exception during prefill: it keeps the whole prompt until the step that computes the prompt's
last token, is compacted to the budget then if the prompt exceeds it, and after that follows the same rule
as the others (its prefill scores are frozen: see `eviction`). A compaction that must copy shared blocks
(copy-on-write) when no block is free waits for a later step (SnapKV's end-of-prompt one then waits for
the rule above), and a sequence is not compacted in the step it finishes.

Prefix hits (`max_hit_tokens`). A policy whose scores need queries of the prompt cannot take a prefix hit
whose queries it would miss: the cached tokens' KV is reused, but their queries never run. H2O sums the
attention every query gave every token, prompt included, so a hit would leave the cached tokens without
their prompt scores (the same prompt then kept other tokens, and generated other text, when its prefix was
cached): H2O takes no prefix hit. SnapKV scores the prompt from its last ``SNAPKV_WINDOW`` queries, so a hit
must leave them to compute; with them computed, its scores are those of the whole prompt computed here.
StreamingLLM keeps sinks and the newest tokens, which no hit changes; TOVA scores with the newest query only,
so a hit acts on it as a chunk boundary does (where a prompt longer than the budget is compacted before its
end, the selection depends on where its chunks end, hit or not).
"""
from __future__ import annotations

import math
from fractions import Fraction

from ..config import EvictionConfig

PYRAMID_BETA = 20  # PyramidKV's default: the top layer keeps 1/beta of the mean compressible budget
SNAPKV_WINDOW = 32  # SnapKV's observation window in queries (the SnapKV repository's default; kvpress uses 64)
# the policies that score tokens by attention (`eviction.EvictionPolicy.needs_attention`): every step of theirs
# records attention statistics, so a prefill chunk runs attention with its probabilities materialized, which costs
# more than the fused kernel a plain chunk runs (`cost.SCORED_FEATURES`)
SCORING_POLICIES = frozenset({"h2o", "tova", "snapkv"})


def _fraction(eviction: EvictionConfig) -> Fraction:
    return Fraction(eviction.budget_fraction).limit_denominator(10 ** 6)


def base_budget(eviction: EvictionConfig, context_len: int) -> int:
    """The budget in tokens (the mean over layers) for a sequence that has computed ``context_len`` tokens."""
    if eviction.budget_tokens is not None:
        return eviction.budget_tokens
    return math.ceil(_fraction(eviction) * context_len)


def _pyramid(budget: int, protected: int, n_layers: int) -> list[int]:
    compressible = budget - protected
    if n_layers == 1 or compressible <= 0:
        return [budget] * n_layers
    # layer l's exact share hi - (hi - lo) l / (L - 1) as numerator / den, in integers (exact and fast):
    # hi = c (2β - 1) / β, lo = c / β
    beta, span = PYRAMID_BETA, n_layers - 1
    den = beta * span
    num = [compressible * ((2 * beta - 1) * span - (2 * beta - 2) * layer) for layer in range(n_layers)]
    kept = [n // den for n in num]
    short = n_layers * compressible - sum(kept)  # the exact shares sum to n_layers * compressible
    # one each to the lowest layers: the mean stays exact and the budgets keep decreasing
    return [protected + k + (layer < short) for layer, k in enumerate(kept)]


def layer_budgets(eviction: EvictionConfig, n_layers: int, context_len: int) -> list[int]:
    """Tokens each layer keeps (see the module docstring for both schedules). The largest of them sets how
    many KV slots, hence blocks, the sequence holds: the block table is shared by all layers."""
    budget = base_budget(eviction, context_len)
    if eviction.layer_schedule == "uniform":
        return [budget] * n_layers
    return _pyramid(budget, eviction.sink_tokens + eviction.recent_window, n_layers)


class EvictionBudget:
    """The scheduler's view of an eviction config: per-layer budgets and when a sequence is due for a
    compaction (`due`), to how many slots (`plan`), and where runs of decode steps compact (`decode_steps_to_due`)."""

    def __init__(self, eviction: EvictionConfig, n_layers: int, block_size: int) -> None:
        if eviction.policy == "none":
            raise ValueError("eviction.policy: 'none' has no budget (build no EvictionBudget for it)")
        self.config = eviction
        self.n_layers = n_layers
        self.block_size = block_size
        self.whole_prompt_first = eviction.policy == "snapkv"  # scores need the end of the prompt
        self.no_empty_slots = (0,) * n_layers  # kv_first_slot of a sequence with nothing evicted
        # budget = ceil(context * num / den) in integers (a fixed budget: num = 0, den = 1, plus the tokens)
        fraction = Fraction(0) if eviction.budget_tokens is not None else _fraction(eviction)
        self._num, self._den = fraction.numerator, fraction.denominator
        self._fixed = eviction.budget_tokens or 0
        self._by_base: dict[int, tuple[int, ...]] = {}  # budgets depend on the context only through the base

    def budgets(self, context_len: int) -> tuple[int, ...]:
        base = self._fixed - (-context_len * self._num // self._den)
        found = self._by_base.get(base)
        if found is None:
            found = self._by_base[base] = tuple(layer_budgets(self.config, self.n_layers, context_len))
        return found

    def max_hit_tokens(self, num_tokens: int) -> int | None:
        """The most prompt tokens a sequence of ``num_tokens`` (to compute from its start) may take from the
        prefix cache without changing what the policy keeps (module docstring); None: no limit."""
        policy = self.config.policy
        if policy == "h2o":
            return 0
        if policy == "snapkv":
            return max(0, num_tokens - SNAPKV_WINDOW)
        return None

    def max_budget(self, context_len: int) -> int:
        return self.budgets(context_len)[0]  # layer 0's: pyramid budgets decrease with the layer

    def due(self, kv_len: int, context_len: int, in_prefill: bool, ends_prefill: bool) -> bool:
        """Whether a sequence with ``kv_len`` slots after a step that took it to ``context_len`` tokens is
        compacted after that step. ``in_prefill``: the step computes prompt tokens (or, after a recompute
        preemption, tokens it had before); ``ends_prefill``: it computes the last of them."""
        budget = self.max_budget(context_len)
        if self.whole_prompt_first and in_prefill:
            return ends_prefill and kv_len > budget
        return kv_len >= budget + self.block_size

    def plan(self, kv_len: int, context_len: int, first_slot: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        """(slots kept, tokens kept per layer) of a compaction of ``kv_len`` slots whose layer ``l`` holds
        tokens from slot ``first_slot[l]`` on. A layer keeps its budget or all it holds if that is less."""
        keep = tuple(min(b, kv_len - f) for b, f in zip(self.budgets(context_len), first_slot))
        return max(keep), keep

    def peak_slots(self, prompt_len: int, total_len: int, step_tokens: int) -> int:
        """About the most KV slots a sequence of ``total_len`` tokens (``prompt_len`` of them its prompt) holds
        at once: its largest layer budget, one block of hysteresis less a slot, and one step's new tokens
        (``step_tokens``: a prefill chunk); for SnapKV at least the whole prompt, which it keeps until its
        last token is computed. (A SnapKV sequence preempted after it generated tokens recomputes them
        as prefill too, and may then need more: this bound is for serving it alone.)"""
        peak = self.max_budget(total_len) + self.block_size - 1 + step_tokens
        if self.whole_prompt_first:
            peak = max(peak, prompt_len)
        return min(total_len, peak)

    def decode_steps_to_due(self, kv_len: int, context_len: int, limit: int) -> int | None:
        """The fewest decode steps ``d <= limit`` after which a sequence now at ``kv_len`` slots and
        ``context_len`` tokens is due, or None if it is not due within ``limit`` steps."""
        d = 1
        while d <= limit:
            short = self.max_budget(context_len + d) + self.block_size - (kv_len + d)
            if short <= 0:
                return d
            # slots minus budget grows by at most one per step (budgets never shrink as the context grows),
            # so no step before d + short can be due
            d += short
        return None
