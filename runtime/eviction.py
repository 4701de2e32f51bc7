"""KV eviction policies: which tokens each KV head of each layer keeps when a sequence is compacted.

Selection only (pure torch, no model code): the scheduler decides when a sequence is compacted and to how
many tokens per layer (`eviction_budget`, re-exported here: `layer_budgets`); the model runner feeds the
attention statistics to `EvictionStats` during the forward pass, asks `kept_slots` for each layer's
selection after it, and moves the KV.

Policies (``sink_tokens`` and ``recent_window`` are honoured by every policy; set them to 0 for the papers'
pure variants, e.g. H2O or TOVA without sinks):
- ``streaming`` (StreamingLLM): the sinks and the newest tokens, nothing else; its window is the budget
  minus the sinks (so ``recent_window`` only matters when it is larger than that: it is then clipped).
- ``h2o`` (Heavy-Hitter Oracle): the sinks, the recent window, and the tokens with the largest attention
  received so far (summed over every query of every step, prefill included).
- ``tova`` (Token Omission Via Attention): the sinks, the recent window, and the tokens the newest query
  attends to most (the others, the lowest current attention, are dropped).
- ``snapkv``: the sinks, the recent window, and the tokens with the largest attention from the observation
  window (the prompt's last ``SNAPKV_WINDOW`` queries), max-pooled over ``SNAPKV_POOL`` neighbouring slots,
  chosen when the prompt's last token has been computed. Those scores are then frozen: tokens generated
  later score 0, so when the budget is reached again the newest tokens (ties go to the newer) and the
  prompt's best keep their places and older generated tokens go first.

Prefix hits: H2O takes none, and SnapKV only those that leave its observation window to compute, so that a
cached prefix never changes what they keep (`EvictionBudget.max_hit_tokens`).

Scores are per KV head: the attention probabilities of the query heads of one GQA group are summed, and
each KV head keeps its own token set (the same number of tokens per head in a layer).

Ties are broken towards the newer token (so a policy without distinguishing scores degrades to a recent
window), which makes every selection deterministic.

Positions: keys are stored after RoPE at their original positions, and tokens after an eviction keep their
true positions (the H2O and SnapKV implementations' convention). StreamingLLM's paper re-assigns positions
inside the cache (re-rotating the kept keys); this runtime does not.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ..config import EvictionConfig
from .eviction_budget import SNAPKV_WINDOW, EvictionBudget, base_budget, layer_budgets  # noqa: F401 (re-exported)
from .scheduler import Compaction

SNAPKV_POOL = 5  # pooling kernel over neighbouring slots (SnapKV's)


class EvictionPolicy(Protocol):
    """What the runner and the contract tests need of a policy."""

    name: str
    needs_attention: bool  # whether the runner must feed `EvictionStats` (streaming needs no statistics)

    def scored_queries(self, num_prefill_tokens: int, start: int, num_new_tokens: int) -> int:
        """How many of a step's last queries (tokens ``[start, start + num_new_tokens)`` of a sequence whose
        prefill covers its first ``num_prefill_tokens``) are summed into ``probs_sum``."""

    def update(self, scores: torch.Tensor, probs_sum: torch.Tensor, probs_last: torch.Tensor) -> torch.Tensor:
        """New statistics ``[n_kv_heads, ctx]`` from the old ones (zero-extended to ctx) and a step's."""

    def select(self, scores: torch.Tensor, keep: int, sink_tokens: int, recent_window: int) -> torch.Tensor:
        """Indices ``[n_kv_heads, keep]`` (ascending, unique) of the tokens to keep among ``scores.shape[1]``
        (``scores``: ``[n_kv_heads, kv_len]``, zeros for a policy without statistics)."""


def protected_counts(kv_len: int, keep: int, sink_tokens: int, recent_window: int) -> tuple[int, int]:
    """(sinks, recent) actually kept: the budget wins, so the recent window is clipped first, then the sinks."""
    keep = min(keep, kv_len)
    sinks = min(sink_tokens, keep)
    return sinks, min(recent_window, keep - sinks)


