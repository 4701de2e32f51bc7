"""Continuous batching under one token budget per step (vLLM v1 style): prefill and decode tokens are
the same currency, so there are no separate phases. Pure Python, no torch: the runtime executes a
`SchedulerOutput` with the real model, the simulator with a clock.

Each step: running sequences first (in priority order; when one cannot get blocks, the lowest-priority
running sequence is preempted by recompute and the allocation retried), then waiting sequences in the
policy's order while tokens, sequence slots and blocks last. `schedule()` ends by checking its budgets.

With eviction (an `EvictionBudget`), `schedule()` also decides which sequences are compacted after this
step's forward pass (`Compaction`, see `eviction_budget` for when and to how much): their blocks are made
safe to rewrite now (copy-on-write of shared and cached blocks, listed for the executor), the executor
selects and moves the KV after the forward pass, and `update()` frees the blocks past the kept slots.
A sequence's first compaction leaves its prompt's prefix in the prefix cache as it was before it (blocks
it rewrites are copied first while free blocks last: `Compaction.prefix_copies`).
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple
from typing import Sequence as Sequence_  # `Sequence` is the scheduler's sequence state below

from .block_manager import KVCacheManager
from .eviction_budget import EvictionBudget
from .request import Request, RequestRecord
from .tiers import Transfer

PREFIX_POLICY_WINDOW = 64  # waiting sequences scanned for the longest cached prefix (bounds the cost)


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Scheduler state of one request: its tokens (prompt, then outputs) and how many have KV.

    The prompt is kept as the request gives it (a workload's numpy array is not copied into a list: the
    simulator admits thousands of long prompts and reads few of their tokens); `tokens` reads a span."""

    def __init__(self, request: Request, record: RequestRecord) -> None:
        self.request = request
        self.seq_id = request.request_id
        self.prompt = request.prompt_token_ids
        self.num_prompt_tokens = len(self.prompt)
        self.output_token_ids: list[int] = []
        self.num_tokens = self.num_prompt_tokens  # prompt + outputs (a field: read per sequence per step)
        self.num_computed_tokens = 0
        self.num_prefill_tokens = self.num_prompt_tokens  # tokens computed as prefill since the last admission
        # with eviction, per layer, the first KV slot holding a token (a layer that keeps fewer tokens than
        # the largest leaves the slots before it empty: attention skips them); empty without eviction
        self.kv_first_slot: tuple[int, ...] = ()
        self.status = SeqStatus.WAITING
        self.record = record

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids ``start..end`` (prompt, then outputs) as Python ints."""
        p = self.num_prompt_tokens
        out: list[int] = []
        if start < p:
            part = self.prompt[start:min(end, p)]
            out = part.tolist() if hasattr(part, "tolist") else [int(t) for t in part]
        if end > p:
            out += self.output_token_ids[max(start - p, 0):end - p]
        return out

    @property
    def token_ids(self) -> list[int]:
        """Every token id, prompt then outputs (a new list)."""
        return self.tokens(0, self.num_tokens)

    def append_tokens(self, token_ids: list[int]) -> None:
        self.output_token_ids += token_ids
        self.num_tokens += len(token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def max_tokens(self) -> int:
        return self.num_prompt_tokens + self.request.max_new_tokens

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"


class ScheduledSeq(NamedTuple):
    """``num_new_tokens`` tokens of ``seq`` starting at position ``start`` are computed this step, their KV
    written from slot ``kv_start`` on (``start`` unless eviction has dropped tokens: attention then reads
    the slots ``[0, kv_start + num_new_tokens)`` and the tokens keep their true positions); ``samples``
    says whether the step reaches the sequence's last token, so a new token is sampled.
    (A NamedTuple: the scheduler makes one per sequence per step, and the simulator makes millions.)"""

    seq: Sequence
    start: int
    num_new_tokens: int
    samples: bool
    kv_start: int

    @classmethod
    def of(cls, seq: Sequence, start: int, num_new_tokens: int, kv_start: int) -> "ScheduledSeq":
        return cls(seq, start, num_new_tokens, start + num_new_tokens == seq.num_tokens, kv_start)


@dataclass(frozen=True)
class Compaction:
    """An eviction compaction of one sequence, run by the executor after the step's forward pass.

    Before the forward pass the executor copies each ``(src, dst)`` block of ``copies`` (all layers, keys
    and values: the block table already names ``dst``). After it, for each layer ``l``, the policy picks
    ``keep_per_layer[l]`` of the layer's occupied slots ``[src_first_slot[l], kv_len)`` per KV head, and
    their keys and values move, in ascending slot order, to the slots ``[dst_first_slot[l],
    new_num_kv_tokens)``. `Scheduler.update` then frees the blocks past ``new_num_kv_tokens``.

    ``prefix_copies`` (a first compaction with prefix reuse): between the forward pass and the compaction,
    the executor copies each ``(src, dst)`` block, so that the prompt blocks the compaction rewrites stay
    cached as they were (`KVCacheManager.prepare_prefix_copies`)."""

    seq_id: str
    kv_len: int  # slots before the compaction (this step's tokens included)
    new_num_kv_tokens: int
    keep_per_layer: tuple[int, ...]
    src_first_slot: tuple[int, ...]
    copies: tuple[tuple[int, int], ...]
    prefix_copies: tuple[tuple[int, int], ...] = ()

    @property
    def dst_first_slot(self) -> tuple[int, ...]:
        return tuple(self.new_num_kv_tokens - k for k in self.keep_per_layer)


class DecodeCompaction(NamedTuple):
    """A compaction inside a run of decode steps (the simulator's fast-forward): after the run's step
    ``step`` (1-based), the sequence keeps ``new_num_kv_tokens`` slots, layer ``l`` from ``first_slot[l]``."""

    step: int
    new_num_kv_tokens: int
    first_slot: tuple[int, ...]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # their KV is dropped (recomputed later)
    swapped: list[Sequence] = field(default_factory=list)  # preempted with their KV swapped to the host
    swapped_in: list[Sequence] = field(default_factory=list)  # swapped sequences resumed in this step
    compactions: list[Compaction] = field(default_factory=list)
    finished_seq_ids: list[str] = field(default_factory=list)  # finished since the previous step
    dropped: list[Sequence] = field(default_factory=list)  # waiting ones that can never be served (`_drop`)
    # tier moves (see `tiers`): ``transfers`` run in order before the forward pass; ``prefetch`` (blocks of
    # waiting sequences brought up ahead of use) may overlap it and must be done before the next step's
    transfers: list[Transfer] = field(default_factory=list)
    prefetch: list[Transfer] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class _FcfsQueue:
    """Arrival order; preempted sequences go back to the front."""

    def __init__(self) -> None:
        self._q: deque[Sequence] = deque()

    def add(self, seq: Sequence, front: bool = False) -> None:
        self._q.appendleft(seq) if front else self._q.append(seq)

    def peek(self, kv: KVCacheManager) -> Sequence:
        return self._q[0]

    def remove(self, seq: Sequence) -> None:
        if self._q[0] is seq:
            self._q.popleft()
        else:
            self._q.remove(seq)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(self._q)


class _PrefixQueue(_FcfsQueue):
    """Longest cached prefix first among the oldest `PREFIX_POLICY_WINDOW` waiting sequences."""

    def peek(self, kv: KVCacheManager) -> Sequence:
        window = itertools.islice(self._q, PREFIX_POLICY_WINDOW)
        return max(window, key=lambda s: len(kv.get_computed_blocks(s)))  # max keeps the first of ties


class _EdfQueue:
    """Earliest deadline first (ties in arrival order)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Sequence]] = []
        self._counter = itertools.count()

    def add(self, seq: Sequence, front: bool = False) -> None:
        heapq.heappush(self._heap, (seq.request.priority_deadline_s, next(self._counter), seq))

    def peek(self, kv: KVCacheManager) -> Sequence:
        return self._heap[0][2]

    def remove(self, seq: Sequence) -> None:
        if self._heap[0][2] is seq:
            heapq.heappop(self._heap)
        else:
            self._heap = [e for e in self._heap if e[2] is not seq]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (e[2] for e in sorted(self._heap))


