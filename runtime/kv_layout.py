"""KV memory arithmetic shared by the runtime and the simulator (torch-free).

A KV block holds ``block_size`` tokens of every layer's keys and values. At 16 bits a side (keys or
values) of one layer stores its elements in the model's dtype. At 8/4/2 bits it stores packed codes
(``bits / 8`` bytes per element) plus scales and zero points in the model's dtype: keys one pair per
KV head and channel per block (per-channel groups over the block's tokens), values one pair per token,
KV head and group of channels (see `skistune.kernels.quant`).

A quantized side also keeps its sequences' newest tokens at full precision in a ring per running
sequence (`full_precision_ring_tokens`): the tokens of the block still being filled (a per-channel
key group is complete only with its block) plus the configured ``bitwidth.full_precision_window``.
That ring is a fixed cost taken from the KV pool before it is cut into blocks.

`kv_traffic` turns the same layout into what a step moves per token of KV it touches: the runtime's
profiler records measured steps with it and the simulator predicts steps with it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import KVConfig, format_bytes
from .eviction_budget import SCORING_POLICIES
from .presets import ModelSpec

# With no explicit device_kv_bytes, the device pool is device_memory_fraction of the free device
# memory. A CPU has no device memory of its own: like vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE,
# default 4 GiB), the fraction is then taken of a fixed 4 GiB of host memory.
CPU_KV_SPACE_BYTES = 4 << 30
FULL_PRECISION_BITS = 16


def value_group(config: KVConfig, spec: ModelSpec) -> int:
    """Channels per value group: the configured group size, at most one head."""
    return min(config.bitwidth.group_size, spec.head_dim)


def layout_notes(config: KVConfig, spec: ModelSpec) -> list[str]:
    """What this model's shape changes in the config's layout, for the notes shown beside a run's results. A
    config may be written for no model in particular, so a value group wider than a head is clamped to the
    head (`value_group`) rather than refused; this says so instead of clamping silently."""
    bw = config.bitwidth
    # pairs as configured, not `layer_bits`: a note must not raise on a layer count the pool check reports
    values_quantized = any(vb != FULL_PRECISION_BITS for _, vb in configured_bits(config))  # (keys: per channel)
    if values_quantized and bw.group_size > spec.head_dim:
        return [f"bitwidth.group_size {bw.group_size} is more than a head's {spec.head_dim} channels: values are "
                f"grouped per head ({spec.head_dim})"]
    return []


def side_block_bytes(spec: ModelSpec, block_size: int, itemsize: int, bits: int, is_key: bool,
                     group: int) -> int:
    """Bytes of one layer's keys (or values) in one block at ``bits``."""
    elements = block_size * spec.n_kv_heads * spec.head_dim
    if bits == FULL_PRECISION_BITS:
        return elements * itemsize
    groups = spec.n_kv_heads * spec.head_dim if is_key else block_size * spec.n_kv_heads * spec.head_dim // group
    return elements * bits // 8 + 2 * groups * itemsize  # codes + (scale, zero) per group


def layer_bits(config: KVConfig, spec: ModelSpec) -> list[tuple[int, int]]:
    """(key bits, value bits) of every layer."""
    if config.bitwidth.layer_bits is not None and len(config.bitwidth.layer_bits) != spec.n_layers:
        n = len(config.bitwidth.layer_bits)
        raise ValueError(f"bitwidth.layer_bits: {n} (key, value) pair{'s' * (n != 1)} for a model of "
                         f"{spec.n_layers} layer{'s' * (spec.n_layers != 1)}: give one per layer")
    return [config.bitwidth.bits_for_layer(i) for i in range(spec.n_layers)]


def kv_block_bytes(spec: ModelSpec, block_size: int, itemsize: int, config: KVConfig | None = None) -> int:
    """Bytes of one block over all layers, keys and values (16-bit sides at ``itemsize`` bytes)."""
    if config is None:
        return spec.n_layers * 2 * block_size * spec.n_kv_heads * spec.head_dim * itemsize
    group = value_group(config, spec)
    return sum(side_block_bytes(spec, block_size, itemsize, kb, True, group)
               + side_block_bytes(spec, block_size, itemsize, vb, False, group)
               for kb, vb in layer_bits(config, spec))


