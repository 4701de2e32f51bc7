"""End to end with the real SmolLM2-135M-Instruct weights (loads in a few seconds)."""
import os
import sysconfig

import pytest
import torch

from skistune.config import KVConfig
from skistune.kernels.attention import build_attention_metadata
from skistune.runtime.llm import Runtime
from skistune.runtime.request import Request
from skistune.runtime.weights import find_smollm2_gguf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rt():
    return Runtime.from_preset("smollm2-135m", KVConfig().with_knobs({"offload.device_kv_bytes": 64 << 20}))


def all_logits(rt, ids):
    n = len(ids)
    meta = build_attention_metadata([list(range(1, -(-n // 16) + 1))], [n], [n], 16)
    with torch.inference_mode():
        return rt.model.forward(torch.tensor(ids), torch.arange(n), rt.store, meta, torch.arange(n))


def english_text():
    """Plain English every CPython install ships: the history section of the licence file, else the
    argparse module documentation."""
    path = os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")
    if os.path.exists(path):
        return open(path, encoding="utf-8").read().split("B. TERMS AND CONDITIONS")[0]
    import argparse
    return argparse.__doc__


def test_greedy_completion_is_sensible(rt):
    assert rt.generate(["The capital of France is"], max_new_tokens=4)[0].strip().startswith("Paris")


def test_perplexity_on_plain_english_is_about_20(rt):
    ids = rt.tokenizer.encode(english_text())[:512]
    logits = all_logits(rt, ids)
    ppl = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).exp().item()
    assert 5 < ppl < 40, ppl


def test_logits_equal_transformers_on_the_same_gguf(rt):
    from transformers import AutoModelForCausalLM
    path = find_smollm2_gguf()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    ids = rt.tokenizer.encode("Paged attention keeps the KV cache in fixed-size blocks, like pages.")
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(all_logits(rt, ids), ref, atol=2e-3, rtol=1e-4)


def test_greedy_tokens_survive_preemption(rt):
    prompts = ["Once upon a time", "The history of Rome", "def fibonacci(n):", "Photosynthesis is"]
    reqs = [Request(f"r{i}", rt.tokenizer.encode(p), 24) for i, p in enumerate(prompts)]
    roomy = rt.new_engine()
    roomy_out = [roomy.add_request(r) for r in reqs]
    roomy.run_until_done()
    # 6 blocks of 16 tokens for 4 sequences of up to 30 tokens: preemption is forced
    tight = rt.with_config(rt.config.with_knobs({"offload.device_kv_bytes": 6 * rt.store.block_bytes}))
    eng = tight.new_engine()
    tight_out = [eng.add_request(r) for r in reqs]
    eng.run_until_done()
    assert eng.scheduler.num_preemptions > 0
    assert [r.output_token_ids for r in tight_out] == [r.output_token_ids for r in roomy_out]
