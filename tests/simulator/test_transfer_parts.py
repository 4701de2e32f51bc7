"""Tier transfers priced as the runtime's `TierStore` runs them: a host <-> device copy makes one call per part
tensor of the layout (per layer, keys and values: 16-bit data, or codes, scales and zero points), each paying
the link's per-call latency; a disk transfer goes block by block, converting each block's parts to or from the
bytes of one write or read. A tester measured 16-bit transfers at 2x and 4-bit ones at 15x their prediction
when a transfer was priced as one copy of its bytes."""
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from skistune.config import KVConfig
from skistune.profile import load_profile
from skistune.profile.cost import FEATURES, StepCostModel
from skistune.profile.fit import FitQuality, fit_linear, fit_transfer
from skistune.profile.profile import HardwareProfile, Measured
from skistune.profile.records import BLOCK_IO_FEATURES, GridPoint, Timing, block_io_features
from skistune.runtime.kv_layout import kv_block_bytes, part_tensors, quantized_sides
from skistune.runtime.presets import PRESETS
from skistune.runtime.tiers import Transfer
from skistune.simulator import SimTarget, build_engine, target_from_profile

SPEC = PRESETS["smollm2-135m"]
CPU_PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "cpu-smollm2-135m.json"
QUALITY = FitQuality(r2=0.99, median_rel_error=0.01, max_rel_error=0.02, points=8)
INT4 = {"bitwidth.key_bits": 4, "bitwidth.value_bits": 4}


@dataclass(frozen=True)
class Fit:  # a `TransferFit`
    latency_s: float
    bytes_per_s: float
    quality: FitQuality = QUALITY

    def time_s(self, nbytes: int, calls: int = 1) -> float:
        return calls * self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Conversion:  # a block conversion's `LinearFit`: per block, per part tensor, per byte
    coef: tuple[float, float, float]
    quality: FitQuality = QUALITY

    def predict_s(self, features) -> float:
        return sum(c * f for c, f in zip(self.coef, features))


COPY = Fit(10e-6, 1e10)
DISK = Fit(100e-6, 1e9)
LINKS = {"device_to_host": COPY, "host_to_device": COPY, "host_to_disk": DISK, "disk_to_host": DISK}
BLOCK_IO = {"device_to_bytes": Conversion((2e-6, 3e-6, 1 / 2e10)), "host_to_bytes": Conversion((2e-6, 4e-6, 1 / 2e10)),
            "bytes_to_device": Conversion((5e-6, 8e-6, 1 / 1e10))}


def executor(knobs=None, block_io=None):
    c = dict(fixed=1e-3, seqs=0.0, tokens=1e-5, tokens_past_knee=0.0, multi_token=0.0, decode_kv_bytes=0.0,
             prefill_kv_bytes=0.0, prefill_pairs=0.0, samples=0.0)
    t = SimTarget(SPEC, StepCostModel(tuple(c[f] for f in FEATURES), 512), kv_itemsize=2, device_free_bytes=1 << 30,
                  transfers=LINKS, block_io=block_io or {})
    config = KVConfig().with_knobs({"offload.device_kv_bytes": 256 << 20, "offload.host_kv_bytes": 64 << 20,
                                    "offload.disk_kv_bytes": 64 << 20, **(knobs or {})})
    _, ex = build_engine(config, t)
    return config, ex


def test_a_block_is_stored_across_one_tensor_per_16_bit_side_and_three_per_quantized_one():
    assert part_tensors(KVConfig(), SPEC) == 60  # keys and values of 30 layers
    assert part_tensors(KVConfig().with_knobs(INT4), SPEC) == 180  # codes, scales and zero points
    mixed = KVConfig().with_knobs({"bitwidth.layer_bits": ((16, 4),) * 10 + ((4, 4),) * 20})
    assert part_tensors(mixed, SPEC) == 10 * (1 + 3) + 20 * 6
    assert quantized_sides(mixed, SPEC) == 10 + 40