def configured_bits(config: KVConfig) -> tuple:
    """The (key bits, value bits) pairs as the config gives them: one for every layer, or one per layer (not
    checked against a model's layer count, which `layer_bits` does)."""
    bw = config.bitwidth
    return bw.layer_bits if bw.layer_bits is not None else ((bw.key_bits, bw.value_bits),)


def read_full_precision_window(config: KVConfig) -> int:
    """``bitwidth.full_precision_window`` where some KV is quantized (at 16 bits everything is read in full)."""
    quantized = any(bits != FULL_PRECISION_BITS for pair in configured_bits(config) for bits in pair)
    return config.bitwidth.full_precision_window if quantized else 0


def full_precision_start(context_len: int, ring_start: int, window: int, block_size: int) -> int:
    """First position of a sequence read from its ring rather than from packed blocks: the window's first
    block (block-aligned so that everything before it is in full, quantized blocks), never before the first
    position the sequence wrote itself (prefix-cache hits exist only packed)."""
    return max(max(0, context_len - window) // block_size * block_size, ring_start)


def full_precision_ring_tokens(config: KVConfig) -> int:
    """Tokens of a running sequence kept at full precision per quantized side: the window rounded up
    to whole blocks, plus the block being filled."""
    bs = config.prefix_reuse.block_size
    return -(-config.bitwidth.full_precision_window // bs) * bs + bs


def quantized_sides(config: KVConfig, spec: ModelSpec) -> int:
    """Layer sides (a layer's keys, or its values) stored at fewer than 16 bits."""
    return sum((kb != FULL_PRECISION_BITS) + (vb != FULL_PRECISION_BITS) for kb, vb in layer_bits(config, spec))


def part_tensors(config: KVConfig, spec: ModelSpec) -> int:
    """Tensors a block of the pool is stored across (`kv_store`): per layer side, its 16-bit data, or its packed
    codes, scales and zero points. The tier copies make one call per tensor (`TierStore`), and the disk tier
    converts each of a block's to and from bytes, so a transfer's fixed cost grows with them."""
    return sum(1 if bits == FULL_PRECISION_BITS else 3 for pair in layer_bits(config, spec) for bits in pair)


def ring_bytes_per_seq(config: KVConfig, spec: ModelSpec, itemsize: int) -> int:
    """Bytes of one sequence's full-precision ring, every layer (0 when nothing is quantized): what a swap
    moves beside the sequence's blocks."""
    per_token = quantized_sides(config, spec) * spec.n_kv_heads * spec.head_dim * itemsize
    return full_precision_ring_tokens(config) * per_token


def ring_bytes(config: KVConfig, spec: ModelSpec, itemsize: int) -> int:
    """Bytes of the full-precision rings of all running sequences (0 when nothing is quantized)."""
    return config.batching.max_num_seqs * ring_bytes_per_seq(config, spec, itemsize)


@dataclass(frozen=True)
class KVTraffic:
    """What a step moves per token of KV it touches, over all layers, at a config's bits."""

    bytes_per_token: int  # stored: codes + scales + zero points, the token's share of its block (all at 16 bits)
    quantized_elements_per_token: int = 0  # dequantized on every read, quantized once when its block completes
    ring_bytes_per_seq: int = 0  # full-precision ring tokens each sequence's attention reads (mean, see kv_traffic)
    unpacked_elements_per_token: int = 0  # sub-byte codes' extra unpacking work: see `unpack_work`
    block_size: int = 0  # tokens a block packs when it completes (0: nothing is quantized, nothing packed)
    scored_prefill: bool = False  # the eviction policy records attention statistics (`SCORING_POLICIES`)


def kv_traffic(config: KVConfig, spec: ModelSpec, itemsize: int) -> KVTraffic:
    """Per-token KV traffic at ``config``'s bits (``itemsize``: bytes of a 16-bit-side element).

    Attention reads a quantized sequence's newest tokens from its ring: from the block-aligned start of the
    full-precision window to the end, ``window + (context - window) % block_size`` tokens once the context
    exceeds the window. That saw-tooth is counted at its mean over a block of decode steps,
    ``window + block_size // 2`` tokens, so that a step's cost stays linear in its context (which the
    simulator's decode fast-forward relies on)."""
    bs = config.prefix_reuse.block_size
    elements = quantized_sides(config, spec) * spec.n_kv_heads * spec.head_dim
    ring_tokens = config.bitwidth.full_precision_window + bs // 2
    unpacked = sum(unpack_work(kb) + unpack_work(vb) for kb, vb in layer_bits(config, spec))
    return KVTraffic(kv_block_bytes(spec, bs, itemsize, config) // bs, elements,
                     ring_tokens * elements * itemsize, unpacked * spec.n_kv_heads * spec.head_dim,
                     bs if elements else 0, config.eviction.policy in SCORING_POLICIES)


def unpack_work(bits: int) -> int:
    """Extra codes unpacked per byte read, per element: 0 for 16 and 8 bits (a byte is one code), 1 at 4 bits,
    3 at 2 bits (shifts and masks beyond the first code of a byte). The profiler measured a 4-bit context
    costing more per element than an 8-bit one (0.368 vs 0.215 s for the same decode step at 4 x 2,048)."""
    return 0 if bits >= 8 else 8 // bits - 1


class KVPoolTooSmall(ValueError):
    """The device pool cannot hold one block after the full-precision rings: the config cannot serve here."""


def kv_pool_bytes(config: KVConfig, device_free_bytes: int) -> int:
    if config.offload.device_kv_bytes is not None:
        return config.offload.device_kv_bytes
    return int(config.offload.device_memory_fraction * device_free_bytes)


def kv_pool_blocks(config: KVConfig, spec: ModelSpec, itemsize: int, device_free_bytes: int) -> tuple[int, int]:
    """(number of blocks, bytes per block) of the device pool, after the full-precision rings."""
    block_bytes = kv_block_bytes(spec, config.prefix_reuse.block_size, itemsize, config)
    rings = ring_bytes(config, spec, itemsize)
    pool = kv_pool_bytes(config, device_free_bytes)
    num_blocks = (pool - rings) // block_bytes
    if num_blocks < 1:
        raise KVPoolTooSmall(pool_too_small_message(config, pool, device_free_bytes, block_bytes, rings))
    return num_blocks, block_bytes


def pool_too_small_message(config: KVConfig, pool: int, device_free_bytes: int, block_bytes: int,
                           rings: int) -> str:
    """Why the pool holds no block, in one line naming knobs the user can change: the one the pool is sized
    by (device_kv_bytes only when set: a tester was told to shrink a device_kv_bytes they never gave) and,
    when the rings take the room, the two that size the rings."""
    off = config.offload
    if off.device_kv_bytes is not None:
        knob, pool_text = "offload.device_kv_bytes", format_bytes(pool)
    else:
        knob = "offload.device_memory_fraction"
        pool_text = (f"{off.device_memory_fraction} of the {format_bytes(device_free_bytes)} of device memory "
                     f"free for KV ({format_bytes(pool)})")
    message = f"{knob}: {pool_text} is less than one KV block ({format_bytes(block_bytes)})"
    if rings:
        message += (f" plus the full-precision rings of quantized KV ({format_bytes(rings)}: "
                    f"{full_precision_ring_tokens(config)} tokens, bitwidth.full_precision_window "
                    f"{config.bitwidth.full_precision_window} and the block being filled, for each of "
                    f"batching.max_num_seqs {config.batching.max_num_seqs} sequences)")
    if rings and pool >= block_bytes:  # the rings alone leave no room: shrinking them is a fix too
        return message + f"; lower bitwidth.full_precision_window or batching.max_num_seqs, or raise {knob}"
    return message + f"; raise {knob}"
