"""A tiny random Llama and a plain dense forward pass to check the paged runtime against."""
import torch
import torch.nn.functional as F

from skistune.config import KVConfig
from skistune.runtime.llm import Runtime
from skistune.runtime.model import apply_rope, rms_norm, rope_tables
from skistune.runtime.presets import ModelSpec
from skistune.runtime.weights import random_weights

TINY = ModelSpec("tiny", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden=128,
                 vocab_size=101, rope_theta=10000.0, max_context=512, tie_embeddings=True)


def tiny_weights(seed=0):
    # std 0.02 weights give near-uniform logits; scale up so that errors would show
    return {k: (v if k.endswith("norm") else v * 10) for k, v in random_weights(TINY, seed=seed).items()}


def tiny_runtime(**knobs):
    cfg = KVConfig().with_knobs({"offload.device_kv_bytes": 64 * 1024, "prefix_reuse.block_size": 4, **knobs})
    return Runtime(TINY, tiny_weights(), cfg)


def dense_logits(spec, weights, token_ids):
    """Logits [S, vocab] of a plain causal forward over the whole sequence (no cache)."""
    s = spec
    x = F.embedding(torch.tensor(token_ids), weights["embed_tokens"])
    cos, sin = rope_tables(s, x.dtype, x.device)
    pos = torch.arange(len(token_ids))
    cos, sin = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    for i in range(s.n_layers):
        h = rms_norm(x, weights[f"layers.{i}.input_norm"], s.rms_eps)
        q = apply_rope((h @ weights[f"layers.{i}.q_proj"].T).view(-1, s.n_heads, s.head_dim), cos, sin)
        k = apply_rope((h @ weights[f"layers.{i}.k_proj"].T).view(-1, s.n_kv_heads, s.head_dim), cos, sin)
        v = (h @ weights[f"layers.{i}.v_proj"].T).view(-1, s.n_kv_heads, s.head_dim)
        rep = s.n_heads // s.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / s.head_dim ** 0.5
        causal = torch.ones(len(token_ids), len(token_ids), dtype=torch.bool).tril()
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(len(token_ids), -1)
        x = x + o @ weights[f"layers.{i}.o_proj"].T
        h = rms_norm(x, weights[f"layers.{i}.post_attn_norm"], s.rms_eps)
        gate, up = h @ weights[f"layers.{i}.gate_proj"].T, h @ weights[f"layers.{i}.up_proj"].T
        x = x + (F.silu(gate) * up) @ weights[f"layers.{i}.down_proj"].T
    return rms_norm(x, weights["norm"], s.rms_eps) @ weights.get("lm_head", weights["embed_tokens"]).T
