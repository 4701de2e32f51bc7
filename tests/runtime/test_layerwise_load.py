"""Layer-wise loading (``prefetch.unit: layers``): a step's host <-> device copies run layer by layer on
the prefetch worker while the forward pass computes. The split of a step's transfers, the pipeline's time,
and on the real runtime: the same tokens as with every copy before the step, copies really made per layer,
the loader never more than ``depth`` layers ahead, and a failing copy that surfaces instead of hanging."""
import threading
import time

import pytest
import torch

from skistune.runtime.engine import layerwise_depth, prefetch_blocks
from skistune.runtime.model_runner import LayerLoader
from skistune.runtime.request import Request
from skistune.runtime.scheduler import SchedulerOutput
from skistune.runtime.tiers import DEVICE, DISK, HOST, Transfer, layered_split, layered_step_s

from tiny import tiny_runtime

BLOCK_BYTES = 2048  # the tiny model's block: 2 layers x (K, V) x 4 tokens x 2 heads x 16 dims x 4 bytes


def split(transfers, layerwise=True, compactions=()):
    return layered_split(SchedulerOutput(transfers=transfers, compactions=list(compactions)), layerwise)


def test_disk_transfers_and_all_before_them_run_whole_the_rest_by_layer():
    a, b = Transfer(DEVICE, HOST, [1], [0]), Transfer(DISK, DEVICE, [3], [1])
    c, d = Transfer(HOST, DEVICE, [2], [5]), Transfer(DEVICE, HOST, [6], [4])
    assert split([a, b, c, d]) == ([a, b], [c, d])  # `a` must not wait for layers: `b` reuses nothing
    assert split([a, c]) == ([], [a, c])
    assert split([c, b]) == ([c, b], [])
    assert split([]) == ([], [])
    assert split([a, c], layerwise=False) == ([a, c], []) == split([a, c], compactions=[object()])


@pytest.mark.parametrize("compute, copy, layers, expected", [
    (1.0, 0.0, 30, 1.0),  # nothing to copy
    (1.0, 0.6, 30, 1.0 + 0.6 / 30),  # copies hide behind the compute, but the first layer's
    (0.3, 0.9, 30, 0.9 + 0.3 / 30),  # the compute hides behind the copies, but the last layer's
    (1.0, 1.0, 1, 2.0),  # one layer: nothing overlaps
])
def test_pipelined_step_time(compute, copy, layers, expected):
    assert layered_step_s(compute, copy, layers) == pytest.approx(expected)
    assert max(compute, copy) <= layered_step_s(compute, copy, layers) <= compute + copy


def test_unit_decides_between_block_prefetch_and_layer_loading():
    from skistune.config import KVConfig

    on = KVConfig().with_knobs({"prefetch.enabled": True, "prefetch.depth": 3})
    assert (prefetch_blocks(on), layerwise_depth(on)) == (3, 0)
    layers = on.with_knobs({"prefetch.unit": "layers"})
    assert (prefetch_blocks(layers), layerwise_depth(layers)) == (0, 3)
    assert layerwise_depth(layers.with_knobs({"prefetch.enabled": False})) == 0


def test_the_loader_stays_at_most_depth_layers_ahead_of_the_compute():
    loader = LayerLoader(n_layers=6, depth=2)
    copied = []

    class Store:
        def run(self, transfers, layer):
            copied.append(layer)

    worker = threading.Thread(target=loader.load, args=(Store(), [Transfer(HOST, DEVICE, [0], [1])]))
    worker.start()
    loader.ready[1].wait(5)
    worker.join(0.2)
    assert copied == [0, 1] and worker.is_alive()  # layer 2 waits for the compute to reach layer 0
    for i in range(6):
        loader.before_layer(i)
        assert len(copied) <= i + 1 + 2
    worker.join(5)
    assert copied == list(range(6)) and not worker.is_alive()


def test_the_loader_times_its_copies_not_its_waits_for_the_compute():
    loader = LayerLoader(n_layers=4, depth=1)

    class Store:
        def run(self, transfers, layer):
            time.sleep(0.01)

    result = []
    worker = threading.Thread(target=lambda: result.append(loader.load(Store(), [Transfer(HOST, DEVICE, [0], [1])])))
    worker.start()
    for i in range(4):  # the compute takes 0.1 s a layer: the loader, a layer ahead, waits most of it
        loader.before_layer(i)
        time.sleep(0.1)
    worker.join(5)
    assert 0.04 <= result[0] < 0.2  # four copies of 10 ms, not the 0.3 s it spent waiting for layers 0-2


def serve(rt, prompts, max_new_tokens=6):
    engine = rt.new_engine()
    records = [engine.add_request(Request(f"r{i}", p, max_new_tokens)) for i, p in enumerate(prompts)]
    engine.run_until_done()
    return [r.output_token_ids for r in records], engine


def shared_prefix_prompts():
    """Four prefixes of 12 tokens cycled over 8 requests: the small device pool demotes them to the host
    and later requests promote them back."""
    g = torch.Generator().manual_seed(4)
    bases = [torch.randint(3, 100, (12,), generator=g).tolist() for _ in range(4)]
    return [bases[i % 4] + [3 + i, 4 + i] for i in range(8)]


def test_layer_by_layer_gives_the_same_tokens_and_copies_per_layer(monkeypatch):
    ps = shared_prefix_prompts()
    knobs = {"offload.device_kv_bytes": 12 * BLOCK_BYTES, "offload.host_kv_bytes": 32 * BLOCK_BYTES,
             "batching.max_num_seqs": 1}
    reference, _ = serve(tiny_runtime(**knobs), ps)
    layers_seen = []
    from skistune.runtime.kv_store import TierStore

    original = TierStore.run

    def spy(self, transfers, layer=None):
        if transfers:
            layers_seen.append(layer)
        return original(self, transfers, layer)

    monkeypatch.setattr(TierStore, "run", spy)
    out, engine = serve(tiny_runtime(**knobs, **{"prefetch.enabled": True, "prefetch.unit": "layers",
                                                 "prefetch.depth": 1}), ps)
    m = engine.metrics(1.0)
    assert out == reference and m.tiers.promotions > 0
    assert set(layers_seen) == {0, 1}  # every copy ran per layer (no disk tier: nothing runs whole)
    assert layers_seen.count(0) == layers_seen.count(1)
    assert m.tiers.transfer_s > 0 and 0 <= m.tiers.stall_s


def test_a_failing_layer_copy_surfaces_after_the_step(monkeypatch):
    from skistune.runtime.kv_store import TierStore

    ps = shared_prefix_prompts()
    knobs = {"offload.device_kv_bytes": 12 * BLOCK_BYTES, "offload.host_kv_bytes": 32 * BLOCK_BYTES,
             "batching.max_num_seqs": 1, "prefetch.enabled": True, "prefetch.unit": "layers"}
    original = TierStore.run

    def broken(self, transfers, layer=None):
        if layer == 1 and any(t.dst_tier == DEVICE for t in transfers):
            raise RuntimeError("copy failed")
        return original(self, transfers, layer)

    monkeypatch.setattr(TierStore, "run", broken)
    with pytest.raises(RuntimeError, match="copy failed"):
        serve(tiny_runtime(**knobs), ps)
