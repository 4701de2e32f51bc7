"""Executes a scheduled step with the real model: flattens the batch, builds the attention metadata
once, runs the forward pass and samples greedily."""
from __future__ import annotations

import torch

from ..kernels.attention import build_attention_metadata
from .block_manager import KVCacheManager
from .kv_store import PagedKVStore
from .model import LlamaModel
from .scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model: LlamaModel, store: PagedKVStore) -> None:
        self.model = model
        self.store = store

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
        meta = build_attention_metadata(tables, query_lens, context_lens, self.store.block_size)
        device = self.model.device
        logits = self.model.forward(torch.tensor(token_ids, device=device), torch.tensor(positions, device=device),
                                    self.store, meta, torch.tensor(logit_rows, device=device))
        return dict(zip(sampling_ids, logits.argmax(-1).tolist()))