@pytest.mark.parametrize("knobs, parts", [({}, 60), (INT4, 180)])
def test_a_host_device_copy_pays_the_per_call_latency_once_per_part_tensor(knobs, parts):
    config, ex = executor(knobs)
    block_bytes = kv_block_bytes(SPEC, 16, 2, config)
    assert ex.parts == parts and ex.block_bytes == block_bytes
    for src, dst in (("device", "host"), ("host", "device")):
        t = Transfer(src, dst, [1, 2, 3], [0, 1, 2])
        assert ex.transfer_s([t]) == pytest.approx(parts * 10e-6 + 3 * block_bytes / 1e10)
    # (a 4-bit block is smaller, but it is copied in three times the calls: the calls dominate small transfers)
    assert ex.transfer_s([Transfer("device", "host", [1], [0])]) > parts * 10e-6


def test_transfers_add_up_in_order_and_layer_wise_loads_make_the_same_calls():
    config, ex = executor({"prefetch.enabled": True, "prefetch.unit": "layers"})
    one, two = Transfer("host", "device", [0], [5]), Transfer("host", "device", [1, 2], [6, 7])
    assert ex.transfer_s([one, two]) == pytest.approx(ex.transfer_s([one]) + ex.transfer_s([two]))
    assert ex.layerwise_layers == 30 and ex.parts == 60  # a layer's 2 parts at a time: 60 calls a transfer still


@pytest.mark.parametrize("knobs", [{}, INT4])
def test_a_disk_transfer_writes_block_by_block_and_converts_each_part(knobs):
    config, ex = executor(knobs, BLOCK_IO)
    parts, nbytes = ex.parts, 2 * ex.block_bytes
    write = 2 * 100e-6 + nbytes / 1e9  # a write (or read) per block
    cases = {("device", "disk"): write + 2 * 2e-6 + 2 * parts * 3e-6 + nbytes / 2e10,
             ("host", "disk"): write + 2 * 2e-6 + 2 * parts * 4e-6 + nbytes / 2e10,
             ("disk", "device"): write + 2 * 5e-6 + 2 * parts * 8e-6 + nbytes / 1e10}
    for (src, dst), expected in cases.items():
        assert ex.transfer_s([Transfer(src, dst, [3, 4], [0, 1])]) == pytest.approx(expected)


def test_without_timed_conversions_the_device_side_of_a_disk_transfer_is_priced_as_a_copy():
    config, ex = executor()  # a profile from before the conversions were timed
    nbytes = 2 * ex.block_bytes
    write = 2 * 100e-6 + nbytes / 1e9
    assert ex.transfer_s([Transfer("host", "disk", [3, 4], [0, 1])]) == pytest.approx(write)
    assert ex.transfer_s([Transfer("device", "disk", [3, 4], [0, 1])]) == pytest.approx(
        write + 60 * 10e-6 + nbytes / 1e10)


def test_a_swap_copies_each_ring_row_in_a_call_of_its_own():
    config, ex = executor({**INT4, "batching.preemption": "swap", "batching.max_num_seqs": 4})
    assert ex.rings == 60 and ex.ring_swap_bytes > 0

    class Out:
        swapped, swapped_in = [object()], [object()] * 2

    assert ex.ring_swap_s(Out()) == pytest.approx(3 * (60 * 10e-6 + ex.ring_swap_bytes / 1e10))


def test_the_fit_tells_the_per_call_latency_from_the_bandwidth():
    sizes, calls = [1 << 20, 4 << 20, 1 << 20, 4 << 20], [1, 1, 60, 60]
    fit = fit_transfer(sizes, [c * 12e-6 + n / 8e9 for n, c in zip(sizes, calls)], calls)
    assert fit.latency_s == pytest.approx(12e-6, rel=1e-6) and fit.bytes_per_s == pytest.approx(8e9, rel=1e-6)
    assert fit.time_s(1 << 20, 180) == pytest.approx(180 * 12e-6 + (1 << 20) / 8e9)


