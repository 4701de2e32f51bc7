"""Llama-family decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP) that reads and writes KV only
through the paged KV store. Tokens of a step are flattened over the batch: ``[T, hidden]``.

Weights use the Hugging Face layout and RoPE convention (rotate-half); see `weights.py`.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..kernels.attention import AttentionMetadata, paged_attention, write_kv
from ..kernels.linear import ProjectionRule, linear, machine_rule
from .host_allocator import keep_freed_host_memory
from .kv_store import PagedKVStore
from .presets import ModelSpec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_tables(spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[max_context, head_dim]`` for the rotate-half convention."""
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float64) / spec.head_dim))
    freqs = torch.outer(torch.arange(spec.max_context, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[T, heads, D]``; cos/sin ``[T, 1, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class LlamaModel:
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], rule: ProjectionRule | None = None) -> None:
        """``rule``: the projections' orientations (`kernels.rows`); by default this machine's, measured once
        on these weights and cached (`kernels.linear.machine_rule`)."""
        self.spec = spec
        # q/k/v and gate/up are kept only fused (below), so the separate copies can be freed by the caller
        fused = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
        self.w = {k: v for k, v in weights.items() if not k.endswith(fused)}
        ref = weights["embed_tokens"]
        self.dtype, self.device = ref.dtype, ref.device
        if self.device.type == "cpu":
            keep_freed_host_memory()  # a step's large temporaries are reused, not faulted in afresh
        self.lm_head = weights.get("lm_head", ref)  # tied embeddings when the file has no output matrix
        # q, k and v projections fused into one matmul per layer (fewer, larger GEMMs on small batches)
        self.qkv = [torch.cat([weights[f"layers.{i}.{n}_proj"] for n in "qkv"]) for i in range(spec.n_layers)]
        self.gate_up = [torch.cat([weights[f"layers.{i}.gate_proj"], weights[f"layers.{i}.up_proj"]])
                        for i in range(spec.n_layers)]
        self.cos, self.sin = rope_tables(spec, self.dtype, self.device)
        self.scale = spec.head_dim ** -0.5
        self.rule = rule or machine_rule(self.streamed_weights(), spec.name)

    def streamed_weights(self) -> list[torch.Tensor]:
        """The projection weights in the order a step reads them, the LM head last."""
        return [w for i in range(self.spec.n_layers) for w in (self.qkv[i], self.w[f"layers.{i}.o_proj"],
                                                                self.gate_up[i], self.w[f"layers.{i}.down_proj"])] \
            + [self.lm_head]

    def _attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   store: PagedKVStore, meta: AttentionMetadata) -> torch.Tensor:
        s = self.spec
        q_dim, kv_dim = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
        q, k, v = linear(x, self.qkv[i], self.rule).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = apply_rope(q.view(-1, s.n_heads, s.head_dim), cos, sin)
        k = apply_rope(k.view(-1, s.n_kv_heads, s.head_dim), cos, sin)
        key, value = store.layer(i)
        write_kv(key, value, k, v.view(-1, s.n_kv_heads, s.head_dim), meta, store.value_group)
        o = paged_attention(q, key, value, meta, self.scale)
        return linear(o.reshape(-1, q_dim), self.w[f"layers.{i}.o_proj"], self.rule)

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up[i], self.rule).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.w[f"layers.{i}.down_proj"], self.rule)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, store: PagedKVStore,
                meta: AttentionMetadata, logit_rows: torch.Tensor,
                before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits ``[len(logit_rows), vocab]`` of the chosen rows of a step of ``[T]`` tokens.
        ``before_layer(i)`` runs before layer i touches its KV (layer-wise loading waits there)."""
        eps = self.spec.rms_eps
        h = F.embedding(input_ids, self.w["embed_tokens"])  # [T, hidden]
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        for i in range(self.spec.n_layers):
            if before_layer is not None:
                before_layer(i)
            h = h + self._attention(i, rms_norm(h, self.w[f"layers.{i}.input_norm"], eps), cos, sin, store, meta)
            h = h + self._mlp(i, rms_norm(h, self.w[f"layers.{i}.post_attn_norm"], eps))
        h = rms_norm(h[logit_rows], self.w["norm"], eps)
        return linear(h, self.lm_head, self.rule)
