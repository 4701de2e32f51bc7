"""The tiny random Llama and the grid the profile tests measure it on (a few seconds)."""
from __future__ import annotations

from pathlib import Path

from skistune.config import KVConfig
from skistune.profile.measure import Grid
from skistune.runtime.llm import Runtime
from skistune.runtime.presets import ModelSpec
from skistune.runtime.weights import random_weights

SHIPPED = Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json"
TINY = ModelSpec("tiny", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden=128,
                 vocab_size=101, max_context=512, tie_embeddings=True)
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # layers x (key, value) x KV heads x head_dim x float32
TINY_GRID = Grid(
    decode_batches=(1, 2, 4, 8), decode_contexts=(16, 64, 128), max_decode_kv_tokens=512,
    prefill=((16, 0), (32, 0), (16, 32), (32, 64)), mixed=((2, 32, 16), (4, 64, 32)),
    warmup=1, repeats=3, max_repeats=6, min_time_s=0.01, overhead_batches=(1, 8, 32), overhead_repeats=5,
    kernel_repeats=3, copy_blocks=(1, 4), disk_bytes=(4096, 65536), transfer_repeats=2, idle_s=0.1,
    quant_decode=((2, 64), (4, 128)), quant_prefill=((32, 0), (16, 32)), step_bits=(8, 4), kernel_bits=(8, 4, 2),
    quantize_blocks=(1, 4), compaction=((1, 32), (4, 64)), scored_prefill=((8, 0), (16, 32)),
    projection_rows=(1, 2, 3, 4, 8, 16, 64),
    projection_rounds=1, quant_packing=((1, 32), (4, 16)), idle_wake_rounds=2)


def tiny_runtime() -> Runtime:
    pool_bytes = TINY_GRID.pool_tokens(16) * TINY_KV_BYTES_PER_TOKEN
    return Runtime(TINY, random_weights(TINY, seed=0), KVConfig().with_knobs({"offload.device_kv_bytes": pool_bytes}))
