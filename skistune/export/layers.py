"""`layers`: per-layer key/value bits and eviction budgets, ``{layer: {nbits_key, nbits_value, budget}}``,
for tools that configure KV compression layer by layer (and for reading what a config means per layer).

Budgets per layer (`layer_budgets`, from `layer_schedule`, the one schedule TensorRT-LLM's per-layer
max_attention_window is written from too):
- ``uniform``: every layer keeps the config's budget.
- ``pyramid``: the runtime's schedule (PyramidKV as kvpress computes it, see
  `skistune.runtime.eviction_budget`): more tokens in the first layers, fewer in the last, the same mean.
  A fraction budget's per-layer shares are those of a sequence at the model's full context (max_context).
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


def layer_schedule(config: KVConfig, model: ModelSpec) -> list[int] | None:
    """Tokens each layer of ``model`` keeps, as the runtime applies the budget
    (`runtime.eviction_budget.layer_budgets`) to a sequence at the model's full context; None when the policy
    is ``none``. The one per-layer schedule of every export: `layer_budgets` (the `layers` file) and
    TensorRT-LLM's max_attention_window are both written from it, so they cannot disagree.

    Which context: a token budget does not depend on it. A fraction does, and not only in scale: the runtime
    keeps ceil(fraction x the tokens seen so far), and the pyramid spreads that around the protected tokens
    (sinks + recent window), a fixed number of tokens in every layer, so each layer's share changes with the
    context and no single list of shares is right at every length. The model's max_context is the one both
    exports need: the runtime's budgets are largest there (they size the KV memory), and TensorRT-LLM's window
    is a fixed token count, so it must be the window of a sequence at full context. (A long nominal context,
    1M tokens, used to stand in for "any context": no preset serves one, the protected tokens vanish in it,
    and the last layers' shares came out far below what the runtime keeps at the model's context.)"""
    ev = config.eviction
    if ev.policy == "none":
        return None
    budgets = runtime_layer_budgets(ev, model.n_layers, model.max_context)
    if ev.budget_fraction is not None:  # a layer cannot keep more than the whole context
        budgets = [min(b, model.max_context) for b in budgets]
    return budgets


def layer_budgets(config: KVConfig, model: ModelSpec) -> list[int | float | None]:
    """The eviction budget of each layer of ``model`` (`layer_schedule`): tokens (int) for a token budget, a
    fraction of the context (float) for a fractional one; None for every layer when the policy is ``none``."""
    ev, tokens = config.eviction, layer_schedule(config, model)
    if tokens is None:
        return [None] * model.n_layers
    if ev.budget_tokens is not None:
        return tokens
    if ev.layer_schedule == "uniform":  # the same share at every context: the fraction itself, not rounded
        return [min(1.0, ev.budget_fraction)] * model.n_layers  # to whole tokens of one context
    return [round(t / model.max_context, 6) for t in tokens]


class LayerCountError(ValueError):
    """Per-layer bits for another layer count than the model's (`export` names the file, as `load_config` does)."""


def check_layer_bits(config: KVConfig, model: ModelSpec) -> None:
    """Per-layer bits must name every layer of the model they are exported for."""
    pairs = config.bitwidth.layer_bits
    if pairs is not None and len(pairs) != model.n_layers:
        raise LayerCountError(f"bitwidth.layer_bits: {len(pairs)} [key, value] pairs, but model {model.name} has "
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
        budgets = layer_budgets(config, model)
        lines = []
        for layer, budget in enumerate(budgets):
            key_bits, value_bits = config.bitwidth.bits_for_layer(layer)
            entry = {"nbits_key": key_bits, "nbits_value": value_bits, "budget": budget}
            # one flow-style line per layer: a 30-layer model stays a 30-line table
            lines.append(f"{layer}: {yaml.safe_dump(entry, default_flow_style=True, sort_keys=False).strip()}\n")
        plan.express(*plan.relevant)
        ev = config.eviction
        unit = "fraction of the context kept" if ev.budget_fraction is not None else "tokens kept"
        # the pyramid's shares of a fraction hold at one context only (see layer_schedule): say which
        at = f", at the full {model.max_context}-token context" if ev.budget_fraction is not None and \
            ev.layer_schedule == "pyramid" else ""
        header = (f"Per-layer KV bits and eviction budgets for {model.name} ({model.n_layers} layers).\n"
                  f"budget: {unit} per sequence and KV head{at} (null: every token kept); "
                  f"policy {ev.policy}, schedule {ev.layer_schedule}.")
        return Rendered(comment(header) + "".join(lines))
