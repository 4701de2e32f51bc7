"""SmolLM2's tokenizer, rebuilt from the GGUF metadata with the `tokenizers` library (no tokenizer.json needed)."""
from __future__ import annotations

import os
from collections.abc import Iterable

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from .weights import gguf_value, open_gguf

_CONTROL = 3  # llama.cpp token type of special tokens such as <|im_start|>
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class Tokenizer:
    """Byte-level BPE tokenizer of a `tokenizer.ggml.model == "gpt2"` GGUF (SmolLM2's)."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int, eos_token_id: int):
        self._backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], *, reader: gguf.GGUFReader | None = None) -> Tokenizer:
        """The tokenizer in the GGUF at ``path``; ``reader``: `open_gguf(path)` if the caller has it already."""
        reader = reader if reader is not None else open_gguf(path)
        kind, pre = gguf_value(reader, "tokenizer.ggml.model"), gguf_value(reader, "tokenizer.ggml.pre")
        if kind != "gpt2" or pre != "smollm":
            raise ValueError(f"GGUF tokenizer {kind!r}/{pre!r} is not supported: only gpt2/smollm (SmolLM2) is")
        tokens = gguf_value(reader, "tokenizer.ggml.tokens")
        merges = [tuple(merge.split(" ")) for merge in gguf_value(reader, "tokenizer.ggml.merges")]
        backend = tokenizers.Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, merges))
        # SmolLM2's tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) split every digit off before
        # the GPT-2 regex, so "  8" becomes "  " + "8", not " " + " 8".
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
        backend.decoder = decoders.ByteLevel()
        # Control tokens must stay whole in text (a chat prompt spells them out), not be split into bytes.
        token_types = gguf_value(reader, "tokenizer.ggml.token_type")
        backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                    for token, token_type in zip(tokens, token_types) if token_type == _CONTROL])
        return cls(backend, bos_token_id=gguf_value(reader, "tokenizer.ggml.bos_token_id"),
                   eos_token_id=gguf_value(reader, "tokenizer.ggml.eos_token_id"))

    @property
    def bos_token_id(self) -> int:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, special tokens included as single ids; no BOS (the GGUF's add_bos_token is off)."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, special tokens spelled out, so that decode(encode(s)) == s."""
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """SmolLM2's ChatML prompt, ending with the assistant's generation prompt (the GGUF's chat_template)."""
        turns = list(messages)
        if turns and turns[0]["role"] != "system":
            turns.insert(0, {"role": "system", "content": DEFAULT_SYSTEM_PROMPT})
        body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in turns)
        return body + "<|im_start|>assistant\n"
