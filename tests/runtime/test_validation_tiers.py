"""Tier configs that cannot work as written: swap without host room is counted as a fallback, and tiers
smaller than a block or a swap without a host tier are warned about instead of silently off."""
import warnings
from dataclasses import dataclass

import pytest

from skistune.config import KVConfig
from skistune.runtime.block_manager import KVCacheManager, TokenList
from skistune.runtime.engine import Engine, VirtualClock
from skistune.runtime.request import Request
from skistune.runtime.tiers import TierManager

BLOCK_BYTES = 100


class CountingExecutor:
    def __init__(self, clock):
        self.clock = clock

    def execute(self, out, kv):
        self.clock.advance(0.01)
        return {s.seq.seq_id: (s.seq.token_ids[-1] + 1) % 1000 for s in out.scheduled if s.samples}


def make_engine(num_blocks=6, **knobs):
    cfg = KVConfig().with_knobs({"prefix_reuse.block_size": 4, "prefix_reuse.enabled": False, **knobs})
    clock = VirtualClock()
    return Engine(cfg, num_blocks=num_blocks, block_bytes=BLOCK_BYTES, max_context=4096,
                  executor=CountingExecutor(clock), clock=clock)


def serve_under_pressure(eng):
    """Two sequences of 8 + 10 tokens in 6 blocks of 4: the newer one is preempted at least once."""
    eng.add_request(Request("a", list(range(8)), 10))
    eng.add_request(Request("b", list(range(100, 108)), 10))
    eng.run_until_done()
    return eng.metrics(1.0)


@dataclass
class Seq(TokenList):
    seq_id: str
    token_ids: list[int]
    num_computed_tokens: int = 0


def computed_seq(kv):
    """A sequence of 5 computed tokens in device blocks 1, 2, 3 (blocks of 2 tokens)."""
    s = Seq("s", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(s, 5) == [1, 2, 3]
    s.num_computed_tokens = 5
    return s


def test_swap_with_a_disk_tier_but_no_host_tier_counts_the_fallback():
    kv = KVCacheManager(4, 2, True, TierManager(0, 4, swap=True))
    s = computed_seq(kv)
    assert not kv.swap_out(s) and kv.tiers.stats.swap_fallbacks == 1 and kv.take_transfers() == []
    assert kv.block_table("s") == [1, 2, 3]  # nothing moved: the caller recomputes


def test_recompute_preemption_is_no_swap_fallback():
    kv = KVCacheManager(4, 2, True, TierManager(0, 4, swap=False))
    s = computed_seq(kv)
    assert not kv.swap_out(s) and kv.tiers.stats.swap_fallbacks == 0


def test_every_swap_that_recomputes_is_counted_in_a_disk_only_engine():
    with pytest.warns(UserWarning, match="batching.preemption: swap needs a host tier"):
        eng = make_engine(**{"batching.preemption": "swap", "offload.disk_kv_bytes": 50 * BLOCK_BYTES})
    m = serve_under_pressure(eng)
    assert m.preemptions >= 1 and m.tiers.swap_fallbacks == m.preemptions and m.tiers.swapped_out == 0
    assert m.num_finished == 2


@pytest.mark.parametrize("knob, other", [("offload.host_kv_bytes", "offload.disk_kv_bytes"),
                                         ("offload.disk_kv_bytes", "offload.host_kv_bytes")])
def test_a_tier_below_one_block_warns_that_it_is_off(knob, other):
    with pytest.warns(UserWarning) as caught:
        eng = make_engine(**{knob: 99})
    assert [str(w.message) for w in caught] == [
        f"{knob}: 99 bytes hold less than one KV block of {BLOCK_BYTES} bytes: the tier is off"]
    assert eng.kv.tiers is None
    with pytest.warns(UserWarning, match=f"{knob}: 99 bytes hold less than one KV block"):
        eng = make_engine(**{knob: 99, other: 8 * BLOCK_BYTES})  # the other tier stays on
    assert eng.kv.tiers is not None and [p.capacity for p in eng.kv.tiers.levels] == [8]


def test_swap_without_any_tier_warns_once_and_recomputes():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own filter: a repeated warning shows once
        for _ in range(3):
            eng = make_engine(**{"batching.preemption": "swap"})
    assert [str(w.message) for w in caught] == [
        "batching.preemption: swap needs a host tier (offload.host_kv_bytes of one KV block or more): "
        "without one every preemption recomputes"]
    m = serve_under_pressure(eng)
    assert m.preemptions >= 1 and m.num_finished == 2


def test_configs_that_work_as_written_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_engine()
        make_engine(**{"offload.host_kv_bytes": BLOCK_BYTES, "batching.preemption": "swap"})
        make_engine(**{"offload.disk_kv_bytes": BLOCK_BYTES})


def test_prefetch_without_any_tier_warns_that_it_does_nothing():
    with pytest.warns(UserWarning) as caught:
        eng = make_engine(**{"prefetch.enabled": True})
    assert [str(w.message) for w in caught] == [
        "prefetch.enabled: no host or disk tier (offload.host_kv_bytes, offload.disk_kv_bytes) holds KV to bring "
        "back: prefetch does nothing"]
    assert eng.kv.tiers is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # with a tier: nothing to say
        make_engine(**{"prefetch.enabled": True, "offload.host_kv_bytes": 8 * BLOCK_BYTES})
