"""A hand-made quality profile (no model runs): each measurement's per-window NLL increase follows a simple
formula, so the tests can compute what the combination model must predict."""
from __future__ import annotations

from skistune.quality.model import FORMAT, VERSION, knob_key

FULL_NLL = [2.0, 3.0]  # two windows
WINDOW_SPREAD = [1.0, 2.0]  # window 1 loses twice as much as window 0
KEY_LOSS = {8: 0.001, 4: 0.01, 2: 0.2}  # mean-window NLL increase at fp window 0
VALUE_LOSS = {(8, 32): 0.002, (4, 32): 0.02, (2, 32): 0.3, (8, 64): 0.003, (4, 64): 0.03, (2, 64): 0.4}
FP_WINDOW_KEEPS = {0: 1.0, 128: 0.25}  # share of the loss left with a 128-token full-precision window
EVICT_LOSS = {"h2o": {0.25: 0.06, 0.5: 0.02}, "streaming": {0.25: 0.05, 0.5: 0.01}}  # sinks 4
NO_SINKS_LOSS = {"streaming": {0.25: 0.5, 0.5: 0.3}}
VARIANT_RATIO = {("eviction.recent_window", 16): 1.5, ("eviction.recent_window", 256): 0.5,
                 ("eviction.layer_schedule", "pyramid"): 0.8}
LAYER_PROBE = [0.04, 0.0, 0.02, 0.02]  # loss of each layer alone at 2/2 bits (4 layers)
NEEDLE = {"full": [True] * 4, 8: [True] * 4, 4: [True, True, True, False], 2: [False] * 4,
          ("h2o", 0.25): [True, False, False, False], ("h2o", 0.5): [True, True, False, False]}


def spread(mean: float) -> list[float]:
    """Per-window increases with the given mean (windows in WINDOW_SPREAD's proportions)."""
    scale = 2 * mean / sum(WINDOW_SPREAD)
    return [scale * w for w in WINDOW_SPREAD]


def _entry(kind: str, knobs: dict, mean: float) -> tuple[str, dict]:
    nll = [f + d for f, d in zip(FULL_NLL, spread(mean))]
    return knob_key(knobs), {"kind": kind, "knobs": knobs, "nll": nll, "nll_all_positions": nll}


def profile_data(n_layers: int = 4, joint: tuple[tuple[dict, float], ...] = ()) -> dict:
    ppl = dict([_entry("full", {}, 0.0)])
    for bits, loss in KEY_LOSS.items():
        for win, keep in FP_WINDOW_KEEPS.items():
            ppl.update([_entry("key", {"bitwidth.key_bits": bits, "bitwidth.full_precision_window": win}, loss * keep)])
    for (bits, group), loss in VALUE_LOSS.items():
        for win, keep in FP_WINDOW_KEEPS.items():
            knobs = {"bitwidth.value_bits": bits, "bitwidth.group_size": group, "bitwidth.full_precision_window": win}
            ppl.update([_entry("value", knobs, loss * keep)])
    for table, sinks in ((EVICT_LOSS, 4), (NO_SINKS_LOSS, 0)):
        for policy, curve in table.items():
            for fraction, loss in curve.items():
                knobs = {"eviction.policy": policy, "eviction.budget_fraction": fraction, "eviction.sink_tokens": sinks}
                ppl.update([_entry("evict", knobs, loss)])
    for (knob, value), ratio in VARIANT_RATIO.items():
        knobs = {"eviction.policy": "h2o", "eviction.budget_fraction": 0.25, knob: value}
        ppl.update([_entry("evict-variant", knobs, EVICT_LOSS["h2o"][0.25] * ratio)])
    for layer, loss in enumerate(LAYER_PROBE[:n_layers]):
        pairs = [[16, 16]] * n_layers
        pairs[layer] = [2, 2]
        ppl.update([_entry("layer", {"bitwidth.layer_bits": pairs}, loss)])
    for knobs, loss in joint:
        ppl.update([_entry("joint", knobs, loss)])
    needle = {}
    for key, found in NEEDLE.items():
        if key == "full":
            kind, knobs = "needle-full", {}
        elif isinstance(key, int):
            kind, knobs = "needle-bits", {"bitwidth.key_bits": key, "bitwidth.value_bits": key}
        else:
            kind, knobs = "needle-evict", {"eviction.policy": key[0], "eviction.budget_fraction": key[1]}
        needle[knob_key(knobs)] = {"kind": kind, "knobs": knobs, "found": found}
    return {"format": FORMAT, "version": VERSION, "model": "smollm2-135m", "n_layers": n_layers,
            "corpus": {"window_tokens": 1000, "python": "3.11.7"},
            "protocol": {"grid": "synthetic", "windows": 2, "continuation": 64, "chunk": 128},
            "perplexity": ppl, "needle": needle}
