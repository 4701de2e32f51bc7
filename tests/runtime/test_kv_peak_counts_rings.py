"""The runtime's KV peak and capacity count the full-precision rings its quantized KV store allocated: they
take the device budget the blocks share (`kv_layout.kv_pool_blocks`), for `max_num_seqs` sequences up front.
The simulator counts the same bytes from the layout (`kv_layout.ring_bytes`); the two must agree."""
import pytest

from skistune.runtime.kv_layout import ring_bytes
from skistune.runtime.request import Request

from tiny import TINY, tiny_runtime

POOL = 64 * 1024  # tiny_runtime's offload.device_kv_bytes
QUANTIZED = {"bitwidth.key_bits": 4, "bitwidth.value_bits": 8, "bitwidth.full_precision_window": 8,
             "batching.max_num_seqs": 2}


@pytest.mark.parametrize("knobs", [{}, QUANTIZED])
def test_kv_peak_and_capacity_are_the_blocks_in_use_plus_the_rings_allocated(knobs):
    rt = tiny_runtime(**knobs)
    engine = rt.new_engine()
    rings = ring_bytes(rt.config, TINY, rt.model.dtype.itemsize)
    allocated = sum(side.ring.numel() * side.ring.element_size() for pair in engine.executor.store.layers
                    for side in pair if getattr(side, "ring", None) is not None)  # (the store's own rings)
    assert engine.ring_bytes == allocated == rings
    assert (rings > 0) == bool(knobs)  # 2 sequences x 12 tokens x 4 sides x 2 heads x 16 dims x 4 bytes
    assert rings == (2 * 12 * 4 * 2 * 16 * 4 if knobs else 0)
    engine.add_request(Request("a", list(range(3, 23)), 4))
    engine.run_until_done()
    m = engine.metrics(duration_s=1.0)
    assert engine.kv.peak_used_blocks > 0
    assert m.kv_peak_bytes == engine.kv.peak_used_blocks * engine.block_bytes + rings
    assert m.kv_capacity_bytes == engine.kv.pool.num_blocks * engine.block_bytes + rings
    assert 0 <= POOL - m.kv_capacity_bytes < engine.block_bytes  # the budget, but for what no block fills
