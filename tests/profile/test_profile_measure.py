"""A profile measured on a tiny random Llama: every grid point is there (16-bit and quantized) with the step
shape it asked for, the fits have what they need, and the file round-trips exactly."""
from __future__ import annotations

import json

import pytest
from profile_tiny import TINY, TINY_GRID, TINY_KV_BYTES_PER_TOKEN

from skistune.config import KVConfig
from skistune.profile import LINKS, FitQuality, HardwareProfile, load_profile
from skistune.profile.cost import StepShape
from skistune.profile.measure import Grid, held_out_mask
from skistune.profile.records import StepPoint, Timing, kv_bits
from skistune.runtime.kv_layout import kv_traffic


TINY_GRID_BLOCK = 16  # the tiny runtime's block size


def _traffic(bits: int):
    return kv_traffic(KVConfig().with_knobs({"bitwidth.key_bits": bits, "bitwidth.value_bits": bits}), TINY, 4)


def test_every_grid_point_is_measured_in_order(tiny_profile: HardwareProfile):
    grids = [(p.kind, p.grid) for p in tiny_profile.steps]
    expected = [("decode", {"batch": b, "context": c, "bits": 16}) for b, c in TINY_GRID.decode()]
    expected += [("prefill", {"chunk": n, "cached": k, "bits": 16}) for n, k in TINY_GRID.prefill]
    expected += [("mixed", {"batch": b, "context": c, "chunk": n, "bits": 16}) for b, c, n in TINY_GRID.mixed]
    for bits in TINY_GRID.step_bits:
        expected += [("decode", {"batch": b, "context": c, "bits": bits}) for b, c in TINY_GRID.quant_decode]
        expected += [("prefill", {"chunk": n, "cached": k, "bits": bits}) for n, k in TINY_GRID.quant_prefill]
        expected += [("packing", {"batch": b, "context": c, "bits": bits}) for b, c in TINY_GRID.quant_packing]
    expected += [("compaction", {"batch": b, "budget": n, "bits": 16}) for b, n in TINY_GRID.compaction]
    expected += [("scored", {"chunk": n, "cached": k, "bits": 16}) for n, k in TINY_GRID.scored_prefill]
    assert grids == expected
    assert tiny_profile.kv_bytes_per_token == TINY_KV_BYTES_PER_TOKEN
    assert tiny_profile.block_size == 16 and tiny_profile.dtype == "float32" and tiny_profile.device == "cpu"


def test_measured_steps_have_the_shape_of_their_grid_point(tiny_profile: HardwareProfile):
    for p in tiny_profile.steps:
        s, g, kv = p.shape, p.grid, _traffic(kv_bits(p.grid))
        kvb, ring, q = kv.bytes_per_token, kv.ring_bytes_per_seq, kv.quantized_elements_per_token
        u = kv.unpacked_elements_per_token
        assert u == (q if kv_bits(g) == 4 else 0)  # one extra code per byte at 4 bits, none at 8
        if p.kind == "decode":  # context grows by one token a step: at least the prompt plus one
            b = g["batch"]
            assert (s.num_seqs, s.num_tokens, s.num_samples, s.prefill_pairs) == (b,) * 3 + (0,)
            assert b * (g["context"] + 1) * kvb <= s.decode_kv_bytes - b * ring <= b * (g["context"] + 16) * kvb
            assert s.decode_dequant_elements * kvb == (s.decode_kv_bytes - b * ring) * q
            assert s.decode_unpack_elements * kvb == (s.decode_kv_bytes - b * ring) * u
            assert s.quantize_elements == b * q
            assert s.packed_blocks == 0  # (quantized: the steps that complete a block are the packing points')
        elif p.kind == "packing":  # every sequence reads a whole number of blocks: it completed the last one
            b = g["batch"]
            assert (s.num_seqs, s.num_tokens, s.packed_blocks, s.quantize_elements) == (b, b, b, b * q)
            assert s.decode_dequant_elements % (b * TINY_GRID_BLOCK * q) == 0 < s.decode_dequant_elements
            assert s.decode_dequant_elements >= b * (g["context"] + 1) * q
        elif p.kind in ("prefill", "scored"):  # scored: under H2O at a budget it never reaches
            context, scored = g["cached"] + g["chunk"], p.kind == "scored"
            assert s == StepShape(num_tokens=g["chunk"], num_seqs=1, decode_kv_bytes=0,
                                  prefill_pairs=g["chunk"] * context, num_samples=1,
                                  prefill_kv_bytes=context * kvb + ring, prefill_dequant_elements=context * q,
                                  quantize_elements=g["chunk"] * q, prefill_unpack_elements=context * u,
                                  packed_blocks=context // TINY_GRID_BLOCK - g["cached"] // TINY_GRID_BLOCK
                                  if q else 0, scored_prefill_tokens=g["chunk"] if scored else 0,
                                  scored_prefill_pairs=g["chunk"] * context if scored else 0)
        elif p.kind == "compaction":  # every sequence at its budget plus the block it grew by, compacted
            b, grown = g["batch"], g["budget"] + TINY_GRID_BLOCK
            assert (s.num_seqs, s.num_tokens, s.compactions, s.compacted_slots) == (b, b, b, b * grown)
            assert s.decode_kv_bytes == b * grown * kvb
        else:
            batch, chunk = g["batch"], g["chunk"]
            assert (s.num_seqs, s.num_tokens, s.num_samples) == (batch + 1, batch + chunk, batch + 1)
            assert s.prefill_pairs == g["chunk"] * g["chunk"]
            assert s.compactions == 0