def keep_top(scores: torch.Tensor, keep: int, sink_tokens: int, recent_window: int) -> torch.Tensor:
    """The sinks, the recent window and the best-scoring of the tokens between them (ties to the newer);
    ``scores [H, L]`` -> indices ``[H, min(keep, L)]`` ascending."""
    n_heads, kv_len = scores.shape
    keep = min(keep, kv_len)
    sinks, recent = protected_counts(kv_len, keep, sink_tokens, recent_window)
    middle = scores[:, sinks:kv_len - recent]  # [H, M] the candidates
    # newest first, then a stable sort by score: equal scores keep the newer token
    order = torch.sort(middle.flip(-1), dim=-1, descending=True, stable=True).indices
    chosen = middle.shape[1] - 1 - order[:, :keep - sinks - recent] + sinks
    fixed = torch.cat([torch.arange(sinks), torch.arange(kv_len - recent, kv_len)]).to(scores.device)
    picked = torch.cat([fixed.expand(n_heads, -1), chosen], dim=-1)
    return picked.sort(dim=-1).values


class StreamingPolicy:
    """Attention sinks plus the newest tokens (no statistics)."""

    name = "streaming"
    needs_attention = False

    def scored_queries(self, num_prefill_tokens: int, start: int, num_new_tokens: int) -> int:
        return 0

    def update(self, scores: torch.Tensor, probs_sum: torch.Tensor, probs_last: torch.Tensor) -> torch.Tensor:
        return scores

    def select(self, scores: torch.Tensor, keep: int, sink_tokens: int, recent_window: int) -> torch.Tensor:
        n_heads, kv_len = scores.shape
        keep = min(keep, kv_len)
        sinks = min(sink_tokens, keep)
        kept = torch.cat([torch.arange(sinks), torch.arange(kv_len - (keep - sinks), kv_len)])
        return kept.to(scores.device).expand(n_heads, -1).clone()


class H2OPolicy:
    """Heavy hitters: attention received, accumulated over every query so far."""

    name = "h2o"
    needs_attention = True

    def scored_queries(self, num_prefill_tokens: int, start: int, num_new_tokens: int) -> int:
        return num_new_tokens

    def update(self, scores: torch.Tensor, probs_sum: torch.Tensor, probs_last: torch.Tensor) -> torch.Tensor:
        return scores + probs_sum

    def select(self, scores: torch.Tensor, keep: int, sink_tokens: int, recent_window: int) -> torch.Tensor:
        return keep_top(scores, keep, sink_tokens, recent_window)


class TovaPolicy:
    """The newest query's attention: the tokens it attends to least are dropped."""

    name = "tova"
    needs_attention = True

    def scored_queries(self, num_prefill_tokens: int, start: int, num_new_tokens: int) -> int:
        return 0

    def update(self, scores: torch.Tensor, probs_sum: torch.Tensor, probs_last: torch.Tensor) -> torch.Tensor:
        return probs_last.to(scores.dtype)

    def select(self, scores: torch.Tensor, keep: int, sink_tokens: int, recent_window: int) -> torch.Tensor:
        return keep_top(scores, keep, sink_tokens, recent_window)


