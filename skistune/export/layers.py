"""`layers`: per-layer key/value bits and eviction budgets, ``{layer: {nbits_key, nbits_value, budget}}``,
for tools that configure KV compression layer by layer (and for reading what a config means per layer).

Budgets per layer (`layer_budgets`):
- ``uniform``: every layer keeps the config's budget.
- ``pyramid``: the runtime's schedule (PyramidKV as kvpress computes it, see
  `skistune.runtime.eviction_budget`): more tokens in the first layers, fewer in the last, the same mean.
Fraction budgets are capped at 1.0 (a layer cannot keep more than its whole context).
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
from skistune.runtime.eviction_budget import layer_budgets as runtime_layer_budgets
from skistune.runtime.presets import ModelSpec

NOMINAL_CONTEXT = 1_000_000  # tokens: long enough that rounding to whole tokens moves a fraction < 1e-6


def layer_budgets(config: KVConfig, n_layers: int) -> list[int | float | None]:
    """The eviction budget of each layer, as the runtime applies it (`runtime.eviction_budget.layer_budgets`,
    one schedule for both): tokens (int) for a token budget, a fraction of the context (float) for a
    fractional one (the runtime's schedule on a long nominal context, divided by it); None for every layer
    when the policy is ``none``."""
    ev = config.eviction
    if ev.policy == "none":
        return [None] * n_layers
    if ev.budget_tokens is not None:
        return runtime_layer_budgets(ev, n_layers, ev.budget_tokens)  # the context does not enter a token budget
    return [min(1.0, round(b / NOMINAL_CONTEXT, 6)) for b in runtime_layer_budgets(ev, n_layers, NOMINAL_CONTEXT)]


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
