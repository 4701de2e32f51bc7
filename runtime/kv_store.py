"""Where KV tensors live: one zero-initialised tensor per device pool, laid out
``[n_layers, 2 (key, value), num_blocks + 1, block_size, n_kv_heads, head_dim]``. Block 0 is the null
block that pads block tables (see `block_manager`); it stays zero so that padded reads are harmless."""
from __future__ import annotations

import torch

from .kv_layout import kv_block_bytes
from .presets import ModelSpec


class PagedKVStore:
    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.block_bytes = kv_block_bytes(spec, block_size, dtype.itemsize)
        self.kv = torch.zeros(spec.n_layers, 2, num_blocks + 1, block_size, spec.n_kv_heads, spec.head_dim,
                              dtype=dtype, device=device)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[i, 0], self.kv[i, 1]
