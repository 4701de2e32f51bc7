"""Continuous batching under one token budget per step (vLLM v1 style): prefill and decode tokens are
the same currency, so there are no separate phases. Pure Python, no torch: the runtime executes a
`SchedulerOutput` with the real model, the simulator with a clock.

Each step: running sequences first (in priority order; when one cannot get blocks, the lowest-priority
running sequence is preempted by recompute and the allocation retried), then waiting sequences in the
policy's order while tokens, sequence slots and blocks last. `schedule()` ends by checking its budgets.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from .block_manager import KVCacheManager
from .request import Request, RequestRecord

PREFIX_POLICY_WINDOW = 64  # waiting sequences scanned for the longest cached prefix (bounds the cost)


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Scheduler state of one request: its tokens (prompt, then outputs) and how many have KV."""

    def __init__(self, request: Request, record: RequestRecord) -> None:
        self.request = request
        self.seq_id = request.request_id
        prompt = request.prompt_token_ids
        self.token_ids: list[int] = prompt.tolist() if hasattr(prompt, "tolist") else [int(t) for t in prompt]
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.status = SeqStatus.WAITING
        self.record = record

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def max_tokens(self) -> int:
        return self.num_prompt_tokens + self.request.max_new_tokens

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"


class ScheduledSeq(NamedTuple):
    """``num_new_tokens`` tokens of ``seq`` starting at position ``start`` are computed this step;
    ``samples`` says whether the step reaches the sequence's last token, so a new token is sampled.
    (A NamedTuple: the scheduler makes one per sequence per step, and the simulator makes millions.)"""

    seq: Sequence
    start: int
    num_new_tokens: int
    samples: bool

    @classmethod
    def of(cls, seq: Sequence, start: int, num_new_tokens: int) -> "ScheduledSeq":
        return cls(seq, start, num_new_tokens, start + num_new_tokens == len(seq.token_ids))


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

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
    def __init__(self, limits: SchedulerLimits, kv: KVCacheManager) -> None:
        self.limits = limits
        self.kv = kv
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
        remaining = len(seq.token_ids) - num_computed
        if remaining <= 1:
            return min(remaining, budget)
        if not self.limits.chunked_prefill:
            return remaining if remaining <= budget else 0
        return min(remaining, self.limits.chunk_size, budget)

    def _victim(self) -> Sequence:
        """Lowest-priority running sequence: the latest deadline under EDF, else the newest admitted."""
        if self.limits.policy == "edf":
            return max(self.running, key=lambda s: s.request.priority_deadline_s)
        return self.running[-1]

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Recompute preemption: drop the KV, keep the tokens, queue at the front. Returns the tokens
        it had been given earlier in this step (an EDF victim may already be scheduled)."""
        given_back = sum(s.num_new_tokens for s in out.scheduled if s.seq is seq)
        if given_back:
            out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.record.preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(seq, front=True)
        out.preempted.append(seq)
        return given_back

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(seq, seq.num_computed_tokens, budget)
            if n == 0:
                continue
            while self.kv.allocate_slots(seq, n) is None:
                victim = self._victim()
                budget += self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                out.scheduled.append(ScheduledSeq.of(seq, seq.num_computed_tokens, n))
                budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while len(self.waiting) and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting.peek(self.kv)
            hits = self.kv.get_computed_blocks(seq)
            num_computed = len(hits) * self.kv.block_size
            n = self._chunk(seq, num_computed, budget)
            if n == 0 or self.kv.allocate_slots(seq, n, hits) is None:
                break
            self.waiting.remove(seq)
            seq.num_computed_tokens = num_computed
            seq.record.prefix_hit_tokens += num_computed
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq.of(seq, num_computed, n))
            budget -= n

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.limits.max_num_batched_tokens)
        if not out.preempted:  # admitting while preempting would thrash
            self._schedule_waiting(out, budget)
        self._check_budgets(out)
        return out

    def _check_budgets(self, out: SchedulerOutput) -> None:
        lim = self.limits
        problems = []
        if out.num_batched_tokens > lim.max_num_batched_tokens:
            problems.append(f"{out.num_batched_tokens} tokens > max_num_batched_tokens {lim.max_num_batched_tokens}")
        if len(self.running) > lim.max_num_seqs:
            problems.append(f"{len(self.running)} running > max_num_seqs {lim.max_num_seqs}")
        if lim.chunked_prefill and any(s.num_new_tokens > lim.chunk_size for s in out.scheduled):
            problems.append(f"a prefill chunk exceeds chunk_size {lim.chunk_size}")
        if len({s.seq.seq_id for s in out.scheduled}) != len(out.scheduled):
            problems.append("a sequence is scheduled twice")
        if self.kv.pool.num_used() > self.kv.pool.num_blocks:
            problems.append("more blocks in use than the pool has")
        if problems:
            raise RuntimeError("scheduler invariant broken: " + "; ".join(problems))

    # ---- runs of identical decode steps (the simulator's fast-forward) -----------------------------
    def steady_decodes(self) -> list[Sequence] | None:
        """The running sequences if the next step can only be a pure decode of exactly them (all past
        prefill, no admission possible), else None."""
        if not self.running or len(self.running) > self.limits.max_num_batched_tokens:
            return None
        if any(s.num_computed_tokens != s.num_tokens - 1 for s in self.running):
            return None
        if len(self.waiting) and len(self.running) < self.limits.max_num_seqs and self._might_admit():
            return None
        return self.running

    def _might_admit(self) -> bool:
        """Whether the head of the waiting queue could get its first chunk's blocks now (blocks only get
        scarcer during a run of decodes, so a 'no' holds for the whole run)."""
        seq = self.waiting.peek(self.kv)
        hits = self.kv.get_computed_blocks(seq)
        n = self._chunk(seq, len(hits) * self.kv.block_size, self.limits.max_num_batched_tokens - len(self.running))
        if n == 0:
            return False
        needed = self.kv.blocks_for(len(hits) * self.kv.block_size + n) - len(hits)
        return needed + self.kv.pool.num_free_among(hits) <= self.kv.pool.num_free()

    def advance_decodes(self, step_end_s: list[float], new_tokens: list[list[int]]) -> None:
        """Apply ``len(step_end_s)`` decode steps of every running sequence at once. The caller (the
        simulator) has checked with `steady_decodes` and the block counts that nothing else would happen:
        no admission, no finish before the last of these steps, blocks enough."""
        k = len(step_end_s)
        for seq, tokens in zip(self.running, new_tokens):
            if seq.num_output_tokens + k >= seq.request.max_new_tokens or self.kv.allocate_slots(seq, k) is None:
                raise RuntimeError(f"fast-forward of {k} steps is not steady for {seq}")
            seq.num_computed_tokens += k
            seq.token_ids.extend(tokens)
            self.kv.cache_full_blocks(seq)
            seq.record.token_times_s.extend(step_end_s)

    # ---- after the step ---------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int], now_s: float,
               eos_token_id: int | None = None) -> list[Sequence]:
        """Advance the computed counts, append sampled tokens, finish sequences; returns finished ones."""
        finished = []
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens = s.start + s.num_new_tokens
            self.kv.cache_full_blocks(seq)
            if not s.samples:
                continue
            token = sampled[seq.seq_id]
            seq.token_ids.append(token)
            seq.record.token_times_s.append(now_s)
            if seq.num_output_tokens >= seq.request.max_new_tokens or (
                    seq.request.stop_at_eos and token == eos_token_id):
                self._finish(seq, now_s)
                finished.append(seq)
        return finished

    def _finish(self, seq: Sequence, now_s: float) -> None:
        seq.status = SeqStatus.FINISHED
        seq.record.finish_s = now_s
        seq.record.output_token_ids = seq.token_ids[seq.num_prompt_tokens:]
        self.running.remove(seq)
        self.kv.free(seq)
        self.kv.forget(seq)