WAITING_QUEUES = {"fcfs": _FcfsQueue, "prefix": _PrefixQueue, "edf": _EdfQueue}


@dataclass(frozen=True)
class SchedulerLimits:
    """The batching knobs the scheduler enforces (from `BatchingConfig`)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool
    chunk_size: int
    policy: str


class Scheduler:
    def __init__(self, limits: SchedulerLimits, kv: KVCacheManager, eviction: EvictionBudget | None = None,
                 prefetch_blocks: int = 0, full_precision_window: int = 0) -> None:
        self.limits = limits
        # quantized KV's newest tokens read at full precision (0: none, or nothing quantized): see `_max_hit_tokens`
        self.full_precision_window = full_precision_window
        self.prefetch_blocks = prefetch_blocks  # lower-tier blocks promoted ahead of use per step (0: off)
        self.kv = kv
        self.eviction = eviction  # None: nothing is evicted
        self._finished_ids: list[str] = []
        self.waiting = WAITING_QUEUES[limits.policy]()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.add(seq)

    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ---- scheduling -------------------------------------------------------------------------------
    def _chunk(self, seq: Sequence, num_computed: int, budget: int) -> int:
        """Tokens of ``seq`` to compute this step: 1 for decode; a prefill chunk capped by the chunk size
        and the budget; 0 if chunking is off and the rest of the prompt does not fit the budget."""
        remaining = seq.num_tokens - num_computed
        if remaining <= 1:
            return min(remaining, budget)
        if not self.limits.chunked_prefill:
            return remaining if remaining <= budget else 0
        return min(remaining, self.limits.chunk_size, budget)

    def _victim(self) -> Sequence:
        """Lowest-priority running sequence: the latest deadline under EDF, else the newest admitted. Among
        equal deadlines, the newest admitted too: preempting the oldest (the one with the most work done)
        livelocked a tight pool, each readmitted sequence preempting the next one before it finished."""
        if self.limits.policy == "edf":
            return max(reversed(self.running), key=lambda s: s.request.priority_deadline_s)
        return self.running[-1]

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Preemption: swap the KV to the host when the tiers can take it, else drop it (recompute); keep
        the tokens, queue at the front. Returns the tokens it had been given earlier in this step (an EDF
        victim may already be scheduled)."""
        given_back = sum(s.num_new_tokens for s in out.scheduled if s.seq is seq)
        if given_back:
            out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self.running.remove(seq)
        if self.kv.swap_out(seq):
            out.swapped.append(seq)
        else:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            out.preempted.append(seq)
        seq.status = SeqStatus.WAITING
        seq.record.preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(seq, front=True)
        return given_back

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        allocate_slots, evicted, running = self.kv.allocate_slots, self.kv.num_evicted, SeqStatus.RUNNING
        tables, block_size = self.kv.tables, self.kv.block_size
        new_scheduled = tuple.__new__  # a NamedTuple's own constructor is a Python function: 2x as slow
        for seq in list(self.running):
            if seq.status is not running:
                continue  # preempted earlier in this loop
            computed, num_tokens = seq.num_computed_tokens, seq.num_tokens
            # (a decode inlines `_chunk`: this loop runs once per running sequence per step)
            n = (1 if budget else 0) if num_tokens - computed == 1 else self._chunk(seq, computed, budget)
            if n == 0:
                continue
            # a decode with room left in its last block skips the call: `allocate_slots` would return []
            # without a change (15 of 16 decode steps at 16-token blocks)
            seq_id = seq.seq_id
            kv_start = computed - evicted[seq_id] if seq_id in evicted else computed  # (no victim's changes it)
            kv_end = kv_start + n
            while kv_end > len(tables.get(seq_id, ())) * block_size and allocate_slots(seq, n) is None:
                victim = self._victim()
                budget += self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is running:
                out.scheduled.append(new_scheduled(ScheduledSeq, (seq, computed, n, computed + n == num_tokens, kv_start)))
                budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while len(self.waiting) and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting.peek(self.kv)
            if self.kv.is_swapped(seq):
                n = self._resume_swapped(seq, out, budget)
                if n == 0:
                    break
                budget -= n
                continue
            if self._takes_hits(seq):
                self.kv.promote_prefix(seq)
            hits = self._usable_hits(seq, self.kv.get_computed_blocks(seq))
            num_computed = len(hits) * self.kv.block_size
            n = self._chunk(seq, num_computed, budget)
            if n == 0 or self.kv.allocate_slots(seq, n, hits) is None:
                if self._never_fits(budget):
                    self._drop(seq, n or seq.num_tokens - num_computed, out)
                    continue
                break
            self.waiting.remove(seq)
            seq.num_computed_tokens = num_computed
            seq.num_prefill_tokens = seq.num_tokens
            if self.eviction is not None:
                seq.kv_first_slot = self.eviction.no_empty_slots
            seq.record.prefix_hit_tokens += num_computed
            if seq.record.preemptions:
                seq.record.readmission_hit_tokens += num_computed
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq.of(seq, num_computed, n, num_computed))
            budget -= n

    def _never_fits(self, budget: int) -> bool:
        """Whether the head of the queue, refused its next chunk, is refused with nothing else running and
        every block free: no later step can give it more."""
        return not self.running and budget == self.limits.max_num_batched_tokens and \
            self.kv.pool.num_free() == self.kv.pool.num_blocks

    def _drop(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> None:
        """Give up a waiting sequence that can never be served (`_never_fits`), recording why. Admission
        refuses what cannot be served alone (`Engine._rejection`); what is left is a sequence preempted with
        recompute whose prompt and outputs, in one step without chunked prefill, need more blocks than the
        pool has, which its eviction budget had kept it under. It would wait for ever, and the engine with it."""
        self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.kv.forget(seq)
        needed = self.kv.blocks_for(num_tokens)
        why = (f"its next step of {num_tokens} tokens needs {needed} KV blocks, the cache holds "
               f"{self.kv.pool.num_blocks}")
        if seq.record.preemptions:
            why = (f"preempted after {seq.num_output_tokens} output tokens and recomputed in one step (chunked "
                   f"prefill {'on' if self.limits.chunked_prefill else 'off'}): {why}; dropped")
        seq.record.rejected_reason = why
        out.dropped.append(seq)

    def _usable_hits(self, seq: Sequence, hits: list[int]) -> list[int]:
        """The prefix hits a waiting sequence may take: all of them, unless its eviction policy's scores need
        the hit tokens' queries (`EvictionBudget.max_hit_tokens`: none for H2O, SnapKV's observation window
        left to compute), or with eviction the hit and the chunk after it could not fit the pool together.
        Admission checked a sequence against the pool at its peak under its eviction budget
        (`EvictionBudget.peak_slots`), and compactions keep prompts cached whole (`KVCacheManager.truncate`): a
        hit can be far longer than the budget, and a sequence that needs more blocks than the pool has would
        wait forever. (Without eviction a hit never makes a sequence hold more than its own tokens, which
        admission checked.)"""
        num_blocks, block_size = self.kv.pool.num_blocks, self.kv.block_size
        cap = self._max_hit_tokens(seq)
        if cap is not None:
            hits = hits[:cap // block_size]
        if self.eviction is None or not hits:
            return hits
        if self.kv.blocks_for(seq.num_tokens) <= num_blocks:
            return hits
        lim = self.limits
        step = min(lim.chunk_size, lim.max_num_batched_tokens) if lim.chunked_prefill else seq.num_tokens
        return hits[:max(0, num_blocks * block_size - step) // block_size]

    def _would_prefetch(self) -> bool:
        """Whether `_prefetch` would move blocks after this step: the sequence admitted next has prefix blocks
        below the device (a fast-forwarded run of decodes makes no such per-step moves: the simulator had
        predicted 4 blocks prefetched where the runtime prefetched 37)."""
        return bool(self.prefetch_blocks) and self.kv.tiers is not None and self._next_to_prefetch() is not None

    def _max_hit_tokens(self, seq: Sequence) -> int | None:
        """The most prompt tokens a sequence may take from the prefix cache and compute as it would from its
        start (None: no limit). Its eviction policy's (`EvictionBudget.max_hit_tokens`), and with quantized KV
        none of the full-precision window: a hit exists only packed, so the window's tokens must be computed
        into the sequence's own full-precision ring (`kv_layout.full_precision_start`), or a prompt served
        after itself reads them dequantized and samples other tokens (a tester's finding: 4-bit keys, 2-bit
        values, an 8-token window, a 50-token prompt served twice: the second diverged at its 4th token)."""
        cap = None if self.eviction is None else self.eviction.max_hit_tokens(seq.num_tokens)
        if self.full_precision_window:  # (no list built: asked for every waiting sequence at every step)
            window_cap = max(0, seq.num_tokens - self.full_precision_window)
            return window_cap if cap is None else min(cap, window_cap)
        return cap

    def _takes_hits(self, seq: Sequence) -> bool:
        """Whether the sequence may take any prefix hit (else its lower-tier prefix is not brought up for it)."""
        cap = self._max_hit_tokens(seq)
        return cap is None or cap >= self.kv.block_size

    def _resume_swapped(self, seq: Sequence, out: SchedulerOutput, budget: int) -> int:
        """Bring a swapped sequence back (its blocks from the host) with its next chunk; returns the
        chunk's tokens, 0 when it does not fit."""
        n = self._chunk(seq, seq.num_computed_tokens, budget)
        if n == 0 or not self.kv.can_swap_in(seq, n):
            return 0
        self.kv.swap_in(seq)
        if self.kv.allocate_slots(seq, n) is None:  # unreachable after can_swap_in; a hard invariant
            raise RuntimeError(f"KV pool: {seq.seq_id} swapped in without room for its next tokens")
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        out.swapped_in.append(seq)
        out.scheduled.append(ScheduledSeq.of(seq, seq.num_computed_tokens, n, self.kv.num_kv_tokens(seq)))
        return n

    def _prefetch(self) -> None:
        """Promote lower-tier prefix blocks of the sequence admitted next, up to the prefetch depth in blocks a
        step: after every allocation of the step, so none of them can reuse these blocks. It keeps a free
        block per running sequence (their next tokens). A chain longer than the depth is promoted from its
        start, the rest in the next steps (its leading blocks are hits as soon as they are up; a chain taken
        whole only had left every prefix longer than the depth, 32 tokens by default, to on-demand loads).
        Only the next sequence's: blocks promoted for those further back sit free until their turn, and the
        running sequences' new blocks take them back down first (prefetching for the whole queue moved 2,570
        blocks up, 19% of them used)."""
        found = self._next_to_prefetch()
        left = min(self.prefetch_blocks, self.kv.pool.num_free() - len(self.running))
        if found is not None and left > 0:
            seq, wanted = found
            self.kv.promote_prefix(seq, max_blocks=min(wanted, left), prefetch=True)

    def _next_to_prefetch(self) -> tuple[Sequence, int] | None:
        """The waiting sequence admitted next and its prefix blocks below the device, if it has any it may use."""
        if not len(self.waiting):
            return None
        seq = self.waiting.peek(self.kv)
        if self.kv.is_swapped(seq) or not self._takes_hits(seq):
            return None
        wanted = self.kv.lower_prefix_blocks(seq)
        return (seq, wanted) if wanted else None

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.limits.max_num_batched_tokens)
        if not out.preempted and not out.swapped:  # admitting while preempting would thrash
            self._schedule_waiting(out, budget)
        if self.eviction is not None:
            self._plan_compactions(out, self.eviction)
        if self.kv.tiers is not None:
            out.transfers = self.kv.take_transfers()
            if self.prefetch_blocks and not out.preempted and not out.swapped:
                self._prefetch()
                out.prefetch = self.kv.take_transfers()
        out.finished_seq_ids, self._finished_ids = self._finished_ids, []
        self._check_budgets(out)
        return out

    def _plan_compactions(self, out: SchedulerOutput, eviction: EvictionBudget) -> None:
        """Compactions after this step, planned after every allocation so that their copy-on-write blocks
        never cost a preemption (without free blocks for them, a compaction waits for a later step)."""
        for s in out.scheduled:
            seq = s.seq
            if s.samples and seq.num_output_tokens + 1 >= seq.request.max_new_tokens:
                continue  # it finishes this step: all its blocks are freed anyway
            kv_len, context = s.kv_start + s.num_new_tokens, s.start + s.num_new_tokens
            if not eviction.due(kv_len, context, in_prefill=s.start < seq.num_prefill_tokens, ends_prefill=s.samples):
                continue
            new_num_kv, keep = eviction.plan(kv_len, context, seq.kv_first_slot)
            copies = self.kv.prepare_compaction(seq, new_num_kv)
            if copies is not None:
                prefix_copies = self.kv.prepare_prefix_copies(seq, context, new_num_kv)
                out.compactions.append(Compaction(seq.seq_id, kv_len, new_num_kv, keep, seq.kv_first_slot,
                                                  tuple(copies), tuple(prefix_copies)))

    def _check_budgets(self, out: SchedulerOutput) -> None:
        lim = self.limits
        problems = []
        num_new = [s.num_new_tokens for s in out.scheduled]
        if sum(num_new) > lim.max_num_batched_tokens:
            problems.append(f"{sum(num_new)} tokens > max_num_batched_tokens {lim.max_num_batched_tokens}")
        if len(self.running) > lim.max_num_seqs:
            problems.append(f"{len(self.running)} running > max_num_seqs {lim.max_num_seqs}")
        if lim.chunked_prefill and max(num_new, default=0) > lim.chunk_size:
            problems.append(f"a prefill chunk exceeds chunk_size {lim.chunk_size}")
        if len({s.seq.seq_id for s in out.scheduled}) != len(out.scheduled):
            problems.append("a sequence is scheduled twice")
        if self.kv.pool.num_used() > self.kv.pool.num_blocks:
            problems.append("more blocks in use than the pool has")
        if out.compactions and any(c.new_num_kv_tokens >= c.kv_len for c in out.compactions):
            problems.append("a compaction frees no KV slot")
        if problems:
            raise RuntimeError("scheduler invariant broken: " + "; ".join(problems))

    # ---- runs of steps whose outcome is known (the simulator's fast-forward) -----------------------
    def lone_prefill(self) -> tuple[Sequence, list[int]] | None:
        """The running sequence and its prefill's chunks, in order, if the next steps can only be those
        chunks: it runs alone and is in its prefill, nothing waits (an arrival would end such a run), and
        nothing is evicted or moved between tiers (those plan work per step). Else None."""
        if len(self.running) != 1 or len(self.waiting) or self.eviction is not None or self.kv.tiers is not None:
            return None
        seq = self.running[0]
        computed, chunks = seq.num_computed_tokens, []
        if seq.num_tokens - computed <= 1:
            return None  # a decode (`steady_decodes`)
        while computed < seq.num_tokens:  # what `_schedule_running` gives a lone sequence, step by step
            n = self._chunk(seq, computed, self.limits.max_num_batched_tokens)
            if n == 0:
                break  # (unchunked and over the budget: the step itself reports that it cannot progress)
            chunks.append(n)
            computed += n
        return (seq, chunks) if chunks else None

    def advance_prefill(self, seq: Sequence, chunks: list[int], step_end_s: float, token: int | None = None,
                        eos_token_id: int | None = None) -> list[Sequence]:
        """Apply the first ``chunks`` of `lone_prefill` (the last of them ending at ``step_end_s``) as their
        steps would: their blocks in one allocation (the same blocks, in the same order, as one per step),
        then `update` for the last chunk, which caches the full blocks and, if it ends the prefill, takes
        the sampled ``token``. Returns the sequence if it finished (one new token asked)."""
        if self.kv.allocate_slots(seq, sum(chunks)) is None:  # it runs alone: admission checked it fits
            raise RuntimeError(f"prefill of {seq} alone ran out of blocks")
        start = seq.num_computed_tokens + sum(chunks[:-1])
        last = ScheduledSeq.of(seq, start, chunks[-1], start)
        return self.update(SchedulerOutput([last]), {seq.seq_id: token} if last.samples else {}, step_end_s,
                           eos_token_id)

    # ---- runs of identical decode steps -----------------------------------------------------------
    def steady_decodes(self) -> list[Sequence] | None:
        """The running sequences if the next step can only be a pure decode of exactly them (all past
        prefill, no admission possible), else None."""
        if not self.running or len(self.running) > self.limits.max_num_batched_tokens:
            return None
        for s in self.running:  # (a loop, not `any` of a generator: asked after every step)
            if s.num_computed_tokens != s.num_tokens - 1:
                return None
        if len(self.waiting) and len(self.running) < self.limits.max_num_seqs and self._might_admit():
            return None
        if self._would_prefetch():
            return None  # (each step of a run would prefetch: the runs are stepped one at a time)
        return self.running

    def max_decode_run(self, seqs: list[Sequence]) -> int:
        """The most decode steps a run of ``seqs`` (the `steady_decodes`) may take: up to the first finish,
        which ends the run (`advance_decodes` finishes whoever reaches its last token in the last step). With
        eviction or tiers the run stops before that step, which stays a normal one: a sequence is not
        compacted in the step it finishes (`plan_decode_run` does not model that), and a step's tier
        transfers and prefetches are its own (a run charges its transfers at its end and prefetches none)."""
        left = min([s.request.max_new_tokens - (s.num_tokens - s.num_prompt_tokens) for s in seqs])  # (inlined)
        return left if self._runs_may_finish() else left - 1

    def _runs_may_finish(self) -> bool:
        return self.eviction is None and self.kv.tiers is None

    def _might_admit(self) -> bool:
        """Whether the head of the waiting queue could get its first chunk's blocks now (blocks only get
        scarcer during a run of decodes, so a 'no' holds for the whole run)."""
        seq = self.waiting.peek(self.kv)
        budget = self.limits.max_num_batched_tokens - len(self.running)
        if self.kv.is_swapped(seq):
            n = self._chunk(seq, seq.num_computed_tokens, budget)
            return n > 0 and self.kv.can_swap_in(seq, n)
        if self._takes_hits(seq) and self.kv.lower_prefix_blocks(seq, at_most=1):
            return True  # a promotion may make room count differently: let the step decide
        hits = self._usable_hits(seq, self.kv.get_computed_blocks(seq))
        n = self._chunk(seq, len(hits) * self.kv.block_size, budget)
        if n == 0:
            return False
        needed = self.kv.blocks_for(len(hits) * self.kv.block_size + n) - len(hits)
        return needed + self.kv.pool.num_free_among(hits) <= self.kv.pool.num_free()

    def plan_decode_run(self, seqs: list[Sequence], k_max: int) -> tuple[int, list[list[DecodeCompaction]]]:
        """With eviction: the most decode steps (<= ``k_max``) of ``seqs`` (the `steady_decodes`) that
        `advance_decodes` can apply, and each sequence's compactions in them. A run stops before a
        compaction that `schedule()` must plan (it may copy shared or cached blocks: a sequence's first,
        with prefix reuse on), ends with the first compaction if a waiting sequence might use the blocks it
        frees, and does not start while a sequence is still in its prefill."""
        if self.eviction is None:
            return k_max, [[] for _ in seqs]
        if any(s.num_computed_tokens < s.num_prefill_tokens for s in seqs):
            return 0, []
        # a compaction frees blocks, so a sequence left waiting for them may be admitted after it
        may_admit = len(self.waiting) > 0 and len(self.running) < self.limits.max_num_seqs
        k = k_max
        for seq in seqs:  # first compactions only: they bound the run, which is often short
            d = self.eviction.decode_steps_to_due(self.kv.num_kv_tokens(seq), seq.num_computed_tokens, k)
            if d is not None and seq.seq_id not in self.kv.num_evicted and self.kv.enable_prefix_reuse:
                k = d - 1
            elif d is not None and may_admit:
                k = d
        return k, [self._decode_compactions(seq, k, self.eviction) for seq in seqs]

    def _decode_compactions(self, seq: Sequence, k: int, eviction: EvictionBudget) -> list[DecodeCompaction]:
        """The compactions `schedule()` would plan in the next ``k`` decode steps of ``seq``."""
        kv_len, context, first = self.kv.num_kv_tokens(seq), seq.num_computed_tokens, seq.kv_first_slot
        events: list[DecodeCompaction] = []
        done = 0
        while (d := eviction.decode_steps_to_due(kv_len, context + done, k - done)) is not None:
            done += d
            new_num_kv, keep = eviction.plan(kv_len + d, context + done, first)
            events.append(DecodeCompaction(done, new_num_kv, tuple(new_num_kv - n for n in keep)))
            kv_len, first = new_num_kv, events[-1].first_slot
        return events

    def advance_decodes(self, step_end_s: Sequence_[float], new_tokens: list[list[int]],
                        compactions: Sequence_[list[DecodeCompaction]] = ()) -> list[Sequence]:
        """Apply ``len(step_end_s)`` decode steps of every running sequence at once, with the compactions
        of `plan_decode_run` (by sequence, in the order of ``running``), and finish the sequences whose
        last token is the last step's, as `update` would; returns them. The caller (the simulator) has
        checked with `steady_decodes`, `max_decode_run` and the block counts that nothing else would
        happen: no admission, no finish before the last of these steps, blocks enough at every step.
        Sequences are advanced from one compaction to the next in step order, so that the blocks in use
        never exceed those of the same steps taken one at a time. (Sampled tokens are not checked for EOS:
        the simulator's engine has none.)"""
        k = len(step_end_s)
        last_step = k if self._runs_may_finish() else k + 1  # the run may end with finishes (`max_decode_run`)
        for seq in self.running:  # (`num_output_tokens`, inlined here and below: once per sequence per run)
            if seq.num_tokens - seq.num_prompt_tokens + last_step > seq.request.max_new_tokens:
                raise RuntimeError(f"fast-forward of {k} steps is not steady for {seq}: it would finish")
        done = [0] * len(self.running)
        events = sorted((e.step, i, e) for i, per_seq in enumerate(compactions) for e in per_seq)
        for step, i, event in events:
            seq = self.running[i]
            self._advance_decode(seq, done[i], step, step_end_s, new_tokens[i])
            done[i] = step
            self.kv.truncate(seq, event.new_num_kv_tokens)
            seq.kv_first_slot = event.first_slot
        for i, seq in enumerate(self.running):
            self._advance_decode(seq, done[i], k, step_end_s, new_tokens[i])
        finished = [seq for seq in self.running if seq.num_tokens - seq.num_prompt_tokens >= seq.request.max_new_tokens]
        for seq in finished:  # after every allocation of the last step, in the order `update` finishes them
            self._finish(seq, step_end_s[-1])
        return finished

    def _advance_decode(self, seq: Sequence, begin: int, end: int, step_end_s: Sequence_[float],
                        new_tokens: list[int]) -> None:
        """Decode steps ``begin..end`` (of a run) of one sequence."""
        if end == begin:
            return
        kv = self.kv
        if kv.allocate_slots(seq, end - begin) is None:
            raise RuntimeError(f"fast-forward to step {end} is not steady for {seq}: blocks ran out")
        seq.num_computed_tokens += end - begin
        seq.output_token_ids += new_tokens[begin:end]  # (`append_tokens`, inlined: once per sequence per run)
        seq.num_tokens += end - begin
        done = kv.num_cached_blocks.get(seq.seq_id, 0)
        if seq.num_computed_tokens // kv.block_size > done and kv.private_from.get(seq.seq_id, done + 1) > done:
            kv.cache_full_blocks(seq)  # (only when it may cache a block, as in `update`)
        seq.record.token_times_s.extend(step_end_s[begin:end])

    # ---- after the step ---------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int], now_s: float,
               eos_token_id: int | None = None) -> list[Sequence]:
        """Advance the computed counts, append sampled tokens, finish sequences; returns finished ones."""
        finished = []
        compacted = {c.seq_id: c for c in out.compactions}
        cache_full_blocks, cached_blocks, block_size = (self.kv.cache_full_blocks, self.kv.num_cached_blocks,
                                                        self.kv.block_size)
        prefix_reuse, private_from = self.kv.enable_prefix_reuse, self.kv.private_from
        for seq, start, num_new_tokens, samples, _ in out.scheduled:
            seq.num_computed_tokens = start + num_new_tokens
            if compacted:
                self._apply_compaction(seq, compacted.get(seq.seq_id))
            # only when a block filled that it may cache (the call returns at once otherwise): a sequence past its
            # `private_from` caches no more, and in a replay most are (`private_prefixes`)
            if prefix_reuse and (start + num_new_tokens) // block_size > (done := cached_blocks.get(seq.seq_id, 0)) \
                    and private_from.get(seq.seq_id, done + 1) > done:
                cache_full_blocks(seq)
            if not samples:
                continue
            token = sampled[seq.seq_id]
            seq.output_token_ids.append(token)  # (`append_tokens`, inlined: once per sequence per step)
            seq.num_tokens += 1
            seq.record.token_times_s.append(now_s)
            request = seq.request
            if seq.num_tokens - seq.num_prompt_tokens >= request.max_new_tokens or (
                    request.stop_at_eos and token == eos_token_id):
                self._finish(seq, now_s)
                finished.append(seq)
        return finished

    def _apply_compaction(self, seq: Sequence, compaction: Compaction | None) -> None:
        if compaction is not None:
            self.kv.truncate(seq, compaction.new_num_kv_tokens, compaction.prefix_copies)
            seq.kv_first_slot = compaction.dst_first_slot

    def _finish(self, seq: Sequence, now_s: float) -> None:
        self._finished_ids.append(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.record.finish_s = now_s
        seq.record.output_token_ids = seq.output_token_ids
        self.running.remove(seq)
        self.kv.free(seq, finished=True)
        self.kv.forget(seq)
