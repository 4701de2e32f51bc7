"""What a quality profile measures: the single-knob grids, the per-layer sensitivities, the passkey configs
and the joint configs that check how effects combine. Each measurement is a kind and a set of knobs on
top of the full-precision, no-eviction config; `model` reads them back by kind.

Kinds (perplexity):
    full           16-bit KV, no eviction: the reference every loss is measured against
    key            keys at fewer bits (values at 16) x full-precision window
    value          values at fewer bits (keys at 16) x group size x full-precision window
    evict          policy x budget fraction x sink tokens (recent window 64, uniform schedule)
    evict-variant  policy at each reference budget (`VARIANT_FRACTIONS`) with one other knob changed (recent
                   window 16 or 256, pyramid schedule): what the knob adds to the policy's loss
    key-evict      keys at fewer bits under a policy at `INTERACTION_FRACTION` (values at 16): what keys lose
                   beyond the two knobs' own losses, because every compaction re-quantizes the kept keys
    layer          two adjacent layers' keys and values at 2 bits, the others at 16: per-layer sensitivity
                   (each layer of the pair is given half)
    joint          configs changing several knobs at once, measured to check the combination model
Kinds (passkey retrieval): needle-full, needle-bits (keys and values at the same bits), needle-evict.
"""
from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("streaming", "h2o", "snapkv", "tova")
VARIANT_FRACTIONS = (0.25, 0.5)  # where the evict-variant measurements are taken (an effect depends on the budget)
INTERACTION_FRACTION = 0.5  # where the key-evict measurements are taken ...
INTERACTION_WINDOWS = (0, 128)  # ... at these full-precision windows (a window changes how much it adds)
REFERENCE_SINKS = 4
LAYER_PROBE_BITS = 2
LAYERS_PER_PROBE = 2


@dataclass(frozen=True)
class Measurement:
    kind: str
    knobs: dict = field(default_factory=dict)


def _evict(policy: str, fraction: float, **extra) -> dict:
    return {"eviction.policy": policy, "eviction.budget_fraction": fraction, **extra}


@dataclass(frozen=True)
class Grid:
    """The axes of one profile run (`QUICK` or `FULL`)."""

    name: str
    windows: int  # profile windows scored per perplexity measurement
    window_tokens: int
    continuation: int  # last tokens of each window fed as decode steps
    bits: tuple[int, ...]
    fp_windows: tuple[int, ...]
    value_groups: tuple[int, ...]
    fractions: tuple[float, ...]
    fractions_no_sinks: tuple[float, ...]  # where sink_tokens 0 is measured (when 0 is in sinks)
    sinks: tuple[int, ...]
    variants: bool  # measure evict-variant
    interaction_bits: tuple[int, ...]  # key bits measured under each policy (key-evict)
    layers: bool  # measure per-layer sensitivity
    needle_placements: tuple[tuple[int, float], ...]  # (context tokens, depth) per trial
    needle_bits: tuple[int, ...]
    needle_fractions: tuple[float, ...]
    joint: tuple[dict, ...]

    def perplexity(self, n_layers: int) -> list[Measurement]:
        out = [Measurement("full")]
        for bits in self.bits:
            for win in self.fp_windows:
                out.append(Measurement("key", {"bitwidth.key_bits": bits, "bitwidth.full_precision_window": win}))
        for bits in self.bits:
            for group in self.value_groups:
                for win in self.fp_windows:
                    out.append(Measurement("value", {"bitwidth.value_bits": bits, "bitwidth.group_size": group,
                                                     "bitwidth.full_precision_window": win}))
        for policy in POLICIES:
            for sinks in self.sinks:
                for fraction in self.fractions if sinks else self.fractions_no_sinks:
                    out.append(Measurement("evict", _evict(policy, fraction, **{"eviction.sink_tokens": sinks})))
        if self.variants:
            for fraction in VARIANT_FRACTIONS:
                for policy in POLICIES:
                    for extra in ({"eviction.recent_window": 16}, {"eviction.recent_window": 256},
                                  {"eviction.layer_schedule": "pyramid"}):
                        out.append(Measurement("evict-variant", _evict(policy, fraction, **extra)))
        for window in INTERACTION_WINDOWS if self.interaction_bits else ():
            fp = {"bitwidth.full_precision_window": window} if window else {}  # (0: the default, left out)
            for bits in self.interaction_bits:
                for policy in POLICIES:
                    out.append(Measurement("key-evict", {"bitwidth.key_bits": bits, **fp,
                                                         **_evict(policy, INTERACTION_FRACTION)}))
        if self.layers:  # adjacent pairs of layers: half the configs of one layer at a time
            for first in range(0, n_layers, LAYERS_PER_PROBE):
                pairs = [[16, 16]] * n_layers
                for layer in range(first, min(n_layers, first + LAYERS_PER_PROBE)):
                    pairs[layer] = [LAYER_PROBE_BITS, LAYER_PROBE_BITS]
                out.append(Measurement("layer", {"bitwidth.layer_bits": pairs}))
        out += [Measurement("joint", knobs) for knobs in self.joint]
        if self.layers:
            out.append(Measurement("joint", _mixed_layers(n_layers)))
        return out

    def needle(self) -> list[Measurement]:
        out = [Measurement("needle-full")]
        out += [Measurement("needle-bits", {"bitwidth.key_bits": b, "bitwidth.value_bits": b}) for b in self.needle_bits]
        out += [Measurement("needle-evict", _evict(p, f)) for p in POLICIES for f in self.needle_fractions]
        return out


