"""`kv_layout`: what the pool's refusal tells the user, and the notes on what a model's shape changes."""
import pytest

from skistune.config import KVConfig
from skistune.runtime.kv_layout import KVPoolTooSmall, kv_pool_blocks, layout_notes, value_group
from skistune.runtime.presets import get_preset

SPEC = get_preset("smollm2-135m")  # 30 layers, 3 KV heads of 64 channels
FREE = 4 << 30


def refusal(**knobs) -> str:
    with pytest.raises(KVPoolTooSmall) as err:
        kv_pool_blocks(KVConfig().with_knobs(knobs), SPEC, 2, FREE)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_rings_of_every_sequence_slot_name_their_knobs_not_a_device_kv_bytes_never_set():
    """A tester never set device_kv_bytes, yet was told it was too small (in bytes): 4,096 full-precision
    tokens for each of 256 sequence slots were the cause."""
    message = refusal(**{"bitwidth.key_bits": 4, "bitwidth.value_bits": 4, "bitwidth.full_precision_window": 4096})
    assert message == (
        "offload.device_memory_fraction: 0.9 of the 4GiB of device memory free for KV (3.6 GiB) is less than one "
        "KV block (123.8 KiB) plus the full-precision rings of quantized KV (22.6 GiB: 4112 tokens, "
        "bitwidth.full_precision_window 4096 and the block being filled, for each of batching.max_num_seqs 256 "
        "sequences); lower bitwidth.full_precision_window or batching.max_num_seqs, or raise "
        "offload.device_memory_fraction")
    assert "device_kv_bytes" not in message


def test_a_device_kv_bytes_that_was_set_is_named_with_human_sizes():
    rings = 64 * 32 * 30 * 3 * 64 * 2  # 64 sequences x 32 ring tokens (a window of 16 + one block), 4-bit keys
    message = refusal(**{"offload.device_kv_bytes": rings, "bitwidth.key_bits": 4,
                         "bitwidth.full_precision_window": 16, "batching.max_num_seqs": 64})
    assert message == (
        "offload.device_kv_bytes: 22.5 MiB is less than one KV block (247.5 KiB) plus the full-precision rings of "
        "quantized KV (22.5 MiB: 32 tokens, bitwidth.full_precision_window 16 and the block being filled, for "
        "each of batching.max_num_seqs 64 sequences); lower bitwidth.full_precision_window or "
        "batching.max_num_seqs, or raise offload.device_kv_bytes")


def test_a_pool_under_one_block_names_only_its_own_knob():
    """No rings (16-bit KV): shrinking the window or the sequence cap would not help, so they go unnamed."""
    assert refusal(**{"offload.device_kv_bytes": "64KiB"}) == (
        "offload.device_kv_bytes: 64KiB is less than one KV block (360KiB); raise offload.device_kv_bytes")
    quantized = refusal(**{"offload.device_kv_bytes": "64KiB", "bitwidth.value_bits": 8})
    assert quantized.endswith("; raise offload.device_kv_bytes") and "full-precision rings" in quantized


def test_a_value_group_wider_than_a_head_is_clamped_and_noted():
    wide = KVConfig().with_knobs({"bitwidth.value_bits": 4, "bitwidth.group_size": 128})
    assert value_group(wide, SPEC) == 64
    assert layout_notes(wide, SPEC) == [
        "bitwidth.group_size 128 is more than a head's 64 channels: values are grouped per head (64)"]
    assert layout_notes(wide, get_preset("llama-3-8b")) == []  # 128 channels a head: nothing clamped
    assert layout_notes(wide.with_knobs({"bitwidth.group_size": 64}), SPEC) == []
    # the group size does nothing unless values are quantized (keys are grouped per channel)
    assert layout_notes(KVConfig().with_knobs({"bitwidth.key_bits": 4, "bitwidth.group_size": 128}), SPEC) == []
    per_layer = KVConfig().with_knobs({"bitwidth.layer_bits": [[16, 16], [8, 4]] * 15, "bitwidth.group_size": 128})
    assert len(layout_notes(per_layer, SPEC)) == 1