def test_timings_are_medians_of_enough_repeats(tiny_profile: HardwareProfile):
    for p in tiny_profile.steps:
        t = p.timing
        assert TINY_GRID.repeats <= t.repeats <= TINY_GRID.max_repeats
        assert 0 < t.p10_s <= t.median_s <= t.p90_s


def test_held_out_points_are_interior_and_kept_out_of_the_fit(tiny_profile: HardwareProfile):
    held = [p for p in tiny_profile.steps if p.held_out]
    # interior: batch 2 or 4 at context 64 (decode); no prefill, mixed or quantized point is inside its grid
    assert [(p.kind, p.grid) for p in held] == [("decode", {"batch": 2, "context": 64, "bits": 16})]
    assert tiny_profile.step_fit.held_out.points == len(held)
    assert tiny_profile.step_fit.train.points == len(tiny_profile.steps) - len(held)


def test_held_out_mask_takes_every_third_interior_point_of_each_kind():
    def point(kind, **grid):
        return StepPoint(kind, grid, StepShape(1, 1, 0, 0, 1), Timing(1.0, 1.0, 1.0, 1))

    points = [point("decode", batch=b, context=c) for b in (1, 2, 4, 8, 16, 32, 64) for c in (32, 128, 512)]
    points += [point("prefill", chunk=n, cached=k) for n in (16, 64, 256) for k in (0, 512, 1024)]
    points += [point("decode", batch=b, context=c, bits=4) for b in (1, 4, 16) for c in (32, 128, 512)]
    held = [(p.kind, p.grid) for p, m in zip(points, held_out_mask(points)) if m]
    assert held == [("decode", {"batch": 2, "context": 128}), ("decode", {"batch": 16, "context": 128}),
                    ("prefill", {"chunk": 64, "cached": 512}), ("decode", {"batch": 4, "context": 128, "bits": 4})]


def test_other_stages_are_measured(tiny_profile: HardwareProfile):
    assert [p.grid["batch"] for p in tiny_profile.overhead.points] == list(TINY_GRID.overhead_batches)
    quantized = len(TINY_GRID.kernel_bits) * (len(TINY_GRID.quant_decode) + len(TINY_GRID.quant_prefill))
    assert len(tiny_profile.attention.points) == len(TINY_GRID.decode()) + len(TINY_GRID.prefill) + quantized
    assert {kv_bits(p.grid) for p in tiny_profile.attention.points} == {16, 8, 4, 2}
    assert [(p.grid["bits"], p.grid["blocks"]) for p in tiny_profile.quantize.points] == [
        (b, n) for b in TINY_GRID.kernel_bits for n in TINY_GRID.quantize_blocks]
    assert sorted(tiny_profile.transfers) == sorted(LINKS)
    for link, measured in tiny_profile.transfers.items():
        assert measured.fit.bytes_per_s > 0 and measured.fit.latency_s >= 0
        assert tiny_profile.transfer_time_s(1 << 20, link) < tiny_profile.transfer_time_s(1 << 24, link)
    assert tiny_profile.power.source == "modeled" and "modeled" in tiny_profile.power.note
    assert tiny_profile.fingerprint.threads == tiny_profile.threads >= 1
    assert tiny_profile.disk_free_bytes > 0  # where the disk was timed (the temporary directory here)
    assert set(tiny_profile.drift) == {"decode", "prefill"} and all(r > 0 for r in tiny_profile.drift.values())


def test_a_machine_that_moved_while_measured_is_noted_per_kind(shipped: HardwareProfile):
    """The first decode and prefill points are timed again at the end: a kind that moved by 10% or more is
    named in a note that the simulator's target (hence `skistune evaluate`) and the optimizer carry."""
    from dataclasses import replace

    from skistune.simulator import target_from_profile

    moved = replace(shipped, drift={"decode": 1.72, "prefill": 1.04})
    assert "decode steps x1.72" in moved.drift_note and "prefill" not in moved.drift_note
    assert moved.drift_note in target_from_profile(moved).notes
    for still in ({"decode": 1.05, "prefill": 0.93}, {}):  # within 10%, or not recorded
        steady = replace(shipped, drift=still)
        assert steady.drift_note is None and not any("moved" in n for n in target_from_profile(steady).notes)


