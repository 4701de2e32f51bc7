"""Executes a scheduled step with the real model: flattens the batch, builds the attention metadata
once, runs the forward pass and samples greedily."""
from __future__ import annotations

import torch

from ..kernels.attention import RingInfo, build_attention_metadata
from .block_manager import KVCacheManager
from .kv_store import PagedKVStore
from .model import LlamaModel
from .scheduler import SchedulerOutput


class RingSlots:
    """Which full-precision ring slot each running sequence of a quantized store uses, and the first
    position it wrote there. A slot is released once the sequence no longer holds KV blocks (finished or
    preempted): the block manager is the one record of what is running."""

    def __init__(self, num_slots: int) -> None:
        self.free = list(range(num_slots - 1, -1, -1))
        self.assigned: dict[str, tuple[int, int]] = {}  # seq id -> (slot, ring start)

    def release_finished(self, kv: KVCacheManager) -> None:
        for seq_id in [s for s in self.assigned if not kv.block_table(s)]:
            self.free.append(self.assigned.pop(seq_id)[0])

    def get(self, seq_id: str, start: int, block_size: int) -> tuple[int, int]:
        if seq_id not in self.assigned:
            if start % block_size:  # the sequence starts after whole prefix-cache blocks, or at 0
                raise RuntimeError(f"sequence {seq_id}: first computed position {start} is not block-aligned")
            self.assigned[seq_id] = (self.free.pop(), start)
        return self.assigned[seq_id]


class ModelRunner:
    def __init__(self, model: LlamaModel, store: PagedKVStore) -> None:
        self.model = model
        self.store = store
        self.ring_slots = RingSlots(store.slots) if store.quantized else None

    def _ring_info(self, out: SchedulerOutput, kv: KVCacheManager) -> RingInfo | None:
        if self.ring_slots is None:
            return None
        self.ring_slots.release_finished(kv)
        pairs = [self.ring_slots.get(s.seq.seq_id, s.start, self.store.block_size) for s in out.scheduled]
        return RingInfo([p[0] for p in pairs], [p[1] for p in pairs], self.store.ring_tokens, self.store.window)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> dict[str, int]:
        token_ids, positions, tables, query_lens, context_lens = [], [], [], [], []
        logit_rows, sampling_ids = [], []
        for s in out.scheduled:
            end = s.start + s.num_new_tokens
            token_ids.extend(s.seq.token_ids[s.start:end])
            positions.extend(range(s.start, end))
            tables.append(kv.block_table(s.seq.seq_id))
            query_lens.append(s.num_new_tokens)
            context_lens.append(end)
            if s.samples:
                logit_rows.append(len(token_ids) - 1)
                sampling_ids.append(s.seq.seq_id)
        if not logit_rows:  # a step of prefill chunks that all end mid-prompt: KV only
            logit_rows = [len(token_ids) - 1]
        device = self.model.device
        meta = build_attention_metadata(tables, query_lens, context_lens, self.store.block_size,
                                        self._ring_info(out, kv), device)
        logits = self.model.forward(torch.tensor(token_ids, device=device), torch.tensor(positions, device=device),
                                    self.store, meta, torch.tensor(logit_rows, device=device))
        return dict(zip(sampling_ids, logits.argmax(-1).tolist()))
