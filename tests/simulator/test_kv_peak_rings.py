"""KV peak and capacity count the full-precision rings of quantized KV: they are allocated up front for
`max_num_seqs` sequences out of the device budget the blocks share (`kv_layout.kv_pool_blocks`). Counting
blocks only, a 2-bit config with a 512-token window reported a KV peak 6.4x below the 16-bit default's while
it held 97 MB of rings, and the optimizer's `memory` objective ranked it so."""
from pathlib import Path
from types import SimpleNamespace

import pytest

from skistune.config import KVConfig
from skistune.objectives import NAMED
from skistune.profile import load_profile
from skistune.runtime.kv_layout import ring_bytes
from skistune.runtime.request import Request
from skistune.simulator import build_engine, target_from_profile

CPU_PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json"
WINDOW_2BIT = {"bitwidth": {"key_bits": 2, "value_bits": 2, "full_precision_window": 512},
               "batching": {"max_num_seqs": 4}}


@pytest.fixture(scope="module")
def target():
    return target_from_profile(load_profile(CPU_PROFILE, check_fingerprint=False))


def requests():
    return [Request(f"r{i}", [5 + i] * 60, 16, arrival_s=0.2 * i) for i in range(3)]


@pytest.mark.parametrize("config", [{}, WINDOW_2BIT, {"bitwidth": {"key_bits": 8, "value_bits": 4}}])
def test_kv_peak_and_capacity_are_the_blocks_plus_the_rings(target, config):
    config = KVConfig.from_dict(config)
    engine, _ = build_engine(config, target)
    m = engine.replay(requests())
    rings = ring_bytes(config, target.spec, target.kv_itemsize)
    assert engine.ring_bytes == rings and (rings > 0) == (config != KVConfig())
    assert m.kv_peak_bytes == engine.kv.peak_used_blocks * engine.block_bytes + rings
    assert m.kv_capacity_bytes == engine.kv.pool.num_blocks * engine.block_bytes + rings
    assert engine.kv.peak_used_blocks > 0 and m.kv_peak_bytes <= m.kv_capacity_bytes


def test_the_memory_objective_ranks_a_window_of_rings_as_the_memory_it_takes(target):
    memory = NAMED["memory"]
    scored = {}
    for name, config in (("default", {}), ("2-bit, 512-token window", WINDOW_2BIT)):
        engine, _ = build_engine(KVConfig.from_dict(config), target)
        scored[name] = memory.value(SimpleNamespace(metrics=engine.replay(requests())))
    # 4 sequences' rings of 528 tokens at 32 bits: 97 MB against the default's few blocks
    assert scored["2-bit, 512-token window"] > 97e6 > 5 * scored["default"]
