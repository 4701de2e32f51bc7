"""`layers`: per-layer key/value bits and eviction budgets, ``{layer: {nbits_key, nbits_value, budget}}``,
for tools that configure KV compression layer by layer (and for reading what a config means per layer).

Budgets per layer (`layer_budgets`):
- ``uniform``: every layer keeps the config's budget.
- ``pyramid``: skistune's linear schedule, from 1.5x the budget at layer 0 down to 0.5x at the last layer.
  The factors average to 1, so the model keeps as many tokens in total as with ``uniform`` (up to rounding
  and the cap below). This is skistune's schedule, not kvpress's PyramidKV formula (which derives its
  bounds from a window and a beta).
Token budgets are rounded to whole tokens (at least 1); fraction budgets are capped at 1.0 (a layer cannot
keep more than its whole context), so a pyramid of a fraction above 2/3 keeps a little less in total.
``budget`` is null when the policy is ``none`` (every token kept).

The eviction policy, sinks and recent window, and the quantization's group size and full-precision window
apply to every layer alike and are not per-layer facts: they are listed as out of scope, and stay in the
native config that goes with this file.
"""
from __future__ import annotations

import yaml

from skistune.config import KVConfig
from skistune.export.base import EngineVersion, Exporter, Plan, Rendered
from skistune.export.common import comment
from skistune.runtime.presets import ModelSpec

PYRAMID_TOP, PYRAMID_BOTTOM = 1.5, 0.5


def layer_budgets(config: KVConfig, n_layers: int) -> list[int | float | None]:
    """The eviction budget of each layer: tokens (int) or a fraction of the context (float); None for
    every layer when the policy is ``none``."""
    ev = config.eviction
    if ev.policy == "none":
        return [None] * n_layers
    if ev.layer_schedule == "uniform" or n_layers == 1:
        factors = [1.0] * n_layers
    else:  # pyramid: linear from PYRAMID_TOP at layer 0 to PYRAMID_BOTTOM at the last layer
        step = (PYRAMID_TOP - PYRAMID_BOTTOM) / (n_layers - 1)
        factors = [PYRAMID_TOP - layer * step for layer in range(n_layers)]
    if ev.budget_tokens is not None:
        return [max(1, round(ev.budget_tokens * f)) for f in factors]
    return [min(1.0, round(ev.budget_fraction * f, 6)) for f in factors]


def check_layer_bits(config: KVConfig, model: ModelSpec) -> None:
    """Per-layer bits must name every layer of the model they are exported for."""
    pairs = config.bitwidth.layer_bits
    if pairs is not None and len(pairs) != model.n_layers:
        raise ValueError(f"bitwidth.layer_bits: {len(pairs)} [key, value] pairs, but model {model.name} has "
                         f"{model.n_layers} layers (choose the model with --model)")


class LayersExporter(Exporter):
    name = "layers"
    engine = "per-layer"
    versions = (EngineVersion("1", "skistune per-layer format {layer: {nbits_key, nbits_value, budget}}"),)
    default_file = "skistune-layers.yaml"
    scope = frozenset({"bitwidth.key_bits", "bitwidth.value_bits", "bitwidth.layer_bits",
                       "eviction.budget_tokens", "eviction.budget_fraction", "eviction.layer_schedule"})

    def render(self, plan: Plan, version: EngineVersion, model: ModelSpec, file_name: str) -> Rendered:
        config = plan.config
        check_layer_bits(config, model)
        budgets = layer_budgets(config, model.n_layers)
        lines = []
        for layer, budget in enumerate(budgets):
            key_bits, value_bits = config.bitwidth.bits_for_layer(layer)
            entry = {"nbits_key": key_bits, "nbits_value": value_bits, "budget": budget}
            # one flow-style line per layer: a 30-layer model stays a 30-line table
            lines.append(f"{layer}: {yaml.safe_dump(entry, default_flow_style=True, sort_keys=False).strip()}\n")
        plan.express(*plan.relevant)
        unit = "fraction of the context kept" if config.eviction.budget_fraction is not None else "tokens kept"
        header = (f"Per-layer KV bits and eviction budgets for {model.name} ({model.n_layers} layers).\n"
                  f"budget: {unit} per sequence and KV head (null: every token kept); "
                  f"policy {config.eviction.policy}, schedule {config.eviction.layer_schedule}.")
        return Rendered(comment(header) + "".join(lines))
