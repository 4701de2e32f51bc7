"""The serving engine: scheduler + executor + clock. Torch-free.

The runtime plugs in an executor that runs the real model and a wall clock; the simulator plugs in
one that asks the hardware profile for the step time and a virtual clock. Both share this loop, the
scheduler and the block accounting.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable, Iterable, Protocol
from typing import Sequence as PySequence

import numpy as np

from ..config import KVConfig
from .block_manager import KVCacheManager, private_prefixes
from .eviction_budget import EvictionBudget
from .kv_layout import read_full_precision_window
from .metrics import Metrics, TierMetrics, compute_metrics, tier_metrics
from .request import Request, RequestRecord
from .scheduler import Scheduler, SchedulerLimits, SchedulerOutput, Sequence
from .tiers import TierManager

# `Engine.replay`'s ``stop`` is asked STOP_CHECKS times over a replay's arrivals and, where it keeps up with them,
# about as often again over its steps (at least STOP_CHECK_MIN_WORK loops or quarter arrivals apart)
STOP_CHECKS = 32
STOP_CHECK_MIN_WORK = 16


class Executor(Protocol):
    """Computes a scheduled step and returns the sampled token of every sequence that samples. An executor
    may also have ``prepare(kv)``, which the engine calls once its block accounting and tiers exist, before
    any request: what it allocates there is not charged to the first step."""

    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> dict[str, int]: ...


class FastForward(Protocol):
    """Advances runs of steps in which nothing changes in one event (the simulator's); gets the time of
    the next arrival (inf if none) and must stop before it."""

    def __call__(self, engine: "Engine", next_arrival_s: float) -> None: ...


class Clock(Protocol):
    def now(self) -> float: ...

    def wait_until(self, t_s: float) -> None: ...


class WallClock:
    """Seconds since construction, from the monotonic performance counter."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def wait_until(self, t_s: float) -> None:
        delay = t_s - self.now()
        if delay > 0:
            time.sleep(delay)


class VirtualClock:
    """Simulated time: moves only when told (the simulator advances it by each step's predicted time)."""

    def __init__(self) -> None:
        self.t_s = 0.0

    def now(self) -> float:
        return self.t_s

    def advance(self, dt_s: float) -> None:
        self.t_s += dt_s

    def wait_until(self, t_s: float) -> None:
        self.t_s = max(self.t_s, t_s)


def scheduler_limits(config: KVConfig) -> SchedulerLimits:
    b = config.batching
    return SchedulerLimits(max_num_seqs=b.max_num_seqs, max_num_batched_tokens=b.max_num_batched_tokens,
                           chunked_prefill=b.chunked_prefill, chunk_size=b.chunk_size, policy=b.policy)


def eviction_budget(config: KVConfig, n_layers: int | None) -> EvictionBudget | None:
    """The scheduler's eviction budget of a config (None when nothing is evicted)."""
    if config.eviction.policy == "none":
        return None
    if n_layers is None:
        raise ValueError(f"eviction.policy {config.eviction.policy!r}: the engine needs the model's n_layers "
                         "(per-layer budgets)")
    return EvictionBudget(config.eviction, n_layers, config.prefix_reuse.block_size)


def tier_blocks(knob: str, tier_bytes: int, block_bytes: int) -> int:
    """A lower tier's capacity in blocks; warns when a tier was asked for but holds no whole block."""
    blocks = tier_bytes // block_bytes
    if tier_bytes and not blocks:
        warnings.warn(f"{knob}: {tier_bytes} bytes hold less than one KV block of {block_bytes} bytes: "
                      "the tier is off", UserWarning)
    return blocks


def tier_manager(config: KVConfig, block_bytes: int) -> TierManager | None:
    """The host and disk tiers of a config in blocks (None when both hold no block: nothing moves down)."""
    off = config.offload
    host = tier_blocks("offload.host_kv_bytes", off.host_kv_bytes, block_bytes)
    disk = tier_blocks("offload.disk_kv_bytes", off.disk_kv_bytes, block_bytes)
    # a swap moves a sequence's blocks to host slots (with quantized KV its full-precision ring rows too, with
    # eviction its attention statistics stay with it): every config can swap, given a host tier
    swap = config.batching.preemption == "swap"
    if swap and host == 0:  # warned once (Python shows a repeated warning once), not once per preemption
        warnings.warn("batching.preemption: swap needs a host tier (offload.host_kv_bytes of one KV block or "
                      "more): without one every preemption recomputes", UserWarning)
    if host == 0 and disk == 0:
        if config.prefetch.enabled:  # (said, as for swap: a knob that silently does nothing reads as a finding)
            warnings.warn("prefetch.enabled: no host or disk tier (offload.host_kv_bytes, offload.disk_kv_bytes) "
                          "holds KV to bring back: prefetch does nothing", UserWarning)
        return None
    # swap as configured: without host room the tiers count each preemption as a swap fallback
    return TierManager(host, disk, write_through=off.write_policy == "write_through",
                       swap_evicts_prefix=off.demote_first == "preempted", swap=swap)


def prefetch_blocks(config: KVConfig) -> int:
    """Blocks of waiting sequences promoted ahead of use per step (``unit: blocks``): ``depth`` blocks."""
    p = config.prefetch
    return p.depth if p.enabled and p.unit == "blocks" else 0


def layerwise_depth(config: KVConfig) -> int:
    """``unit: layers``: a step's host -> device copies run layer by layer alongside its forward pass, at
    most ``depth`` layers ahead of the compute (0: off). See docs/tiers.md."""
    p = config.prefetch
    return p.depth if p.enabled and p.unit == "layers" else 0


def token_id_range(token_ids: PySequence[int]) -> tuple[int, int]:
    """(lowest, highest) token id of a prompt: vectorised on numpy arrays and a workload's `StreamPrompt`."""
    if isinstance(token_ids, np.ndarray) or hasattr(token_ids, "block_hashes"):
        return int(token_ids.min()), int(token_ids.max())
    return min(token_ids), max(token_ids)


class Engine:
    """Serves requests through the paged KV cache: ``step()`` schedules, executes and updates. ``n_layers``
    (the model's) is needed with eviction only: the budgets are per layer. ``vocab_size``, where a real model
    embeds the prompts, makes a request with token ids outside the vocabulary an error (the simulator's
    executor never embeds them and passes none). ``ring_bytes``: the full-precision rings of quantized KV
    (`kv_layout.ring_bytes`), allocated up front for ``max_num_seqs`` sequences out of the device budget the
    blocks share (`kv_layout.kv_pool_blocks`), so counted in full in KV peak and capacity (the runtime and the
    simulator both pass them from the layout). ``unique_outputs``: the executor's output tokens never continue
    a prompt (the simulator's come from a counter), so a replay need not cache the blocks no other prompt
    shares (`_private_prefixes`)."""

    def __init__(self, config: KVConfig, *, num_blocks: int, block_bytes: int, max_context: int,
                 executor: Executor, clock: Clock, eos_token_id: int | None = None,
                 notes: tuple[str, ...] = (), fast_forward: FastForward | None = None,
                 n_layers: int | None = None, vocab_size: int | None = None, ring_bytes: int = 0,
                 unique_outputs: bool = False) -> None:
        self.config = config
        self.unique_outputs = unique_outputs
        self.fast_forward = fast_forward
        self.kv = KVCacheManager(num_blocks, config.prefix_reuse.block_size, config.prefix_reuse.enabled,
                                 tier_manager(config, block_bytes))
        self.scheduler = Scheduler(scheduler_limits(config), self.kv, eviction_budget(config, n_layers),
                                   prefetch_blocks(config) if self.kv.tiers is not None else 0,
                                   read_full_precision_window(config))
        prepare = getattr(executor, "prepare", None)
        if prepare is not None:
            prepare(self.kv)
        self.block_bytes = block_bytes
        self.ring_bytes = ring_bytes
        self.max_context = max_context
        self.executor = executor
        self.clock = clock
        self.eos_token_id = eos_token_id
        self.notes = notes
        self.vocab_size = vocab_size
        self.records: list[RequestRecord] = []
        # Request ids of this engine's records. An id names one request for the whole run, finished or not:
        # the metrics' rejections and the optimizer's isolated-latency lookup key records by it, and the
        # scheduler and block tables key sequences by it. So a finished request's id is not reused either.
        self.request_ids: set[str] = set()
        self.busy_s = 0.0  # clock time spent in steps (the rest of a replay is idle waiting for arrivals)
        self.stopped = False  # a replay ended early, where its ``stop`` said so (`replay`)

    def _rejection(self, req: Request) -> str | None:
        """Why a request can never be served, or None."""
        total = req.prompt_len + req.max_new_tokens
        if total > self.max_context:
            return f"prompt + output = {total} tokens exceeds the model's context of {self.max_context}"
        needed = self.kv.blocks_for(self._peak_slots(req))
        if needed > self.kv.pool.num_blocks:
            return f"needs {needed} KV blocks, the cache holds {self.kv.pool.num_blocks}"
        b = self.config.batching
        # Without chunked prefill a sequence's whole context is one step's tokens when it is recomputed after a
        # preemption (prompt and outputs so far), so it must fit the step budget: a longer one would wait for
        # ever. vLLM asks the same (it refuses max_num_batched_tokens below max_model_len then: `skistune
        # export` writes the budget as --max-model-len, which refuses these requests).
        if not b.chunked_prefill and total > b.max_num_batched_tokens:
            return (f"prompt + output = {total} tokens exceeds max_num_batched_tokens "
                    f"{b.max_num_batched_tokens} with chunked prefill off")
        return None

    def _peak_slots(self, req: Request) -> int:
        """The KV slots a request needs at once: all its tokens, or with eviction about its budget."""
        total = req.prompt_len + req.max_new_tokens
        eviction = self.scheduler.eviction
        if eviction is None:
            return total
        b = self.config.batching
        step_tokens = min(b.chunk_size, b.max_num_batched_tokens) if b.chunked_prefill else req.prompt_len
        return eviction.peak_slots(req.prompt_len, total, step_tokens)

    def _check_request(self, req: Request, ids: set[str]) -> None:
        """Raise for a request that is a caller's error, not a capacity limit: an id already in ``ids``, or
        prompt token ids outside the model's vocabulary (which the embedding would fail on mid-step)."""
        if req.request_id in ids:
            raise ValueError(f"request {req.request_id}: duplicate request id (ids must be unique in a run)")
        if self.vocab_size is not None:
            lo, hi = token_id_range(req.prompt_token_ids)
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"request {req.request_id}: token id {lo if lo < 0 else hi} is outside the "
                                 f"model's vocabulary of {self.vocab_size} (0..{self.vocab_size - 1})")

    def add_request(self, req: Request, arrival_s: float | None = None) -> RequestRecord:
        """Queue a request (or record why it is rejected); it arrives now unless ``arrival_s`` says when.
        Raises ``ValueError`` for a duplicate id or out-of-vocabulary tokens (`_check_request`)."""
        self._check_request(req, self.request_ids)
        return self._queue(req, arrival_s)

    def _queue(self, req: Request, arrival_s: float | None) -> RequestRecord:
        """`add_request` after its checks (`replay` checks every request before the first arrives)."""
        self.request_ids.add(req.request_id)
        arrival_s = self.clock.now() if arrival_s is None else arrival_s
        record = RequestRecord(req.request_id, arrival_s, req.prompt_len)
        self.records.append(record)
        record.rejected_reason = self._rejection(req)
        if record.rejected_reason is None:
            self.scheduler.add(Sequence(req, record))
        return record

    def step(self) -> list[Sequence]:
        out = self.scheduler.schedule()
        if not out:
            if out.dropped:  # requests that can never be served were given up (their records say why)
                return []
            raise RuntimeError("scheduler made no progress with work pending")
        started_s = self.clock.now()
        sampled = self.executor.execute(out, self.kv)
        now_s = self.clock.now()
        self.busy_s += now_s - started_s
        return self.scheduler.update(out, sampled, now_s, self.eos_token_id)

    def run_until_done(self) -> None:
        while self.scheduler.has_work():
            self.step()

    def replay(self, requests: Iterable[Request], stop: Callable[[Engine], bool] | None = None) -> Metrics:
        """Serve requests at their arrival times (relative to the clock's start) until all finish. ``stop``:
        asked between steps, `STOP_CHECKS` to twice as many times over a replay, whether the rest of it can be
        skipped; where it says so the replay ends there, `stopped` is set and the metrics are those of the
        requests so far (the simulator's capacity search: a replay its SLOs are certain to miss)."""
        pending = sorted(requests, key=lambda r: r.arrival_s)
        ids = set(self.request_ids)
        for r in pending:  # all before serving any: a bad request arriving late would waste the run so far
            self._check_request(r, ids)
            ids.add(r.request_id)
        self._private_prefixes(pending)
        start = self.clock.now()
        i = 0
        self.stopped = False
        # ``stop`` is asked after so much work: a loop (a step, or a fast-forward) counts 1, an arrival 4 (a replay
        # loops 2-10 times a request where it keeps up, and takes in many arrivals a loop where it does not)
        check_every, work, checked_at = max(STOP_CHECK_MIN_WORK, 4 * len(pending) // STOP_CHECKS), 0, 0
        while i < len(pending) or self.scheduler.has_work():
            while i < len(pending) and start + pending[i].arrival_s <= self.clock.now():
                self._queue(pending[i], start + pending[i].arrival_s)
                i += 1
            if stop is not None:
                work += 1
                if work + 4 * i - checked_at >= check_every:
                    checked_at = work + 4 * i
                    if stop(self):
                        self.stopped = True
                        break
            if self.scheduler.has_work():
                self.step()
                if self.fast_forward is not None:
                    self.fast_forward(self, start + pending[i].arrival_s if i < len(pending) else float("inf"))
            elif i < len(pending):
                self.clock.wait_until(start + pending[i].arrival_s)
        return self.metrics(duration_s=self.clock.now() - start)

    def _private_prefixes(self, pending: list[Request]) -> None:
        """Before a replay into an empty engine whose outputs never continue a prompt: the sequences whose
        blocks no other can find cache them only if they are preempted (`block_manager.private_prefixes`),
        which changes nothing a replay measures and saves hashing and caching every block of every prompt.
        Not with tiers (every cached block is written down or demoted when reused) nor eviction (a compaction
        copies the cached blocks it rewrites)."""
        if self.unique_outputs and not self.request_ids and self.kv.enable_prefix_reuse \
                and self.kv.tiers is None and self.scheduler.eviction is None:
            self.kv.private_from = private_prefixes([(r.request_id, r.prompt_token_ids) for r in pending],
                                                    self.kv.block_size)

    def metrics(self, duration_s: float) -> Metrics:
        return compute_metrics(self.records, duration_s=duration_s,
                               kv_peak_bytes=self.kv.peak_used_blocks * self.block_bytes + self.ring_bytes,
                               kv_capacity_bytes=self.kv.pool.num_blocks * self.block_bytes + self.ring_bytes,
                               preemptions=self.scheduler.num_preemptions, busy_s=self.busy_s, notes=self.notes,
                               tiers=self.tier_metrics(), evicted_tokens=self.kv.evicted_tokens)

    def tier_metrics(self) -> TierMetrics | None:
        tiers = self.kv.tiers
        if tiers is None:
            return None
        return tier_metrics(tiers, self.block_bytes, self.kv.peak_used_blocks)