def test_a_machine_busy_as_measuring_began_is_noted():
    """A profile measured under other work is slow throughout, which its start-to-end drift cannot show."""
    from skistune.profile.measure import busy_note

    assert busy_note(None, 2) is None and busy_note(0.6, 2) is None and busy_note(3.0, 16) is None
    assert busy_note(3.8, 2) == ("measured while the machine was busy (load average 3.8 on 2 cores as it began): "
                                 "its step times are likely slower than this machine's when quiet; measure again "
                                 "on a quiet machine")
    assert busy_note(8.0, 16).startswith("measured while the machine was busy (load average 8.0 on 16 cores")


def test_unknown_transfer_link_is_an_error(tiny_profile: HardwareProfile):
    with pytest.raises(ValueError, match="host_to_cloud"):
        tiny_profile.transfer_time_s(4096, "host_to_cloud")


def test_save_and_load_round_trip_exactly(tiny_profile: HardwareProfile, tmp_path):
    path = tiny_profile.save(tmp_path / "sub" / "p.json")
    assert load_profile(path) == tiny_profile
    older = json.loads(path.read_text())
    del older["disk_free_bytes"], older["drift"]  # a file written before the records: loads, with them unknown
    path.write_text(json.dumps(older))
    assert load_profile(path).disk_free_bytes is None and load_profile(path).drift == {}
    assert [f.name for f in path.parent.iterdir()] == ["p.json"]  # the temp file was renamed, not left


def test_file_records_residuals_fits_and_energy(tiny_profile: HardwareProfile, tmp_path):
    data = json.loads(tiny_profile.save(tmp_path / "p.json").read_text())
    point = data["step"]["points"][0]
    assert point["predicted_s"] == pytest.approx(tiny_profile.step_cost.predict_s(tiny_profile.steps[0].shape))
    assert point["rel_error"] == pytest.approx(point["predicted_s"] / point["timing"]["median_s"] - 1)
    assert set(data["step"]["fit"]) == {"knee_loss", "train", "held_out"}
    assert data["step"]["fit"]["train"]["flagged"] == (data["step"]["fit"]["train"]["r2"] < 0.95)
    decode_points = len(TINY_GRID.decode()) + len(TINY_GRID.step_bits) * len(TINY_GRID.quant_decode)
    energy = data["power"]["energy_j_per_token"]
    assert len(energy) == decode_points
    # the fitted step time (what the simulator charges), and the measured median beside it
    decode = [p for p in tiny_profile.steps if p.kind == "decode"]
    busy_w = tiny_profile.power.power_w(1.0)
    assert energy[0]["j_per_token"] == pytest.approx(busy_w * tiny_profile.step_cost.predict_s(decode[0].shape)
                                                     / decode[0].grid["batch"])
    assert energy[0]["measured_j_per_token"] == pytest.approx(busy_w * decode[0].timing.median_s / decode[0].grid["batch"])
    assert set(data["kernels"]) == {"paged_attention", "quantize_append"}
    assert "rel_error" in data["transfers"]["host_to_disk"]["points"][0]


def test_r2_below_the_threshold_is_flagged():
    assert FitQuality(r2=0.94, median_rel_error=0.1, max_rel_error=0.2, points=10).flagged
    assert not FitQuality(r2=0.95, median_rel_error=0.1, max_rel_error=0.2, points=10).flagged
    assert not FitQuality(r2=None, median_rel_error=0.1, max_rel_error=0.2, points=2).flagged


def test_prefill_points_must_fall_on_chunk_boundaries():
    with pytest.raises(ValueError, match="multiple of the chunk"):
        Grid(**{**TINY_GRID.__dict__, "prefill": ((64, 32),)})
    with pytest.raises(ValueError, match="multiple of the chunk"):
        Grid(**{**TINY_GRID.__dict__, "quant_prefill": ((64, 32),)})


def test_quantized_grid_bits_are_the_runtimes():
    with pytest.raises(ValueError, match="3 bits is not one of"):
        Grid(**{**TINY_GRID.__dict__, "step_bits": (3,)})


def test_the_projection_passes_are_timed_and_kept_with_the_step_model(tiny_profile: HardwareProfile, tmp_path):
    table = tiny_profile.step_cost.table
    assert table is not None and table.rows == TINY_GRID.projection_rows
    assert all(t > 0 for t in table.layers_s + table.head_s)
    assert load_profile(tiny_profile.save(tmp_path / "p.json"), check_fingerprint=False).step_cost.table == table