class SnapKVPolicy:
    """The prompt's observation window votes (max-pooled over neighbours); scores frozen after the prompt."""

    name = "snapkv"
    needs_attention = True
    observation_window = SNAPKV_WINDOW

    def scored_queries(self, num_prefill_tokens: int, start: int, num_new_tokens: int) -> int:
        # queries at the positions [P - W, P) of the prefill's P tokens that this step computes: a chunk
        # ending inside or at the end of the prefill holds them at its end; decode steps hold none
        window_start = max(start, num_prefill_tokens - self.observation_window)
        return max(0, min(start + num_new_tokens, num_prefill_tokens) - window_start)

    def update(self, scores: torch.Tensor, probs_sum: torch.Tensor, probs_last: torch.Tensor) -> torch.Tensor:
        return scores + probs_sum

    def select(self, scores: torch.Tensor, keep: int, sink_tokens: int, recent_window: int) -> torch.Tensor:
        pooled = F.max_pool1d(scores.unsqueeze(0), SNAPKV_POOL, stride=1, padding=SNAPKV_POOL // 2).squeeze(0)
        return keep_top(pooled, keep, sink_tokens, recent_window)


POLICIES: dict[str, type] = {"streaming": StreamingPolicy, "h2o": H2OPolicy, "tova": TovaPolicy,
                             "snapkv": SnapKVPolicy}


def make_policy(config: EvictionConfig) -> EvictionPolicy | None:
    """The policy of an eviction config; None for ``none`` (nothing is ever evicted)."""
    if config.policy == "none":
        return None
    return POLICIES[config.policy]()


class EvictionStats:
    """Per sequence and layer, the statistics the policy scores with: ``[n_kv_heads, kv_len]`` over the
    sequence's KV slots (accumulated attention for h2o, the newest query's for tova, the observation
    window's for snapkv; nothing for streaming), in float32."""

    def __init__(self, policy: EvictionPolicy, device: torch.device | str = "cpu") -> None:
        self.policy = policy
        self.device = device
        self._scores: dict[tuple[str, int], torch.Tensor] = {}

    def observe(self, layer: int, seq_id: str, probs_sum: torch.Tensor, probs_last: torch.Tensor) -> None:
        """One step's attention of one sequence at one layer, over its KV slots ``[0, ctx)`` (zeros in the
        slots a layer leaves empty): ``probs_sum [n_kv_heads, ctx]`` summed over each group's query heads
        and over the step's last ``policy.scored_queries(...)`` queries, ``probs_last`` the same for the
        newest query alone. Slots past the known ones are new tokens: their statistics start at zero."""
        n_heads, ctx = probs_last.shape
        old = self.scores(seq_id, layer, ctx, n_heads)
        self._scores[seq_id, layer] = self.policy.update(old, probs_sum.float(), probs_last.float())

    def scores(self, seq_id: str, layer: int, kv_len: int, n_kv_heads: int) -> torch.Tensor:
        """The statistics of ``kv_len`` slots, zero-extended past the observed ones."""
        old = self._scores.get((seq_id, layer))
        if old is None:
            return torch.zeros(n_kv_heads, kv_len, device=self.device)
        if old.shape[1] > kv_len:
            raise ValueError(f"eviction stats of {seq_id} layer {layer}: {old.shape[1]} slots known, "
                             f"asked for {kv_len} (was a compaction not applied to the stats?)")
        return F.pad(old, (0, kv_len - old.shape[1]))

    def compact(self, seq_id: str, layer: int, kept: torch.Tensor, dst_first_slot: int = 0) -> None:
        """Apply a selection ``kept [n_kv_heads, keep]`` (slot indices) whose tokens move to the slots
        ``[dst_first_slot, dst_first_slot + keep)``; the slots before them are empty."""
        old = self._scores.get((seq_id, layer))
        if old is None:
            return  # nothing observed yet: the next observation starts from zeros anyway
        needed = int(kept.max()) + 1 if kept.numel() else 0
        old = F.pad(old, (0, max(0, needed - old.shape[1])))  # kept slots never observed score zero
        self._scores[seq_id, layer] = F.pad(old.gather(1, kept), (dst_first_slot, 0))

    def drop(self, seq_id: str) -> None:
        """Forget a sequence (finished, or preempted: its KV is recomputed from scratch)."""
        for key in [k for k in self._scores if k[0] == seq_id]:
            del self._scores[key]


def kept_slots(policy: EvictionPolicy, stats: EvictionStats, compaction: Compaction, layer: int, n_kv_heads: int,
               sink_tokens: int, recent_window: int) -> torch.Tensor:
    """The slots ``[n_kv_heads, keep_l]`` (ascending) that layer ``layer`` keeps in a `scheduler.Compaction`:
    the policy's choice among the layer's occupied slots ``[src_first_slot[l], kv_len)``."""
    first = compaction.src_first_slot[layer]
    scores = stats.scores(compaction.seq_id, layer, compaction.kv_len, n_kv_heads)[:, first:]
    return first + policy.select(scores, compaction.keep_per_layer[layer], sink_tokens, recent_window)
