"""The layout's count of part tensors (`kv_layout.part_tensors`), which the simulator prices a tier copy by (one
call each), is the runtime's `TierStore`'s; and the block conversions the profiler times (`block_to_bytes`,
`bytes_to_block`) are the bytes the runtime's disk tier writes and reads."""
import pytest
import torch

from skistune.config import KVConfig
from skistune.profile.transfers import block_to_bytes, bytes_to_block
from skistune.runtime.kv_layout import part_tensors, quantized_sides
from skistune.runtime.kv_store import PagedKVStore, TierStore
from skistune.runtime.tiers import Transfer

from tiny import TINY

CONFIGS = [{}, {"bitwidth.key_bits": 4, "bitwidth.value_bits": 4},
           {"bitwidth.layer_bits": ((16, 2), (8, 16)), "batching.max_num_seqs": 2}]


def store(knobs):
    config = KVConfig().with_knobs({"batching.max_num_seqs": 2, "prefix_reuse.block_size": 4, **knobs})
    s = PagedKVStore(TINY, 8, 4, torch.float32, "cpu", config)
    s.fill_random_()
    return config, s


@pytest.mark.parametrize("knobs", CONFIGS)
def test_the_layout_counts_the_tensors_the_tier_store_copies(knobs):
    config, s = store(knobs)
    tiers = TierStore(s, 4, 4)
    assert len(tiers.parts) == part_tensors(config, TINY)
    assert sum(len(r) for r in tiers.layer_parts) == part_tensors(config, TINY)
    rings = [side.ring for pair in s.layers for side in pair if side.ring is not None]
    assert len(rings) == quantized_sides(config, TINY)  # a swap copies each ring's row


@pytest.mark.parametrize("knobs", CONFIGS)
def test_the_profiled_conversions_are_the_disk_tiers_bytes(knobs):
    config, s = store(knobs)
    tiers = TierStore(s, 4, 4)
    tiers.run([Transfer("device", "disk", [3], [1])])
    written = tiers.disk.read(1)
    assert written == block_to_bytes(tiers.parts, 3)
    bytes_to_block(written, tiers.parts, 5, tiers.part_bytes)
    assert all(torch.equal(t[3], t[5]) for t in tiers.parts)
