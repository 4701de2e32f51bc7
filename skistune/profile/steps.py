"""Whole ``Engine.step()`` timings of the real runtime at grid points (decode batches at a context length,
prefill chunks after cached context, and mixes of both), and the runtime's own per-step overhead.

Each grid point gets a fresh engine over the runtime's model and KV store. Its setup steps (the prefills
that build up the context) only sample tokens: the step time depends on how much KV there is, not on
its values, so a decode batch at 2048 tokens of context costs one real step, not a real prefill per
sequence. The KV store is filled with random values once, so that the setup leaves no zeros (and no
untouched pages) behind. The steps being measured run the real `ModelRunner` and are timed whole:
schedule + execute + update, which is what the simulator predicts.

A runtime whose KV is quantized measures the same way: its steps read packed blocks and rings, quantize
the blocks they complete, and every grid point records its bits (``grid["bits"]``). Its decode points time
steps that complete no block (one in a block's worth of steps packs one, and the median would hide it); its
packing points time the steps that do (`cost.PACKING_FEATURES`). Setup steps still claim each new
sequence's full-precision ring slot, as the runner would, so that the measured step finds its sequences
where a served sequence would be.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import numpy as np

from ..config import KVConfig
from ..runtime.block_manager import KVCacheManager
from ..runtime.engine import Engine, WallClock
from ..runtime.kv_layout import KVTraffic, kv_traffic
from ..runtime.llm import Runtime
from ..runtime.model_runner import ModelRunner
from ..runtime.request import Request
from ..runtime.scheduler import SchedulerOutput
from .cost import StepShape, completed_blocks, step_shape
from .harness import enough, synchronize
from .records import GridPoint, StepPoint, Timing

SETUP_TOKENS = 4096  # token budget of the setup steps (they run no model, so big is cheap)
MAX_STEPS = 100_000  # a grid point that needs more steps than this is never reached: a bug, not a wait


class StepRecorder:
    """The profiler's executor: runs the real model on the steps it measures and records their shape;
    on setup steps it only returns a token for each sampling sequence."""

    def __init__(self, runner: ModelRunner, kv: KVTraffic, vocab_size: int) -> None:
        self.runner = runner
        self.kv = kv
        self.vocab_size = vocab_size
        self.measure: Callable[[SchedulerOutput], bool] = lambda out: False
        self.shape: StepShape | None = None  # of the last step, if it ran the model

    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> dict[str, int]:
        if self.measure(out):
            self.shape = step_shape(out, self.kv)
            return self.runner.execute(out, kv)
        self.shape = None
        self._claim_rings(out, kv)
        return {s.seq.seq_id: hash((s.seq.seq_id, s.seq.num_tokens)) % self.vocab_size
                for s in out.scheduled if s.samples}

    def _claim_rings(self, out: SchedulerOutput, kv: KVCacheManager) -> None:
        """What the runner does with ring slots on a step (quantized stores only): a sequence claims its slot
        on its first step, at position 0 (a later first step would not be block-aligned: the runner
        refuses those, as it never sees them when serving)."""
        slots = self.runner.ring_slots
        if slots is None:
            return
        slots.release_finished(kv)
        for s in out.scheduled:
            slots.get(s.seq.seq_id, s.start, self.runner.store.block_size)


def fill_kv(runtime: Runtime) -> None:
    """Random values in every block but the null block 0, which pads block tables and must stay zero."""
    runtime.store.fill_random_()


class StepBench:
    """Times whole engine steps of one runtime at grid points."""

    def __init__(self, runtime: Runtime, *, warmup: int, repeats: int, max_repeats: int, min_time_s: float,
                 seed: int = 0) -> None:
        self.runtime = runtime
        store = runtime.store
        bits = runtime.config.bitwidth
        if bits.key_bits != bits.value_bits or bits.layer_bits is not None:
            raise ValueError("profiler: measures keys and values at the same bits in every layer")
        self.bits = bits.key_bits
        self.kv = kv_traffic(runtime.config, runtime.spec, store.dtype.itemsize)  # at the store's real dtype
        self.kv_bytes_per_token = self.kv.bytes_per_token
        self.recorder = StepRecorder(ModelRunner(runtime.model, store, runtime.config.eviction), self.kv,
                                     runtime.spec.vocab_size)
        self.warmup, self.repeats, self.max_repeats, self.min_time_s = warmup, repeats, max_repeats, min_time_s
        self.rng = np.random.default_rng(seed)
        self.device = runtime.model.device
        self._next_id = 0

    def _engine(self, *, chunk_size: int, budget_tokens: int) -> Engine:
        store = self.runtime.store
        config = replace(KVConfig().with_knobs({
            "batching.chunk_size": chunk_size, "batching.max_num_batched_tokens": budget_tokens,
            "batching.max_num_seqs": 65536, "prefix_reuse.block_size": store.block_size,
            "offload.device_kv_bytes": store.num_blocks * store.block_bytes}), eviction=self.runtime.config.eviction)
        return Engine(config, num_blocks=store.num_blocks, block_bytes=store.block_bytes,
                      max_context=self.runtime.spec.max_context, executor=self.recorder, clock=WallClock(),
                      n_layers=self.runtime.spec.n_layers)

    def _request(self, prompt_len: int, max_new_tokens: int) -> Request:
        """Fresh random token ids: no prefix-cache hits, no repeated inputs."""
        self._next_id += 1
        ids = self.rng.integers(0, self.runtime.spec.vocab_size, prompt_len).tolist()
        return Request(f"profile-{self._next_id}", ids, max_new_tokens)

    def _timed_step(self, engine: Engine) -> tuple[float, StepShape | None]:
        synchronize(self.device)
        t0 = time.perf_counter()
        engine.step()
        synchronize(self.device)
        return time.perf_counter() - t0, self.recorder.shape

    def _run(self, engine: Engine, measure: Callable[[SchedulerOutput], bool],
             feed: Callable[[Engine], None] = lambda engine: None) -> tuple[list[float], list[StepShape]]:
        """Step until enough steps were measured after the warm-up ones; returns their times and shapes."""
        self.recorder.measure = measure
        times_s, shapes = [], []
        for _ in range(MAX_STEPS):
            if enough(times_s[self.warmup:], self.repeats, self.max_repeats, self.min_time_s):
                return times_s[self.warmup:], shapes[self.warmup:]
            feed(engine)
            if not engine.scheduler.has_work():
                break
            dt_s, shape = self._timed_step(engine)
            if shape is not None:
                times_s.append(dt_s)
                shapes.append(shape)
        raise RuntimeError(f"profiler: measured only {len(times_s)} steps at a grid point (a bug)")

    def _point(self, kind: str, grid: dict[str, int], times_s: list[float], shapes: list[StepShape]) -> StepPoint:
        """The median step; its shape is the median step's (shapes differ by a token of context a step)."""
        middle = int(np.argsort(times_s)[len(times_s) // 2])
        return StepPoint(kind, grid, shapes[middle], Timing.of(times_s))

    def _add_decoders(self, engine: Engine, batch: int, context: int, steps: int) -> None:
        """``batch`` sequences with ``context``-token prompts that decode for ``steps`` steps after the
        setup steps that prefill them (during which the first ones done already decode)."""
        setup_steps = -(-batch * context // SETUP_TOKENS) + 2
        for _ in range(batch):
            engine.add_request(self._request(context, setup_steps + steps))

    def decode(self, batch: int, context: int) -> StepPoint:
        """Decode steps of ``batch`` sequences at about ``context`` tokens; with quantized KV, those that
        complete no block (`packing` times those that do)."""
        engine = self._engine(chunk_size=SETUP_TOKENS, budget_tokens=SETUP_TOKENS)
        block = self.runtime.store.block_size
        self._add_decoders(engine, batch, context, (self.warmup + self.max_repeats + 2) * (1 + (self.bits < 16)))
        times_s, shapes = self._run(
            engine, lambda out: len(out.scheduled) == batch and out.num_batched_tokens == batch
            and (self.bits == 16 or not completed_blocks(out, block)))
        return self._point("decode", {"batch": batch, "context": context, "bits": self.bits}, times_s, shapes)

    def packing(self, batch: int, context: int) -> StepPoint:
        """Quantized KV: decode steps of ``batch`` sequences in which every sequence completes a block, which
        the step packs. Their prompts of ``context`` tokens are prefilled in one setup step, so the sequences
        stay in step: every block-th decode step is one of these (the steps between run no model)."""
        setup = max(SETUP_TOKENS, batch * context)
        engine = self._engine(chunk_size=setup, budget_tokens=setup)
        block = self.runtime.store.block_size
        self._add_decoders(engine, batch, context, block * (self.warmup + self.max_repeats + 2))
        times_s, shapes = self._run(engine, lambda out: len(out.scheduled) == batch
                                    and out.num_batched_tokens == batch and completed_blocks(out, block) == batch)
        return self._point("packing", {"batch": batch, "context": context, "bits": self.bits}, times_s, shapes)

    def prefill(self, chunk: int, cached: int, idle_s: float = 0.0, kind: str = "prefill") -> StepPoint:
        """A ``chunk``-token prefill chunk after ``cached`` tokens of the same prompt (a multiple of
        ``chunk``: the scheduler cuts prompts into whole chunks), ending the prompt, so it samples. With
        ``idle_s`` (and ``cached`` 0), each such step follows that long an idle engine (`idle_wake`).
        ``kind``: the point's (``scored``: the runtime's eviction policy scores by attention)."""
        engine = self._engine(chunk_size=chunk, budget_tokens=max(chunk, SETUP_TOKENS))

        def one_request_at_a_time(engine: Engine) -> None:
            if not engine.scheduler.has_work():
                if idle_s:
                    time.sleep(idle_s)
                engine.add_request(self._request(cached + chunk, 1))

        times_s, shapes = self._run(
            engine, lambda out: len(out.scheduled) == 1 and out.scheduled[0].start == cached
            and out.scheduled[0].num_new_tokens == chunk, one_request_at_a_time)
        return self._point(kind, {"chunk": chunk, "cached": cached, "bits": self.bits}, times_s, shapes)

    def after_idle(self, chunk: int, steps: int, idles_s: tuple[float, ...], rounds: int) -> np.ndarray:
        """[idles, rounds, steps] seconds: the steps of one request (a ``chunk``-token prompt, then decodes:
        ``steps`` in all), each time after that long an idle engine. A round takes every idle once, in
        order, so that the machine's drift over the rounds reaches every idle alike. Idle 0 is back to back."""
        engine = self._engine(chunk_size=chunk, budget_tokens=max(chunk, SETUP_TOKENS))
        self.recorder.measure = lambda out: True

        def one_request(idle_s: float) -> list[float]:
            if idle_s:
                time.sleep(idle_s)
            engine.add_request(self._request(chunk, steps))
            times_s = []
            while engine.scheduler.has_work():
                times_s.append(self._timed_step(engine)[0])
            if len(times_s) != steps:
                raise RuntimeError(f"profiler: a request after an idle engine ran {len(times_s)} steps, not {steps}")
            return times_s

        for _ in range(self.warmup):
            one_request(0.0)
        out = np.zeros((len(idles_s), rounds, steps))
        for r in range(rounds):
            for g, idle_s in enumerate(idles_s):
                out[g, r] = one_request(idle_s)
        return out

    def mixed(self, batch: int, context: int, chunk: int) -> StepPoint:
        """``batch`` decodes at ``context`` plus one whole ``chunk``-token prompt, in one step."""
        engine = self._engine(chunk_size=SETUP_TOKENS, budget_tokens=SETUP_TOKENS + batch + chunk)
        self._add_decoders(engine, batch, context, self.warmup + self.max_repeats + 2)

        def prompt_when_all_decode(engine: Engine) -> None:
            running = engine.scheduler.running
            if (not len(engine.scheduler.waiting) and len(running) == batch
                    and all(s.num_computed_tokens >= s.num_prompt_tokens for s in running)):
                engine.add_request(self._request(chunk, 1))

        times_s, shapes = self._run(
            engine, lambda out: len(out.scheduled) == batch + 1 and out.num_batched_tokens == batch + chunk,
            prompt_when_all_decode)
        return self._point("mixed", {"batch": batch, "context": context, "chunk": chunk, "bits": self.bits},
                           times_s, shapes)

    def compaction(self, batch: int, budget: int) -> StepPoint:
        """Decode steps of ``batch`` sequences that are all compacted after the step: their prompts of
        ``budget`` tokens (the runtime's eviction budget in tokens) grow by a block before each compaction
        back to the budget, so every block-th decode step is one of these."""
        setup = max(SETUP_TOKENS, batch * budget)  # every prompt in one setup step: the sequences stay in step
        engine = self._engine(chunk_size=setup, budget_tokens=setup)
        block = self.runtime.store.block_size
        self._add_decoders(engine, batch, budget, block * (self.warmup + self.max_repeats + 2))
        times_s, shapes = self._run(engine, lambda out: len(out.scheduled) == batch
                                    and out.num_batched_tokens == batch and len(out.compactions) == batch)
        return self._point("compaction", {"batch": batch, "budget": budget, "bits": self.bits}, times_s, shapes)

    def overhead(self, batch: int, repeats: int) -> GridPoint:
        """Engine steps of ``batch`` decoding sequences with no model: the runtime's scheduling and
        bookkeeping per step and per sequence."""
        engine = self._engine(chunk_size=SETUP_TOKENS, budget_tokens=SETUP_TOKENS)
        self._add_decoders(engine, batch, 16, self.warmup + repeats + 2)
        self.recorder.measure = lambda out: False
        while len(engine.scheduler.waiting) or any(s.num_computed_tokens < s.num_prompt_tokens
                                                  for s in engine.scheduler.running):
            engine.step()
        times_s = [self._timed_step(engine)[0] for _ in range(self.warmup + repeats)]
        return GridPoint("scheduler", {"batch": batch}, Timing.of(times_s[self.warmup:]))
