"""KV memory arithmetic shared by the runtime and the simulator (torch-free)."""
from __future__ import annotations

from ..config import KVConfig
from .presets import ModelSpec

# With no explicit device_kv_bytes, the device pool is device_memory_fraction of the free device
# memory. A CPU has no device memory of its own: like vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE,
# default 4 GiB), the fraction is then taken of a fixed 4 GiB of host memory.
CPU_KV_SPACE_BYTES = 4 << 30


def kv_block_bytes(spec: ModelSpec, block_size: int, itemsize: int) -> int:
    """Bytes of one block over all layers, keys and values, at ``itemsize`` bytes per element."""
    return spec.n_layers * 2 * block_size * spec.n_kv_heads * spec.head_dim * itemsize


def kv_pool_bytes(config: KVConfig, device_free_bytes: int) -> int:
    if config.offload.device_kv_bytes is not None:
        return config.offload.device_kv_bytes
    return int(config.offload.device_memory_fraction * device_free_bytes)


def kv_pool_blocks(config: KVConfig, spec: ModelSpec, itemsize: int, device_free_bytes: int) -> tuple[int, int]:
    """(number of blocks, bytes per block) of the device pool."""
    block_bytes = kv_block_bytes(spec, config.prefix_reuse.block_size, itemsize)
    num_blocks = kv_pool_bytes(config, device_free_bytes) // block_bytes
    if num_blocks < 1:
        raise ValueError(f"offload.device_kv_bytes: smaller than one KV block ({block_bytes} bytes)")
    return num_blocks, block_bytes