def test_the_profiler_times_copies_split_as_the_layout_and_block_conversions(monkeypatch):
    from skistune.profile import transfers

    monkeypatch.setattr(transfers, "MIN_POOL_BYTES", 64 * 4096)
    import torch

    points = transfers.block_copy_timings(torch.device("cpu"), 4096, (1, 2), parts=4, warmup=0, repeats=1)
    copies = {(p.kind, p.grid["blocks"], p.grid["parts"]) for p in points if p.kind.endswith(("_host", "_device"))
              and "bytes" not in p.kind}
    assert copies == {(k, n, p) for k in ("device_to_host", "host_to_device") for n in (1, 2) for p in (1, 4)}
    conversions = sorted((p.kind, p.grid["parts"], p.grid["bytes"]) for p in points if "bytes_" in p.kind
                         or p.kind.endswith("_bytes"))
    assert conversions == sorted((k, p, b) for k in ("device_to_bytes", "host_to_bytes", "bytes_to_device")
                                 for p, b in ((1, 4096), (1, 1024), (2, 2048), (4, 4096)))


def test_block_conversions_round_trip_the_bytes_the_runtime_writes():
    import torch

    from skistune.profile.transfers import block_to_bytes, bytes_to_block

    parts = [torch.arange(24, dtype=torch.float32).view(3, 8), torch.arange(30, dtype=torch.uint8).view(3, 2, 5)]
    data = block_to_bytes(parts, 1)
    assert len(data) == 8 * 4 + 10
    into = [torch.zeros_like(t) for t in parts]
    bytes_to_block(data, into, 2, [8 * 4, 10])
    assert all(torch.equal(a[1], b[2]) for a, b in zip(parts, into))


@pytest.fixture(scope="module")
def shipped() -> HardwareProfile:
    return load_profile(CPU_PROFILE, check_fingerprint=False)


def test_an_older_profile_loads_and_says_what_it_did_not_time(shipped):
    """A file written before the profiler timed per-part copies and the disk tier's block conversions."""
    data = shipped.to_dict()
    del data["block_io"]
    for link in ("device_to_host", "host_to_device"):
        data["transfers"][link]["points"] = [p for p in data["transfers"][link]["points"] if p["grid"]["parts"] == 1]
    shipped = HardwareProfile.from_dict(data)
    assert shipped.block_io == {}
    gaps = shipped.transfer_gaps
    assert set(gaps) == {"host", "disk"}
    assert "copies of whole blocks only" in gaps["host"][0] and "conversions of KV blocks" in gaps["disk"][0]
    t = target_from_profile(shipped)
    assert t.block_io == {} and gaps["host"][0] in t.link_notes["device_to_host"]


def test_a_profile_with_timed_parts_and_conversions_round_trips_and_has_no_gaps(shipped):
    timing = Timing.of([1e-4, 1.1e-4])
    points = tuple(GridPoint("device_to_host", {"bytes": 737280 * n, "blocks": n, "parts": p}, timing)
                   for n in (1, 4) for p in (1, 60))
    copy = Measured(points, fit_transfer([p.grid["bytes"] for p in points], [1e-4] * 4, [1, 1, 60, 60]), (1e-4,) * 4)
    shapes = ((737280, 60), (12288, 1), (737280, 1))
    features = np.array([block_io_features(1, p, b) for b, p in shapes])
    fit = fit_linear(BLOCK_IO_FEATURES, features, features @ np.array([2e-6, 3e-6, 1 / 2e10]))
    conversions = {k: Measured(tuple(GridPoint(k, {"bytes": b, "blocks": 1, "parts": p}, timing) for b, p in shapes),
                               fit, tuple(features @ np.array(fit.coef)))
                   for k in ("device_to_bytes", "host_to_bytes", "bytes_to_device")}
    assert fit.coef == pytest.approx((2e-6, 3e-6, 1 / 2e10), rel=1e-6)
    profile = replace(shipped, transfers={**shipped.transfers, "device_to_host": copy}, block_io=conversions)
    again = HardwareProfile.from_dict(profile.to_dict())
    assert again.block_io.keys() == conversions.keys() and again.transfer_gaps == {}
    assert again.block_io["device_to_bytes"].fit == conversions["device_to_bytes"].fit
    assert target_from_profile(again).block_io["bytes_to_device"] == conversions["bytes_to_device"].fit
    data = profile.to_dict()
    data["block_io"]["disk_to_cloud"] = data["block_io"]["host_to_bytes"]
    with pytest.raises(ValueError, match="block_io.disk_to_cloud: unknown conversion"):
        HardwareProfile.from_dict(data)