def _both(bits: int, **extra) -> dict:
    return {"bitwidth.key_bits": bits, "bitwidth.value_bits": bits, **extra}


def _mixed_layers(n_layers: int) -> dict:
    """Layers alternate 2 and 8 bits (keys and values): a per-layer assignment the program could choose."""
    return {"bitwidth.layer_bits": [[2, 2] if i % 2 else [8, 8] for i in range(n_layers)]}


# Joint configs: several knobs at once, with values between (or on) the single-knob grid points.
FULL_JOINT = (
    {**_both(4), **_evict("h2o", 0.5)},
    {**_both(8), **_evict("streaming", 0.25)},
    {"bitwidth.key_bits": 4, "bitwidth.value_bits": 2, **_evict("tova", 0.5)},
    {**_both(4, **{"bitwidth.group_size": 64, "bitwidth.full_precision_window": 32}), **_evict("snapkv", 0.25)},
    {**_both(2, **{"bitwidth.full_precision_window": 128}), **_evict("h2o", 0.75)},
    {**_evict("h2o", 0.35, **{"eviction.recent_window": 128, "eviction.layer_schedule": "pyramid"})},
    {**_both(8, **{"bitwidth.value_bits": 4}), **_evict("streaming", 0.5, **{"eviction.sink_tokens": 16})},
    {"bitwidth.key_bits": 2, "bitwidth.value_bits": 4, "bitwidth.full_precision_window": 64},
    {**_both(4), **_evict("tova", 0.2, **{"eviction.sink_tokens": 0})},
    {**_evict("snapkv", 0.6, **{"eviction.recent_window": 32})},
    # added after the combination model was revised on the ten above (recent window read as a share of the
    # budget; SnapKV's bits read on its decoded tokens): held out from that revision
    {**_both(8, **{"bitwidth.value_bits": 4, "bitwidth.group_size": 32}), **_evict("snapkv", 0.5)},
    {"bitwidth.key_bits": 4, "bitwidth.value_bits": 8, "bitwidth.full_precision_window": 128,
     **_evict("streaming", 0.5)},
    {**_evict("h2o", 0.5, **{"eviction.recent_window": 32})},
    {**_both(4, **{"bitwidth.group_size": 64}), **_evict("tova", 0.35)},
    {**_evict("snapkv", 0.3, **{"eviction.recent_window": 128, "eviction.layer_schedule": "pyramid"})},
    {"bitwidth.key_bits": 2, "bitwidth.value_bits": 8, "bitwidth.full_precision_window": 128, **_evict("h2o", 0.5)},
    # added after the second revision (key-evict interaction; variants at a second budget), which looked at all
    # 17 above: held out from it
    {"bitwidth.key_bits": 2, "bitwidth.full_precision_window": 64, **_evict("tova", 0.6)},
    {**_both(2, **{"bitwidth.full_precision_window": 128}), **_evict("streaming", 0.35)},
    {"bitwidth.key_bits": 4, "bitwidth.value_bits": 2, "bitwidth.full_precision_window": 128, **_evict("h2o", 0.3)},
    {**_evict("tova", 0.4, **{"eviction.recent_window": 128})},
    {**_evict("streaming", 0.6, **{"eviction.layer_schedule": "pyramid"})},
    {**_both(4), **_evict("h2o", 0.4, **{"eviction.recent_window": 32, "eviction.layer_schedule": "pyramid"})},
    {"bitwidth.key_bits": 2, "bitwidth.value_bits": 8, "bitwidth.full_precision_window": 32, **_evict("snapkv", 0.4)},
    {**_both(8), **_evict("snapkv", 0.35, **{"eviction.recent_window": 16})},
    # added after the third revision (key-evict at a second full-precision window, the interaction read as
    # the NLL it adds), which looked at all 25 above: held out from it
    {"bitwidth.key_bits": 2, "bitwidth.value_bits": 4, "bitwidth.full_precision_window": 64, **_evict("h2o", 0.6)},
    {"bitwidth.key_bits": 2, "bitwidth.full_precision_window": 128, **_evict("tova", 0.35)},
    {"bitwidth.key_bits": 4, "bitwidth.value_bits": 2, "bitwidth.full_precision_window": 32,
     **_evict("streaming", 0.4)},
    {"bitwidth.key_bits": 2, "bitwidth.full_precision_window": 32,
     **_evict("tova", 0.5, **{"eviction.recent_window": 32})},
    {**_both(2, **{"bitwidth.value_bits": 8, "bitwidth.full_precision_window": 128}), **_evict("snapkv", 0.3)},
    {**_both(4, **{"bitwidth.full_precision_window": 128}),
     **_evict("streaming", 0.25, **{"eviction.layer_schedule": "pyramid"})},
)
# (one joint config and 24 decoded tokens a window: with two and 32, `--quick` took 183 s on a 2-core Zen 4,
# over its 3 minutes)
QUICK_JOINT = (
    {**_both(4), **_evict("h2o", 0.5)},
)

FULL = Grid("full", windows=4, window_tokens=1024, continuation=64, bits=(8, 4, 2), fp_windows=(0, 128),
            value_groups=(32, 64), fractions=(0.1, 0.25, 0.5, 0.75, 0.9), fractions_no_sinks=(0.1, 0.25, 0.5),
            sinks=(0, 4), variants=True, interaction_bits=(4, 2),
            layers=True, needle_placements=((1024, 0.1), (1024, 0.6), (2048, 0.35), (2048, 0.85), (3072, 0.2),
                                            (3072, 0.7)),
            needle_bits=(8, 4, 2), needle_fractions=(0.25, 0.5), joint=FULL_JOINT)
QUICK = Grid("quick", windows=2, window_tokens=512, continuation=24, bits=(8, 4, 2), fp_windows=(0,),
             value_groups=(32,), fractions=(0.25, 0.5), fractions_no_sinks=(), sinks=(4,), variants=False,
             interaction_bits=(), layers=False,
             needle_placements=((1024, 0.2), (1024, 0.7)), needle_bits=(4,),
             needle_fractions=(0.25,), joint=QUICK_JOINT)
GRIDS = {"full": FULL, "quick": QUICK}
